"""Scheduling policies a replay compares, as named strategies (`PolicyName`, `make_policy`).

* static: each deployment's baseline plan, never changed. It stops while any of its GPUs is
  gone and restarts cold (weights from disk) when they are all back.
* static-replicas: what people run today with several fixed deployments: the planner's best
  gear of single-block plans (no PP, no prefill/decode split) for the deployment's peak load,
  placed once at t=0, behind the simulator's least-loaded router; each plan behaves as static.
* restart: Kubernetes-style. On a loss the deployment is redeployed: every plan stops (KV
  dropped, requests recomputed), and the best single plan that now fits starts cold from disk.
  It never moves back on its own.
* flexpipe: the production control loop (`scheduler.control.ControlLoop`, over
  `scheduler.gearbox.decide` and `scheduler.planner`) on snapshots of the simulated cluster, every `tick_s` and at once (after the agents' report
  delay) on a topology change; its switches run as three-phase transitions with their modelled
  costs (`agents.sim.switching`).
* oracle: an upper bound. It knows the event schedule and the requests to come: every
  `replan_s` and at every cluster change it takes the planner's best gear for the load of the
  next window, and switches instantly and for free (sequences keep their KV; a plan that is
  about to lose a GPU has already handed its sequences over).

Decision order across deployments: higher priority first, then file order; each sees the
memory the earlier ones hold (their plans are in the snapshot), as on a real shared cluster.
"""

from __future__ import annotations

import bisect
import enum
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from agents.sim.cluster import Change
from agents.sim.engine import PlanEngine
from agents.sim.executor import TransitionDriver
from agents.sim.fleet import DeploymentRuntime, FleetSim
from agents.sim.metrics import SwitchRecord
from agents.sim.scenario import DistSpec, Scenario
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
from scheduler.costmodel import PlanProfile, Workload, estimate_plan
from scheduler.gearbox import (
    DEFAULT_CONFIG,
    Deployment,
    GearboxConfig,
    LoadWindow,
    Outcome,
    Trigger,
    gear_footprint,
    record_switch,
)
from scheduler.invariants import check as check_invariants
from scheduler.plan import Gear, Plan, single_plan_gear, validate_plan
from scheduler.planner import Candidate, PlannerOptions, plan_candidates
from scheduler.topology import AtomicBlock, FragmentHistory, Snapshot, atomic_blocks
from scheduler.transition import DEFAULT_TRANSITION_CONFIG, TransitionConfig, TransitionRecord
from scheduler.transition import Phase as TransitionPhase


class PolicyName(enum.StrEnum):
    STATIC = "static"
    STATIC_REPLICAS = "static-replicas"
    RESTART = "restart"
    FLEXPIPE = "flexpipe"
    ORACLE = "oracle"


@dataclass(frozen=True)
class PolicyOptions:
    """Knobs shared by the policies."""

    tick_s: float = 30.0  # flexpipe's periodic decision (DESIGN.md: every 10-30 s)
    replan_s: float = 300.0  # the oracle's look-ahead window and replanning period
    gearbox: GearboxConfig = DEFAULT_CONFIG  # flexpipe's hysteresis, cooldowns, windows
    transition: TransitionConfig = DEFAULT_TRANSITION_CONFIG  # flexpipe's canary, drain budget, retries
    zero_poll_s: float = 1.0  # how often flexpipe looks for requests held by a deployment at zero (the
    # console's gateway signals at once; the simulator's queue is looked at this often)
    # flexpipe: deployments that may share a GPU by memory fraction (None: the scenario's
    # `max_models_per_gpu`, else the loop's default, 2 - seed 004 section 4.2; 1: exclusive GPUs)
    max_models_per_gpu: int | None = None
    take_from_lower: bool = True  # flexpipe: loop rule 13 (a higher priority takes GPUs from a lower one)


DEFAULT_POLICY_OPTIONS = PolicyOptions()


class Policy:
    """Base: a SimListener that also places the first plans. Subclasses override what they use."""

    name: PolicyName

    def __init__(self, options: PolicyOptions = DEFAULT_POLICY_OPTIONS) -> None:
        self.options = options
        self.switches = 0  # gear changes it carried out
        self.restarts = 0  # cold restarts

    def attach(self, sim: FleetSim) -> None:
        raise NotImplementedError

    def on_cluster_change(self, sim: FleetSim, t: float, changes: Sequence[Change],
                          broke: Mapping[str, Sequence[PlanEngine]]) -> None:
        return None

    def on_ready(self, sim: FleetSim, t: float, engine: PlanEngine) -> None:
        return None

    def on_released(self, sim: FleetSim, t: float, engine: PlanEngine) -> None:
        return None

    def extra(self) -> dict[str, Any]:
        """Policy-specific facts for the report (JSON types)."""
        return {}


