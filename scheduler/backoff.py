"""Exponential back-off after refused PREPAREs: a deployment does not hammer agents that say no.

A transition that rolls back because an agent refused (a PREPARE that failed or timed out, a
step refused for memory, capabilities, a conflict or missing weights) puts each of its new plans
- (deployment, target plan) - on back-off: that plan is not proposed again before `until_s`,
and the deployment makes no automatic switch before then either (otherwise the next-best
candidate, often on the same refusing node, would be tried at once, and the next, ...); a
forced move off a gear that lost GPUs still goes ahead meanwhile, but not onto the nodes that
refused. The
wait starts at `BASE_S` and doubles with each refusal in a row of that deployment, up to
`MAX_S`; a successful transition ends the streak. A topology change that touches a backed-off
plan's GPUs - one of them lost, back, re-registered - resets that plan's entry (and the
deployment's wait once none of its entries is left): what was refused may work now.

Operators are not backed off: an emergency downshift or a manual switch goes ahead (the gearbox
applies back-off to automatic triggers only), and a forced move off a gear that lost GPUs still
happens, to a plan that is not backed off.

Pure values: `failed`, `succeeded` and `observe` return a new `Backoff`; the console keeps one
per deployment as JSON (`to_dict` / `from_dict`), the simulator's FlexPipe policy in memory.
Both drivers call the same three functions (console/gearbox/ticks.py and actions.py,
agents/sim/flexpolicy.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from scheduler.plan import Gear, Plan
from scheduler.topology import Snapshot
from scheduler.transition import Phase, StepState, TransitionRecord

BASE_S = 30.0  # the first wait after a refusal
MAX_S = 600.0  # the longest wait (10 minutes)
# failure reasons that are the agents saying no (agents.protocol.FAILURE_REASONS and the executor's)
REFUSALS = frozenset({"failed", "conflict", "out_of_memory", "unsupported", "timeout", "target_refused"})

Fingerprint = tuple[tuple[str, str], ...]  # ((gpu uuid, its state), ...)


@dataclass(frozen=True)
class Entry:
    """One (deployment, target plan) on back-off."""

    plan_id: str  # the target plan that was refused
    until_s: float  # not proposed before this
    reason: str  # why (the refusal, in short)
    gpus: tuple[str, ...]  # its GPUs: a topology change touching one resets it
    fingerprint: Fingerprint  # the state of those GPUs when it was refused
    nodes: tuple[str, ...] = ()  # the nodes of those GPUs (whose agents said no)

    def to_dict(self) -> dict[str, object]:
        return {"plan_id": self.plan_id, "until_s": self.until_s, "reason": self.reason, "gpus": list(self.gpus),
                "fingerprint": [list(p) for p in self.fingerprint], "nodes": list(self.nodes)}


@dataclass(frozen=True)
class Backoff:
    """One deployment's back-off state (module docstring)."""

    entries: Mapping[str, Entry] = field(default_factory=dict)  # plan_id -> entry
    streak: int = 0  # refused transitions in a row (the wait doubles with each)
    hold_until_s: float | None = None  # no automatic switch before this (the last refusal's wait)

    # -- reading ------------------------------------------------------------------------------
    def blocked(self, gear: Gear, now_s: float, snapshot: Snapshot | None = None) -> list[Entry]:
        """The entries that keep `gear` from being proposed now: its plans on back-off - and,
        while the deployment waits (`holding`), any plan on a node whose agent refused (given the
        snapshot to place the plans; a forced move still goes ahead, elsewhere)."""
        out = []
        live = [e for e in self.entries.values() if now_s < e.until_s]
        holding = snapshot is not None and self.holding(now_s) is not None
        refusing = {n for e in live for n in e.nodes} if holding else set()
        gpus = snapshot.gpu_by_uuid if snapshot is not None else {}
        for p in gear.plans:
            e = self.entries.get(p.plan_id)
            if e is not None and now_s < e.until_s:
                out.append(e)
            elif refusing:
                nodes = {g.node_id for u in p.gpu_uuids if (g := gpus.get(u)) is not None}
                hit = next((e for e in live if not nodes.isdisjoint(e.nodes)), None)
                if hit is not None:
                    out.append(hit)
        return out

    def holding(self, now_s: float) -> float | None:
        """Until when automatic switches wait, or None when they need not."""
        if self.hold_until_s is not None and now_s < self.hold_until_s:
            return self.hold_until_s
        return None

    def wait_s(self) -> float:
        """The wait the next refusal would get."""
        return min(MAX_S, BASE_S * 2.0 ** self.streak)

    # -- changing -----------------------------------------------------------------------------
    def failed(self, plans: Iterable[Plan], now_s: float, reason: str, snapshot: Snapshot,
               extra: Mapping[str, object] | None = None) -> Backoff:
        """After a refused transition: its new `plans` wait, and so does the deployment, for the
        streak's wait."""
        wait = self.wait_s()
        until = now_s + wait
        entries = {k: e for k, e in self.entries.items() if now_s < e.until_s}
        for plan in plans:
            gpus = tuple(sorted(set(plan.gpu_uuids)))
            pid = plan.plan_id
            nodes = tuple(sorted({g.node_id for u in gpus if (g := snapshot.gpu_by_uuid.get(u)) is not None}))
            entries[pid] = Entry(pid, until, reason[:200], gpus, fingerprint(snapshot, gpus, extra), nodes)
        return Backoff(MappingProxyType(entries), self.streak + 1, until)

    def succeeded(self) -> Backoff:
        """After a transition that reached DONE: the streak ends (entries run out on their own)."""
        if self.streak == 0 and self.hold_until_s is None:
            return self
        return replace(self, streak=0, hold_until_s=None)

    def observe(self, snapshot: Snapshot, extra: Mapping[str, object] | None = None,
                now_s: float | None = None) -> Backoff:
        """Reset the entries whose GPUs changed since they were refused (a topology change that
        touches them), and drop expired ones; the deployment's wait ends with its last entry."""
        if not self.entries:
            return self
        kept = {k: e for k, e in self.entries.items()
                if (now_s is None or now_s < e.until_s) and fingerprint(snapshot, e.gpus, extra) == e.fingerprint}
        if len(kept) == len(self.entries):
            return self
        touched = any(fingerprint(snapshot, e.gpus, extra) != e.fingerprint for e in self.entries.values())
        hold = self.hold_until_s if kept else None
        streak = self.streak if kept or not touched else 0
        return Backoff(MappingProxyType(kept), streak, hold)

    # -- JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, object]:
        return {"entries": [e.to_dict() for _, e in sorted(self.entries.items())], "streak": self.streak,
                "hold_until_s": self.hold_until_s}

    @classmethod
    def from_dict(cls, d: object) -> Backoff:
        """Parse `to_dict`'s shape; anything unreadable is no back-off (it must never wedge a
        deployment: the worst a lost back-off does is one more try)."""
        if not isinstance(d, Mapping):
            return cls()
        entries: dict[str, Entry] = {}
        for raw in d.get("entries") or []:
            try:
                e = Entry(str(raw["plan_id"]), float(raw["until_s"]), str(raw.get("reason", "")),
                          tuple(str(u) for u in raw.get("gpus", [])),
                          tuple((str(a), str(b)) for a, b in raw.get("fingerprint", [])),
                          tuple(str(n) for n in raw.get("nodes", [])))
            except (KeyError, TypeError, ValueError):
                continue
            if math.isfinite(e.until_s):
                entries[e.plan_id] = e
        hold = d.get("hold_until_s")
        streak = d.get("streak", 0)
        return cls(MappingProxyType(entries), streak if isinstance(streak, int) and streak >= 0 else 0,
                   float(hold) if isinstance(hold, int | float) and math.isfinite(hold) else None)


