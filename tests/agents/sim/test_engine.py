"""The per-plan engine, driven through the simulator: batching, KV, PP, P/D, the analytic runs."""

from __future__ import annotations

import statistics

import pytest

from agents.sim.fleet import FleetSim, SimOptions
from agents.sim.workload import build_workload
from scheduler.costmodel import Batch
from scheduler.plan import Plan, Stage
from tests.agents.sim.worlds import one_deployment


def gpus(sim: FleetSim, *idx: int, node: str = "a1") -> tuple[str, ...]:
    return tuple(sim.cluster.gpu_uuid(node, i) for i in idx)


def test_a_lone_request_takes_the_cost_models_prefill_then_one_decode_step_per_token() -> None:
    sim = FleetSim(one_deployment(rate_rps=0))
    engine = sim.launch("d", sim.baseline_plan("d"), source="warm", accepting=True)
    sim.submit("d", 3000, 50)
    sim.advance_to(60)
    rec = sim.recorder
    pipe = engine.profile.pipeline("prefill")
    ttft = rec.f_ttft[0]
    # two chunks: 2048 tokens, then 952 tokens over a 2048-token prefix (chunked prefill)
    assert ttft == pytest.approx(pipe.prefill_time_s(3000), rel=1e-9)
    decode = sum(pipe.iteration(Batch(decode_seqs=1, decode_context_tokens=3001 + i)).latency_s for i in range(49))
    assert rec.f_e2e[0] - ttft == pytest.approx(decode, rel=1e-3)
    assert sum(rec.token_bins) == 50


def test_runs_of_identical_rounds_advanced_at_once_agree_with_simulating_every_round() -> None:
    scenario = one_deployment(rate_rps=6.0, duration_s=300, prompt={"dist": "lognormal", "mean": 500, "sigma": 0.6,
                                                                    "max": 3000},
                              output={"dist": "lognormal", "mean": 150, "sigma": 0.6, "max": 800})
    work = build_workload(scenario).arrivals
    results = []
    for max_run in (1, 4096):
        sim = FleetSim(scenario, options=SimOptions(max_run_rounds=max_run))
        sim.start_baselines()
        sim.feed(work)
        sim.run_to_completion()
        results.append(sim.recorder)
    exact, fast = results
    assert len(exact.f_e2e) == len(fast.f_e2e) == len(work)
    assert sum(exact.token_bins) + exact.tokens_after == pytest.approx(sum(fast.token_bins) + fast.tokens_after,
                                                                        rel=1e-9)
    assert statistics.fmean(fast.f_e2e) == pytest.approx(statistics.fmean(exact.f_e2e), rel=0.005)
    assert statistics.fmean(fast.f_ttft) == pytest.approx(statistics.fmean(exact.f_ttft), rel=0.02)


def test_when_kv_runs_out_sequences_are_preempted_and_recomputed_and_all_finish() -> None:
    scenario = one_deployment(rate_rps=6.0, duration_s=120)
    sim = FleetSim(scenario)
    base = sim.baseline_plan("d")
    small = Plan(base.model, "colocated", base.stages, kv_reserve_tokens=6000)  # ten requests' worth
    sim.launch("d", small, source="warm", accepting=True)
    sim.feed(build_workload(scenario).arrivals)
    sim.run_to_completion()
    assert sim.preemptions > 0
    assert len(sim.recorder.f_e2e) == sum(sim.recorder.admitted) and not sim.recorder.failed


def test_a_request_larger_than_the_plans_kv_ends_with_an_explicit_error() -> None:
    sim = FleetSim(one_deployment(rate_rps=0))
    base = sim.baseline_plan("d")
    sim.launch("d", Plan(base.model, "colocated", base.stages, kv_reserve_tokens=300), source="warm", accepting=True)
    sim.submit("d", 500, 10)
    sim.submit("d", 100, 10)
    sim.run_to_completion()
    assert len(sim.recorder.f_e2e) == 1
    (_, dep, _, reason), = sim.recorder.failed
    assert dep == "d" and "needs 510 KV tokens" in reason and "holds 300" in reason  # prompt + max_tokens


def test_a_pipeline_of_two_stages_serves_everything() -> None:
    scenario = one_deployment(rate_rps=3.0, duration_s=120)
    sim = FleetSim(scenario)
    plan = Plan("Llama-3-8B", "colocated", (Stage(0, 16, gpus(sim, 0, 1)), Stage(16, 32, gpus(sim, 2, 3))),
                kv_reserve_tokens=100_000)
    engine = sim.launch("d", plan, source="warm", accepting=True)
    sim.feed(build_workload(scenario).arrivals)
    sim.run_to_completion()
    assert engine.prefill.pp == 2
    assert len(sim.recorder.f_e2e) == sum(sim.recorder.admitted) > 300


def test_a_prefill_decode_split_hands_the_kv_over_and_counts_it_in_ttft() -> None:
    sim = FleetSim(one_deployment(rate_rps=0))
    plan = Plan("Llama-3-8B", "disaggregated", (Stage(0, 32, gpus(sim, 0, 1)),), (Stage(0, 32, gpus(sim, 2, 3)),),
                kv_reserve_tokens=100_000)
    engine = sim.launch("d", plan, source="warm", accepting=True)
    for _ in range(5):
        sim.submit("d", 2000, 40)
    sim.run_to_completion()
    assert len(sim.recorder.f_e2e) == 5
    alone = engine.profile.pipeline("prefill").prefill_time_s(2000) + engine.profile.kv_handoff_s(2000)
    assert min(sim.recorder.f_ttft) == pytest.approx(alone, rel=1e-6)
    assert engine.profile.kv_handoff_s(2000) > 0
