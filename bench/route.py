"""Route one request trace under several routing policies on a simulated mixed GPU pool, in one
process, and compare them.

    python -m bench.route --trace PATH --json OUT [--policies a,b,...] [--seed N]
    python -m bench.route --trace PATH --decisions-only [--decision-samples N]   # decision_us alone
    python -m bench.route --trace PATH --kv-tiers --policies flexpipe   # KV tiers off vs on

The trace's format is read from the file (agents/sim/traces.py: Mooncake JSONL with prefix
block ids, or an Azure LLM inference CSV). The pool: one deployment of Qwen2-72B (128K context,
so Mooncake's long prompts fit) as six TP4 plans side by side - two on H100 SXM (NVLink), two on
A100 80GB (NVLink), two on L40S (PCIe only) - a fixed gear, no switches. The simulated engines
(agents/sim/engine.py) keep a prefix cache of the trace's blocks, bounded by their KV reserve.

Policies (scheduler/router/baselines.py): round-robin, least-loaded, prefix-only (cache-aware
routing as SGLang's router does it), flexpipe (scheduler.router).

The SLO, one rule for every trace: a request meets it when its TTFT is at most SLO_SCALE (5) x
its prompt's prefill time on the pool's fastest plan that can hold it, idle, and its time per
output token at most SLO_SCALE x one decode step of that plan at its context (the cost model's
times; every plan of this pool meets both when idle). The operating point, one rule for every
trace: the trace's time is compressed or stretched by the factor at which least-loaded meets the
SLO for 80% of the requests (bisection in log space; the factor is printed), then every policy
runs at that factor. A new trace needs no tuning.

JSON: `policies.<name>` with goodput_rps (requests finished within the SLO per second of the
scaled trace), ttft_mean_s, ttft_p50_s, ttft_p99_s, tpot_p99_s, slo_attainment, tokens (output
tokens of finished requests), lost (ended with an error), cache_hit_share (prompt tokens whose
prefill a prefix hit skipped); `time_scale`, `bisection` (factor, attainment per probe);
`decision_us` = {"8": {"p50", "p99", ...}, "64": {...}}: the flexpipe router's own time per
decision (route(), wall clock; cpu_* its thread's CPU time; record_* the admitted() bookkeeping
after it; load_* the Pool.set_loads before it, which derives the load-only terms decisions read
until the next report) over pools of 8 and 64 plans made of this pool's plans, loads drawn from a
seeded generator, requests from the trace; each decision timed as the least of five identical replays
(decision_times), raw_* without that;
`targets`: the issue's targets as measured (reported, never asserted).

--kv-tiers: every policy also runs as `<policy>+tiers` at the same time scale, its engines' prefix
caches spilling to per-node host memory and SSD and restoring from them (agents/sim/kvtiers.py,
default sizes); `policies.<policy>+tiers.kv_tiers` says what went through the tiers, and
`kv_tiers.<policy>` puts TTFT p50 / p99 and SLO attainment off and on side by side.

--kv-budget adds flexpipe+budget, flexpipe's router with seed 003's KV spillover bands
(scheduler/router/spillover.py); every policy's `spills` counts requests sent away from their
first choice, `spill_timeouts` those not admitted where they went within the spillover timeout
(`--spill-timeout`, default 2 s; inf: off) and so re-routed (None: a policy without the bands).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from agents.sim.fleet import FleetSim, SimOptions
from agents.sim.kvtiers import KvTierOptions
from agents.sim.scenario import Scenario, parse_scenario
from agents.sim.traces import Trace, read_trace
from scheduler.buckets import LengthBuckets
from scheduler.costmodel import PlanProfile, max_kv_tokens
from scheduler.modelspec import model_spec
from scheduler.plan import Plan, Stage
from scheduler.router import (
    BLOCK_TOKENS,
    ROUTING_POLICIES,
    PlanFacts,
    PlanLoad,
    Pool,
    Router,
    RouterConfig,
    RouteRequest,
    make_router,
    plan_facts,
)
from scheduler.router.learned import LearnedRouter
from scheduler.router.learning import RolloutConfig, RolloutController
from scheduler.router.learning import Stage as RolloutStage
from scheduler.router.spillover import SpillConfig

MODEL = "Qwen2-72B"  # modelspec: 131,072-token context
DEPLOYMENT = "chat"
TP = 4
NODES = (("h100", "H100-SXM", True), ("a100", "A100-80G", True), ("l40s", "L40S", False))
PLANS_PER_NODE = 2  # two TP4 plans on each 8-GPU node
SLO_SCALE = 5.0
TARGET_ATTAINMENT = 0.8  # least-loaded meets the SLO for this share at the chosen time scale
POLICIES = ("round-robin", "least-loaded", "prefix-only", "flexpipe")
VARIANTS = {"learned": "flexpipe+learned", "buckets": "flexpipe+buckets", "kv_budget": "flexpipe+budget"}
TIERS = "+tiers"  # --kv-tiers: a policy's run over engines with KV tiers
SHORT_PROMPT_TOKENS = 2048  # the short bucket (scheduler/buckets.py): ttft_p99_short_s
DECISION_SIZES = (8, 64)
DECISION_SAMPLES = 4000
DECISION_ROUNDS = 5
TARGETS = {"decision_p99_us_at_64_max": 50.0, "mooncake_goodput_over_round_robin_min": 2.0,
           "mooncake_ttft_mean_round_robin_over_flexpipe_min": 5.0, "azure_goodput_over_least_loaded_min": 1.2}


def pool_scenario(duration_s: float, seed: int) -> Scenario:
    """The cluster: three 8-GPU nodes, one per GPU kind, in one rack (the workload comes from
    the trace: the scenario's own is empty)."""
    return parse_scenario({
        "name": "route-pool", "seed": seed, "duration_s": max(duration_s, 1.0),
        "nodes": [{"id": n, "gpu": g, "gpus": 8, "nvlink": nv, "rack": "A"} for n, g, nv in NODES],
        "network": {"intra_rack_gbps": 400, "inter_rack_gbps": 100},
        "models": [{"deployment": DEPLOYMENT, "model": MODEL, "slo": {"ttft_ms": 1e6, "tpot_ms": 1e6},
                    "baseline": {"tp": TP, "nodes": [NODES[0][0]]}}],
        "workload": [{"deployment": DEPLOYMENT, "arrival": "poisson", "rate_rps": 0,
                      "prompt_tokens": {"dist": "fixed", "value": 1}, "output_tokens": {"dist": "fixed", "value": 1}}],
    }, source="bench.route")


def pool_plans(sim: FleetSim) -> list[Plan]:
    """Two TP4 plans per node, each reserving all the KV that fits under 92% of its GPUs."""
    model = model_spec(MODEL)
    plans = []
    for node, _, _ in NODES:
        for k in range(PLANS_PER_NODE):
            stages = (Stage(0, model.num_layers, tuple(sim.cluster.gpu_uuid(node, i)
                                                       for i in range(k * TP, (k + 1) * TP))),)
            kv = max_kv_tokens(stages, model, sim.snapshot())
            plans.append(Plan(MODEL, "colocated", stages, kv_reserve_tokens=kv))
    return plans


class SloRule:
    """Per request (TTFT, TPOT) limits (module docstring), from the cost model's idle times."""

    def __init__(self, plans: Sequence[Plan], sim: FleetSim) -> None:
        model = model_spec(MODEL)
        snap = sim.snapshot()
        self._plans = [(p.kv_reserve_tokens, PlanProfile.build(p, model, snap).pipeline("prefill")) for p in plans]

    @lru_cache(maxsize=65536)  # noqa: B019 - one rule per run, a few thousand distinct shapes
    def limits(self, prompt: int, output: int) -> tuple[float, float]:
        fits = [prof for cap, prof in self._plans if cap >= prompt + output] or [p for _, p in self._plans]
        ttft = min(prof.prefill_time_s(prompt) for prof in fits)
        tpot = min(prof.decode_step_s(1, prompt + output // 2) for prof in fits)
        return SLO_SCALE * ttft, SLO_SCALE * tpot


@dataclass
class Run:
    policy: str
    factor: float
    summary: dict[str, Any]


def learned_rollout(duration_s: float) -> RolloutConfig:
    """The rollout of flexpipe+learned over a bench run: the issue's stages at the run's scale - a cold
    start on round-robin over the first 10%, windows of a fortieth, a hold of three windows."""
    window = max(1.0, duration_s / 40)
    return RolloutConfig(cold_start_s=duration_s / 10, window_s=window, hold_s=3 * window, min_requests=20)


def run_policy(trace: Trace, policy: str, factor: float, *, seed: int, shift_s: float | None = None,
               kv_tiers: KvTierOptions | None = None, spill_timeout_s: float | None = None) -> Run:
    """One policy over the whole trace at time scale `factor`, drained to the end. `flexpipe+buckets`
    is flexpipe's router over engines that split batches by prompt length (scheduler/buckets.py);
    `shift_s` (a drift case: where the second trace begins, unscaled) splits the attainment in two;
    `spill_timeout_s`: a policy with KV spillover re-routes spilled requests after this (None: the
    default SpillConfig's, inf: never)."""
    arrivals = [replace(a, t_s=a.t_s * factor, deployment=DEPLOYMENT) for a in trace.arrivals]
    duration = max(arrivals[-1].t_s, 1.0)
    buckets = LengthBuckets() if policy == "flexpipe+buckets" else None
    config = None  # (a spill config given to plain flexpipe would turn its bands on)
    if spill_timeout_s is not None and policy == VARIANTS["kv_budget"]:
        config = RouterConfig(spill=SpillConfig(spill_timeout_s=spill_timeout_s))
    router = make_router("flexpipe" if buckets else policy, config, seed=seed)
    sim = FleetSim(pool_scenario(duration, seed), router=router,
                   options=SimOptions(prefix_block_tokens=trace.block_tokens or BLOCK_TOKENS, length_buckets=buckets,
                                      kv_tiers=kv_tiers))
    plans = pool_plans(sim)
    for plan in plans:
        sim.launch(DEPLOYMENT, plan, source="warm", accepting=True)
    rule = _rule(sim, plans)
    if isinstance(router, LearnedRouter):
        router.slo = rule.limits
        router.controller = RolloutController(learned_rollout(duration))
    sim.feed(arrivals)
    sim.run_to_completion()
    rec = sim.recorder
    ttft = np.array(rec.f_ttft)
    tpot = np.array(rec.f_tpot)
    ok = 0
    for t, u, p, o in zip(rec.f_ttft, rec.f_tpot, rec.f_prompt, rec.f_output, strict=True):
        lim_t, lim_u = rule.limits(p, o)
        ok += t <= lim_t and (o <= 1 or u <= lim_u)
    hit = sum(p.cache.hit_tokens for e in sim.engines.values() for p in e.pipes if p.cache is not None)
    prompt_total = sum(a.prompt_tokens for a in arrivals)
    summary: dict[str, Any] = {
        "goodput_rps": round(ok / duration, 4),
        "slo_attainment": round(ok / len(arrivals), 4),
        "ttft_mean_s": _r(float(ttft.mean()) if ttft.size else None),
        "ttft_p50_s": _r(_pct(ttft, 50)),
        "ttft_p99_s": _r(_pct(ttft, 99)),
        "tpot_p99_s": _r(_pct(tpot[np.array(rec.f_output) > 1], 99)),
        "tokens": int(sum(rec.f_output)),
        "finished": len(rec.f_ttft),
        "lost": len(rec.failed),
        "cache_hit_share": round(hit / prompt_total, 4) if prompt_total else 0.0,
        "preemptions": sim.preemptions,
        "sla_violation_rate": round(1 - ok / len(arrivals), 4),
        # KV spillover (scheduler/router/spillover.py): requests sent away from their first choice,
        # and of those re-routed after the spillover timeout; None: a policy without the bands
        "spills": None if sim.spill_watch is None else sim.spill_watch.spills,
        "spill_timeouts": None if sim.spill_watch is None else sim.spill_watch.timeouts,
    }
    if sim.kv_tiers is not None:
        tiers = sim.kv_tiers.totals()
        summary["kv_tiers"] = {"host_hit_share": round(tiers["restored_host_tokens"] / prompt_total, 4),
                               "ssd_hit_share": round(tiers["restored_ssd_tokens"] / prompt_total, 4),
                               "restore_s": round(tiers["restore_s"], 3),
                               **{k: int(tiers[k]) for k in ("offloaded_blocks", "demoted_blocks", "dropped_blocks")}}
    short = [t for t, p in zip(rec.f_ttft, rec.f_prompt, strict=True) if p < SHORT_PROMPT_TOKENS]
    summary["ttft_p99_short_s"] = _r(_pct(np.array(short), 99)) if short else None
    if shift_s is not None:
        for part, keep in (("before", lambda a: a < shift_s * factor), ("after", lambda a: a >= shift_s * factor)):
            idx = [i for i, a in enumerate(rec.f_arrival) if keep(a)]
            met = sum(_met(rule, rec, i) for i in idx)
            summary[f"slo_attainment_{part}_shift"] = round(met / len(idx), 4) if idx else None
    if isinstance(router, LearnedRouter):
        c = router.controller
        summary.update({
            "rollbacks": sum(e.after is RolloutStage.ROLLED_BACK for e in c.events),
            "fallbacks": sum(e.after is RolloutStage.FALLBACK for e in c.events),
            "worst_window_violations_vs_rr": round(c.worst_ratio, 4) if c.compared else None,
            "windows_compared": c.compared,
            "weights": {k: round(v, 4) for k, v in router.weights.items()},
            "stages": [{"at_s": round(e.at_s, 1), "to": e.after.value, "share": round(e.share, 3),
                        "learned_violation_rate": _r(e.learned_violation_rate), "rr_violation_rate":
                        _r(e.rr_violation_rate), "reason": e.reason} for e in c.events[:50]],
        })
    return Run(policy, factor, summary)


def _met(rule: SloRule, rec: Any, i: int) -> bool:
    lim_t, lim_u = rule.limits(rec.f_prompt[i], rec.f_output[i])
    return bool(rec.f_ttft[i] <= lim_t and (rec.f_output[i] <= 1 or rec.f_tpot[i] <= lim_u))


def drift_trace(a: Trace, b: Trace) -> tuple[Trace, float]:
    """Trace `b` after trace `a` (its first request a mean gap after a's last): the drift case, and
    where `b` begins."""
    gap = a.span_s / max(1, len(a.arrivals) - 1)
    t0 = a.arrivals[-1].t_s + gap
    shifted = [replace(x, t_s=t0 + (x.t_s - b.arrivals[0].t_s)) for x in b.arrivals]
    base = a.arrivals[0].t_s
    arrivals = tuple(replace(x, t_s=x.t_s - base) for x in (*a.arrivals, *shifted))
    return Trace(f"{a.path}+{b.path}", f"{a.format}+{b.format}", arrivals, a.block_tokens if a.block_tokens ==
                 b.block_tokens else 0, a.clipped + b.clipped), t0 - base


_RULES: dict[tuple[str, ...], SloRule] = {}


def _rule(sim: FleetSim, plans: Sequence[Plan]) -> SloRule:
    key = tuple(p.plan_id for p in plans)  # the same pool in every run: one rule, one memo
    if key not in _RULES:
        _RULES[key] = SloRule(plans, sim)
    return _RULES[key]


def _pct(a: np.ndarray, q: float) -> float | None:
    return float(np.percentile(a, q)) if a.size else None


def _r(v: float | None, digits: int = 4) -> float | None:
    return None if v is None or not math.isfinite(v) else round(v, digits)


def find_time_scale(trace: Trace, *, seed: int, log: Any = None, iterations: int = 10) -> tuple[float, list[Any]]:
    """The factor at which least-loaded meets the SLO for TARGET_ATTAINMENT of the requests:
    bracket by doubling or halving from 1, then bisect in log space."""
    probes: list[tuple[float, float]] = []

    def attainment(f: float) -> float:
        a = float(run_policy(trace, "least-loaded", f, seed=seed).summary["slo_attainment"])
        probes.append((round(f, 6), a))
        if log is not None:
            log(f"  time scale {f:8.4f}: least-loaded meets the SLO for {a:.1%}")
        return a

    f = 1.0
    a = attainment(f)
    lo, hi = (f, None) if a < TARGET_ATTAINMENT else (None, f)
    for _ in range(12):
        if lo is not None and hi is not None:
            break
        f = f * 2 if hi is None else f / 2
        a = attainment(f)
        if a < TARGET_ATTAINMENT:
            lo = f
        else:
            hi = f
    if lo is None or hi is None:
        raise RuntimeError(f"no time scale in [1/4096, 4096] brings least-loaded to {TARGET_ATTAINMENT:.0%}: "
                           f"{probes}")
    for _ in range(iterations):
        mid = math.sqrt(lo * hi)
        a = attainment(mid)
        if abs(a - TARGET_ATTAINMENT) < 0.005:
            return mid, probes
        if a < TARGET_ATTAINMENT:
            lo = mid
        else:
            hi = mid
    best = min(probes, key=lambda p: abs(p[1] - TARGET_ATTAINMENT))
    return best[0], probes


def decision_times(trace: Trace, *, seed: int, sizes: Sequence[int] = DECISION_SIZES,
                   samples: int = DECISION_SAMPLES, rounds: int = DECISION_ROUNDS) -> dict[str, dict[str, Any]]:
    """The flexpipe router's time per decision over pools of `sizes` plans (module docstring).

    The same sequence of decisions (same requests, same loads, a fresh router from the same seed)
    is replayed `rounds` times; each decision's time is the least of its replays - the work it
    does, without what other processes on a shared machine add to one replay or another, as
    timeit's best-of-N - and p50 / p99 are taken over those. `raw_p50` / `raw_p99` are over every
    replay's times as measured."""
    out: dict[str, dict[str, Any]] = {}
    for n in sizes:
        runs = [_decision_round(trace, n, seed=seed, samples=samples) for _ in range(rounds)]
        best = {k: np.min(np.array([r[k] for r in runs]), axis=0) for k in ("wall", "cpu", "record", "load")}
        raw = np.concatenate([r["wall"] for r in runs])
        out[str(n)] = {"p50": _q(best["wall"], 50), "p99": _q(best["wall"], 99),
                       "cpu_p50": _q(best["cpu"], 50), "cpu_p99": _q(best["cpu"], 99),
                       "record_p50": _q(best["record"], 50), "record_p99": _q(best["record"], 99),
                       "load_p50": _q(best["load"], 50), "load_p99": _q(best["load"], 99),
                       "raw_p50": _q(raw, 50), "raw_p99": _q(raw, 99), "samples": len(best["wall"]),
                       "rounds": rounds}
    return out


def _decision_round(trace: Trace, n: int, *, seed: int, samples: int) -> dict[str, np.ndarray]:
    """One replay: per decision, its wall and thread-CPU ns of route() and of admitted()."""
    sim = FleetSim(pool_scenario(1.0, seed))
    plans = pool_plans(sim)
    model = model_spec(MODEL)
    snap = sim.snapshot()
    base = [plan_facts(p, model, snap) for p in plans]
    reqs = [RouteRequest(a.prompt_tokens, a.output_tokens, blocks=a.blocks)
            for a in trace.arrivals[:samples]]
    facts: list[PlanFacts] = [replace(base[i % len(base)], plan_id=f"{base[i % len(base)].plan_id}-{i}")
                              for i in range(n)]
    pool = Pool(facts, model=MODEL)
    router = Router(rng=random.Random(seed))
    rng = random.Random(seed)
    wall: list[int] = []
    cpu: list[int] = []
    record: list[int] = []
    load: list[int] = []
    for k, req in enumerate(reqs):
        loads = [PlanLoad(rng.randint(0, 64), rng.randint(0, 16), rng.randint(0, 200_000), 0,
                          rng.randint(0, f.kv_capacity_tokens // 2)) for f in facts]
        tl = time.perf_counter_ns()
        pool.set_loads(loads)
        tl = time.perf_counter_ns() - tl
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        d = router.route(req, pool, k * 0.1)
        t1 = time.perf_counter_ns()
        c1 = time.thread_time_ns()
        if d.chosen is not None:
            router.admitted(d, d.chosen)
        t2 = time.perf_counter_ns()
        if k >= len(reqs) // 10:  # the first tenth warms the prefix index and the caches
            wall.append(t1 - t0)
            cpu.append(c1 - c0)
            record.append(t2 - t1)
            load.append(tl)
    return {"wall": np.array(wall), "cpu": np.array(cpu), "record": np.array(record), "load": np.array(load)}


def _q(ns: np.ndarray, q: float) -> float:
    return round(float(np.percentile(ns.astype(np.float64), q)) / 1e3, 2)


def targets(fmt: str, pols: dict[str, Any], decisions: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"limits": TARGETS}
    at64 = decisions.get("64")
    if at64:
        out["decision_p99_us_at_64"] = at64["p99"]
        out["decision_p99_us_at_64_met"] = at64["p99"] <= TARGETS["decision_p99_us_at_64_max"]
    f, rr, ll = pols.get("flexpipe"), pols.get("round-robin"), pols.get("least-loaded")
    if fmt == "mooncake" and f and rr:
        g = _ratio(f["goodput_rps"], rr["goodput_rps"])
        t = _ratio(rr["ttft_mean_s"], f["ttft_mean_s"])
        out["goodput_over_round_robin"] = g
        out["goodput_over_round_robin_met"] = g is not None and g >= TARGETS["mooncake_goodput_over_round_robin_min"]
        out["ttft_mean_round_robin_over_flexpipe"] = t
        out["ttft_mean_round_robin_over_flexpipe_met"] = (
            t is not None and t >= TARGETS["mooncake_ttft_mean_round_robin_over_flexpipe_min"])
    if fmt == "azure" and f and ll:
        g = _ratio(f["goodput_rps"], ll["goodput_rps"])
        out["goodput_over_least_loaded"] = g
        out["goodput_over_least_loaded_met"] = g is not None and g >= TARGETS["azure_goodput_over_least_loaded_min"]
    out["lost"] = {n: r["lost"] for n, r in pols.items()}
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None if a is None or b is None else math.inf
    return round(a / b, 4)


def table(result: dict[str, Any]) -> str:
    pols = result["policies"]
    names = list(pols)
    rows = [("goodput req/s", "goodput_rps"), ("SLO attainment", "slo_attainment"), ("TTFT mean s", "ttft_mean_s"),
            ("TTFT p50 s", "ttft_p50_s"), ("TTFT p99 s", "ttft_p99_s"), ("TPOT p99 s", "tpot_p99_s"),
            ("tokens", "tokens"), ("lost", "lost"), ("prefix cache hit share", "cache_hit_share"),
            ("KV preemptions", "preemptions"), ("KV spills", "spills"), ("spillover timeouts", "spill_timeouts")]
    if any(TIERS in n for n in names):
        rows += [("host tier hit share", "host_hit_share"), ("SSD tier hit share", "ssd_hit_share")]
    out = []
    if names:  # (none: --decisions-only)
        w = max(15, *(len(n) + 2 for n in names))
        out.append(f"{'':26}" + "".join(f"{n:>{w}}" for n in names))
        for label, key in rows:
            out.append(f"{label:26}" + "".join(f"{_fmt(pols[n].get(key, pols[n].get('kv_tiers', {}).get(key))):>{w}}"
                                               for n in names))
        out.append("")
    rounds = next(iter(result["decision_us"].values()), {}).get("rounds", DECISION_ROUNDS)
    out.append(f"router decision (flexpipe), microseconds, least of {rounds} replays: wall p50 / p99, thread CPU"
               " p50 / p99, bookkeeping p50, load update p50; raw (every replay) p50 / p99")
    for n, d in result["decision_us"].items():
        out.append(f"  {n:>3} plans: {d['p50']:7.1f} / {d['p99']:7.1f}   cpu {d['cpu_p50']:7.1f} / {d['cpu_p99']:7.1f}"
                   f"   record {d['record_p50']:6.1f}   load {d.get('load_p50', 0.0):6.1f}"
                   f"   raw {d['raw_p50']:7.1f} / {d['raw_p99']:7.1f}")
    t = result["targets"]
    out.append("")
    out.append("targets (issue 15; measured here, never asserted)")
    for key, label in (("decision_p99_us_at_64", "decision p99 at 64 plans <= 50 us"),
                       ("goodput_over_round_robin", "goodput / round-robin's >= 2"),
                       ("ttft_mean_round_robin_over_flexpipe", "round-robin's mean TTFT / flexpipe's >= 5"),
                       ("goodput_over_least_loaded", "goodput / least-loaded's >= 1.2")):
        if key in t:
            out.append(f"  {label:48}{_fmt(t[key]):>10}  {'met' if t[key + '_met'] else 'NOT met'}")
    return "\n".join(out)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3g}"
    return str(v)


def bench(trace_path: str, *, policies: Sequence[str] = POLICIES, seed: int = 0, log: Any = None,
          decision_samples: int | None = None, drift: str | None = None,
          decisions_only: bool = False, kv_tiers: bool = False, spill_timeout_s: float | None = None,
          time_scale: float | None = None) -> dict[str, Any]:
    """`trace_path`, or with `drift` ("A,B") trace B after trace A. `decisions_only`: only the
    router's time per decision (no time scale, no policy runs: seconds instead of minutes).
    `kv_tiers`: every policy also runs as `<policy>+tiers`, its engines with KV tiers."""
    context = model_spec(MODEL).max_context_tokens
    shift_s = None
    if drift:
        first, second = drift.split(",", 1)
        trace, shift_s = drift_trace(read_trace(first, context_tokens=context), read_trace(second, context_tokens=context))
    else:
        trace = read_trace(trace_path, context_tokens=context)
    say = log or (lambda _: None)
    say(f"{trace.path}: {trace.format}, {len(trace.arrivals)} requests over {trace.span_s:.0f} s"
        f"{f', {trace.clipped} cut to the context' if trace.clipped else ''}")
    if decisions_only:
        decisions = decision_times(trace, seed=seed, samples=decision_samples or DECISION_SAMPLES)
        return {"trace": trace.path, "format": trace.format, "requests": len(trace.arrivals), "model": MODEL,
                "seed": seed, "policies": {}, "decision_us": decisions, "targets": targets(trace.format, {}, decisions)}
    if time_scale is None:
        say("finding the time scale at which least-loaded meets the SLO for 80% of requests")
        factor, probes = find_time_scale(trace, seed=seed, log=say)
    else:  # a load the caller chose (no bisection: one run per policy)
        factor, probes = time_scale, []
    say(f"time scale {factor:.4f} (arrival times x {factor:.4f}; rate x {1 / factor:.3f})")
    results: dict[str, Any] = {}
    for name in policies:
        t0 = time.process_time()
        results[name] = run_policy(trace, name, factor, seed=seed, shift_s=shift_s,
                                   spill_timeout_s=spill_timeout_s).summary
        say(f"  {name:14} goodput {results[name]['goodput_rps']:.3f} req/s, attainment "
            f"{results[name]['slo_attainment']:.1%} ({time.process_time() - t0:.1f} s CPU)")
        if kv_tiers:  # the same policy, time scale and seed over engines with host and SSD KV tiers
            t0 = time.process_time()
            on = results[f"{name}{TIERS}"] = run_policy(trace, name, factor, seed=seed, shift_s=shift_s,
                                                        kv_tiers=KvTierOptions(), spill_timeout_s=spill_timeout_s).summary
            say(f"  {name + TIERS:14} goodput {on['goodput_rps']:.3f} req/s, attainment "
                f"{on['slo_attainment']:.1%} ({time.process_time() - t0:.1f} s CPU)")
    decisions = decision_times(trace, seed=seed, samples=decision_samples or DECISION_SAMPLES)
    return {
        "trace": trace.path, "format": trace.format, "requests": len(trace.arrivals), "span_s": round(trace.span_s, 3),
        "clipped_to_context": trace.clipped, "model": MODEL, "seed": seed,
        "pool": [f"{PLANS_PER_NODE}x TP{TP} {g}{' NVLink' if nv else ' PCIe'}" for _, g, nv in NODES],
        "slo_rule": f"TTFT <= {SLO_SCALE:g} x idle prefill, TPOT <= {SLO_SCALE:g} x idle decode step, "
                    "on the fastest plan that holds the request",
        "time_scale": round(factor, 6), "bisection": probes, "policies": results, "decision_us": decisions,
        "drift_shift_s": None if shift_s is None else round(shift_s * factor, 3),
        "targets": targets(trace.format, results, decisions),
        "kv_tiers": tier_comparison(results) if kv_tiers else None,
        "spill_timeout_s": _spill_timeout(spill_timeout_s),
    }


def _spill_timeout(s: float | None) -> float | None:
    """The spillover timeout the runs used, for the JSON (None: off - JSON has no infinity)."""
    s = SpillConfig().spill_timeout_s if s is None else s
    return None if math.isinf(s) else s


def tier_comparison(results: dict[str, Any]) -> dict[str, Any]:
    """Per policy run with and without KV tiers: TTFT p50 / p99 and SLO attainment, off -> on."""
    keys = ("ttft_p50_s", "ttft_p99_s", "slo_attainment", "goodput_rps", "cache_hit_share", "lost")
    return {name: {k: {"off": r[k], "on": results[name + TIERS][k]} for k in keys}
            for name, r in results.items() if name + TIERS in results}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.route", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", help="Mooncake JSONL or Azure CSV (format read from the file)")
    ap.add_argument("--drift", metavar="TRACE_A,TRACE_B", help="the drift case: trace B after trace A")
    ap.add_argument("--json", help="write the result here")
    known = [*ROUTING_POLICIES, VARIANTS["buckets"]]
    ap.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated: {', '.join(known)}")
    ap.add_argument("--learned", action="store_true", help=f"add {VARIANTS['learned']} (scheduler/router/learned.py)")
    ap.add_argument("--buckets", action="store_true", help=f"add {VARIANTS['buckets']} (scheduler/buckets.py)")
    ap.add_argument("--kv-budget", action="store_true", help=f"add {VARIANTS['kv_budget']} (scheduler/router/spillover.py)")
    ap.add_argument("--kv-tiers", action="store_true",
                    help=f"each policy also as <policy>{TIERS}: GPU -> host -> SSD KV tiers (agents/sim/kvtiers.py)")
    ap.add_argument("--spill-timeout", type=float, metavar="S",
                    help=f"spillover timeout of policies with KV spillover, seconds (default "
                         f"{SpillConfig().spill_timeout_s:g}; inf: never re-route)")
    ap.add_argument("--time-scale", type=float, metavar="F",
                    help="run at this time scale (arrival times x F) instead of finding the one where "
                         "least-loaded meets the SLO for 80%% (a heavier load: F < that)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--decisions-only", action="store_true",
                    help="only the router's time per decision (decision_us), no policy runs")
    ap.add_argument("--decision-samples", type=int, default=DECISION_SAMPLES, metavar="N",
                    help=f"requests of the trace timed per pool size (default {DECISION_SAMPLES})")
    args = ap.parse_args(argv)
    if args.spill_timeout is not None and not args.spill_timeout >= 0:
        ap.error(f"--spill-timeout: must be >= 0 (inf: off), got {args.spill_timeout:g}")
    if args.time_scale is not None and not args.time_scale > 0:
        ap.error(f"--time-scale: must be > 0, got {args.time_scale:g}")
    if args.decision_samples < 20:
        ap.error(f"--decision-samples: at least 20, got {args.decision_samples}")
    names = [p for p in args.policies.split(",") if p]
    names += [VARIANTS[k] for k in ("kv_budget", "learned", "buckets") if getattr(args, k) and VARIANTS[k] not in names]
    unknown = [p for p in names if p not in known]
    if unknown or not names:
        ap.error(f"--policies: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(known)}")
    if bool(args.trace) == bool(args.drift):
        ap.error("--trace or --drift: give one of them")
    for path in (args.drift.split(",") if args.drift else [args.trace]):
        if not Path(path).is_file():
            ap.error(f"{'--drift' if args.drift else '--trace'}: {path} is not a file")
    if args.drift and args.drift.count(",") != 1:
        ap.error("--drift: two traces, TRACE_A,TRACE_B")
    try:
        result = bench(args.trace or "", policies=names, seed=args.seed, log=lambda s: print(s, flush=True),
                       drift=args.drift, decisions_only=args.decisions_only, decision_samples=args.decision_samples,
                       kv_tiers=args.kv_tiers, spill_timeout_s=args.spill_timeout,
                       time_scale=args.time_scale)
    except ValueError as exc:
        print(f"bench.route: {exc}", file=sys.stderr)
        return 2
    print()
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