def by_priority(sim: FleetSim) -> list[DeploymentRuntime]:
    return sorted(sim.deployments.values(), key=lambda d: (-d.spec.priority, d.index))


def peak_workload(scenario: Scenario, deployment: str) -> Workload:
    """The deployment's load at its peak rate, lengths as the scenario states them."""
    rate = 0.0
    prompt: list[tuple[float, float]] = []
    output: list[tuple[float, float]] = []
    for w in scenario.workload:
        if w.deployment != deployment:
            continue
        if w.arrival == "trace":
            span = max(1.0, (w.trace[-1].t_s - w.trace[0].t_s) if len(w.trace) > 1 else 1.0)
            rate += len(w.trace) / span
            prompt += [(r.prompt_tokens, 0.0) for r in w.trace[:1000]]
            output += [(r.output_tokens, 0.0) for r in w.trace[:1000]]
        else:
            assert w.prompt_tokens is not None and w.output_tokens is not None  # noqa: S101 - loader
            rate += w.max_rate_rps()
            prompt.append(_dist_moments(w.prompt_tokens))
            output.append(_dist_moments(w.output_tokens))
    pm, pcv = _pool(prompt)
    om, ocv = _pool(output)
    return Workload(rate, max(1.0, pm), max(1.0, om), pcv, ocv)


def _dist_moments(d: DistSpec) -> tuple[float, float]:
    """(mean, cv) of a token-count distribution, before clipping."""
    if d.dist == "fixed":
        return float(d.value or 1), 0.0
    if d.dist == "uniform":
        lo, hi = float(d.min or 1), float(d.max or 1)
        mean = (lo + hi) / 2
        return mean, (hi - lo) / math.sqrt(12) / mean
    sigma = float(d.sigma or 0.0)
    return float(d.mean or 1.0), math.sqrt(math.expm1(sigma * sigma))


def _pool(items: Sequence[tuple[float, float]]) -> tuple[float, float]:
    if not items:
        return 1.0, 0.0
    mean = sum(m for m, _ in items) / len(items)
    var = sum((cv * m) ** 2 + (m - mean) ** 2 for m, cv in items) / len(items)
    return mean, math.sqrt(var) / mean if mean > 0 else 0.0


# --- static ---------------------------------------------------------------------------------------
class StaticPolicy(Policy):
    """Fixed plans: stop on a loss, cold restart when every GPU of the plan is back."""

    name = PolicyName.STATIC

    def __init__(self, options: PolicyOptions = DEFAULT_POLICY_OPTIONS) -> None:
        super().__init__(options)
        self.fixed: dict[str, list[tuple[Plan, float]]] = {}  # deployment -> (plan, weight)

    def attach(self, sim: FleetSim) -> None:
        for name, engine in sim.start_baselines().items():
            self.fixed[name] = [(engine.plan, 1.0)]

    def on_cluster_change(self, sim: FleetSim, t: float, changes: Sequence[Change],
                          broke: Mapping[str, Sequence[PlanEngine]]) -> None:
        if any(c.kind in ("restore", "return", "join") for c in changes):
            sim.call_at(t + sim.options.report_delay_s, lambda now: self._revive(sim))

    def _revive(self, sim: FleetSim) -> None:
        snapshot = sim.snapshot()
        for name, plans in self.fixed.items():
            dep = sim.deployments[name]
            for plan, weight in plans:
                if sim.engine_of(name, plan.plan_id) is not None:
                    continue
                if validate_plan(plan, snapshot, dep.model):
                    continue  # not all of its GPUs are back
                sim.launch(name, plan, source="disk", accepting=True, weight=weight)
                self.restarts += 1
                snapshot = sim.snapshot()


