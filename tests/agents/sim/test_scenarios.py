"""The premises the shipped scenarios are built on, checked against the cost model and the simulator."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from agents.sim.fleet import FleetSim
from agents.sim.policies import peak_workload
from agents.sim.scenario import load_scenario
from agents.sim.workload import build_workload
from scheduler.costmodel import Workload, estimate_plan
from scheduler.plan import Plan, Stage
from scheduler.planner import plan_candidates

SCENARIOS = Path(__file__).resolve().parents[3] / "scenarios"


def test_paper_loads_its_70b_above_the_fixed_plan_and_below_the_cluster() -> None:
    scenario = load_scenario(SCENARIOS / "paper.yaml")
    sim = FleetSim(scenario)
    fixed = sim.start_baselines()["summarize-70b"]
    dep = sim.deployments["summarize-70b"]
    load = peak_workload(scenario, "summarize-70b")
    fixed_rps = estimate_plan(fixed.profile, load, dep.slo).capacity_rps
    assert fixed.plan.shape() == "TP8" and load.rate_rps > 1.1 * fixed_rps
    # the whole cluster, before anything runs on it, carries the load with the planner's headroom
    empty = FleetSim(scenario).snapshot()
    best = max(c.estimate.capacity_rps for c in plan_candidates(dep.model, empty, load, slo=dep.slo).feasible)
    assert best > 1.25 * load.rate_rps


def test_pd_splitting_prefill_from_decode_on_its_four_free_gpus_beats_two_colocated_plans() -> None:
    scenario = load_scenario(SCENARIOS / "pd.yaml")
    # five minutes at the plateau of its load (9 req/s), the link at full speed
    plateau = max(r for _, r in scenario.workload[0].rate_points)
    scenario = replace(scenario, duration_s=300.0, events=(),
                       workload=(replace(scenario.workload[0], rate_points=((0.0, plateau),)),))
    attainment = {}
    for mode in ("colocated", "disaggregated"):
        sim = FleetSim(scenario)
        h100 = tuple(g.uuid for g in sim.cluster.our_gpus("p1"))
        h200 = tuple(g.uuid for g in sim.cluster.our_gpus("d1"))
        if mode == "colocated":
            plans = [Plan("Llama-3-8B", "colocated", (Stage(0, 32, gpus),), kv_reserve_tokens=400_000)
                     for gpus in (h100, h200)]
        else:
            plans = [Plan("Llama-3-8B", "disaggregated", (Stage(0, 32, h100),), (Stage(0, 32, h200),),
                          kv_reserve_tokens=400_000)]
        for plan in plans:
            sim.launch("rag-8b", plan, source="warm", accepting=True)
        sim.feed(build_workload(scenario).arrivals)
        sim.run_to_completion()
        ok = sim.recorder.f_ok
        attainment[mode] = sum(ok) / len(ok)
    assert attainment["disaggregated"] > 0.98 and attainment["colocated"] < 0.93, attainment


def test_the_cost_model_predicts_the_simulated_tpot_of_a_colocated_plan_under_pd_long_prompts() -> None:
    # one H100 serving pd's 6000-token prompts at 2 req/s: rounds that carry a prompt chunk are
    # several times slower than plain decode steps, and the median request's TPOT is their mix
    scenario = load_scenario(SCENARIOS / "pd.yaml")
    scenario = replace(scenario, duration_s=420.0, events=(),
                       workload=(replace(scenario.workload[0], rate_points=((0.0, 2.0),)),))
    sim = FleetSim(scenario)
    dep = sim.deployments["rag-8b"]
    h100 = tuple(g.uuid for g in sim.cluster.our_gpus("p1"))[:1]
    plan = Plan("Llama-3-8B", "colocated", (Stage(0, 32, h100),), kv_reserve_tokens=200_000)
    engine = sim.launch("rag-8b", plan, source="warm", accepting=True)
    arrivals = build_workload(scenario).arrivals
    sim.feed(arrivals)
    sim.run_to_completion()
    prompt = sum(a.prompt_tokens for a in arrivals) / len(arrivals)
    output = sum(a.output_tokens for a in arrivals) / len(arrivals)
    est = estimate_plan(engine.profile, Workload(2.0, prompt, output, 0.3, 0.3), dep.slo)
    tpot = sorted(t for a, t in zip(sim.recorder.f_arrival, sim.recorder.f_tpot, strict=True) if a > 120.0)
    median = tpot[len(tpot) // 2]
    assert est.tpot_p50_s == pytest.approx(median, rel=0.08), (est.tpot_p50_s, median)
