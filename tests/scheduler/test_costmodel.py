from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import costmodel
from scheduler.costmodel import (
    Batch,
    Efficiency,
    Estimate,
    Path,
    PipelineProfile,
    PlanProfile,
    Slo,
    StageProfile,
    SwitchCost,
    Workload,
    allreduce_time_s,
    decode_step_s,
    estimate_plan,
    iteration_time_s,
    kernel_time_s,
    kv_route,
    migrate_or_replay,
    prefill_time_s,
    switch_cost,
    transfer_time_s,
)
from scheduler.hardware import CATALOG
from scheduler.modelspec import model_spec
from scheduler.plan import Gear, Plan, Stage
from tests.scheduler.builders import CHAT_SLO, NodeSpec, chat_workload, make_fleet, one_plan_gear, tp_plan

M8 = model_spec("Llama-3-8B")
M70 = model_spec("Llama-3-70B")
H100 = CATALOG["H100-SXM"]


def fleet():  # type: ignore[no-untyped-def]
    return make_fleet([NodeSpec("a1", "H100-SXM"), NodeSpec("a2", "H100-SXM"), NodeSpec("b1", "A100-40G", rack="B")])


def one_stage(spec=H100, tp: int = 1, link_bytes_per_s: float = 450e9, model=M8) -> PipelineProfile:  # type: ignore[no-untyped-def]
    stage = StageProfile(model.num_layers, tp, spec, Path(link_bytes_per_s), True, True, None)
    return PipelineProfile(model, [stage], costmodel.DEFAULT_EFFICIENCY)


# --- kernels and links ------------------------------------------------------------------------------
def test_a_big_gemm_is_compute_bound_at_the_fitted_mfu() -> None:
    eff = costmodel.DEFAULT_EFFICIENCY
    flops = 1e15
    assert kernel_time_s(flops, 1e6, H100) == pytest.approx(flops / (eff.mfu * H100.bf16_flops), rel=1e-3)


def test_a_weight_read_is_memory_bound_at_the_fitted_mbu() -> None:
    eff = costmodel.DEFAULT_EFFICIENCY
    nbytes = 1e10
    expected = nbytes / (eff.mbu * H100.hbm_bytes_per_s) + eff.kernel_overhead_s
    assert kernel_time_s(1e6, nbytes, H100) == pytest.approx(expected, rel=1e-3)


def test_measured_links_are_used_as_measured_and_datasheet_links_derated() -> None:
    eff = costmodel.DEFAULT_EFFICIENCY
    nominal, measured = Path(100e9), Path(100e9, measured=True)
    assert transfer_time_s(1e9, measured) < transfer_time_s(1e9, nominal)
    # a point-to-point copy: one launch, the send/recv handshake, one hop, the bytes at p2p efficiency
    assert transfer_time_s(1e9, nominal) == pytest.approx(
        eff.kernel_overhead_s + eff.p2p_latency_s + eff.link_latency_s + 1e9 / (100e9 * eff.p2p_link_efficiency))
    assert math.isinf(transfer_time_s(1.0, Path(0.0)))


def test_an_all_reduce_moves_2_t_minus_1_over_t_of_the_bytes() -> None:
    eff = replace(costmodel.DEFAULT_EFFICIENCY, allreduce_latency_s=0.0, link_latency_s=0.0)
    path = Path(100e9)
    assert allreduce_time_s(1, 1e9, path, eff) == 0.0
    assert allreduce_time_s(8, 1e9, path, eff) == pytest.approx(2 * 7 / 8 * 1e9 / (100e9 * eff.link_efficiency))


def test_a_small_all_reduce_costs_its_fixed_latency_and_large_ones_their_bytes() -> None:
    eff = costmodel.DEFAULT_EFFICIENCY
    nvlink = Path(300e9)
    fixed = eff.allreduce_latency_s + 2 * 7 * eff.link_latency_s  # the call, and 14 hops of an 8-GPU ring
    tiny = allreduce_time_s(8, 16e3, nvlink, eff)
    assert tiny == pytest.approx(fixed, rel=0.05)  # a decode step's message: latency-bound
    big = allreduce_time_s(8, 1e9, nvlink, eff)
    assert big - fixed == pytest.approx(2 * 7 / 8 * 1e9 / (300e9 * eff.link_efficiency))
    assert allreduce_time_s(2, 16e3, nvlink, eff) < tiny  # fewer hops