class StaticReplicasPolicy(StaticPolicy):
    """Fixed single-block plans on every atomic block (module docstring): each deployment, in
    priority order, takes room on the most capable blocks - on each, the planner's single-block
    gear that serves most of what the deployment still needs - until its peak load x the
    planner's headroom is covered; then each block's remaining room goes to the deployment whose
    peak is largest against what it holds. Placed once at t=0, never changed."""

    name = PolicyName.STATIC_REPLICAS

    def attach(self, sim: FleetSim) -> None:
        options = PlannerOptions(allow_pp=False, allow_disaggregated=False)
        deps = by_priority(sim)
        peak = {d.name: peak_workload(sim.scenario, d.name) for d in deps}
        capacity = {d.name: 0.0 for d in deps}
        self.fixed = {d.name: [] for d in deps}

        def planning_snapshot() -> Snapshot:
            # fixed deployments do not share a GPU: one that hosts a plan has no room left
            snap = sim.snapshot()
            taken = {u for e in sim.live.values() for u in e.plan.gpu_uuids}
            return replace(snap, gpus=tuple(replace(g, mem_used_bytes=g.mem_total_bytes) if g.uuid in taken else g
                                            for g in snap.gpus))

        def blocks() -> list[AtomicBlock]:
            snap = planning_snapshot()
            return sorted(atomic_blocks(snap), key=lambda b: (-b.size * snap.spec(b.gpu_model).bf16_flops, b.id))

        def place(dep: DeploymentRuntime, block_id: str, demand: Workload) -> bool:
            block = next((b for b in blocks() if b.id == block_id), None)
            if block is None:
                return False
            cands = plan_candidates(dep.model, planning_snapshot(), demand, slo=dep.slo, options=options,
                                    blocks=[block])
            if not cands.feasible:
                return False
            # the candidate that serves most of the demand: when one block cannot carry it every
            # candidate is overloaded, its estimated goodput is 0, and the planner's ranking
            # (goodput, then fewer GPUs) would pick the smallest
            best = min(cands.feasible, key=lambda c: (-round(min(c.estimate.capacity_rps, demand.rate_rps), 6),
                                                      -round(c.estimate.goodput_tokens_s, 6), c.estimate.gpus))
            for plan, weight in zip(best.gear.plans, best.gear.weights, strict=True):
                sim.launch(dep.name, plan, source="warm", accepting=True, weight=max(weight, 1e-6))
                self.fixed[dep.name].append((plan, weight))
            capacity[dep.name] += best.estimate.capacity_rps
            return True

        headroom = options.headroom
        for dep in deps:
            for block in blocks():
                need = peak[dep.name].rate_rps * headroom - capacity[dep.name]
                if need <= 0:
                    break
                place(dep, block.id, peak[dep.name].scaled(need / max(peak[dep.name].rate_rps, 1e-9)))
        for block in blocks():
            # what is left of each block: the most loaded deployment (peak over what it holds) that fits
            for dep in sorted(deps, key=lambda d: (-peak[d.name].rate_rps / max(capacity[d.name], 1e-9), d.index)):
                if place(dep, block.id, peak[dep.name]):
                    break
        for dep in deps:
            if not self.fixed[dep.name]:
                plan = sim.baseline_plan(dep.name)
                self.fixed[dep.name] = [(plan, 1.0)]
                sim.launch(dep.name, plan, source="warm", accepting=True)
        # routing weights follow each plan's share of its deployment's capacity (planner weights
        # are per gear; a deployment holds several gears' plans here)
        for dep in deps:
            engines = sim.plans(dep.name)
            caps = {e.engine_id: estimate_plan(e.profile, peak[dep.name], dep.slo).capacity_rps for e in engines}
            total = sum(caps.values()) or 1.0
            sim.set_routing(dep.name, {i: max(c / total, 1e-6) for i, c in caps.items()})
            self.fixed[dep.name] = [(e.plan, max(caps[e.engine_id] / total, 1e-6)) for e in engines]


