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


def test_paper_loads_its_70b_within_the_fixed_plan_before_the_preemptions_and_to_its_edge_after() -> None:
    scenario = load_scenario(SCENARIOS / "paper.yaml")
    sim = FleetSim(scenario)
    fixed = sim.start_baselines()["summarize-70b"]
    dep = sim.deployments["summarize-70b"]
    peak = peak_workload(scenario, "summarize-70b")
    fixed_rps = estimate_plan(fixed.profile, peak, dep.slo).capacity_rps
    assert fixed.plan.shape() == "TP8"
    first_event_s = min(e.at_s for e in scenario.events)
    (spec,) = [w for w in scenario.workload if w.deployment == "summarize-70b"]
    morning = max(r for t, r in spec.rate_points if t <= first_event_s)
    # the seed's fixed plan served its load before the first preemption (P95 ~380 ms) ...
    assert morning < 0.8 * fixed_rps
    # ... but never had room to work off what queued while it was stopped
    assert peak.rate_rps > 0.9 * fixed_rps
    # the whole cluster, before anything runs on it, carries the peak with the planner's headroom
    empty = FleetSim(scenario).snapshot()
    best = max(c.estimate.capacity_rps for c in plan_candidates(dep.model, empty, peak, slo=dep.slo).feasible)
    assert best > 1.25 * peak.rate_rps


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