def test_an_all_reduce_over_a_network_pays_the_probed_latency_per_hop_and_shares_bytes_over_cards() -> None:
    eff = costmodel.DEFAULT_EFFICIENCY
    net = Path(25e9, latency_s=10e-6, measured=True)
    fixed = eff.allreduce_latency_s + 2 * 15 * (eff.link_latency_s + 10e-6)
    one = allreduce_time_s(16, 64e6, net, eff)
    assert one == pytest.approx(fixed + 2 * 15 / 16 * 64e6 / (25e9 * eff.link_efficiency))
    eight = allreduce_time_s(16, 64e6, net, eff, lanes=8)
    assert eight - fixed == pytest.approx((one - fixed) / 8)


# --- iterations ------------------------------------------------------------------------------------
batches = st.builds(
    Batch,
    prefill_tokens=st.integers(0, 8192),
    prefill_seqs=st.integers(1, 16),
    prefill_context_tokens=st.integers(0, 8192),
    decode_seqs=st.integers(0, 512),
    decode_context_tokens=st.integers(0, 1_000_000),
)


@settings(max_examples=60, deadline=None)
@given(batches, st.sampled_from(["prefill_tokens", "decode_seqs", "decode_context_tokens", "prefill_context_tokens"]),
       st.integers(1, 4096))
def test_iteration_time_never_drops_when_a_batch_grows(b: Batch, field: str, more: int) -> None:
    pipe = one_stage(tp=2)
    bigger = replace(b, **{field: getattr(b, field) + more})
    assert pipe.iteration(bigger).latency_s >= pipe.iteration(b).latency_s


@settings(max_examples=40, deadline=None)
@given(batches, st.floats(1.05, 4.0), st.sampled_from(["hbm_bytes_per_s", "bf16_flops", "link"]))
def test_iteration_time_never_rises_with_more_bandwidth_or_compute(b: Batch, factor: float, what: str) -> None:
    if what == "link":
        slow, fast = one_stage(tp=4, link_bytes_per_s=100e9), one_stage(tp=4, link_bytes_per_s=100e9 * factor)
    else:
        better = replace(H100, **{what: getattr(H100, what) * factor})
        slow, fast = one_stage(H100, tp=4), one_stage(better, tp=4)
    assert fast.iteration(b).latency_s <= slow.iteration(b).latency_s


def test_decode_is_memory_bound_and_prefill_compute_bound() -> None:
    pipe = one_stage()
    decode = pipe.iteration(Batch(decode_seqs=1, decode_context_tokens=512))
    prefill = pipe.iteration(Batch(prefill_tokens=8192, prefill_seqs=1))
    eff = costmodel.DEFAULT_EFFICIENCY
    weights_s = M8.weight_bytes / (eff.mbu * H100.hbm_bytes_per_s)
    assert decode.latency_s == pytest.approx(weights_s, rel=0.2)
    assert prefill.gemm_s == pytest.approx(8192 * M8.linear_flops_per_token / (eff.mfu * H100.bf16_flops), rel=0.1)


@pytest.mark.parametrize(("gpu", "ms"), [("H100-SXM", 6.5), ("A100-40G", 13.0)])
def test_single_stream_decode_matches_the_vllm_anchors_within_10_percent(gpu: str, ms: float) -> None:
    snap = make_fleet([NodeSpec("n", gpu, 1)])
    step = decode_step_s(tp_plan(M8, ["n-g0"]), M8, snap, 1, 512)
    assert step * 1e3 == pytest.approx(ms, rel=0.10)


def test_tp_adds_all_reduces_and_pp_splits_latency_from_interval() -> None:
    snap = fleet()
    tp1 = PlanProfile.build(tp_plan(M8, ["a1-g0"]), M8, snap).pipeline("decode")
    tp4 = PlanProfile.build(tp_plan(M8, [f"a1-g{i}" for i in range(4)]), M8, snap).pipeline("decode")
    b = Batch(decode_seqs=32, decode_context_tokens=32 * 1000)
    assert tp1.iteration(b).allreduce_s == 0 and tp4.iteration(b).allreduce_s > 0
    pp = Plan(M70.name, "colocated", (Stage(0, 40, tuple(f"a1-g{i}" for i in range(8))),
                                      Stage(40, 80, tuple(f"a2-g{i}" for i in range(8)))), kv_reserve_tokens=1000)
    cost = PlanProfile.build(pp, M70, snap).pipeline("prefill").iteration(b)
    assert len(cost.handoff_s) == 1 and cost.handoff_s[0] > 0
    assert cost.latency_s == pytest.approx(sum(cost.stage_s) + sum(cost.handoff_s))
    assert cost.interval_s < cost.latency_s


