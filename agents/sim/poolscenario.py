"""One pool, many models: a simulator scenario from per-model rate series (the library behind
`python -m bench.pool`).

    series = read_rate_series("../shared/traces/servegen-m-small-rate-week1.csv")  # agents.sim.rateseries
    built = build_pool_scenario(PoolSpec(models=(pool_model("Phi-3-mini", series), ...)))
    built.scenario            # an agents.sim.scenario.Scenario: nodes, models, Poisson workload
    built.models[0].peak_rps  # what the series' peak was scaled to

Rate series: the format of ../shared/traces/servegen-*-rate-week1.csv, read and mapped onto
simulated time by agents/sim/rateseries.py (which scenario files use too).

Scaling: each series is scaled on its own so that its peak (over the span simulated) is what the
model's dedicated deployment is sized for: `gpus` GPUs as replicas of `tp` GPUs on the pool's
most capable GPU, each replica's capacity from the cost model (scheduler.costmodel.estimate_plan
under the model's request lengths and SLO) - peak_rps = replicas x capacity / headroom, the
planner's headroom (1.25) that the dedicated policy sizes with. The shape and the phase between
models are the trace's; only the level changes.

Time compression: `compress` > 1 runs `compress` seconds of the trace in one simulated second -
a 10-minute window lasts 600 / compress simulated seconds - at the scaled rates (requests per
simulated second), so a compressed day has `compress` times fewer requests than a real one, and
the control loops (windows, cooldowns, weight loads) see the tide `compress` times faster than
they would. Rate points sit at each window's middle, linear between them (the workload's
piecewise-linear rate), flat before the first and after the last.

Fine-tune jobs: `PoolSpec.jobs` is passed through untouched (`Scenario.extra["jobs"]`) for the
simulator's job workload; this module builds none. `busiest_s` says where a job meant to arrive
at the busiest hour belongs (the window where the pool's summed dedicated-GPU demand peaks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agents.sim.rateseries import WINDOW_S, series_points, span_of
from agents.sim.scenario import BaselineSpec, ModelDeploymentSpec, NetworkSpec, NodeSpec, Scenario
from agents.sim.scenario_load import DistSpec, WorkloadSpec
from scheduler.costmodel import PlanProfile, estimate_plan
from scheduler.modelspec import model_spec
from scheduler.planner import DEFAULT_OPTIONS as PLANNER_DEFAULTS


@dataclass(frozen=True)
class PoolModel:
    """One model of the pool: its deployment, its rate series and what its dedicated deployment holds."""

    deployment: str  # deployment id (the --rates NAME)
    model: str  # a catalog model (scheduler.modelspec)
    series: tuple[tuple[float, float], ...]  # (t_s from 0, rate_rps) per window, unscaled
    gpus: int  # GPUs its dedicated deployment is sized to at the series' peak
    tp: int  # GPUs per replica (one TP group in one atomic block)
    ttft_ms: float
    tpot_ms: float
    prompt_tokens: DistSpec
    output_tokens: DistSpec
    priority: int = 10  # inference (issue 17: inference 10, fine-tune jobs 1)


# request lengths and SLOs per catalog model when the command line does not say: stated
# assumptions, long-prompt (RAG / code) requests for every model - they keep a day of a 24-GPU
# pool to ~100k requests, which the simulator runs in about a minute of CPU per policy
LONG = (DistSpec("lognormal", mean=2000, sigma=0.6, max=3500), DistSpec("lognormal", mean=400, sigma=0.5, max=560))
MODEL_DEFAULTS: dict[str, dict[str, Any]] = {
    "Phi-3-mini": {"tp": 1, "gpus": 4, "slo": (1000.0, 100.0), "lengths": LONG},
    "Llama-2-7B": {"tp": 1, "gpus": 4, "slo": (1000.0, 100.0), "lengths": LONG},
    "Llama-3-8B": {"tp": 1, "gpus": 4, "slo": (1000.0, 100.0), "lengths": LONG},
    "Llama-3-70B": {"tp": 4, "gpus": 8, "slo": (2500.0, 100.0), "lengths": LONG},
    "Qwen2-72B": {"tp": 4, "gpus": 8, "slo": (2500.0, 100.0), "lengths": LONG},
}


def pool_model(model: str, series: Sequence[tuple[float, float]], *, deployment: str | None = None,
               gpus: int | None = None, tp: int | None = None) -> PoolModel:
    """A PoolModel with the defaults of MODEL_DEFAULTS (a model not listed: tp from its weights)."""
    spec = model_spec(model)  # ValueError naming the known models
    d = MODEL_DEFAULTS.get(model)
    if d is None:
        # the smallest power-of-two TP whose weights fill at most half of an 80 GB GPU each
        want = 1
        while spec.weight_bytes / want > 40e9 and want < 8:
            want *= 2
        d = {"tp": want, "gpus": 2 * want, "slo": (1000.0, 100.0), "lengths": LONG}
    tp_ = tp if tp is not None else int(d["tp"])
    n = gpus if gpus is not None else int(d["gpus"])
    if n < tp_ or n % tp_:
        raise ValueError(f"gpus.{deployment or model}: must be a multiple of the replica's tp ({tp_}); got {n}")
    prompt, output = d["lengths"]
    return PoolModel(deployment or model, model, tuple(series), n, tp_, d["slo"][0], d["slo"][1], prompt, output)


@dataclass(frozen=True)
class PoolSpec:
    """What `build_pool_scenario` builds from."""

    models: tuple[PoolModel, ...]
    nodes: tuple[NodeSpec, ...] = (
        NodeSpec("h1", "H100-SXM", 8, True, "A", 8),
        NodeSpec("h2", "H100-SXM", 8, True, "A", 8),
        NodeSpec("a1", "A100-80G", 8, True, "B", 8),
    )
    network: NetworkSpec = NetworkSpec(400.0, 100.0)
    start_s: float = 0.0  # where in the (shifted) series the run starts, trace seconds
    span_s: float = 86400.0  # how much of the series it runs, trace seconds
    compress: float = 24.0  # trace seconds per simulated second
    seed: int = 17
    jobs: tuple[Any, ...] = ()  # fine-tune jobs for the simulator, passed through (module docstring)
    name: str = "pool"

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("models: name at least one model")
        if len({m.deployment for m in self.models}) != len(self.models):
            raise ValueError("models: deployment names must be unique")
        if not self.compress >= 1:
            raise ValueError(f"compress: must be >= 1; got {self.compress}")
        if not self.span_s > 0 or self.start_s < 0:
            raise ValueError(f"span_s/start_s: need span_s > 0 and start_s >= 0; got {self.span_s}, {self.start_s}")


@dataclass(frozen=True)
class BuiltModel:
    """What was made of one PoolModel."""

    spec: PoolModel
    replica_capacity_rps: float  # one dedicated replica on the pool's most capable block (cost model)
    peak_rps: float  # the scaled series' peak
    mean_rps: float  # ... and its mean over the span
    scale: float  # scaled rate = trace rate x scale
    rate_points: tuple[tuple[float, float], ...]  # (simulated t_s, rps)


@dataclass(frozen=True)
class BuiltPool:
    scenario: Scenario
    models: tuple[BuiltModel, ...]
    duration_s: float  # simulated
    busiest_s: float  # simulated time of the window with the largest summed dedicated demand
    notes: tuple[str, ...] = field(default_factory=tuple)


def replica_capacities(scenario: Scenario, tp: dict[str, int]) -> dict[str, float]:
    """Per deployment, the cost model's capacity of one replica (`tp` GPUs on the pool's most
    capable block, all the KV that fits) under its request shape at peak and its SLO - priced
    exactly as the dedicated policy prices it (agents/sim/poolpolicies.py), on the pool's own
    simulator, so that scaling and sizing agree."""
    from agents.sim.fleet import FleetSim
    from agents.sim.policies import peak_workload
    from agents.sim.poolpolicies import replica_plan

    sim = FleetSim(scenario)
    out: dict[str, float] = {}
    for m in scenario.models:
        plan = replica_plan(sim, m.deployment, tp[m.deployment])
        if plan is None:
            raise ValueError(f"gpus.{m.deployment}: no block of the pool has {tp[m.deployment]} free GPUs")
        dep = sim.deployments[m.deployment]
        profile = PlanProfile.build(plan, dep.model, sim.snapshot(), sim.eff)
        out[m.deployment] = float(estimate_plan(profile, peak_workload(scenario, m.deployment), dep.slo).capacity_rps)
    return out


def build_pool_scenario(spec: PoolSpec) -> BuiltPool:
    """The pool's scenario (module docstring)."""
    duration = spec.span_s / spec.compress
    node_ids = tuple(n.id for n in spec.nodes)
    models = tuple(ModelDeploymentSpec(m.deployment, m.model, m.ttft_ms, m.tpot_ms, m.priority,
                                       BaselineSpec(m.tp, 1, node_ids)) for m in spec.models)
    rows = {m.deployment: span_of(m.series, spec.start_s, spec.span_s) for m in spec.models}
    for m in spec.models:
        if max(r for _, r in rows[m.deployment]) <= 0:
            raise ValueError(f"rates.{m.deployment}: the series is 0 over the span simulated")
    # priced at a unit rate first: capacity does not depend on the rate, only on the shape
    unit = tuple(WorkloadSpec(m.deployment, "poisson", ((0.0, 1.0),), m.prompt_tokens, m.output_tokens)
                 for m in spec.models)

    def scenario_with(workload: tuple[WorkloadSpec, ...]) -> Scenario:
        return Scenario(name=spec.name, seed=spec.seed, duration_s=duration, time_scale=1.0, nodes=spec.nodes,
                        network=spec.network, models=models, workload=workload,
                        extra={"jobs": list(spec.jobs), "compress": spec.compress})

    caps = replica_capacities(scenario_with(unit), {m.deployment: m.tp for m in spec.models})
    built: list[BuiltModel] = []
    workload: list[WorkloadSpec] = []
    demand: dict[float, float] = {}
    for m in spec.models:
        mine = rows[m.deployment]
        peak_raw = max(r for _, r in mine)
        cap = caps[m.deployment]
        if cap <= 0:
            raise ValueError(f"rates.{m.deployment}: one replica of tp={m.tp} serves nothing under the SLO")
        # a hair under the sized capacity, so that float rounding never asks for one replica more
        peak = (m.gpus // m.tp) * cap / PLANNER_DEFAULTS.headroom * (1 - 1e-6)
        scale = peak / peak_raw
        points = series_points(mine, compress=spec.compress, scale=scale, duration_s=duration)
        for t, r in mine:
            demand[t] = demand.get(t, 0.0) + r / peak_raw * m.gpus
        mean = sum(r for _, r in mine) / len(mine) * scale
        built.append(BuiltModel(m, cap, peak, mean, scale, points))
        workload.append(WorkloadSpec(m.deployment, "poisson", points, m.prompt_tokens, m.output_tokens))
    busiest = max(demand, key=lambda t: (demand[t], -t))
    return BuiltPool(scenario_with(tuple(workload)), tuple(built), duration, round((busiest + WINDOW_S / 2) / spec.compress, 3))
