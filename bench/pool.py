"""One pool, many models (issue 17's benchmark): dedicated GPUs per model, per-model reactive
autoscaling and FlexPipe's shared pool, side by side on the same requests, in one process.

    python -m bench.pool [--rates NAME=CSV ...] [--gpus NAME=N ...] [--hours H] [--start-h H]
                         [--compress X] [--policies a,b] [--seed N] [--json OUT]

--rates: one per model; NAME is a catalog model (scheduler.modelspec: Phi-3-mini, Llama-3-8B,
Llama-3-70B, ...), CSV a rate series in the format of ../shared/traces/servegen-*-rate-week1.csv
(`window_start_s,rate_rps`, 10-minute windows, shifted to start at 0). Default: the three
ServeGen series, m-small -> Phi-3-mini, m-mid -> Llama-3-8B, m-large -> Llama-3-70B.
--gpus: the GPUs a model's dedicated deployment is sized to at its peak (default: 4, 4 and 8 GPUs,
replicas of TP 1, 1 and 4); each series is scaled so that its own peak over the span run needs
exactly that (agents/sim/poolscenario.py says how).
The pool: 2 nodes of 8 H100-SXM and 1 node of 8 A100-80G (24 GPUs, NVLink inside each node).

Time: by default the first day of the series (--start-h 0 --hours 24), compressed 24x
(--compress 24): 24 trace hours run in 1 simulated hour, each 10-minute window lasting 25
simulated seconds, at the scaled rates - so 24x fewer requests than a real day, and every control
loop (windows, cooldowns, weight loads) sees the tide 24x faster than it would. That keeps the
three policies to a few minutes of CPU; --compress 1 runs real time.

Policies: dedicated and reactive (agents/sim/poolpolicies.py; reactive imitates a per-model
Kubernetes HPA / Knative KPA: its docstring says what of them), flexpipe (the one control loop,
scheduler/control, TWU rule 11, every model on the shared pool; agents/sim/flexpolicy.py), here
with GearboxConfig.scale_in_on_twu_band on (the default): when TWU asks for less capacity the
smaller gear must stand below the high watermark, the TWU band being the scale-in's band, not also
below the gearbox's shrink watermark (0.65), which vetoed every such ask (--no-twu-band: off);
and with GearboxConfig.trend on (the default: the load window's trend, scheduler.gearbox.planned_load;
--no-trend: the level alone), and with the soft limits of loop rule 14 (--weights NAME=W,...; default
seed 004's example, its Qwen2-72B weight on this bench's Llama-3-70B; "": none). They reorder only
deployments of one priority while the pool's TWU is over 0.8, and here the file order is already the
lightest first: the default run's JSON is the same with and without them.

Per policy (JSON `policies.<name>`): gpu_hours_held (GPU-hours held by plans, launch to release,
over the simulated span), slo_attainment (share of all models' finished requests that met both
SLOs), per_model.<NAME> (slo_attainment, ttft_p99_s, gpu_hours_held, peak_gpus, lost),
ttft_p99_s, cold_starts (bring-ups of a model from zero replicas after t=0),
cold_start_ttft_p99_s (TTFT P99 of the requests that arrived while their model held nothing;
null without cold starts), gpus_reclaimed_from_jobs (GPUs inference took from the fine-tune job),
job_gpu_hours and jobs.<NAME> (state, progress, done_s, yields: agents/sim/jobs.py), lost, switches,
and gpus_timeline.<NAME> (GPUs held at each window). The fine-tune job (--job-gpus, default 8 GPUs
of 4 trace hours' work; 0: none) arrives at the busiest hour (busiest_hour_job); only flexpipe
takes GPUs from it - dedicated and reactive leave it whatever they do not hold.
`scenario.elastic_bound_over_dedicated` says what the series' shapes allow at best (each model's
dedicated GPUs scaled to its load at every instant, fractional, without lag). Then `ratios`
(flexpipe over dedicated and over reactive GPU-hours, attainment deltas in points) and `targets` (issue 17: flexpipe <= 0.5x dedicated's GPU-hours
and <= 0.8x reactive's, its attainment no more than 1 point below dedicated's, 0 lost), each
with `met`. Measured, never asserted; wall_s / cpu_s are the whole run's (--no-timing leaves
them out). The default run: ~120k requests per policy, about 3 minutes of CPU for the three.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from agents.sim.fleet import FleetSim
from agents.sim.policies import PolicyOptions
from agents.sim.poolpolicies import POOL_POLICIES, make_pool_policy
from agents.sim.poolscenario import BuiltPool, PoolSpec, build_pool_scenario, pool_model
from agents.sim.rateseries import WINDOW_S, read_rate_series, traces_dir
from agents.sim.run import run_policy
from agents.sim.workload import build_workload
from scheduler.gearbox import DEFAULT_CONFIG
from scheduler.pool.autoscale import parse_weights
from scheduler.pool.jobs import Job

TRACES = traces_dir()
DEFAULT_RATES = (("Phi-3-mini", "servegen-m-small-rate-week1.csv"), ("Llama-3-8B", "servegen-m-mid-rate-week1.csv"),
                 ("Llama-3-70B", "servegen-m-large-rate-week1.csv"))
# flexpipe's soft-limit weights (loop rule 14): seed 004 section 3.2's example, its Qwen2-72B's weight given
# to this bench's Llama-3-70B, the heavy model in the same place (70B against 72B parameters)
DEFAULT_WEIGHTS = {"Phi-3-mini": 1.0, "Llama-3-8B": 2.3, "Llama-3-70B": 8.7}
TARGETS = {"flexpipe_over_dedicated_gpu_hours_max": 0.5, "flexpipe_over_reactive_gpu_hours_max": 0.8,
           "attainment_below_dedicated_max_points": 1.0, "lost_max": 0}


def _r(v: float | None, digits: int = 4) -> float | None:
    return None if v is None else round(float(v), digits)


def pool_figures(sim: FleetSim, bin_s: float) -> dict[str, Any]:
    """Per deployment, from every engine's life (launch to release): GPU-hours, the GPUs held at
    each bin, cold starts (a launch after t=0 while the deployment held nothing) and the TTFTs of
    the requests that arrived while it held nothing and waited for that bring-up."""
    end = sim.scenario.duration_s
    rec = sim.recorder
    arrival = np.asarray(rec.f_arrival, dtype=float)
    ttft = np.asarray(rec.f_ttft, dtype=float)
    dep_of = np.asarray(rec.f_dep, dtype=int)
    out: dict[str, Any] = {}
    for name in sim.deployments:
        lives = sorted(((e.launched_s, e.engine_id, sim._ended_s.get(e.engine_id, float("inf")),
                         len(e.plan.gpu_uuids), e) for e in sim.engines.values() if e.deployment == name),
                       key=lambda x: (x[0], x[1]))
        gpu_s = sum(n * max(0.0, min(b, end) - a) for a, _, b, n, _ in lives)
        times = [i * bin_s for i in range(int(end // bin_s) + 1)]
        timeline = [sum(n for a, _, b, n, _ in lives if a <= t < b) for t in times]
        cold: list[tuple[float, float]] = []  # (held nothing since, served again at)
        held_until = 0.0
        for a, _, b, _, engine in lives:
            if 0 < a < end and a > held_until:
                ready = engine.started_s if engine.started_s > 0 else b
                cold.append((held_until, ready))
            held_until = max(held_until, b)
        i = rec.dep_index[name]
        waited: list[float] = []
        for since, ready in cold:
            sel = (dep_of == i) & (arrival >= since) & (arrival <= ready)
            waited += ttft[sel].tolist()
        out[name] = {"gpu_hours_held": _r(gpu_s / 3600, 3), "peak_gpus": max(timeline, default=0),
                     "timeline": timeline, "cold_starts": len(cold), "cold_ttfts": waited}
    return out


def run(built: BuiltPool, policies: Sequence[str], *, on_policy: Any = None, twu_band: bool = True,
        trend: bool = True, weights: Mapping[str, float] | None = None) -> dict[str, Any]:
    """Every policy on the same requests; the result (module docstring). `twu_band`: flexpipe's
    gearbox scales in on the TWU rule's band (GearboxConfig.scale_in_on_twu_band); `trend`: it
    plans for the load window's trend too (GearboxConfig.trend); `weights`: flexpipe's soft-limit
    weights (loop rule 14; None: DEFAULT_WEIGHTS, {}: none)."""
    options = PolicyOptions(gearbox=replace(DEFAULT_CONFIG, scale_in_on_twu_band=twu_band, trend=trend),
                            model_weights=dict(DEFAULT_WEIGHTS if weights is None else weights))
    scenario = built.scenario
    tp = {m.spec.deployment: m.spec.tp for m in built.models}
    for name in policies:
        make_pool_policy(name, tp)  # unknown names fail before anything runs
    work = build_workload(scenario)
    bin_s = WINDOW_S / float(scenario.extra.get("compress", 1.0))
    results: dict[str, Any] = {}
    for name in policies:
        figures: dict[str, Any] = {}

        def inspect(sim: FleetSim, into: dict[str, Any] = figures) -> None:
            into.update(pool_figures(sim, bin_s))

        r = run_policy(scenario, name, workload=work, policy=make_pool_policy(name, tp, options), inspect=inspect)
        cold = [x for f in figures.values() for x in f["cold_ttfts"]]
        results[name] = {
            "gpu_hours_held": r["gpu_hours_held"],
            "slo_attainment": r["slo_attainment"],
            "ttft_p99_s": r["ttft_p99_s"],
            "cold_starts": sum(f["cold_starts"] for f in figures.values()),
            "cold_start_ttft_p99_s": _r(float(np.percentile(cold, 99))) if cold else None,
            "gpus_reclaimed_from_jobs": r["gpus_reclaimed_from_jobs"],
            "job_gpu_hours": r["job_gpu_hours"],
            "jobs": r["jobs"],  # each job's state, progress, done_s, yields and work lost (agents/sim/jobs.py)
            "lost": r["lost"],
            "finished": r["finished"],
            "switches": r["switches"],
            "peak_gpu_mem_fraction": r["peak_gpu_mem_fraction"],
            "per_model": {d: {"slo_attainment": pd["slo_attainment"], "ttft_p99_s": pd["ttft_p99_s"],
                              "gpu_hours_held": figures[d]["gpu_hours_held"], "peak_gpus": figures[d]["peak_gpus"],
                              "lost": pd["lost"], "finished": pd["finished"]}
                          for d, pd in r["per_deployment"].items()},
            "gpus_timeline": {d: f["timeline"] for d, f in figures.items()},
            "gear_timeline": r["gear_timeline"],  # (t_s, deployment, shape, GPUs) each time a gear took traffic
            "decisions": r.get("decisions", [])[:100],  # flexpipe's switches and blocks (agents.sim.policies)
            "sequence_violations": r["sequence_violations"],
            "memory_violations": r["memory_violations"],
        }
        if on_policy is not None:
            on_policy(name, results[name])
    return {
        "scenario": {
            "pool": [{"node": n.id, "gpu": n.gpu, "gpus": n.gpus} for n in scenario.nodes],
            "gpus": sum(n.gpus for n in scenario.nodes),
            "duration_s": built.duration_s,
            "compress": scenario.extra.get("compress"),
            "window_s_simulated": bin_s,
            "busiest_s": built.busiest_s,
            "jobs": [{"name": j.name, "gpus": j.gpus, "work_gpu_s": j.work_gpu_s, "arrive_s": j.arrive_s,
                      "priority": j.priority, "grace_s": j.grace_s, "checkpoint_s": j.checkpoint_s}
                     for j in scenario.jobs],
            "requests": len(work.arrivals),
            # GPU-hours of a policy that held each model's dedicated GPUs scaled to its load at every
            # instant (fractional GPUs, no lag, the same headroom), over dedicated's: what the
            # series' shapes allow at best without packing models tighter than dedicated does
            "elastic_bound_over_dedicated": _r(sum(m.spec.gpus * m.mean_rps / m.peak_rps for m in built.models)
                                               / sum(m.spec.gpus for m in built.models)),
            "models": {m.spec.deployment: {"model": m.spec.model, "dedicated_gpus": m.spec.gpus, "tp": m.spec.tp,
                                           "replica_capacity_rps": _r(m.replica_capacity_rps),
                                           "peak_rps": _r(m.peak_rps), "mean_rps": _r(m.mean_rps), "slo_ms": [m.spec.ttft_ms, m.spec.tpot_ms]}
                       for m in built.models},
        },
        "flexpipe_options": {"scale_in_on_twu_band": twu_band, "trend": trend},
        "policies": results,
        "ratios": ratios(results),
        "targets": targets(results),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 4)


def ratios(results: dict[str, Any]) -> dict[str, Any]:
    f, d, r = (results.get(n) for n in ("flexpipe", "dedicated", "reactive"))
    out: dict[str, Any] = {}
    if f and d:
        out["flexpipe_over_dedicated_gpu_hours"] = _ratio(f["gpu_hours_held"], d["gpu_hours_held"])
        out["flexpipe_minus_dedicated_attainment_points"] = _points(f, d)
    if f and r:
        out["flexpipe_over_reactive_gpu_hours"] = _ratio(f["gpu_hours_held"], r["gpu_hours_held"])
        out["flexpipe_minus_reactive_attainment_points"] = _points(f, r)
    if r and d:
        out["reactive_over_dedicated_gpu_hours"] = _ratio(r["gpu_hours_held"], d["gpu_hours_held"])
    return out


def _points(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    if a["slo_attainment"] is None or b["slo_attainment"] is None:
        return None
    return round(100 * (float(a["slo_attainment"]) - float(b["slo_attainment"])), 3)


def targets(results: dict[str, Any]) -> dict[str, Any]:
    rat = ratios(results)
    out: dict[str, Any] = {"limits": TARGETS}

    def target(key: str, value: float | None, ok: bool | None) -> None:
        out[key] = {"value": value, "met": ok}

    v = rat.get("flexpipe_over_dedicated_gpu_hours")
    target("flexpipe_over_dedicated_gpu_hours", v, None if v is None else v <= TARGETS[
        "flexpipe_over_dedicated_gpu_hours_max"])
    v = rat.get("flexpipe_over_reactive_gpu_hours")
    target("flexpipe_over_reactive_gpu_hours", v, None if v is None else v <= TARGETS[
        "flexpipe_over_reactive_gpu_hours_max"])
    v = rat.get("flexpipe_minus_dedicated_attainment_points")
    target("flexpipe_attainment_vs_dedicated_points", v, None if v is None else v >= -TARGETS[
        "attainment_below_dedicated_max_points"])
    if "flexpipe" in results:
        lost = results["flexpipe"]["lost"]
        target("flexpipe_lost", lost, lost <= TARGETS["lost_max"])
    out["lost"] = {n: r["lost"] for n, r in results.items()}
    return out


def table(result: dict[str, Any]) -> str:
    pols = result["policies"]
    names = list(pols)
    models = list(result["scenario"]["models"])
    rows: list[tuple[str, Any]] = [("GPU-hours held", "gpu_hours_held"), ("SLO attainment", "slo_attainment"),
                                   ("TTFT p99 s", "ttft_p99_s"), ("cold starts", "cold_starts"),
                                   ("cold-start TTFT p99 s", "cold_start_ttft_p99_s"),
                                   ("GPUs reclaimed from jobs", "gpus_reclaimed_from_jobs"), ("lost", "lost"),
                                   ("switches", "switches")]
    out = [f"{'':34}" + "".join(f"{n:>14}" for n in names)]
    for label, key in rows:
        out.append(f"{label:34}" + "".join(f"{_fmt(pols[n][key]):>14}" for n in names))
    for m in models:
        for label, key in (("attainment", "slo_attainment"), ("GPU-hours", "gpu_hours_held"), ("peak GPUs", "peak_gpus")):
            out.append(f"{m + ' ' + label:34}" + "".join(f"{_fmt(pols[n]['per_model'][m][key]):>14}" for n in names))
    out.append("")
    out.append(f"  {'elastic bound / dedicated GPU-hours (the shapes allow)':50}"
               f"{_fmt(result['scenario']['elastic_bound_over_dedicated']):>10}")
    for key, t in result["targets"].items():
        if isinstance(t, dict) and "met" in t:
            mark = "-" if t["met"] is None else ("met" if t["met"] else "NOT met")
            out.append(f"  {key:50}{_fmt(t['value']):>10}  {mark}")
    return "\n".join(out)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def _pairs(items: Sequence[str], flag: str) -> list[tuple[str, str]]:
    out = []
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise ValueError(f"{flag}: want NAME=VALUE; got {item!r}")
        out.append((name, value))
    return out


def busiest_hour_job(built: BuiltPool, gpus: int, hours: float) -> Job:
    """The fine-tune job of issue 17's benchmark: it arrives half a trace hour before the middle of
    the busiest window - at the busiest hour - and wants `gpus` GPUs of any model for `hours` trace
    hours of uninterrupted work (priority 1, a 20 s checkpoint inside a 30 s grace: seed 004 §5.2's
    'yield within a grace time')."""
    compress = float(built.scenario.extra.get("compress", 1.0))
    arrive = max(0.0, built.busiest_s - 1800.0 / compress)
    return Job(name="finetune", gpus=gpus, work_gpu_s=gpus * hours * 3600.0 / compress, arrive_s=round(arrive, 3))


def with_job(built: BuiltPool, job: Job | None) -> BuiltPool:
    return built if job is None else replace(built, scenario=replace(built.scenario, jobs=(job,)))


def build_from_args(args: argparse.Namespace) -> BuiltPool:
    rates = _pairs(args.rates, "--rates") if args.rates else [(m, str(TRACES / f)) for m, f in DEFAULT_RATES]
    gpus: dict[str, int] = {}
    for name, value in _pairs(args.gpus or [], "--gpus"):
        try:
            gpus[name] = int(value)
        except ValueError:
            raise ValueError(f"--gpus.{name}: not an integer: {value!r}") from None
    unknown = sorted(set(gpus) - {n for n, _ in rates})
    if unknown:
        raise ValueError(f"--gpus.{unknown[0]}: no --rates entry of that name")
    models = tuple(pool_model(name, read_rate_series(path), gpus=gpus.get(name)) for name, path in rates)
    spec = PoolSpec(models, start_s=args.start_h * 3600, span_s=args.hours * 3600, compress=args.compress,
                    seed=args.seed)
    built = build_pool_scenario(spec)
    if args.job_gpus < 0:
        raise ValueError(f"--job-gpus: must be >= 0 (0: no job); got {args.job_gpus}")
    return with_job(built, busiest_hour_job(built, args.job_gpus, args.job_hours) if args.job_gpus else None)


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pool", description=__doc__.split("\n")[0])
    parser.add_argument("--rates", nargs="+", metavar="NAME=CSV", help="a model's rate series (default: ServeGen)")
    parser.add_argument("--gpus", nargs="+", metavar="NAME=N", help="GPUs its dedicated deployment holds at peak")
    parser.add_argument("--hours", type=float, default=24.0, help="trace hours to run (default 24)")
    parser.add_argument("--start-h", type=float, default=0.0, help="trace hour to start at (default 0)")
    parser.add_argument("--compress", type=float, default=24.0, help="trace seconds per simulated second (24)")
    parser.add_argument("--policies", default=",".join(POOL_POLICIES), help="comma-separated (default: all three)")
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--job-gpus", type=int, default=8,
                        help="GPUs of the fine-tune job arriving at the busiest hour (default 8; 0: none)")
    parser.add_argument("--job-hours", type=float, default=4.0, help="its work, trace hours on its GPUs (4)")
    parser.add_argument("--no-trend", action="store_true",
                        help="flexpipe plans for the load's level alone (GearboxConfig.trend off)")
    parser.add_argument("--no-twu-band", action="store_true",
                        help="flexpipe keeps the gearbox's shrink watermark under TWU's scale-in asks")
    parser.add_argument("--weights", default=",".join(f"{k}={v:g}" for k, v in DEFAULT_WEIGHTS.items()),
                        help="flexpipe's soft-limit weights, NAME=W,... (loop rule 14; \"\": none)")
    parser.add_argument("--no-timing", action="store_true", help="leave wall_s/cpu_s out of the JSON")
    args = parser.parse_args(list(argv) if argv is not None else None)
    names = [p.strip() for p in args.policies.split(",") if p.strip()]
    try:
        weights = parse_weights(args.weights, "--weights")
        built = build_from_args(args)
        for name in names:
            make_pool_policy(name, {m.spec.deployment: m.spec.tp for m in built.models})
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    wall0, cpu0 = time.perf_counter(), time.process_time()
    print(f"pool of {sum(n.gpus for n in built.scenario.nodes)} GPUs, {len(built.models)} models,"
          f" {args.hours:g} trace hours compressed {args.compress:g}x into {built.duration_s:.0f} s;"
          f" policies {', '.join(names)}", file=sys.stderr)

    def done(name: str, r: dict[str, Any]) -> None:
        print(f"  {name:10} done: {r['finished']} finished, {r['gpu_hours_held']} GPU-h"
              f" ({time.process_time() - cpu0:.0f} s CPU so far)", file=sys.stderr)

    result = run(built, names, on_policy=done, twu_band=not args.no_twu_band, trend=not args.no_trend,
                 weights=weights)
    print(table(result))
    if not args.no_timing:
        result["wall_s"] = round(time.perf_counter() - wall0, 3)
        result["cpu_s"] = round(time.process_time() - cpu0, 3)
    if args.json:
        Path(args.json).write_text(json.dumps(result, sort_keys=True, indent=1, allow_nan=False) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
