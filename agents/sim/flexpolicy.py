"""The flexpipe policy of the replays (agents/sim/policies.py lists them all): a thin driver of the
production control loop (`scheduler.control.ControlLoop`, over `scheduler.gearbox.decide` and
`scheduler.planner`) on snapshots of the simulated cluster, every `tick_s` and at once (after the
agents' report delay) on a topology change; its switches run as three-phase transitions with
their modelled costs through `agents.sim.executor.TransitionDriver`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from agents.sim.cluster import Change
from agents.sim.engine import PlanEngine
from agents.sim.executor import TransitionDriver
from agents.sim.fleet import FleetSim
from agents.sim.policies import DEFAULT_POLICY_OPTIONS, Policy, PolicyName, PolicyOptions, by_priority
from scheduler.backoff import Backoff
from scheduler.control import (
    ControlLoop,
    DeploymentState,
    Finished,
    FirstStage,
    FleetState,
    LoopConfig,
    Running,
    Staged,
    Step,
)
from scheduler.gearbox import Deployment, LoadWindow, Outcome, Trigger, record_switch
from scheduler.invariants import check as check_invariants
from scheduler.plan import Gear, single_plan_gear
from scheduler.pool.priority import UNLOAD_HOLD_S
from scheduler.topology import FragmentHistory, atomic_blocks
from scheduler.transition import Phase as TransitionPhase
from scheduler.transition import TransitionRecord

# --- flexpipe ------------------------------------------------------------------------------------
# The simulator's differences from the console's loop, as the loop's own inputs (scheduler.control):
# reports are instant (reports_mirror_last), and a periodic step inside a cooldown is skipped
# (skip_cooldown_stays: the replay needs only switches). Baselines are seeded at t=0; a gear whose
# plans all died (drop_lost) comes back through the loop's bring-up (rule 9), as the console's does
SIM_LOOP = LoopConfig(skip_cooldown_stays=True)


class FlexPipePolicy(Policy):
    """A thin driver of scheduler.control.ControlLoop on simulated snapshots; its transitions
    run through scheduler.transition (agents.sim.executor.TransitionDriver)."""

    name = PolicyName.FLEXPIPE

    def __init__(self, options: PolicyOptions = DEFAULT_POLICY_OPTIONS) -> None:
        super().__init__(options)
        self.loop = ControlLoop(replace(SIM_LOOP, gearbox=options.gearbox))
        self.deployments: dict[str, Deployment] = {}
        self.windows: dict[str, LoadWindow] = {}
        self.history = FragmentHistory()
        self.driver: TransitionDriver | None = None
        self.decisions: list[dict[str, Any]] = []  # switches and blocks, for the report
        self.staged: dict[str, Staged] = {}  # deployment -> its staged switch on the way
        self.backoff: dict[str, Backoff] = {}  # deployment -> its back-off book (scheduler.backoff)
        self.finished: dict[str, list[Finished]] = {}  # deployment -> transitions ended since its last step
        self._topology_at: float | None = None
        self._sim: FleetSim | None = None
        self.at_zero: set[str] = set()  # deployments whose gear rule 9b released (waiting for a request)
        self.waking: set[str] = set()  # ... whose wake-up transition runs
        self.up_since: dict[str, float] = {}  # deployment -> when its last wake-up finished
        self.cold_starts = 0  # wake-ups started (a deployment at zero brought back for a held request)
        self.scaled_to_zero = 0  # releases carried out (rule 9b)
        self.unloads = 0  # releases of a giver with nowhere to go (rule 13)
        self.kept_off: dict[str, tuple[frozenset[str], float]] = {}  # giver -> GPUs it gave, until when
        self._last_block: dict[str, tuple[str, str]] = {}  # deployment -> its last block (trigger, reason)

    @property
    def calls(self) -> int:
        """gearbox.decide calls."""
        return self.loop.calls

    def attach(self, sim: FleetSim) -> None:
        self._sim = sim
        opts = self.options
        most = opts.max_models_per_gpu or sim.scenario.max_models_per_gpu or self.loop.config.max_models_per_gpu
        self.loop = ControlLoop(replace(self.loop.config, max_models_per_gpu=most, take_from_lower=opts.take_from_lower,
                                        model_weights=opts.model_weights))
        sim.max_models_per_gpu = most
        self.driver = TransitionDriver(sim, config=self.options.transition, on_finished=self._done)
        self.driver.world.store.max_models_per_gpu = most
        driver = self.driver
        sim.control_busy = lambda: any(driver.running(name) for name in sim.deployments)
        for name, gear in self.start_gears(sim).items():
            dep = sim.deployments[name]
            self.driver.seed(name, gear)
            self.deployments[name] = Deployment(id=name, model=dep.model.name, slo=dep.slo, baseline=gear,
                                                priority=dep.spec.priority)
            self.windows[name] = LoadWindow()
        self.history = self.history.observe(atomic_blocks(sim.snapshot()), 0.0)
        sim.call_at(self.options.tick_s, lambda t: self._tick(sim, t))

    def start_gears(self, sim: FleetSim) -> dict[str, Gear]:
        """deployment -> the gear it runs, warm, at t=0 (also its baseline gear, the emergency
        target): the scenario's baseline plans."""
        return {name: single_plan_gear(engine.plan) for name, engine in sim.start_baselines().items()}

    # -- triggers -------------------------------------------------------------------------------
    def _tick(self, sim: FleetSim, t: float) -> None:
        cfg = self.options.gearbox
        keep = cfg.long_window_s + 2 * self.options.tick_s
        for name in self.deployments:
            sample = sim.load_sample(name, t)
            if sample is not None:
                self.windows[name] = self.windows[name].add(sample, keep_s=keep)
        self._step(sim, t, Trigger.PERIODIC)
        if t + self.options.tick_s <= sim.scenario.duration_s:
            sim.call_at(t + self.options.tick_s, lambda now: self._tick(sim, now))

    def on_cluster_change(self, sim: FleetSim, t: float, changes: Sequence[Change],
                          broke: Mapping[str, Sequence[PlanEngine]]) -> None:
        assert self.driver is not None  # noqa: S101 - attached first
        self.driver.kick_all()  # a running transition notices lost GPUs at its next pass
        at = t + sim.options.report_delay_s
        if self._topology_at is None or self._topology_at < t:
            self._topology_at = at
            sim.call_at(at, lambda now: self._topology(sim, now))

    def _topology(self, sim: FleetSim, t: float) -> None:
        self._topology_at = None
        self._step(sim, t, Trigger.TOPOLOGY)

    def on_ready(self, sim: FleetSim, t: float, engine: PlanEngine) -> None:
        if self.driver is not None:
            self.driver.on_ready(engine)

    def on_released(self, sim: FleetSim, t: float, engine: PlanEngine) -> None:
        if self.driver is not None:
            self.driver.on_stopped(engine)

    def _done(self, rec: TransitionRecord, t: float) -> None:
        sim = self._sim
        assert sim is not None  # noqa: S101
        name = rec.deployment_id
        # the loop folds it into the back-off at the deployment's next step (rule 5), on the
        # fleet as it is now (what the refusal's fingerprint must compare against)
        self.finished.setdefault(name, []).append(Finished(rec, t, sim.snapshot()))
        if name in self.waking:
            self.waking.discard(name)
            if rec.phase is TransitionPhase.DONE:  # back from zero: the idle time counts from now
                self.at_zero.discard(name)
                self.up_since[name] = t
            else:  # rolled back: still at zero, its requests still held; the watch goes on
                self._watch_zero(sim, name, t + self.options.zero_poll_s)
        staged = self.staged.get(name)
        if staged is not None:
            done = rec.phase is TransitionPhase.DONE
            self.staged[name] = replace(staged, first_stage=FirstStage.DONE if done else FirstStage.ENDED)
            if done:
                # the first stage of a staged switch is done: on to the second at once
                sim.call_at(t, lambda now: self._step(sim, now, Trigger.PERIODIC, only=name))
                return
        if not self._valid(sim, name) or rec.phase is not TransitionPhase.DONE:
            # decisions deferred while it ran may be owed: decide again now - or, after a roll
            # back, a second later (as the console's retry does): at the same instant the same
            # snapshot gives the same decision, and a reservation refused because another
            # deployment booked the GPUs an instant ago would be refused again, forever
            again = t if rec.phase is TransitionPhase.DONE else t + 1.0
            sim.call_at(again, lambda now: self._step(sim, now, Trigger.TOPOLOGY, only=name))

    # -- the loop -------------------------------------------------------------------------------
    def _valid(self, sim: FleetSim, name: str) -> bool:
        """Every plan of the stable gear serves (then the gearbox's validity check passes: the
        simulator's memory never changes under a serving plan)."""
        assert self.driver is not None  # noqa: S101
        gear = self.driver.current_gear(name)
        if gear is None:
            return False
        for plan in gear.plans:
            engine = sim.engine_of(name, plan.plan_id)
            if engine is None or engine.state != "serving":
                return False
        return True

    def observation(self, sim: FleetSim, t: float, only: str | None = None
                    ) -> tuple[list[DeploymentState], FleetState]:
        """The simulator's state as the loop observes it (also records the blocks' trajectories)."""
        assert self.driver is not None  # noqa: S101
        driver = self.driver
        snap = sim.snapshot()
        self.history = self.history.observe(atomic_blocks(snap), t)
        states = []
        for dep in by_priority(sim):
            name = dep.name
            if only is not None and name != only:
                continue
            lost = driver.drop_lost(name)  # plans that died on GPUs that came back (the loop's rule 2)
            running = driver.world.store.active(name)
            states.append(DeploymentState(
                deployment=self.deployments[name], current=driver.current_gear(name), load=self.windows[name],
                model=dep.model, backoff=self.backoff.get(name), finished=tuple(self.finished.get(name, ())),
                staged=self.staged.get(name),
                running=Running(running.seq, running.kind, running.phase.value, bool(running.abort_reason))
                if running is not None else None,
                serving=self._valid(sim, name), lost_plans=tuple(lost), index=dep.index,
                idle_to_zero_s=dep.spec.idle_to_zero_s, min_replicas=dep.spec.min_replicas,
                up_since_s=self.up_since.get(name), at_zero=name in self.at_zero,
                waiting=len(dep.pending) if name in self.at_zero else 0,
                # mirror first: a wake-up waits until the released plans freed their GPUs
                reports_mirror_last=not (name in self.at_zero and dep.engines),
                keep_off=self._kept_off(name, t)))
        return states, FleetState(snapshot=snap, history=self.history, held=_held(driver), jobs=sim.job_states(),
                                  booked=_booked(sim, driver))

    def _step(self, sim: FleetSim, t: float, trigger: Trigger, only: str | None = None) -> None:
        assert self.driver is not None  # noqa: S101
        states, fleet = self.observation(sim, t, only)
        self.loop.observe(states, fleet)
        out = self.loop.step(t, trigger)
        for step in out.steps:
            self._carry_out(sim, step, t)

    def _carry_out(self, sim: FleetSim, step: Step, t: float) -> None:
        """Persist one step of the loop's output in the simulator's state; start its transition."""
        assert self.driver is not None  # noqa: S101
        name = step.deployment_id
        if step.backoff is not None:  # the loop folded what ended (rule 5)
            self.backoff[name] = step.backoff
            self.finished.pop(name, None)
        if step.clear_staged:
            self.staged.pop(name, None)
        if step.release is not None:  # rule 9b (or 13: unload): drain and free the gear; its requests wait
            self.driver.release(name)
            self.at_zero.add(name)
            if step.gives_to is not None:  # it unloaded for a higher priority: kept off what it gave
                self.unloads += 1
                self.kept_off[name] = (frozenset(step.given), t + UNLOAD_HOLD_S)
            else:
                self.scaled_to_zero += 1
            self.decisions.append({"t_s": round(t, 3), "deployment": name, "trigger": step.trigger.value,
                                   "outcome": "unload" if step.gives_to is not None else "scale_to_zero",
                                   "target": None, "stage": 0, "reason": step.release,
                                   **({"gives_to": step.gives_to} if step.gives_to is not None else {})})
            self._watch_zero(sim, name, t + self.options.zero_poll_s)
            return
        decision = step.decision
        if decision is None:
            return
        if step.start is not None:
            rec = self.driver.start(name, step.start.target, decision.trigger.value, decision_ref=f"{name}@{t:.3f}")
            if rec is None:
                return
            if step.start.staged_target is not None:
                self.staged[name] = Staged(step.start.staged_target, step.start.kind, FirstStage.RUNNING)
            if step.wake:  # a cold start: no cooldown (a bring-up is no switch the gearbox chose)
                self.waking.add(name)
                self.cold_starts += 1
            else:
                # only a switch the gearbox chose starts a cooldown (gearbox.record_switch)
                self.deployments[name] = record_switch(self.deployments[name], t, forced=decision.forced)
                self.switches += 1
        if decision.outcome is Outcome.BLOCKED and not (step.takes or step.gives_to):
            # a deployment waiting for GPUs (at zero, kept off what it gave) is blocked at every
            # look for its held requests: the same block again is not a new entry
            said = (decision.trigger.value, decision.reasons[-1] if decision.reasons else "")
            if self._last_block.get(name) == said:
                return
            self._last_block[name] = said
        if decision.outcome in (Outcome.SWITCH, Outcome.BLOCKED) or step.takes or step.gives_to:
            entry: dict[str, Any] = {
                "t_s": round(t, 3), "deployment": name, "trigger": decision.trigger.value,
                "outcome": decision.outcome.value,
                "target": decision.target.shape() if decision.target else None,
                "stage": decision.stage,
                "reason": decision.reasons[-1] if decision.reasons else "",
            }
            if step.takes is not None:  # loop rule 13: both sides name the other
                entry["takes"] = {g.giver: list(g.gpus) for g in step.takes.gives}
                entry["reason"] = step.takes.taker_reason()
            if step.gives_to is not None:
                entry["gives_to"] = step.gives_to
                entry["reason"] = decision.reasons[0]
            self.decisions.append(entry)

    def _kept_off(self, name: str, t: float) -> frozenset[str]:
        """The GPUs a giver that unloaded gave, while the hold lasts (the loop's `keep_off`)."""
        gpus, until = self.kept_off.get(name, (frozenset(), 0.0))
        if t >= until:
            self.kept_off.pop(name, None)
            return frozenset()
        return gpus

    def _watch_zero(self, sim: FleetSim, name: str, t: float) -> None:
        """While a deployment is at zero, look for held requests every `zero_poll_s`: one wakes it."""
        if name not in self.at_zero or name in self.waking:
            return
        if sim.deployments[name].pending:
            self._step(sim, t, Trigger.PERIODIC, only=name)
        if t + self.options.zero_poll_s <= sim.scenario.duration_s or sim.deployments[name].pending:
            sim.call_at(t + self.options.zero_poll_s, lambda now: self._watch_zero(sim, name, now))

    def extra(self) -> dict[str, Any]:
        assert self.driver is not None  # noqa: S101
        violations = check_invariants(self.driver.log.events, complete=True)
        out: dict[str, Any] = {"decide_calls": self.calls, "decisions": self.decisions[:200],
                               "transition_invariant_violations": [str(v) for v in violations[:20]]}
        if any(d.spec.idle_to_zero_s is not None for d in self._sim.deployments.values()) if self._sim else False:
            out.update(scaled_to_zero=self.scaled_to_zero, cold_starts=self.cold_starts)
        if self.unloads:
            out.update(unloads=self.unloads)
        return out