NO_BACKOFF = Backoff()


def fingerprint(snapshot: Snapshot, gpus: Sequence[str], extra: Mapping[str, object] | None = None) -> Fingerprint:
    """What a topology change would alter about these GPUs: present, healthy, schedulable, their
    node schedulable - and, from `extra` (node id -> a token such as the agent's registration
    epoch), that the node's agent registered again."""
    out = []
    for u in gpus:
        g = snapshot.gpu_by_uuid.get(u)
        if g is None:
            out.append((u, "absent"))
            continue
        node = snapshot.node_by_id.get(g.node_id)
        token = "" if extra is None else str(extra.get(g.node_id, ""))
        out.append((u, f"{int(g.healthy)}{int(g.schedulable)}{int(node.schedulable if node else 0)}:{token}"))
    return tuple(out)


def refusal(rec: TransitionRecord) -> str | None:
    """Why `rec` counts for back-off, or None: it rolled back (not on an operator's request)
    because a PREPARE failed or an agent refused a step."""
    if rec.phase is not Phase.ROLLED_BACK or rec.abort_reason:
        return None
    failed = [s for s in rec.steps if s.state is StepState.FAILED and s.reason != "aborted"]
    if not failed:
        return None
    first = failed[0]
    if first.phase is Phase.PREPARE or first.reason in REFUSALS:
        return f"{first.step.value} {first.reason or 'failed'}: {first.error}"[:200]
    return None


__all__ = ["BASE_S", "Backoff", "Entry", "MAX_S", "NO_BACKOFF", "REFUSALS", "fingerprint", "refusal"]
