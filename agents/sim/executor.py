"""FlexPipe's gear changes in the simulator, through the production transition executor.

`TransitionDriver` runs `scheduler.transition.Executor` - the three-phase state machine that
production runs from Celery - over the in-memory ports of `scheduler.transition_memory` (store,
versioned routing table, agent mailbox), with the `FleetSim` playing every agent: it takes the
commands queued for each node and carries them out on its engines, with modelled durations,
then acks them as agent protocol v1 says: `agents.sim.simagents.SimAgents`, the one simulated
executor of those commands (the live fleet and the tests' worlds run it too).

After every executor pass the simulator's routing follows the committed routing table (weight
> 0 and not frozen: takes new requests). The executor is advanced whenever an ack arrives,
after a cluster change, and at the times it asks to be woken (a canary dwell, a timeout).
Transition events and effects go to the driver's `EventLog`, so `scheduler.invariants.check` can
verify invariant 3 over a run; each request's life goes to the simulator's own log when it has
one (agents/sim/seqlog.py: `agents.sim.run` checks invariants 1-2 on it as a replay runs).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import replace

from agents.sim.engine import PlanEngine
from agents.sim.faults import Fault
from agents.sim.fleet import FleetSim
from agents.sim.metrics import SwitchRecord
from agents.sim.simagents import SimAgents
from scheduler.invariants import EventLog
from scheduler.modelspec import model_spec
from scheduler.plan import Gear
from scheduler.transition import (
    DEFAULT_TRANSITION_CONFIG,
    CommandIntent,
    Executor,
    Kind,
    Phase,
    Route,
    Step,
    TransitionConfig,
    TransitionRecord,
    plan_nodes,
)
from scheduler.transition_memory import ManualClock, MemoryWorld

Finished = Callable[[TransitionRecord, float], None]


class TransitionDriver:
    """The production executor, advanced on the simulator's clock (module docstring)."""

    def __init__(self, sim: FleetSim, *, config: TransitionConfig = DEFAULT_TRANSITION_CONFIG,
                 on_finished: Finished | None = None) -> None:
        self.sim = sim
        self.config = config
        self.on_finished = on_finished
        self.clock = ManualClock(sim.now_s)
        self.log = EventLog(record_decodes=False)
        self.world = MemoryWorld(self.clock, sim.snapshot, self.log)
        self.executor = Executor(self.world.store, self.world.agents, self.world.routing, self._now,
                                 config=config, models=model_spec, eff=sim.eff)
        self.records: dict[str, SwitchRecord] = {}  # "<deployment>/<seq>" -> what the report shows
        self._versions: dict[str, int] = {}  # deployment -> routing version the simulator follows
        self._wakes: dict[str, set[float]] = {}  # deployment -> advances already scheduled
        self.agents = SimAgents(sim, self._ack, config=config, log=self.log)

    def _now(self) -> float:
        return self.sim.now_s

    # --- state --------------------------------------------------------------------------------
    def running(self, deployment: str) -> bool:
        return self.world.store.active(deployment) is not None

    def current_gear(self, deployment: str) -> Gear | None:
        return self.world.store.current_gear(deployment)

    def held_by_others(self, deployment: str) -> set[str]:
        """GPUs other deployments hold: their stable gears, both gears of a transition they run,
        and their bookings (what the console's `held_gpus` gives the gearbox, the same way)."""
        store = self.world.store
        out: set[str] = set()
        for name, gear in store.gears.items():
            if name != deployment and gear is not None:
                out.update(gear.gpu_uuids)
        for name in list(store.gears):
            rec = store.active(name) if name != deployment else None
            if rec is not None:
                out.update(rec.to_gear.gpu_uuids)
                if rec.from_gear is not None:
                    out.update(rec.from_gear.gpu_uuids)
        for u, holders in store.bookings.items():
            if any(d != deployment for (d, _) in holders):
                out.add(u)
        return out

    def seed(self, deployment: str, gear: Gear) -> None:
        """A deployment already running `gear` (started before the scenario): its stable gear
        and routing table, as a past transition would have left them."""
        snap = self.sim.snapshot()
        self.world.store.gears[deployment] = gear
        table = self.world.routing.seed(deployment, [Route(p, w, nodes=plan_nodes(p, snap))
                                                     for p, w in zip(gear.plans, gear.weights, strict=True)])
        self._versions[deployment] = table.version

    def release(self, deployment: str) -> None:
        """Scale to zero (the control loop's rule 9b), with no transition - there is no gear to switch
        to: the routing table is emptied (its arrivals wait in the deployment's queue), the stable
        gear is forgotten, and each plan drains - what it holds finishes there - then frees its GPUs.
        The next gear comes up through the loop's wake-up, a transition from no gear."""
        self.world.store.gears[deployment] = None
        table = self.world.routing.seed(deployment, [])
        self._versions[deployment] = table.version
        self.sim.set_routing(deployment, {}, table.version)
        for engine in self.sim.plans(deployment):
            self.sim.retire(engine, "drain")

    def drop_lost(self, deployment: str) -> list[str]:
        """Take the plans of the stable gear that died with GPUs that are back now out of its gear
        and routing table; their ids (the console's actions.drop_lost_plans, for a simulated engine).

        A plan that loses a GPU stops (FleetSim); while its GPUs are gone its gear is invalid and
        the gearbox moves off it. When they come back before it did (nothing else was free), the
        gear looks valid on the snapshot but nothing of it runs: what is left of it keeps serving,
        weights renormalised, and the loop's next step (a topology one, its rule 2) replaces what
        was lost - brings a gear up again when no plan is left (rule 9). Never while a transition
        runs: it notices its lost plans itself."""
        gear = self.current_gear(deployment)
        if gear is None or self.running(deployment):
            return []
        lost = {p.plan_id for p in gear.plans if self.sim.engine_of(deployment, p.plan_id) is None
                and all(self.sim.gpu_usable(u) for u in p.gpu_uuids)}
        if not lost:
            return []
        kept = [(p, w) for p, w in zip(gear.plans, gear.weights, strict=True) if p.plan_id not in lost]
        total = sum(w for _, w in kept)
        self.world.store.gears[deployment] = (
            Gear(gear.model, tuple(p for p, _ in kept), tuple(w / total if total > 0 else 1.0 / len(kept)
                                                            for _, w in kept)) if kept else None)
        routes = [r for r in self.world.routing.current(deployment).routes if r.plan_id not in lost]
        open_weight = sum(r.weight for r in routes if not r.frozen)
        self.world.routing.seed(deployment, [r if r.frozen else replace(
            r, weight=r.weight / open_weight if open_weight > 0 else 1.0 / len(routes)) for r in routes])
        self._follow_routing(deployment)
        return sorted(lost)

    # --- starting and advancing -----------------------------------------------------------------
    def start(self, deployment: str, target: Gear, trigger: str, decision_ref: str | None = None
              ) -> TransitionRecord | None:
        self.clock.set(self.sim.now_s)
        current = self.current_gear(deployment)
        rec = self.executor.start(deployment, target, kind=Kind.AUTO, decision_ref=decision_ref)
        if rec is None:
            return None
        record = SwitchRecord(deployment, self.sim.now_s, from_shape=current.shape() if current else "none",
                              to_shape=target.shape(), trigger=trigger)
        self.records[f"{deployment}/{rec.seq}"] = record
        self.sim.recorder.switches.append(record)
        # advance at once (reserve, prepare): its new plans hold their memory before the next
        # deployment decides on the same snapshot
        self._advance(deployment, self.sim.now_s)
        return rec

    def kick(self, deployment: str, at_s: float | None = None) -> None:
        """Advance the deployment's transition at `at_s` (default now), once per instant."""
        t = self.sim.now_s if at_s is None else max(self.sim.now_s, at_s)
        wakes = self._wakes.setdefault(deployment, set())
        if t in wakes:
            return
        wakes.add(t)
        self.sim.call_at(t, lambda now: self._advance(deployment, now))

    def kick_all(self) -> None:
        for dep in self.sim.deployments:
            if self.running(dep):
                self.kick(dep)

    def _advance(self, deployment: str, t: float) -> None:
        self._wakes.get(deployment, set()).discard(t)
        self.clock.set(t)
        before = self.world.store.active(deployment)
        adv = self.executor.advance(deployment)
        self._follow_routing(deployment)
        self._carry_out()
        rec = adv.record
        if rec is None:
            return
        switch = self.records.get(f"{deployment}/{rec.seq}")
        if switch is not None:
            # the canary's routing commit (or, without one, the flip's) is when the new plans take requests
            canary = any(not a.intent.noop for a in rec.attempts(Step.CANARY))
            if switch.serving_s is None and rec.phase is not Phase.ROLLBACK and (canary or rec.done(Step.FLIP)):
                switch.serving_s = t  # the canary (or the flip): the new gear takes requests
            switch.migrated = rec.moved.seqs_migrated
            switch.replayed = rec.moved.seqs_replayed
            switch.stayed = rec.moved.seqs_finished
        if adv.finished or (before is not None and not rec.active):
            if switch is not None:
                switch.done_s = t
                switch.outcome = "done" if rec.phase is Phase.DONE else "rolled_back"
                if rec.phase is not Phase.DONE:
                    switch.serving_s = None
            if self.on_finished is not None:
                self.on_finished(rec, t)
            return
        if adv.wake_at_s is not None and math.isfinite(adv.wake_at_s):
            self.kick(deployment, adv.wake_at_s)

    def _follow_routing(self, deployment: str) -> None:
        """The simulator routes as the committed table says (weight > 0 and not frozen)."""
        table = self.world.routing.current(deployment)
        if self._versions.get(deployment) == table.version:
            return
        self._versions[deployment] = table.version
        weights: dict[int, float] = {}
        for route in table.routes:
            engine = self.sim.engine_of(deployment, route.plan_id)
            if engine is not None and route.weight > 0 and not route.frozen:
                weights[engine.engine_id] = route.weight
        self.sim.set_routing(deployment, weights, table.version)

    # --- the mailbox ---------------------------------------------------------------------------------
    @property
    def faults(self) -> list[Fault]:
        """The faults injected and not yet used up (the agents hold them)."""
        return self.agents.faults

    def inject(self, fault: Fault) -> None:
        """Make the next matching commands misbehave (agents/sim/faults.py: fail, hang, lose_gpus),
        as the simulated agents of the live fleet and of the tests' worlds do."""
        self.agents.inject(fault)

    def _carry_out(self) -> None:
        mailbox = self.world.agents
        for node in sorted(self.sim.cluster.nodes):
            for cmd in mailbox.take(node):
                self.agents.execute(cmd)

    def _ack(self, cmd: CommandIntent, ok: bool, detail: str, result: Mapping[str, object]) -> None:
        self.world.agents.ack(cmd.key, "ok" if ok else "failed", detail, dict(result))
        self.kick(cmd.deployment_id)

    def on_ready(self, engine: PlanEngine) -> None:
        self.agents.on_ready(engine)

    def on_stopped(self, engine: PlanEngine) -> None:
        self.agents.on_stopped(engine)


__all__ = ["Finished", "SimAgents", "TransitionDriver"]
