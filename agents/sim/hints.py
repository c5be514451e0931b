"""The global correction's hints on the simulated fleet (agents/protocol/: `apply_hints`;
scheduler/control/correction.py: the rules). A node keeps its hints in its own HintBook; each plan
it leads reads the batch-token threshold there on its local loop (LocalHints, asked by
agents/sim/engine.py every round), and the fleet's routing (the live fleet's gateway side:
agents/sim/live.py) multiplies the plan's table weight by the hint's weight multiplier while the
hint lives. Hinting is a mixin of FleetSim (agents/sim/fleet.py).

The local loop (the three time scales: scheduler/control/correction.py): each round's batch-token
threshold is the engine's own, times the scale of a live hint for the plan once `apply_hints` put
one in its node's HintBook; the engine looks at the book every `local_loop_s` (SimOptions, default
100 ms), so a hint takes effect within one local period and a lapsed one (its ttl ran out: the
global loop is down) returns the default without anything else running."""

# mypy: disable-error-code="misc"
# (its methods take `self: FleetSim`, the class that mixes it in: see agents/sim/churn.py)

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from scheduler.control.correction import HintBook, hints_from_payload

if TYPE_CHECKING:
    from agents.sim.fleet import FleetSim


class LocalHints:
    """One engine's local loop over its node's hint book (module docstring): the book once a hint
    named the plan, the threshold last read there and when it looks again."""

    def __init__(self, default_tokens: int) -> None:
        self.default_tokens = default_tokens
        self.book: HintBook | None = None
        self.tokens = default_tokens
        self.next_look_s = -math.inf

    def attach(self, book: HintBook) -> None:
        """A hint for the plan arrived in `book`: the next round reads it."""
        self.book = book
        self.next_look_s = -math.inf

    def batch_tokens(self, deployment: str, plan_id: str, t: float, period_s: float) -> int:
        if self.book is None:
            return self.default_tokens
        if t >= self.next_look_s:
            self.tokens = self.book.batch_tokens(deployment, plan_id, t, self.default_tokens)
            self.next_look_s = t + period_s
        return self.tokens


class Hinting:
    """FleetSim's side of `apply_hints` (module docstring)."""

    def apply_hints(self: FleetSim, node_id: str, payload: Mapping[str, object], *, ttl_scale: float = 1.0
                    ) -> tuple[str, dict[str, object]]:
        """Carry out one `apply_hints` that agents.protocol.check_payload accepted, on `node_id`, at
        the simulator's now; `ttl_scale` turns the controller's seconds into sim seconds (the live
        fleet's time scale). Returns the ack's (detail, result)."""
        deployment, version, ttl_s, hints = hints_from_payload(payload)
        book = self.hint_books.setdefault(node_id, HintBook())
        if not book.apply(deployment, version, ttl_s * ttl_scale, hints, self.now_s):
            held = book.versions[deployment]
            return (f"hints {version} of {deployment} ignored: {held} is newer",
                    {"applied": False, "hints_version": held, "plans": [], "unknown": []})
        took: list[str] = []
        unknown: list[str] = []
        for h in hints:
            engine = self.engine_of(deployment, h.plan_id) if deployment in self.deployments else None
            if engine is None or self._plan_nodes(engine.plan)[0] != node_id:
                unknown.append(h.plan_id)  # not a plan this node leads
                continue
            engine.local.attach(book)
            took.append(h.plan_id)
        detail = f"hints {version} of {deployment}: {len(took)} plan(s)" + (
            f"; not led here: {', '.join(unknown)}" if unknown else "")
        return detail, {"applied": True, "hints_version": version, "plans": took, "unknown": unknown}

    def hinted_weight(self: FleetSim, deployment: str, plan_id: str) -> float:
        """The live weight multiplier of a plan (1 without a live hint), from its leader's book."""
        engine = self.engine_of(deployment, plan_id) if deployment in self.deployments else None
        if engine is None or engine.local.book is None:
            return 1.0
        return engine.local.book.weight(deployment, plan_id, self.now_s)


class SimGlobalLoop:
    """The global correction run inside an offline FleetSim (a replay, a bench), as the console runs
    it against live agents (console/gearbox/correction.py): every `period_s` of sim time it reads
    the engine reports (FleetSim.engine_reports: the counters since the previous call), steps the
    GlobalCorrection per deployment, and sends each due hint to the plan's leader through the
    protocol's check and FleetSim.apply_hints; the weight multipliers scale the routing weights the
    loop found when it started (what the routing table says). `stop_s`: it stops there (the global
    loop down; the engines' hints lapse after their ttl). Not for the live fleet, whose agents'
    reports read the same counters."""

    def __init__(self, sim: FleetSim, *, period_s: float = 0.5, loop: Any = None, stop_s: float = math.inf) -> None:
        from scheduler.control.correction import GlobalCorrection

        self.sim = sim
        self.period_s = period_s
        self.loop = loop or GlobalCorrection()
        self.stop_s = stop_s
        self.sent = 0  # apply_hints carried out
        self.base: dict[tuple[str, str], float] = {}
        sim.call_at(sim.now_s + period_s, self._tick)

    def _tick(self, t: float) -> None:
        from agents.protocol import check_payload
        from scheduler.control.correction import PlanSignal

        sim = self.sim
        if t >= self.stop_s:  # down: the routing table's own weights again (the hints lapse by themselves)
            for dep in sorted({d for d, _ in self.base}):
                sim.set_weights(dep, {p: w for (d, p), w in self.base.items()
                                      if d == dep and sim.engine_of(d, p) is not None})
            return
        by_dep: dict[str, list[tuple[PlanSignal, str]]] = {}
        for m in sim.engine_reports():
            e = m.report
            sig = PlanSignal(e.plan_id, e.running, e.waiting, kv_usage=e.kv_usage, finished=e.finished,
                             violated=e.slo_violations)
            by_dep.setdefault(m.deployment, []).append((sig, m.node_ids[0]))
        for dep, rows in sorted(by_dep.items()):
            engines = {e.plan.plan_id: e for e in sim.plans(dep) if e.accepting}
            rows = [(s, n) for s, n in rows if s.plan_id in engines]
            if not rows:
                continue
            for pid, e in engines.items():
                self.base.setdefault((dep, pid), e.weight)
            step = self.loop.step(t, dep, [s for s, _ in rows])
            leader = {s.plan_id: n for s, n in rows}
            for h in self.loop.due(step, t):
                payload = check_payload("apply_hints", {"deployment": dep, "hints_version": step.hints_version,
                                                        "ttl_s": step.ttl_s, "plans": [h.to_dict()]})
                sim.apply_hints(leader[h.plan_id], payload)
                self.sent += 1
            sim.set_weights(dep, {pid: self.base[(dep, pid)] * sim.hinted_weight(dep, pid) for pid in engines})
        sim.call_at(t + self.period_s, self._tick)


__all__ = ["Hinting", "LocalHints", "SimGlobalLoop"]
