"""The plan commands of a node agent (agents/protocol/: prepare_plan, abort_plan, freeze_plan,
thaw_plan, move_sequences, release_plan) and what they keep: the plans this node holds, the memory
booked for them, their engines and stage workers.

PlanCommands is a mixin of NodeAgent (agents/node/daemon.py): the daemon pulls each command once,
checks its payload and calls the handler here under the plan's lock, then acks its outcome. The
attributes the class declares are the agent's, set by its __init__.

Invariants:
- Each transition command is idempotent on the plan's state too (a retry is a new command id):
  prepare of a prepared plan acks ok at once; abort, thaw and release of a plan this node does not
  hold ack ok with `noop: true`; freeze of one acks no sequences; move names each sequence "gone".
- A plan whose engine failed for good is given up by the main loop (`_give_up_failed`): stopped,
  unbooked, not listed again - the controller replaces it (agents/protocol/: what runs).
- A plan's GPUs keep its reserve_bytes booked from prepare until abort or release; a prepare that
  fails books nothing. A prepare that would book more than 92% of a GPU beside what is used and
  booked there is refused (reason out_of_memory, scheduler.booking's words); one whose plan this
  node's engine cannot run is refused too (reason unsupported, scheduler.capabilities' words).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from agents.node.plans import Backend, ModelStore, PlanEngine
from agents.node.state import NodeState, PlanSlot, _Outcome
from agents.probes import Probe
from agents.protocol import FAILURE_REASONS
from scheduler.booking import REFUSAL_REASON, refuse_booking
from scheduler.capabilities import EngineCaps, engine_refusals
from scheduler.plan import Plan
from scheduler.refusal import Refused

log = logging.getLogger("agents.node")


def _slo_ms(payload: dict[str, Any]) -> tuple[float, float] | None:
    """A prepare's optional slo (check_payload validated it: ttft_ms, tpot_ms > 0) as the host takes it."""
    slo = payload.get("slo")
    return (float(slo["ttft_ms"]), float(slo["tpot_ms"])) if isinstance(slo, dict) else None