# --- restart --------------------------------------------------------------------------------------
class RestartPolicy(Policy):
    """Redeploy on a loss: the best single plan that fits now, from cold."""

    name = PolicyName.RESTART

    def __init__(self, options: PolicyOptions = DEFAULT_POLICY_OPTIONS) -> None:
        super().__init__(options)
        self.waiting: set[str] = set()  # deployments with nothing that fits: retry on a change
        self.starting: dict[int, SwitchRecord] = {}  # engine id -> the restart it carries out

    def attach(self, sim: FleetSim) -> None:
        sim.start_baselines()

    def on_cluster_change(self, sim: FleetSim, t: float, changes: Sequence[Change],
                          broke: Mapping[str, Sequence[PlanEngine]]) -> None:
        # its broken deployments, those still waiting for room, and those whose cold start died
        # while loading (nothing of them holds GPUs any more)
        todo = sorted(set(broke) | self.waiting | {n for n in sim.deployments if not sim.plans(n)})
        if todo:
            sim.call_at(t + sim.options.report_delay_s, lambda now: self._restart(sim, todo))

    def _restart(self, sim: FleetSim, names: Sequence[str]) -> None:
        for dep in by_priority(sim):
            if dep.name not in names:
                continue
            engines = sim.plans(dep.name)
            sim.set_routing(dep.name, {})
            for e in engines:
                sim.retire(e, "stop")
            snapshot = sim.snapshot()
            workload = peak_workload(sim.scenario, dep.name)
            cands = plan_candidates(dep.model, snapshot, workload, slo=dep.slo)
            if not cands.feasible:
                self.waiting.add(dep.name)
                continue
            self.waiting.discard(dep.name)
            plan = best_single_plan(cands.feasible, dep, snapshot, workload)
            sim.recorder.switches.append(SwitchRecord(
                dep.name, sim.now_s, from_shape=" + ".join(e.plan.shape() for e in engines) or "none",
                to_shape=plan.shape(), trigger="loss", outcome="restart"))
            engine = sim.launch(dep.name, plan, source="disk", accepting=True)
            self.restarts += 1
            self.switches += 1
            self.starting[engine.engine_id] = sim.recorder.switches[-1]

    def on_ready(self, sim: FleetSim, t: float, engine: PlanEngine) -> None:
        rec = self.starting.pop(engine.engine_id, None)
        if rec is not None:
            rec.serving_s = rec.done_s = t
            rec.outcome = "done"


