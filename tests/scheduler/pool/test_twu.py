"""Token-weighted utilisation (scheduler/pool/twu.py): named cases, no database."""

from __future__ import annotations

import pytest

from scheduler.costmodel import PlanProfile, Workload, steady_state
from scheduler.modelspec import model_spec
from scheduler.plan import Plan, Stage
from scheduler.pool.twu import PlanTokens, TokenCosts, deployment_twu, gpu_twu, plan_twu, pool_twu
from tests.scheduler.builders import NodeSpec, chat_workload, make_fleet, tp_plan

M8 = model_spec("Llama-3-8B")
SNAP = make_fleet([NodeSpec("a1"), NodeSpec("a2")])


def _plan_and_costs(plan: Plan, shape: Workload) -> tuple[PlanProfile, TokenCosts]:
    profile = PlanProfile.build(plan, M8, SNAP)
    return profile, TokenCosts.of(profile, shape)


def test_an_idle_plan_has_twu_zero() -> None:
    plan = tp_plan(M8, ["a1-g0"], 100_000)
    _, costs = _plan_and_costs(plan, chat_workload())
    twu = plan_twu(plan, costs, PlanTokens(plan.plan_id, 15.0, 0.0, 0.0))
    assert twu is not None and twu.twu == 0.0 and dict(twu.gpus) == {"a1-g0": 0.0}


@pytest.mark.parametrize("plan", [
    tp_plan(M8, ["a1-g0"], 100_000),
    tp_plan(M8, ["a1-g0", "a1-g1"], 200_000),
    Plan(M8.name, "colocated", (Stage(0, 16, ("a1-g0",)), Stage(16, 32, ("a1-g1",))), kv_reserve_tokens=100_000),
    Plan(M8.name, "disaggregated", (Stage(0, 32, ("a1-g0",)),), (Stage(0, 32, ("a2-g0",)),), kv_reserve_tokens=100_000),
], ids=["tp1", "tp2", "pp2", "disaggregated"])
@pytest.mark.parametrize("shape", [chat_workload(), Workload(1.0, 4000, 50), Workload(1.0, 100, 1000)],
                         ids=["chat", "prefill-heavy", "decode-heavy"])
def test_a_plan_serving_its_modelled_capacity_has_twu_one(plan: Plan, shape: Workload) -> None:
    profile, costs = _plan_and_costs(plan, shape)
    state = steady_state(profile, shape)
    window_s = 15.0
    served = state.capacity_rps * window_s  # requests at capacity over the window, of the modelled shape
    tokens = PlanTokens(plan.plan_id, window_s, served * state.prompt, served * state.output)
    twu = plan_twu(plan, costs, tokens)
    assert twu is not None
    assert twu.twu == pytest.approx(1.0, rel=1e-6)
    half = plan_twu(plan, costs, PlanTokens(plan.plan_id, window_s, tokens.prompt_tokens / 2, tokens.output_tokens / 2))
    assert half is not None and half.twu == pytest.approx(0.5, rel=1e-6)


def test_a_decode_token_costs_more_than_a_prompt_token() -> None:
    # prefill runs in large compute-bound batches; a decode step reads the weights and the KV
    # for one token per sequence: at equal token counts a decode-heavy window is busier
    plan = tp_plan(M8, ["a1-g0"], 100_000)
    _, costs = _plan_and_costs(plan, chat_workload())
    assert 0 < costs.prefill_s < costs.decode_s
    prefill_heavy = plan_twu(plan, costs, PlanTokens(plan.plan_id, 10.0, 9000.0, 1000.0))
    decode_heavy = plan_twu(plan, costs, PlanTokens(plan.plan_id, 10.0, 1000.0, 9000.0))
    assert prefill_heavy is not None and decode_heavy is not None
    assert decode_heavy.twu > 2 * prefill_heavy.twu
    assert prefill_heavy.twu == pytest.approx((9000 * costs.prefill_s + 1000 * costs.decode_s) / 10.0)


def test_a_window_with_no_reports_is_unknown_not_idle() -> None:
    plan = tp_plan(M8, ["a1-g0"], 100_000)
    _, costs = _plan_and_costs(plan, chat_workload())
    assert PlanTokens.from_reports(plan.plan_id, [], 15.0) is None
    assert plan_twu(plan, costs, None) is None
    assert deployment_twu([None, None]) is None
    assert gpu_twu([]) == {}


def test_tokens_come_from_engine_report_fields() -> None:
    reports = [{"tokens_per_s": 100.0, "arrivals": 30, "prompt_tokens_mean": 400.0},
               {"tokens_per_s": 20.0, "arrivals": 0, "prompt_tokens_mean": None}]
    tokens = PlanTokens.from_reports("p", reports, 15.0)
    assert tokens == PlanTokens("p", 15.0, 12_000.0, 1_800.0)


def test_a_split_plan_gives_each_side_its_own_share() -> None:
    plan = Plan(M8.name, "disaggregated", (Stage(0, 32, ("a1-g0",)),), (Stage(0, 32, ("a2-g0",)),),
                kv_reserve_tokens=100_000)
    costs = TokenCosts(prefill_s=1e-4, decode_s=1e-3, split=True)
    twu = plan_twu(plan, costs, PlanTokens(plan.plan_id, 10.0, 80_000.0, 2_000.0))
    assert twu is not None
    assert twu.prefill == pytest.approx(0.8) and twu.decode == pytest.approx(0.2)
    assert twu.twu == pytest.approx(0.8)  # the busier side bounds the plan
    assert dict(twu.gpus) == {"a1-g0": pytest.approx(0.8), "a2-g0": pytest.approx(0.2)}


def test_a_gpu_shared_by_two_plans_sums_their_shares_and_a_deployment_weighs_by_gpus() -> None:
    a = tp_plan(M8, ["a1-g0", "a1-g1"])
    b = tp_plan(model_spec("Phi-3-mini"), ["a1-g1"])
    costs = TokenCosts(prefill_s=0.0, decode_s=1e-3)
    ta = plan_twu(a, costs, PlanTokens(a.plan_id, 10.0, 0.0, 5_000.0))  # 0.5
    tb = plan_twu(b, costs, PlanTokens(b.plan_id, 10.0, 0.0, 3_000.0))  # 0.3
    assert ta is not None and tb is not None
    per_gpu = gpu_twu([ta, tb])
    assert per_gpu == {"a1-g0": pytest.approx(0.5), "a1-g1": pytest.approx(0.8)}
    assert deployment_twu([ta, tb]) == pytest.approx((0.5 * 2 + 0.3 * 1) / 3)
    assert deployment_twu([ta, None]) == pytest.approx(0.5)
    assert pool_twu(per_gpu, ["a1-g0", "a1-g1", "a1-g2", "a1-g3"]) == pytest.approx(1.3 / 4)
    assert pool_twu(per_gpu, []) is None


def test_bad_windows_and_token_counts_name_the_field() -> None:
    with pytest.raises(ValueError, match="window_s"):
        PlanTokens("p", 0.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="output_tokens"):
        PlanTokens("p", 1.0, 1.0, -1.0)
    with pytest.raises(ValueError, match="decode_s"):
        TokenCosts(1e-5, -1.0)