class PlanCommands:
    """The handlers of a plan's commands, and the plans they keep (module docstring)."""

    node_id: str
    backend: Backend | None
    backend_name: str
    probe: Probe
    book_memory: bool
    capabilities: EngineCaps | None
    clock: Callable[[], float]
    state: NodeState
    plans: dict[tuple[str, str], PlanSlot]
    _hinted: set[tuple[str, str]]
    _plan_locks: dict[tuple[str, str], threading.Lock]
    _lock: threading.Lock

    def booked(self) -> dict[str, int]:
        """GPU uuid -> bytes booked by the plans held now."""
        out: dict[str, int] = {}
        with self._lock:
            for slot in self.plans.values():
                for u, b in slot.reserve_bytes.items():
                    out[u] = out.get(u, 0) + b
        return out

    def _slot(self, key: tuple[str, str]) -> PlanSlot | None:
        with self._lock:
            return self.plans.get(key)

    def _prepare(self, key: tuple[str, str], p: dict[str, Any]) -> _Outcome:
        deployment, plan_id = key
        slot = self._slot(key)
        if slot is not None:
            return _Outcome("ok", "already prepared", {"plan_id": plan_id, "reserved_bytes": slot.reserve_bytes,
                                                      "load_s": slot.load_s, "already": True})
        want = {str(u): int(b) for u, b in p["reserve_bytes"].items()}
        self._check_engine(p)
        self._check_gpus(want)
        slot = PlanSlot(deployment, plan_id, str(p["role"]), want, prepared_at_s=self.clock())
        with self._lock:
            self.plans[key] = slot  # booked now, so a concurrent prepare sees the memory taken
        t0 = self.clock()
        try:
            if slot.role == "leader":
                version = p.get("model_version") or {}
                if self.backend is None:
                    raise Refused(f"this node runs no engine backend ({self.backend_name})")
                engine = self.backend.make(deployment, p["plan"], plan_id, str(p["model"]), p.get("weights_sha256"),
                                           stages=list(p.get("stages") or []), peers=dict(p.get("peers") or {}),
                                           warmup_tokens=int(version.get("warmup_tokens", 1)),
                                           slo_ms=_slo_ms(p), max_context=version.get("max_context"))
                slot.engine = engine
                engine.start()
            elif self.backend is not None:
                # Registered before the ack: the leader's engine asks for our ranks as soon as its own
                # prepare runs, and is told to retry (409) until this point.
                slot.part = self.backend.join(deployment, p["plan"], plan_id, str(p["model"]),
                                              p.get("weights_sha256"), stages=list(p.get("stages") or []),
                                              node_id=self.node_id)
        except Exception as exc:
            with self._lock:
                self.plans.pop(key, None)
            if slot.engine is not None:
                self._stop_engine(slot.engine)
            self._leave(slot)
            if isinstance(exc, Refused):
                raise
            log.exception("%s: prepare of %s failed", self.node_id, plan_id)
            raise Refused(f"plan {plan_id}: the engine did not start: {exc}") from exc
        slot.load_s = self.clock() - t0
        slot.ready = True
        log.info("%s: plan %s of %s prepared as %s in %.2f s", self.node_id, plan_id, deployment, slot.role,
                 slot.load_s)
        result: dict[str, Any] = {"plan_id": plan_id, "reserved_bytes": want, "load_s": round(slot.load_s, 4)}
        digest = self._weights_digest(str(p["model"]))
        if digest is not None:
            result["weights_sha256"] = digest  # hashed here before loading: the registry verifies the version
        checkout = getattr(slot.engine, "checkout", None) or getattr(slot.part, "checkout", None)
        if checkout is not None:
            result["weights_source"], result["weights_bytes"] = checkout.source, checkout.weights_bytes
        return _Outcome("ok", f"prepared ({slot.role}, weights from {result.get('weights_source', 'disk')})",
                        result)

    def _weights_digest(self, model: str) -> str | None:
        """What this node's model store computed for the weights it loaded (None when it hashed none)."""
        store = getattr(self.backend, "models", None)
        return store.digest_of(model) if isinstance(store, ModelStore) else None

    def _check_gpus(self, want: dict[str, int]) -> None:
        """Refused unless every GPU is ours, healthy, allocatable and has the memory free."""
        reports = {g.uuid: g for g in self.probe.report()}
        not_ours = sorted(u for u in want if u not in reports)
        if not_ours:
            raise Refused(f"GPU(s) {', '.join(not_ours)} are not on node {self.node_id}", "preempted", gpus=not_ours)
        lost = sorted(u for u in want if not reports[u].healthy or not reports[u].allocatable)
        if lost:
            raise Refused(f"GPU(s) {', '.join(lost)} are unhealthy or held by another tenant", "preempted",
                          gpus=lost)
        booked = self.booked() if self.book_memory else {}
        over = refuse_booking(want, {u: g.mem_used_bytes + booked.get(u, 0) for u, g in reports.items()},
                              {u: g.mem_total_bytes for u, g in reports.items()})
        if over is not None:
            # scheduler.booking: the words every agent (and the simulated ones) refuses with
            raise Refused(over.message(), REFUSAL_REASON, gpus=[over.gpu])

    def _check_engine(self, p: dict[str, Any]) -> None:
        """Refused unless this node's engine can run the plan (scheduler.capabilities: the
        planner's filter, in the same words)."""
        if self.capabilities is None:
            return
        try:
            plan = Plan.from_dict(p["plan"])
        except ValueError as exc:
            raise Refused(f"plan: {exc}", field="plan") from None
        nodes = sorted({self.node_id, *(str(n) for n in (p.get("peers") or {}))})
        problems = engine_refusals(plan, nodes, {self.node_id: self.capabilities})
        if problems:
            raise Refused("; ".join(problems), "unsupported")

    def _stop_engine(self, engine: PlanEngine) -> None:
        try:
            engine.stop()
        except Exception:  # noqa: BLE001 - stopping must go on for the other plans
            log.exception("%s: plan %s did not stop cleanly", self.node_id, engine.plan_id)
        if self.backend is not None:
            self.backend.forget(engine)

    def _leave(self, slot: PlanSlot) -> None:
        """Stop a member's stage workers of `slot`'s plan (none: nothing to do)."""
        part, slot.part = slot.part, None
        if part is not None and self.backend is not None:
            try:
                self.backend.leave(part)
            except Exception:  # noqa: BLE001 - stopping must go on for the other plans
                log.exception("%s: the stage workers of plan %s did not stop cleanly", self.node_id, slot.plan_id)

    def _give_up_failed(self) -> None:
        """Give up each plan whose engine failed for good (the vLLM watchdog's restarts ran out; a
        torch worker died, or the GPU under it): its engine stopped, its memory unbooked, its slot
        gone - so the report that follows at once no longer lists it and the controller replaces it
        (its undo commands then ack noop). Under the plan's lock; a command running on the plan
        (its release, its abort) ends it instead, or the next pass does."""
        with self._lock:
            failed = [k for k, s in self.plans.items() if s.ready and s.engine is not None and s.engine.failed]
        for key in failed:
            with self._lock:
                lock = self._plan_locks.setdefault(key, threading.Lock())
            if not lock.acquire(blocking=False):
                continue
            try:
                slot = self._drop(key)
                if slot is None:
                    continue
                log.warning("%s: plan %s of %s failed for good; given up", self.node_id, slot.plan_id,
                            slot.deployment)
                if slot.engine is not None:
                    self._stop_engine(slot.engine)
                self._leave(slot)
                with self._lock:
                    self._hinted.discard(key)
                    self.state.dirty = True
            finally:
                lock.release()

    def _drop(self, key: tuple[str, str]) -> PlanSlot | None:
        with self._lock:
            return self.plans.pop(key, None)

    def _abort(self, key: tuple[str, str], p: dict[str, Any]) -> _Outcome:
        slot = self._slot(key)
        if slot is None:
            return _Outcome("ok", "nothing to abort", {"plan_id": key[1], "failed": [], "noop": True})
        failed: list[str] = []
        if slot.engine is not None:
            r = slot.engine.release(float(p.get("drain_timeout_s", 0.0)), None)
            failed = [str(s) for s in r.get("failed", [])]
            self._stop_engine(slot.engine)
        self._leave(slot)
        self._drop(key)
        return _Outcome("ok", f"aborted: {p.get('reason', '')}"[:200], {"plan_id": key[1], "failed": failed})

    def _freeze(self, key: tuple[str, str], p: dict[str, Any]) -> _Outcome:
        slot = self._slot(key)
        if slot is None or slot.engine is None:
            return _Outcome("ok", "no such plan here: nothing in flight",
                            {"plan_id": key[1], "sequences": [], "noop": slot is None})
        result = slot.engine.freeze(int(p["routing_version"]))
        slot.frozen = True
        return _Outcome("ok", f"frozen with {len(result.get('sequences', []))} sequence(s)",
                        {**result, "plan_id": key[1]})

    def _thaw(self, key: tuple[str, str], p: dict[str, Any]) -> _Outcome:
        slot = self._slot(key)
        if slot is None or slot.engine is None:
            return _Outcome("ok", "nothing to thaw", {"plan_id": key[1], "noop": slot is None})
        slot.engine.thaw()
        slot.frozen = False
        return _Outcome("ok", "admitting again", {"plan_id": key[1]})

    def _move(self, key: tuple[str, str], p: dict[str, Any]) -> _Outcome:
        moves = [dict(m) for m in p.get("moves", [])]
        slot = self._slot(key)
        if slot is None or slot.engine is None:
            gone = [{"seq_id": m["seq_id"], "action": m["action"], "ok": True, "outcome": "gone",
                     "context_tokens": 0, "kv_bytes": 0, "replay_tokens": 0, "stall_s": 0.0} for m in moves]
            return _Outcome("ok", "no such plan here: every sequence is gone", {"plan_id": key[1], "moved": gone})
        result = {**slot.engine.move(moves, int(p["routing_version"])), "plan_id": key[1]}
        bad = [m for m in result.get("moved", []) if isinstance(m, dict) and m.get("ok") is False]
        if bad:
            reason = next((m["reason"] for m in bad if m.get("reason") in FAILURE_REASONS), "failed")
            detail = "; ".join(f"{m.get('seq_id')}: {m.get('error', m.get('reason', 'failed'))}" for m in bad[:5])
            return _Outcome("failed", f"{len(bad)} hand-over(s) failed: {detail}", {**result, "reason": reason})
        return _Outcome("ok", f"{len(result.get('moved', []))} sequence(s) handled", result)

    def _release(self, key: tuple[str, str], p: dict[str, Any]) -> _Outcome:
        slot = self._slot(key)
        if slot is None:
            return _Outcome("ok", "nothing to release", {"plan_id": key[1], "freed_bytes": 0, "failed": [],
                                                         "handed_over": [], "noop": True})
        result: dict[str, Any] = {"failed": [], "handed_over": []}
        if slot.engine is not None:
            result = dict(slot.engine.release(float(p.get("drain_timeout_s", 0.0)), p.get("fallback")))
            self._stop_engine(slot.engine)
        self._leave(slot)
        self._drop(key)
        freed = sum(slot.reserve_bytes.values())
        return _Outcome("ok", f"released, {freed} bytes freed", {**result, "plan_id": key[1], "freed_bytes": freed})


__all__ = ["PlanCommands"]