def best_single_plan(cands: Sequence[Candidate], dep: DeploymentRuntime, snapshot: Snapshot,
                     workload: Workload) -> Plan:
    """Among every plan the planner built, the one that serves the most alone - throughput,
    then goodput (an overloaded plan's goodput is 0 whatever its size), then fewer GPUs: a
    redeployed pod has one shape."""
    seen: dict[Plan, tuple[float, float, int]] = {}
    for c in cands:
        for plan in c.gear.plans:
            if plan not in seen:
                profile = c.profiles.get(plan) or PlanProfile.build(plan, dep.model, snapshot)
                est = estimate_plan(profile, workload, dep.slo)
                seen[plan] = (round(est.throughput_tokens_s, 6), round(est.goodput_tokens_s, 6), len(plan.gpu_uuids))
    return min(seen, key=lambda p: (-seen[p][0], -seen[p][1], seen[p][2], p.gpu_uuids))


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

    @property
    def calls(self) -> int:
        """gearbox.decide calls."""
        return self.loop.calls

    def attach(self, sim: FleetSim) -> None:
        self._sim = sim
        opts = self.options
        most = opts.max_models_per_gpu or sim.scenario.max_models_per_gpu or self.loop.config.max_models_per_gpu
        self.loop = ControlLoop(replace(self.loop.config, max_models_per_gpu=most, take_from_lower=opts.take_from_lower))
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
                reports_mirror_last=not (name in self.at_zero and dep.engines)))
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
        if step.release is not None:  # rule 9b: drain and free the gear; its requests wait for a wake-up
            self.driver.release(name)
            self.at_zero.add(name)
            self.scaled_to_zero += 1
            self.decisions.append({"t_s": round(t, 3), "deployment": name, "trigger": step.trigger.value,
                                   "outcome": "scale_to_zero", "target": None, "stage": 0, "reason": step.release})
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
class OraclePolicy(Policy):
    """Best gear for the coming window, switched instantly and for free (module docstring)."""

    name = PolicyName.ORACLE

    def __init__(self, options: PolicyOptions = DEFAULT_POLICY_OPTIONS) -> None:
        super().__init__(options)
        self.future: dict[str, tuple[list[float], list[int], list[int]]] = {}

    def attach(self, sim: FleetSim) -> None:
        sim.kv_survives_loss = True  # it moved the sequences away just before the loss
        for name in sim.deployments:
            arr = [a for a in sim._arrivals if a.deployment == name]
            self.future[name] = ([a.t_s for a in arr], [a.prompt_tokens for a in arr],
                                 [a.output_tokens for a in arr])
        self._replan(sim, 0.0)
        sim.call_at(self.options.replan_s, lambda t: self._tick(sim, t))

    def _tick(self, sim: FleetSim, t: float) -> None:
        self._replan(sim, t)
        if t + self.options.replan_s <= sim.scenario.duration_s:
            sim.call_at(t + self.options.replan_s, lambda now: self._tick(sim, now))

    def on_cluster_change(self, sim: FleetSim, t: float, changes: Sequence[Change],
                          broke: Mapping[str, Sequence[PlanEngine]]) -> None:
        self._replan(sim, t)

    def lookahead(self, name: str, t: float) -> Workload:
        """The load of [t, t + replan_s) as it will be (the oracle knows the requests)."""
        times, prompts, outputs = self.future[name]
        window = self.options.replan_s
        i, j = bisect.bisect_left(times, t), bisect.bisect_left(times, t + window)
        n = j - i
        if n == 0:
            return Workload(0.0, 512.0, 128.0)
        pm = sum(prompts[i:j]) / n
        om = sum(outputs[i:j]) / n
        pcv = math.sqrt(max(0.0, sum(p * p for p in prompts[i:j]) / n - pm * pm)) / pm
        ocv = math.sqrt(max(0.0, sum(o * o for o in outputs[i:j]) / n - om * om)) / om
        return Workload(n / window, pm, om, pcv, ocv)

    def _replan(self, sim: FleetSim, t: float) -> None:
        for dep in by_priority(sim):
            current = [e for e in sim.plans(dep.name) if not e.release_when_empty]
            snapshot = sim.snapshot()
            gear_now = Gear(dep.model.name, tuple(e.plan for e in current),
                            tuple(1.0 / len(current) for _ in current)) if current else None
            reclaim = gear_footprint(gear_now, dep.model, snapshot) if gear_now else {}
            cands = plan_candidates(dep.model, snapshot, self.lookahead(dep.name, t), slo=dep.slo,
                                    reclaimable_bytes=reclaim,
                                    prefer_gpus=gear_now.gpu_uuids if gear_now else ())
            if not cands.feasible:
                continue
            target = cands.feasible[0].gear
            if set(target.plans) == {e.plan for e in current}:
                continue
            self._switch_free(sim, dep.name, target, current, t)

    def _switch_free(self, sim: FleetSim, name: str, target: Gear, current: list[PlanEngine], t: float) -> None:
        by_plan = {e.plan: e for e in current}
        record = SwitchRecord(name, t, serving_s=t, done_s=t,
                              from_shape=" + ".join(e.plan.shape() for e in current) or "none",
                              to_shape=target.shape(), trigger="oracle", outcome="done")
        # NOTE(memory): the leaving plans go first, so that the new ones book GPUs that are free
        # (invariant 4 holds for the bound too): routing keeps only the plans both gears share,
        # the leaving ones hand their sequences over with their KV ("free") - to a kept plan, or
        # to the deployment's queue - and the new plans start warm and take the queue at once
        kept = {by_plan[p].engine_id: w for p, w in zip(target.plans, target.weights, strict=True) if p in by_plan}
        sim.set_routing(name, kept)
        for e in current:
            if e.plan not in target.plans:
                sim.retire(e, "free", record)
        engines: dict[int, float] = {}
        for plan, w in zip(target.plans, target.weights, strict=True):
            engine = by_plan.get(plan) or sim.launch(name, plan, source="warm", accepting=False)
            engines[engine.engine_id] = w
        sim.set_routing(name, engines)
        sim.recorder.switches.append(record)
        self.switches += 1


REGISTRY: dict[PolicyName, Callable[[PolicyOptions], Policy]] = {
    PolicyName.STATIC: StaticPolicy,
    PolicyName.STATIC_REPLICAS: StaticReplicasPolicy,
    PolicyName.RESTART: RestartPolicy,
    PolicyName.FLEXPIPE: FlexPipePolicy,
    PolicyName.ORACLE: OraclePolicy,
}


def make_policy(name: str, options: PolicyOptions = DEFAULT_POLICY_OPTIONS) -> Policy:
    """The policy registered under `name`; ValueError naming the known ones otherwise."""
    try:
        key = PolicyName(name)
    except ValueError:
        raise ValueError(f"policy: unknown {name!r}; known: {', '.join(p.value for p in PolicyName)}") from None
    return REGISTRY[key](options)


ALL_POLICIES: tuple[str, ...] = tuple(p.value for p in PolicyName)
