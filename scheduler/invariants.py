"""An event log of what transitions, routing and engines did, and a checker of invariants 1-4.

Anything that moves requests or plans appends `LogEvent`s to one `EventLog` (the in-memory
ports, the simulated agents and engines, a test harness); `check(log)` then verifies, over the
whole history, DESIGN.md's invariants:

1. Nothing admitted is lost: every admitted sequence ends exactly once - finished, or failed
   with a recorded reason - and nothing happens to it afterwards.
2. A sequence is owned by exactly one plan at a time: it is assigned once; only its owner
   decodes, pauses or finishes it; a hand-over starts from the owner, after the owner paused
   it at a safe boundary (the end of a decode iteration, or while idle), and carries a lease
   whose routing version is newer than the one it replaces. An owner may also return it to
   the router with a recorded reason (its plan stopped; a policy without leases re-routes it):
   then no plan owns it until it is assigned again.
3. One active transition per deployment and strictly increasing seqs; phases follow
   `transition.PHASE_EDGES`; every effect (command, routing commit, reservation) of a step
   comes after that step was persisted; the routing table never lists a plan that was
   released or aborted (and a plan is never released while the table lists it); with
   `complete=True`, every transition reached DONE or ROLLED_BACK.
4. (memory) No GPU is booked above 92% of its memory: every `mem_booked` event - an agent saying
   what a GPU holds after a booking, every plan on it counted, of every deployment that shares
   it - stays within the limit (scheduler.booking.over_limit); and (invariant 4 extended, GPU
   sharing: scheduler.pool.sharing) no GPU holds plans of more deployments than the limit the
   event carries (`holders`: max_models_per_gpu, seed 004 section 4.2).

The checker reports every violation with its invariant, time and a sentence; an empty list
means the history is clean. It never raises on a bad log.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

from scheduler.booking import over_limit
from scheduler.plan import MEM_FRACTION
from scheduler.transition import PHASE_EDGES, Phase, TransitionEvent

EventKind = Literal[
    # transitions (TransitionEvent.kind)
    "created", "step_started", "step_ok", "step_failed", "step_abandoned", "phase", "finished",
    # effects of a step
    "command_issued", "routing_committed", "reserved", "unreserved",
    # plans on agents
    "plan_prepared", "plan_released", "plan_aborted",
    # memory: what GPUs hold after a booking (invariant 4)
    "mem_booked",
    # sequences
    "seq_admitted", "seq_assigned", "seq_decoded", "seq_paused", "seq_handover", "seq_returned", "seq_finished",
    "seq_failed",
]
SAFE_BOUNDARIES = ("decode_end", "idle")


@dataclass(frozen=True)
class LogEvent:
    """One thing that happened. Fields not relevant to a kind keep their defaults."""

    t_s: float  # when (the injected clock)
    kind: EventKind
    deployment: str = ""
    seq: int = 0  # transition seq
    step: str = ""  # transition step
    attempt: int = 0
    phase: str = ""
    node: str = ""
    plan_id: str = ""
    seq_id: str = ""  # a request/sequence
    version: int = 0  # routing version (routing_committed, leases)
    to_plan: str = ""  # seq_handover
    boundary: str = ""  # seq_paused / seq_handover: decode_end | idle | ...
    plans: tuple[tuple[str, float, bool], ...] = ()  # routing_committed: (plan_id, weight, frozen)
    gpus: tuple[tuple[str, int, int], ...] = ()  # mem_booked: (GPU uuid, bytes booked there now, its memory)
    # mem_booked: (GPU uuid, deployments holding plans there now, how many may: max_models_per_gpu)
    holders: tuple[tuple[str, int, int], ...] = ()
    detail: str = ""

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"t_s": self.t_s, "kind": self.kind}
        for k, v in self.__dict__.items():
            if k in ("t_s", "kind") or v in ("", 0, ()):
                continue
            out[k] = [list(p) for p in v] if k in ("plans", "gpus", "holders") else v
        return out


@dataclass
class EventLog:
    """Append-only list of events, shared by everyone who acts in one world."""

    events: list[LogEvent] = field(default_factory=list)
    record_decodes: bool = True  # seq_decoded events are many; a long live run may leave them out

    def add(self, event: LogEvent) -> None:
        if event.kind == "seq_decoded" and not self.record_decodes:
            return
        self.events.append(event)

    def transition(self, ev: TransitionEvent) -> None:
        self.add(LogEvent(ev.t_s, ev.kind, deployment=ev.deployment_id, seq=ev.seq,
                          step=ev.step.value if ev.step else "", attempt=ev.attempt, phase=ev.phase.value,
                          detail=ev.detail))

    def of(self, *kinds: EventKind) -> list[LogEvent]:
        return [e for e in self.events if e.kind in kinds]

    def __iter__(self) -> Iterator[LogEvent]:
        return iter(self.events)

    def __len__(self) -> int:
        return len(self.events)


@dataclass(frozen=True)
class Violation:
    invariant: int  # 1, 2, 3 or 4
    t_s: float
    what: str

    def __str__(self) -> str:
        return f"invariant {self.invariant} at t={self.t_s:.3f}: {self.what}"


@dataclass
class _Seq:
    owner: str = ""
    lease: int = -1
    ended: bool = False
    paused_on: str = ""  # the plan that paused it at a safe boundary, awaiting hand-over


@dataclass
class _Transition:
    seq: int
    phase: Phase
    persisted: set[tuple[str, int]] = field(default_factory=set)  # (step, attempt)


class Checker:
    """Invariants 1-4 checked one event at a time (module docstring): `add` every event in
    order, then `violations()`. It keeps a little state per sequence and per deployment, not
    the events, so a replay of hundreds of thousands of requests can be checked as it runs."""

    def __init__(self) -> None:
        self.found: list[Violation] = []
        self.seqs: dict[str, _Seq] = {}
        self.active: dict[str, _Transition] = {}
        self.last_seq: dict[str, int] = {}
        self.routed: dict[str, set[str]] = {}  # deployment -> plan_ids in its routing table
        self.released: set[str] = set()  # plans released or aborted on some node and not prepared since

    def _bad(self, inv: int, t: float, what: str) -> None:
        self.found.append(Violation(inv, t, what))

    def add(self, e: LogEvent) -> None:
        k = e.kind
        # -- invariant 4: memory -------------------------------------------------------------
        if k == "mem_booked":
            for uuid, booked, total in e.gpus:
                if over_limit(booked, total):
                    self._bad(4, e.t_s, f"GPU {uuid} holds {booked} of {total} bytes ({booked / total:.1%}) after plan"
                                        f" {e.plan_id} booked it, above {MEM_FRACTION:.0%}")
            for uuid, n, most in e.holders:
                if n > most:
                    self._bad(4, e.t_s, f"GPU {uuid} holds plans of {n} deployments after plan {e.plan_id} booked it,"
                                        f" above max_models_per_gpu={most}")
            return
        # -- invariant 1 and 2: sequences ----------------------------------------------------
        if k == "seq_admitted":
            if e.seq_id in self.seqs:
                self._bad(1, e.t_s, f"sequence {e.seq_id} admitted twice")
                return
            self.seqs[e.seq_id] = _Seq()
            return
        if k in ("seq_assigned", "seq_decoded", "seq_paused", "seq_handover", "seq_returned", "seq_finished",
                 "seq_failed"):
            s = self.seqs.get(e.seq_id)
            if s is None:
                self._bad(1, e.t_s, f"{k} for sequence {e.seq_id}, which was never admitted")
                return
            if s.ended:
                self._bad(1, e.t_s, f"{k} for sequence {e.seq_id} after it had ended")
                return
            if k == "seq_assigned":
                if s.owner:
                    self._bad(2, e.t_s, f"sequence {e.seq_id} assigned to {e.plan_id} while {s.owner} owns it")
                    return
                s.owner, s.lease = e.plan_id, e.version
            elif k == "seq_decoded":
                if e.plan_id != s.owner:
                    self._bad(2, e.t_s, f"plan {e.plan_id} decoded sequence {e.seq_id} but {s.owner or 'no plan'} owns it")
                s.paused_on = ""  # its owner goes on with it: a hand-over that did not happen
            elif k == "seq_paused":
                if e.plan_id != s.owner:
                    self._bad(2, e.t_s, f"plan {e.plan_id} paused sequence {e.seq_id} owned by {s.owner or 'no plan'}")
                elif e.boundary not in SAFE_BOUNDARIES:
                    self._bad(2, e.t_s, f"sequence {e.seq_id} paused at {e.boundary or 'no boundary'}, not a safe one")
                else:
                    s.paused_on = e.plan_id
            elif k == "seq_handover":
                if e.plan_id != s.owner:
                    self._bad(2, e.t_s, f"hand-over of {e.seq_id} from {e.plan_id}, but {s.owner or 'no plan'} owns it")
                elif s.paused_on != e.plan_id:
                    self._bad(2, e.t_s, f"hand-over of {e.seq_id} from {e.plan_id} without a pause at a safe boundary")
                elif e.version <= s.lease:
                    self._bad(2, e.t_s, f"hand-over of {e.seq_id} carries lease version {e.version}, not newer than "
                                        f"{s.lease}")
                else:
                    s.owner, s.lease, s.paused_on = e.to_plan, e.version, ""
            elif k == "seq_returned":
                # its owner gives it back to the router without a lease to hand it over with (the
                # plan stopped, or a simulated policy re-routes it): owned by none until assigned
                if e.plan_id != s.owner:
                    self._bad(2, e.t_s, f"plan {e.plan_id} returned sequence {e.seq_id} owned by "
                                        f"{s.owner or 'no plan'}")
                elif not e.detail:
                    self._bad(2, e.t_s, f"sequence {e.seq_id} returned by {e.plan_id} without a recorded reason")
                else:
                    s.owner, s.paused_on = "", ""
            elif k == "seq_finished":
                if e.plan_id != s.owner:
                    self._bad(2, e.t_s, f"plan {e.plan_id} finished sequence {e.seq_id} owned by {s.owner or 'no plan'}")
                s.ended = True
            elif k == "seq_failed":
                if not e.detail:
                    self._bad(1, e.t_s, f"sequence {e.seq_id} failed without a recorded reason")
                s.ended = True
            return
        # -- invariant 3: transitions --------------------------------------------------------
        if k == "created":
            if e.deployment in self.active:
                self._bad(3, e.t_s, f"{e.deployment}: transition {e.seq} created while {self.active[e.deployment].seq} "
                                    "is active")
            if e.seq <= self.last_seq.get(e.deployment, 0):
                self._bad(3, e.t_s, f"{e.deployment}: transition seq {e.seq} is not above {self.last_seq[e.deployment]}")
            self.last_seq[e.deployment] = max(e.seq, self.last_seq.get(e.deployment, 0))
            self.active[e.deployment] = _Transition(e.seq, Phase.PREPARE)
            return
        if k in ("step_started", "step_ok", "step_failed", "step_abandoned", "phase", "finished"):
            t = self.active.get(e.deployment)
            if t is None or t.seq != e.seq:
                self._bad(3, e.t_s, f"{e.deployment}: {k} for transition {e.seq}, which is not the active one")
                return
            if k == "step_started":
                t.persisted.add((e.step, e.attempt))
            elif k == "phase":
                try:
                    new = Phase(e.phase)
                except ValueError:
                    self._bad(3, e.t_s, f"{e.deployment}: unknown phase {e.phase!r}")
                    return
                if new is not t.phase and new not in PHASE_EDGES[t.phase]:
                    self._bad(3, e.t_s, f"{e.deployment}: transition {e.seq} went from {t.phase.value} to {new.value}")
                t.phase = new
            elif k == "finished":
                if t.phase not in (Phase.DONE, Phase.ROLLED_BACK):
                    self._bad(3, e.t_s, f"{e.deployment}: transition {e.seq} finished in phase {t.phase.value}")
                del self.active[e.deployment]
            return
        if k in ("command_issued", "routing_committed", "reserved", "unreserved"):
            if e.seq:
                t = self.active.get(e.deployment)
                if t is None or t.seq != e.seq:
                    self._bad(3, e.t_s, f"{e.deployment}: {k} for transition {e.seq}, which is not active")
                elif (e.step, e.attempt) not in t.persisted:
                    self._bad(3, e.t_s, f"{e.deployment}: {k} by step {e.step} attempt {e.attempt} of transition "
                                        f"{e.seq} before the step was persisted")
            if k == "routing_committed":
                plans = {p for p, _, _ in e.plans}
                gone = sorted(plans & self.released)
                if gone:
                    self._bad(3, e.t_s, f"{e.deployment}: routing version {e.version} lists released plan(s) "
                                        f"{', '.join(gone)}")
                self.routed[e.deployment] = plans
            return
        if k == "plan_prepared":
            self.released.discard(e.plan_id)
            return
        if k in ("plan_released", "plan_aborted"):
            holders = sorted(d for d, ps in self.routed.items() if e.plan_id in ps)
            if holders:
                self._bad(3, e.t_s, f"plan {e.plan_id} {k.split('_')[1]} on {e.node} while the routing table of "
                                    f"{', '.join(holders)} lists it")
            self.released.add(e.plan_id)
            return

    def violations(self, *, complete: bool = True) -> list[Violation]:
        """What was found so far; with `complete`, also what the history left unended."""
        out = list(self.found)
        if complete:
            for seq_id, s in self.seqs.items():
                if not s.ended:
                    out.append(Violation(1, math.inf, f"sequence {seq_id} was admitted and never finished nor failed"))
            for dep, t in self.active.items():
                out.append(Violation(3, math.inf, f"{dep}: transition {t.seq} never finished (phase {t.phase.value})"))
        return out


class CheckingLog(EventLog):
    """An EventLog that checks each event as it comes (a `Checker`) and keeps none of them: for
    a replay, whose per-sequence events would fill memory."""

    def __init__(self) -> None:
        super().__init__(record_decodes=False)
        self.checker = Checker()
        self.counts: dict[str, int] = {}  # events seen per kind

    def add(self, event: LogEvent) -> None:
        if event.kind == "seq_decoded" and not self.record_decodes:
            return
        self.counts[event.kind] = self.counts.get(event.kind, 0) + 1
        self.checker.add(event)


def check(events: Iterable[LogEvent], *, complete: bool = True) -> list[Violation]:
    """Every violation of invariants 1-4 in the history (module docstring)."""
    checker = Checker()
    for e in events:
        checker.add(e)
    return checker.violations(complete=complete)


def assert_clean(events: Iterable[LogEvent], *, complete: bool = True, limit: int = 10) -> None:
    """Raise AssertionError listing the first violations, if any (for tests and the simulator)."""
    found = check(events, complete=complete)
    if found:
        lines = "\n".join(str(v) for v in found[:limit])
        more = f"\n... and {len(found) - limit} more" if len(found) > limit else ""
        raise AssertionError(f"{len(found)} invariant violation(s):\n{lines}{more}")


def summary(events: Sequence[LogEvent]) -> dict[str, int]:
    """Counts per kind, for reports."""
    out: dict[str, int] = {}
    for e in events:
        out[e.kind] = out.get(e.kind, 0) + 1
    return out


__all__ = ["Checker", "CheckingLog", "EventKind", "EventLog", "LogEvent", "SAFE_BOUNDARIES", "Violation", "assert_clean", "check", "summary"]
