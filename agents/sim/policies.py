"""Scheduling policies a replay compares, as named strategies (`PolicyName`, `make_policy`).

* static: each deployment's baseline plan, never changed. It stops while any of its GPUs is
  gone and restarts cold (weights from disk) when they are all back.
* static-replicas: what people run today with several fixed deployments: the planner's best
  gear of single-block plans (no PP, no prefill/decode split) for the deployment's peak load,
  placed once at t=0, behind the simulator's least-loaded router; each plan behaves as static.
* restart: Kubernetes-style. On a loss the deployment is redeployed: every plan stops (KV
  dropped, requests recomputed), and the best single plan that now fits starts cold from disk.
  It never moves back on its own.
* flexpipe (agents/sim/flexpolicy.py): the production control loop (`scheduler.control.ControlLoop`,
  over `scheduler.gearbox.decide` and `scheduler.planner`) on snapshots of the simulated cluster,
  every `tick_s` and at once (after the agents' report delay) on a topology change; its switches
  run as three-phase transitions with their modelled costs.
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
from dataclasses import dataclass, field, replace
from typing import Any

from agents.sim.cluster import Change
from agents.sim.engine import PlanEngine
from agents.sim.fleet import DeploymentRuntime, FleetSim
from agents.sim.metrics import SwitchRecord
from agents.sim.scenario import Scenario
from agents.sim.scenario_load import DistSpec
from scheduler.costmodel import PlanProfile, Workload, estimate_plan
from scheduler.gearbox import (
    DEFAULT_CONFIG,
    GearboxConfig,
    gear_footprint,
)
from scheduler.plan import Gear, Plan, validate_plan
from scheduler.planner import Candidate, PlannerOptions, plan_candidates
from scheduler.topology import AtomicBlock, Snapshot, atomic_blocks
from scheduler.transition import DEFAULT_TRANSITION_CONFIG, TransitionConfig


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
    # flexpipe: loop rule 14's soft-limit weights by model name (seed 004 section 3.2; empty: none)
    model_weights: Mapping[str, float] = field(default_factory=dict)


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


def registry() -> dict[PolicyName, Callable[[PolicyOptions], Policy]]:
    """Every policy by name. The FlexPipe policy lives in agents/sim/flexpolicy.py, which builds on
    the base classes here (imported when asked for, so either module may be imported first)."""
    from agents.sim.flexpolicy import FlexPipePolicy

    return {PolicyName.STATIC: StaticPolicy, PolicyName.STATIC_REPLICAS: StaticReplicasPolicy,
            PolicyName.RESTART: RestartPolicy, PolicyName.FLEXPIPE: FlexPipePolicy, PolicyName.ORACLE: OraclePolicy}


def make_policy(name: str, options: PolicyOptions = DEFAULT_POLICY_OPTIONS) -> Policy:
    """The policy registered under `name`; ValueError naming the known ones otherwise."""
    try:
        key = PolicyName(name)
    except ValueError:
        raise ValueError(f"policy: unknown {name!r}; known: {', '.join(p.value for p in PolicyName)}") from None
    return registry()[key](options)


ALL_POLICIES: tuple[str, ...] = tuple(p.value for p in PolicyName)