def test_a_disaggregated_plan_hands_kv_over_and_its_prompt_pays_for_it() -> None:
    snap = fleet()
    pd = Plan(M8.name, "disaggregated", (Stage(0, 32, ("a1-g0",)),), (Stage(0, 32, ("a2-g0",)),), kv_reserve_tokens=1000)
    profile = PlanProfile.build(pd, M8, snap)
    assert profile.pipeline("prefill") is not profile.pipeline("decode")
    assert 0 < profile.kv_handoff_s(100) < profile.kv_handoff_s(4000)
    assert prefill_time_s(pd, M8, snap, 4000) > profile.pipeline("prefill").prefill_time_s(4000)


def test_the_convenience_functions_agree_with_the_profile() -> None:
    snap = fleet()
    plan = tp_plan(M8, ["a1-g0", "a1-g1"])
    direct = iteration_time_s(plan, M8, snap, prefill_tokens=512, decode_seqs=8, decode_context_tokens=8000)
    via = PlanProfile.build(plan, M8, snap).pipeline("prefill").iteration(
        Batch(prefill_tokens=512, prefill_seqs=1, decode_seqs=8, decode_context_tokens=8000))
    assert direct == via.latency_s


def test_it_rejects_a_negative_batch() -> None:
    with pytest.raises(ValueError, match="decode_seqs: must be >= 0"):
        Batch(decode_seqs=-1)


# --- steady state -----------------------------------------------------------------------------------
def test_an_overloaded_plan_reports_infinite_latency_and_serialises_it_as_null() -> None:
    profile = PlanProfile.build(tp_plan(M8, ["a1-g0"], 100_000), M8, fleet())
    est = estimate_plan(profile, chat_workload(rate_rps=1000.0), CHAT_SLO)
    assert est.overloaded and est.served_rps == est.capacity_rps
    assert math.isinf(est.ttft_p99_s)
    d = json.loads(json.dumps(est.to_dict()))
    assert d["ttft_p99_s"] is None
    assert Estimate.from_dict(d) == est


@settings(max_examples=30, deadline=None)
@given(st.floats(0.01, 50.0), st.floats(1.1, 3.0))
def test_more_load_never_lowers_latency_and_p99_is_at_least_p50(rate: float, more: float) -> None:
    profile = PlanProfile.build(tp_plan(M8, ["a1-g0", "a1-g1"], 100_000), M8, fleet())
    low = estimate_plan(profile, chat_workload(rate), CHAT_SLO)
    high = estimate_plan(profile, chat_workload(rate * more), CHAT_SLO)
    for e in (low, high):
        assert e.ttft_p99_s >= e.ttft_p50_s and e.tpot_p99_s >= e.tpot_p50_s
        assert e.goodput_tokens_s <= e.throughput_tokens_s + 1e-9
    assert high.ttft_p99_s >= low.ttft_p99_s and high.tpot_p50_s >= low.tpot_p50_s


@settings(max_examples=30, deadline=None)
@given(st.floats(1.05, 3.0))
def test_capacity_never_drops_with_more_hbm_bandwidth(factor: float) -> None:
    plan = tp_plan(M8, ["a1-g0"], 100_000)
    slow = PlanProfile(plan, M8, {"prefill": one_stage(), "decode": one_stage()}, None, costmodel.DEFAULT_EFFICIENCY)
    fast_pipe = one_stage(replace(H100, hbm_bytes_per_s=H100.hbm_bytes_per_s * factor))
    fast = PlanProfile(plan, M8, {"prefill": fast_pipe, "decode": fast_pipe}, None, costmodel.DEFAULT_EFFICIENCY)
    assert estimate_plan(fast, chat_workload(1.0)).capacity_rps >= estimate_plan(slow, chat_workload(1.0)).capacity_rps


