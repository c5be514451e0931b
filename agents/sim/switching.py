"""Gear changes inside the simulator: PREPARE -> SWITCH -> CLEANUP, or ROLLBACK.

This is the simulated equivalent of `scheduler.transition` (DESIGN.md, seed 000 section 4.3)
until that module lands; it has the same phases and charges the same modelled costs:

* PREPARE: every plan of the target gear that does not run yet starts in shadow: it holds its
  memory at once and loads its weights (from host memory over each GPU's host link; shards a
  GPU already holds for this deployment cost nothing - `costmodel.switch_cost`'s PREPARE time).
  The current gear keeps serving meanwhile.
* SWITCH: when every new plan is up, the routing table flips to the target gear (new requests
  go there at its weights); the plans that leave stop taking requests, their queues move at
  once, and at the end of their round in flight each sequence moves the cheaper way
  (`costmodel.migrate_or_replay`: KV migration along `kv_route`, one at a time per route, or
  recompute on the new plan) - short ones finish where they are (`SimOptions.stay_tokens`).
* CLEANUP: a leaving plan is released when its last sequence is gone; the transition is done
  when all are.
* ROLLBACK: a new plan that loses a GPU before SWITCH aborts the transition: the new plans are
  released, the current gear never stopped serving. (After SWITCH there is nothing to roll
  back: the new gear serves, and a later loss is a new decision's business.)

Each transition has a strictly increasing sequence number per simulator, and a deployment has
at most one at a time (invariant 3); `running(deployment)` is what the gearbox's
`transition_running` reads.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from agents.sim.engine import PlanEngine
from agents.sim.fleet import FleetSim
from agents.sim.metrics import SwitchRecord
from scheduler.plan import Gear


class Phase(enum.StrEnum):
    PREPARE = "prepare"
    SWITCH = "switch"
    CLEANUP = "cleanup"
    DONE = "done"
    ROLLED_BACK = "rolled_back"


@dataclass
class SimTransition:
    """One gear change of one deployment."""

    seq: int  # strictly increasing per simulator
    deployment: str
    target: Gear
    phase: Phase
    record: SwitchRecord
    new: list[PlanEngine] = field(default_factory=list)  # plans started for the target
    keep: list[PlanEngine] = field(default_factory=list)  # plans in both gears
    leaving: list[PlanEngine] = field(default_factory=list)  # plans of the current gear that go


Done = Callable[[SimTransition, float], None]


class TransitionExecutor:
    """Runs transitions against a FleetSim (module docstring)."""

    def __init__(self, sim: FleetSim, on_done: Done | None = None) -> None:
        self.sim = sim
        self.on_done = on_done
        self.active: dict[str, SimTransition] = {}
        self.history: list[SimTransition] = []
        self._seq = itertools.count(1)

    def running(self, deployment: str) -> bool:
        return deployment in self.active

    def begin(self, deployment: str, target: Gear, trigger: str) -> SimTransition:
        """PREPARE: start the target's new plans; SWITCH follows when they are all up."""
        if deployment in self.active:
            raise ValueError(f"deployment: {deployment} already has transition {self.active[deployment].seq} running")
        sim = self.sim
        t = sim.now_s
        current = [e for e in sim.plans(deployment) if not e.release_when_empty]
        by_plan = {e.plan: e for e in current}
        record = SwitchRecord(deployment, t, from_shape=_shape(current), to_shape=target.shape(), trigger=trigger)
        tr = SimTransition(next(self._seq), deployment, target, Phase.PREPARE, record)
        for plan in target.plans:
            engine = by_plan.get(plan)
            if engine is not None:
                tr.keep.append(engine)
            else:
                tr.new.append(sim.launch(deployment, plan, source="host", accepting=False))
        wanted = set(target.plans)
        tr.leaving = [e for e in current if e.plan not in wanted]
        self.active[deployment] = tr
        sim.recorder.switches.append(record)
        self.history.append(tr)
        ready = max((e.ready_s for e in tr.new), default=t)
        sim.call_at(ready, lambda now: self._switch(tr, now))
        return tr

    def lost(self, deployment: str) -> None:
        """Some plan of the deployment stopped (a loss): a transition still preparing whose
        target lost a plan rolls back now."""
        tr = self.active.get(deployment)
        if tr is None or tr.phase is not Phase.PREPARE:
            return
        if any(e.state == "dead" for e in tr.new + tr.keep):
            self._rollback(tr, self.sim.now_s)

    def _rollback(self, tr: SimTransition, t: float) -> None:
        for e in tr.new:
            self.sim.retire(e, "stop")
        tr.phase = Phase.ROLLED_BACK
        tr.record.outcome = "rolled_back"
        tr.record.done_s = t
        self._finish(tr, t)

    def _switch(self, tr: SimTransition, t: float) -> None:
        if tr.phase is not Phase.PREPARE:
            return  # rolled back meanwhile
        if any(e.state != "serving" for e in tr.new + tr.keep):
            self._rollback(tr, t)
            return
        tr.phase = Phase.SWITCH
        engines = tr.new + tr.keep
        weight = {p: w for p, w in zip(tr.target.plans, tr.target.weights, strict=True)}
        self.sim.set_routing(tr.deployment, {e.engine_id: weight[e.plan] for e in engines})
        tr.record.serving_s = t
        tr.phase = Phase.CLEANUP
        for e in tr.leaving:
            self.sim.retire(e, "move", tr.record)
        self.check_cleanup(tr.deployment)

    def check_cleanup(self, deployment: str) -> None:
        """CLEANUP ends when every leaving plan is released (the simulator calls back)."""
        tr = self.active.get(deployment)
        if tr is None or tr.phase is not Phase.CLEANUP:
            return
        if all(e.state in ("released", "dead") for e in tr.leaving):
            tr.phase = Phase.DONE
            tr.record.outcome = "done"
            tr.record.done_s = self.sim.now_s
            self._finish(tr, self.sim.now_s)

    def _finish(self, tr: SimTransition, t: float) -> None:
        self.active.pop(tr.deployment, None)
        if self.on_done is not None:
            self.on_done(tr, t)


def _shape(engines: list[PlanEngine]) -> str:
    return " + ".join(e.plan.shape() for e in engines) if engines else "none"