def _held(driver: TransitionDriver) -> dict[str, frozenset[str]]:
    """deployment -> GPUs it holds: its stable gear, both gears of a transition it runs, its
    bookings (the console's `held_gpus`, on the simulator's store)."""
    store = driver.world.store
    out: dict[str, set[str]] = {}
    for name, gear in store.gears.items():
        if gear is not None:
            out.setdefault(name, set()).update(gear.gpu_uuids)
    for name in list(store.gears):
        rec = store.active(name)
        if rec is not None:
            out.setdefault(name, set()).update(rec.to_gear.gpu_uuids)
            if rec.from_gear is not None:
                out[name].update(rec.from_gear.gpu_uuids)
    for u, holders in store.bookings.items():
        for d, _ in holders:
            out.setdefault(d, set()).add(u)
    return {k: frozenset(v) for k, v in out.items()}


def _booked(sim: FleetSim, driver: TransitionDriver) -> dict[str, dict[str, int]]:
    """deployment -> GPU -> bytes it holds: what its simulated agents hold now, or its bookings
    where those are more (a plan booked, not yet launched) - the console's reservations."""
    out = sim.booked_by_deployment()
    for u, holders in driver.world.store.bookings.items():
        per_dep: dict[str, int] = {}
        for (d, _), b in holders.items():
            per_dep[d] = per_dep.get(d, 0) + b
        for d, b in per_dep.items():
            per = out.setdefault(d, {})
            per[u] = max(per.get(u, 0), b)
    return out


# --- oracle ----------------------------------------------------------------------------------------


__all__ = ["SIM_LOOP", "FlexPipePolicy"]