def test_a_round_that_carries_a_thin_slice_of_prompt_costs_a_decode_step_plus_its_share_of_a_chunk() -> None:
    # long prompts, short answers: ~12 prompt tokens per decoding sequence per round. The engine
    # puts them in whole chunks (a few rounds pay a chunk's compute, the rest are decode steps);
    # the mean round is that mixture, not one round with a thin slice whose compute would hide
    # under the weight reads.
    plan = tp_plan(M8, ["a1-g0"], 200_000)
    profile = PlanProfile.build(plan, M8, fleet())
    rag = Workload(rate_rps=1.0, prompt_tokens_mean=6000, output_tokens_mean=500, prompt_tokens_cv=0.3,
                   output_tokens_cv=0.3)
    state = costmodel.steady_state(profile, rag)
    pipe = profile.pipeline("decode")
    seqs = 16
    context = int(state.context * seqs)
    slice_tokens = round(seqs * state.prompt / state.output)
    thin = pipe.iteration(Batch(prefill_tokens=slice_tokens, prefill_seqs=1, decode_seqs=seqs,
                                decode_context_tokens=context)).latency_s
    plain = pipe.iteration(Batch(decode_seqs=seqs, decode_context_tokens=context)).latency_s
    chunk = costmodel.MAX_BATCHED_TOKENS - seqs
    cached = int(chunk * (math.ceil(state.prompt / chunk) - 1) / 2)  # a chunk's mean prefix
    mixed = pipe.iteration(Batch(prefill_tokens=chunk, prefill_seqs=1, prefill_context_tokens=cached,
                                 decode_seqs=seqs, decode_context_tokens=context)).latency_s
    expected = plain + slice_tokens / chunk * (mixed - plain)
    assert state.round_s(seqs) == pytest.approx(expected, rel=0.02)
    assert state.round_s(seqs) > 1.1 * thin


def test_chunk_rounds_and_the_load_a_request_lives_with_spread_tpot_p99() -> None:
    profile = PlanProfile.build(tp_plan(M8, ["a1-g0"], 200_000), M8, fleet())
    rag = Workload(rate_rps=2.0, prompt_tokens_mean=6000, output_tokens_mean=500, prompt_tokens_cv=0.3,
                   output_tokens_cv=0.3)
    est = estimate_plan(profile, rag)
    # a request shares its ~7 s with a Poisson number of others: P99 sits a few ms above P50
    assert est.tpot_p99_s > est.tpot_p50_s * 1.15


def test_a_small_kv_reserve_limits_capacity_and_says_so() -> None:
    snap = fleet()
    small = estimate_plan(PlanProfile.build(tp_plan(M8, ["a1-g0"], 4000), M8, snap), chat_workload(1.0))
    large = estimate_plan(PlanProfile.build(tp_plan(M8, ["a1-g0"], 200_000), M8, snap), chat_workload(1.0))
    assert small.limit == "kv" and small.capacity_rps < large.capacity_rps


def test_a_tight_slo_lowers_goodput_not_throughput() -> None:
    profile = PlanProfile.build(tp_plan(M70, [f"a1-g{i}" for i in range(4)], 20_000), M70, fleet())
    loose = estimate_plan(profile, chat_workload(2.0), Slo(10_000, 1000))
    tight = estimate_plan(profile, chat_workload(2.0), Slo(5, 1))
    assert loose.throughput_tokens_s == tight.throughput_tokens_s
    assert tight.goodput_tokens_s < loose.goodput_tokens_s


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"rate_rps": -1.0}, "rate_rps"), ({"prompt_tokens_mean": 0.5}, "prompt_tokens_mean"),
     ({"output_tokens_cv": -0.1}, "output_tokens_cv")],
)
def test_a_bad_workload_names_the_field(kwargs: dict[str, float], message: str) -> None:
    base = {"rate_rps": 1.0, "prompt_tokens_mean": 100.0, "output_tokens_mean": 100.0}
    with pytest.raises(ValueError, match=message):
        Workload(**{**base, **kwargs})


def test_efficiency_factors_must_be_physical() -> None:
    with pytest.raises(ValueError, match="mfu"):
        Efficiency(mfu=1.5)


# --- switching ---------------------------------------------------------------------------------------
def test_kv_stays_in_place_when_a_stage_keeps_its_gpus_and_layers() -> None:
    snap = fleet()
    stages = (Stage(0, 32, ("a1-g0", "a1-g1")),)
    route = kv_route(stages, stages, M8, snap)
    assert route.bytes_per_token == 0 and route.time_s(10_000) == 0


def test_each_sequence_takes_the_cheaper_of_migration_and_replay() -> None:
    snap = make_fleet([NodeSpec("a1"), NodeSpec("a2")], intra_rack_gbps=1.0)  # a very slow node link
    src, dst_far, dst_near = (Stage(0, 32, ("a1-g0",)),), (Stage(0, 32, ("a2-g0",)),), (Stage(0, 32, ("a1-g1",)),)
    target = PlanProfile.build(tp_plan(M8, ["a2-g0"]), M8, snap).pipeline("prefill")
    far = migrate_or_replay(4000, kv_route(src, dst_far, M8, snap), target)
    near = migrate_or_replay(4000, kv_route(src, dst_near, M8, snap), target)
    assert far.choice == "replay" and far.replay_s < far.migrate_s
    assert near.choice == "migrate" and near.migrate_s < near.replay_s
    assert near.migrate_bytes == 4000 * M8.kv_bytes_per_token


