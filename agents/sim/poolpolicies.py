"""The baselines `bench.pool` compares FlexPipe's shared pool against (agents.sim.policies has
the others; `make_pool_policy` knows both):

* dedicated: seed 004's "one deployment per business line". Each model gets its own GPUs,
  sized once for its peak: replicas of a fixed shape (`tp` GPUs in one atomic block, all the KV
  that fits), placed on the most capable free blocks until their modelled capacity covers the
  peak rate x the planner's headroom (1.25), warm at t=0, never changed. Unlike
  static-replicas it does not hand the rest of the pool out: what it does not need stays free.
* reactive: each model scaled alone on its own utilisation, the way a Kubernetes
  HorizontalPodAutoscaler (HPA, autoscaling/v2) or a Knative Pod Autoscaler (KPA) scales one
  Deployment. What it imitates, per model:
    - the metric: the model's arrival rate over the last `metric_window_s` (60 s: KPA's stable
      window) over the modelled capacity of the replicas it holds - a requests-per-second
      utilisation, as an HPA on a custom RPS metric or KPA's "rps" metric sees it;
    - the rule every `sync_s` (15 s: HPA's --horizontal-pod-autoscaler-sync-period):
      desired = ceil(rate / (target x capacity per replica)), target = 1 / headroom (0.8, so it
      aims where dedicated is sized), nothing done within the HPA's 10% tolerance;
    - scale up at once (HPA's default scaleUp stabilization 0 s), scale down only to the
      largest recommendation of the last `scale_down_window_s` (300 s: HPA's default
      downscale stabilization window), a replica at a time, the least capable first, drained;
    - a new replica is a new pod: it starts cold, its weights from disk plus a process start
      (FleetSim `source="disk"`), and takes traffic once it serves;
    - min 1 replica (HPA's minReplicas >= 1; KPA could scale to zero - here nothing does), max
      what the free GPUs allow: a replica that does not fit waits for the next sync.
  It knows nothing of the other models: GPUs another model holds are simply not free.

Both route by each replica's share of its deployment's modelled capacity.

* flexpipe, as bench.pool runs it (`PoolFlexPipePolicy`): agents.sim.flexpolicy's FlexPipePolicy -
  the one control loop, every model on the shared pool - started the way the other two start:
  warm at t=0 on the fewest-GPU gear of the planner's that meets the SLOs at each model's opening
  load with the gearbox's headroom (in priority order, each on GPUs the earlier ones left), not on a one-replica scenario baseline that the opening load
  would overload (the gearbox then grabs the gear that loads fastest - the widest TP - and holds
  it for a cooldown). What happens after t=0 is the control loop's alone.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Mapping
from typing import Any

from agents.sim.engine import PlanEngine
from agents.sim.fleet import FleetSim
from agents.sim.flexpolicy import FlexPipePolicy
from agents.sim.policies import (
    DEFAULT_POLICY_OPTIONS,
    Policy,
    PolicyOptions,
    by_priority,
    make_policy,
    peak_workload,
)
from scheduler.control.loop import decision_snapshot
from scheduler.costmodel import Workload, estimate_plan, max_kv_tokens
from scheduler.gearbox import standing
from scheduler.hardware import gpu_spec
from scheduler.plan import Gear, Plan, Stage
from scheduler.planner import DEFAULT_OPTIONS as PLANNER_DEFAULTS
from scheduler.planner import plan_candidates
from scheduler.topology import atomic_blocks


class PoolPolicyName(enum.StrEnum):
    DEDICATED = "dedicated"
    REACTIVE = "reactive"


def free_gpus(sim: FleetSim) -> set[str]:
    """GPUs that are ours, healthy and held by no plan now."""
    held = {u for e in sim.live.values() for u in e.plan.gpu_uuids}
    return {g.uuid for g in sim.snapshot().gpus if g.schedulable and g.healthy and sim.gpu_usable(g.uuid)} - held


def replica_plan(sim: FleetSim, deployment: str, tp: int) -> Plan | None:
    """One replica of `tp` GPUs on the most capable block that has them free (all the KV that
    fits under 92%), or None when no block has."""
    snap = sim.snapshot()
    model = sim.deployments[deployment].model
    free = free_gpus(sim)
    blocks = sorted(atomic_blocks(snap), key=lambda b: (-gpu_spec(b.gpu_model).bf16_flops, b.id))
    for block in blocks:
        mine = [u for u in block.gpu_uuids if u in free]
        if len(mine) < tp:
            continue
        stages = (Stage(0, model.num_layers, tuple(mine[:tp])),)
        kv = max_kv_tokens(stages, model, snap)
        if kv < model.max_context_tokens:
            continue  # the weights barely fit: not a replica anyone would run
        return Plan(model.name, "colocated", stages, kv_reserve_tokens=kv)
    return None


class _Replicas(Policy):
    """Replicas of a fixed shape per deployment (`tp`: deployment -> GPUs per replica)."""

    def __init__(self, tp: Mapping[str, int], options: PolicyOptions = DEFAULT_POLICY_OPTIONS) -> None:
        super().__init__(options)
        self.tp = dict(tp)
        self.work: dict[str, Workload] = {}  # deployment -> its peak request shape
        self.short: dict[str, str] = {}  # deployment -> why it holds less than it wants (last time)

    def capacity(self, sim: FleetSim, engine: PlanEngine) -> float:
        dep = sim.deployments[engine.deployment]
        return float(estimate_plan(engine.profile, self.work[dep.name], dep.slo).capacity_rps)

    def reroute(self, sim: FleetSim, deployment: str) -> None:
        engines = [e for e in sim.plans(deployment) if e.accepting]
        caps = {e.engine_id: self.capacity(sim, e) for e in engines}
        total = sum(caps.values()) or 1.0
        sim.set_routing(deployment, {i: max(c / total, 1e-6) for i, c in caps.items()})

    def grow(self, sim: FleetSim, deployment: str, *, source: str) -> PlanEngine | None:
        plan = replica_plan(sim, deployment, self.tp[deployment])
        if plan is None:
            self.short[deployment] = f"no block has {self.tp[deployment]} free GPUs"
            return None
        return sim.launch(deployment, plan, source=source, accepting=True)  # type: ignore[arg-type]

    def extra(self) -> dict[str, Any]:
        return {"short": dict(self.short)}


class DedicatedPolicy(_Replicas):
    """Each model on its own GPUs, sized once for its peak (module docstring)."""

    name = PoolPolicyName.DEDICATED  # type: ignore[assignment]

    def attach(self, sim: FleetSim) -> None:
        headroom = PLANNER_DEFAULTS.headroom
        for dep in by_priority(sim):
            self.work[dep.name] = peak_workload(sim.scenario, dep.name)
            need = self.work[dep.name].rate_rps * headroom
            have = 0.0
            while have < need * (1 - 1e-9):
                engine = self.grow(sim, dep.name, source="warm")
                if engine is None:
                    break
                have += self.capacity(sim, engine)
            self.reroute(sim, dep.name)


class ReactivePolicy(_Replicas):
    """Each model scaled alone on its own utilisation, HPA/KPA-style (module docstring)."""

    name = PoolPolicyName.REACTIVE  # type: ignore[assignment]

    def __init__(self, tp: Mapping[str, int], options: PolicyOptions = DEFAULT_POLICY_OPTIONS, *,
                 sync_s: float = 15.0, metric_window_s: float = 60.0, scale_down_window_s: float = 300.0,
                 tolerance: float = 0.1) -> None:
        super().__init__(tp, options)
        self.sync_s = sync_s
        self.metric_window_s = metric_window_s
        self.scale_down_window_s = scale_down_window_s
        self.tolerance = tolerance
        self.target = 1.0 / PLANNER_DEFAULTS.headroom
        self.rates: dict[str, deque[tuple[float, float, float]]] = {}  # deployment -> (t, span, rate)
        self.recs: dict[str, deque[tuple[float, int]]] = {}  # deployment -> (t, desired replicas)
        self.scale_ups = 0
        self.scale_downs = 0

    def attach(self, sim: FleetSim) -> None:
        # at t=0 each model holds what its own rule wants for the rate it starts at (warm)
        for dep in by_priority(sim):
            self.work[dep.name] = peak_workload(sim.scenario, dep.name)
            self.rates[dep.name] = deque()
            self.recs[dep.name] = deque()
            rate0 = sum(w.rate_rps(0.0) for w in sim.scenario.workload if w.deployment == dep.name)
            have = 0.0
            while not sim.plans(dep.name) or have * self.target < rate0:
                engine = self.grow(sim, dep.name, source="warm")
                if engine is None:
                    break
                have += self.capacity(sim, engine)
            self.reroute(sim, dep.name)
        sim.call_at(self.sync_s, lambda t: self._sync(sim, t))

    def _rate(self, name: str, t: float) -> float:
        window = self.rates[name]
        while window and window[0][0] <= t - self.metric_window_s:
            window.popleft()
        span = sum(s for _, s, _ in window)
        return sum(s * r for _, s, r in window) / span if span > 0 else 0.0

    def _sync(self, sim: FleetSim, t: float) -> None:
        for dep in by_priority(sim):
            name = dep.name
            sample = sim.load_sample(name, t)
            if sample is not None:
                self.rates[name].append((t, self.sync_s, sample.rate_rps))
            self._scale(sim, name, t, self._rate(name, t))
        if t + self.sync_s <= sim.scenario.duration_s:
            sim.call_at(t + self.sync_s, lambda now: self._sync(sim, now))

    def _scale(self, sim: FleetSim, name: str, t: float, rate: float) -> None:
        engines = [e for e in sim.plans(name) if e.accepting]
        caps = [self.capacity(sim, e) for e in engines]
        per_replica = sum(caps) / len(caps) if caps else 1.0
        desired = max(1, math.ceil(rate / (self.target * per_replica)))
        recs = self.recs[name]
        recs.append((t, desired))
        while recs and recs[0][0] < t - self.scale_down_window_s:
            recs.popleft()
        n = len(engines)
        ratio = rate / (self.target * sum(caps)) if caps else math.inf
        if abs(ratio - 1.0) <= self.tolerance:
            return  # within the HPA's tolerance
        if desired > n:
            for _ in range(desired - n):
                if self.grow(sim, name, source="disk") is None:
                    break
                self.scale_ups += 1
            self.reroute(sim, name)
            return
        stable = max(d for _, d in recs)  # the downscale stabilization window
        if stable < n:
            # one at a time, the least capable (then the newest) first; it drains what it holds
            victim = min(engines, key=lambda e: (self.capacity(sim, e), -e.engine_id))
            sim.retire(victim, "drain")
            self.scale_downs += 1
            self.reroute(sim, name)

    def extra(self) -> dict[str, Any]:
        return {**super().extra(), "scale_ups": self.scale_ups, "scale_downs": self.scale_downs}


class PoolFlexPipePolicy(FlexPipePolicy):
    """FlexPipe started warm on the planner's gear for the opening load (module docstring)."""

    def start_gears(self, sim: FleetSim) -> dict[str, Gear]:
        out: dict[str, Gear] = {}
        for dep in by_priority(sim):
            shape = peak_workload(sim.scenario, dep.name)
            rate0 = sum(w.rate_rps(0.0) for w in sim.scenario.workload if w.deployment == dep.name)
            others = {u for e in sim.live.values() for u in e.plan.gpu_uuids}
            load = shape.scaled(rate0 / max(shape.rate_rps, 1e-9))
            cands = plan_candidates(dep.model, decision_snapshot(sim.snapshot(), others), load, slo=dep.slo)
            if not cands.feasible:
                raise ValueError(f"{dep.name}: no gear fits the pool at t=0: {'; '.join(cands.infeasible[:2])}")
            # the gearbox's choice among gears that meet the SLOs with its headroom: the fewest GPUs
            # (the planner's order breaks ties; none standing: the planner's first)
            ok = [c for c in cands.feasible if standing(c.estimate, load)]
            gear = min(ok, key=lambda c: c.estimate.gpus).gear if ok else cands.feasible[0].gear
            engines = {sim.launch(dep.name, p, source="warm", accepting=True, weight=w).engine_id: w
                       for p, w in zip(gear.plans, gear.weights, strict=True)}
            sim.set_routing(dep.name, engines)
            out[dep.name] = gear
        return out


POOL_POLICIES: tuple[str, ...] = (PoolPolicyName.DEDICATED.value, PoolPolicyName.REACTIVE.value, "flexpipe")


def make_pool_policy(name: str, tp: Mapping[str, int], options: PolicyOptions = DEFAULT_POLICY_OPTIONS) -> Policy:
    """dedicated, reactive, or any policy of agents.sim.policies (ValueError naming them all)."""
    if name == PoolPolicyName.DEDICATED:
        return DedicatedPolicy(tp, options)
    if name == PoolPolicyName.REACTIVE:
        return ReactivePolicy(tp, options)
    if name == "flexpipe":
        return PoolFlexPipePolicy(options)
    try:
        return make_policy(name, options)
    except ValueError as exc:
        raise ValueError(f"{exc}, {', '.join(p.value for p in PoolPolicyName)}") from None