def test_sequences_on_lost_gpus_can_only_replay() -> None:
    snap = fleet()
    route = kv_route((Stage(0, 32, ("gone-0",)),), (Stage(0, 32, ("a1-g0",)),), M8, snap)
    target = PlanProfile.build(tp_plan(M8, ["a1-g0"]), M8, snap).pipeline("prefill")
    assert migrate_or_replay(1000, route, target).choice == "replay"


def test_staying_on_the_same_gear_costs_nothing() -> None:
    snap = fleet()
    gear = one_plan_gear(tp_plan(M8, ["a1-g0"], 100_000))
    cost = switch_cost(gear, gear, M8, snap, chat_workload(5.0))
    assert cost.tokens == 0 and cost.weight_load_bytes == 0 and cost.weight_source == "none"


def test_a_new_plan_loads_its_weights_and_disk_is_slower_than_host_memory() -> None:
    snap = fleet()
    old = one_plan_gear(tp_plan(M8, ["a1-g0"], 100_000))
    new = one_plan_gear(tp_plan(M8, ["a2-g0", "a2-g1"], 100_000))
    est = estimate_plan(PlanProfile.build(old.plans[0], M8, snap), chat_workload(5.0), CHAT_SLO)
    host = switch_cost(old, new, M8, snap, chat_workload(5.0), current_estimate=est)
    disk = switch_cost(old, new, M8, snap, chat_workload(5.0), current_estimate=est, weights_in_host_memory=False)
    assert host.weight_load_bytes == pytest.approx(M8.weight_bytes, rel=0.01)
    assert disk.weight_load_s > host.weight_load_s > 0
    assert host.time_to_effect_s >= host.weight_load_s
    assert host.migrate_seqs + host.replay_seqs > 0  # the running sequences move
    assert host.tokens > 0 and host.lost_cold_start_tokens > 0


def test_reusing_a_plan_in_a_bigger_gear_charges_only_the_new_plan() -> None:
    snap = fleet()
    a = tp_plan(M8, ["a1-g0"], 100_000)
    b = tp_plan(M8, ["a2-g0"], 100_000)
    cost = switch_cost(one_plan_gear(a), Gear(M8.name, (a, b), (0.5, 0.5)), M8, snap, chat_workload(5.0))
    assert cost.weight_load_bytes == pytest.approx(M8.weight_bytes, rel=0.01)
    assert cost.migrate_seqs == cost.replay_seqs == 0  # nothing goes away


def test_a_switch_cost_round_trips_through_json() -> None:
    snap = fleet()
    cost = switch_cost(None, one_plan_gear(tp_plan(M8, ["a1-g0"], 100_000)), M8, snap, chat_workload(5.0))
    assert SwitchCost.from_dict(json.loads(json.dumps(cost.to_dict()))) == cost


def test_the_switch_cost_is_the_same_whether_profiles_are_handed_over_or_built() -> None:
    snap = fleet()
    current = one_plan_gear(tp_plan(M8, ["a1-g0"], 50_000))
    target = Gear(M8.name, (tp_plan(M8, ["a2-g0", "a2-g1"], 50_000), tp_plan(M8, ["a1-g2", "a1-g3"], 50_000)),
                  (0.5, 0.5))
    workload = chat_workload(20.0)
    est = estimate_plan(PlanProfile.build(current.plans[0], M8, snap), workload)
    built = switch_cost(current, target, M8, snap, workload, current_estimate=est)
    given_profiles = {p: PlanProfile.build(p, M8, snap) for p in target.plans}
    handed = switch_cost(current, target, M8, snap, workload, current_estimate=est, profiles=given_profiles)
    assert built == handed and built.migrate_seqs + built.replay_seqs > 0


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(0.0, 80.0), min_size=1, max_size=6))
def test_a_steady_state_answers_the_same_whatever_it_was_asked_before(rates: list[float]) -> None:
    # round times are computed when first needed: the order of questions changes nothing
    profile = PlanProfile.build(tp_plan(M8, ["a1-g0", "a1-g1"], 60_000), M8, fleet())
    shape = chat_workload(1.0)
    costmodel.clear_caches()
    fresh = [costmodel.SteadyState(profile, shape, CHAT_SLO).estimate(r) for r in rates]
    reused = costmodel.SteadyState(profile, shape, CHAT_SLO)
    for r in reversed(rates):
        reused.estimate(r)
    assert [reused.estimate(r) for r in rates] == fresh
