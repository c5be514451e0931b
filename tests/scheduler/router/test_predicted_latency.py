"""predicted_latency: queue + prefill + decode on each plan's own hardware, from its load."""

from __future__ import annotations

import pytest

from scheduler.router import PlanLoad, Pool
from scheduler.router.predicted_latency import predict, score
from tests.scheduler.router.builders import facts, gpu_of, idle, mixed_pool, mixed_snapshot, req, router


def test_on_an_idle_pool_the_h100_is_fastest_and_the_l40s_slowest() -> None:
    pool = idle(mixed_pool())
    ttft, tpot = predict(req(8000), pool, None)
    order = [gpu_of(pool, int(i)) for i in ttft.argsort()]
    assert order == ["H100-SXM", "A100-80G", "L40S"]
    assert gpu_of(pool, int(tpot.argmin())) == "H100-SXM"
    h100 = pool.facts[0].steps
    assert ttft[0] == pytest.approx(h100.prefill_s(8000))


def test_the_prefill_fit_follows_the_cost_model_within_five_percent_from_1k_tokens() -> None:
    from scheduler.costmodel import PlanProfile
    from tests.scheduler.router.builders import MODEL, tp4

    snap = mixed_snapshot()
    for node in ("h100", "l40s"):
        plan = tp4(node, snap)
        exact = PlanProfile.build(plan, MODEL, snap).pipeline("prefill")
        fit = facts(node, snap).steps
        for n in (1000, 5000, 20000, 60000):
            assert fit.prefill_s(n) == pytest.approx(exact.prefill_time_s(n), rel=0.05)


def test_a_queue_on_the_h100_plan_sends_the_next_prompt_to_the_a100() -> None:
    snap = mixed_snapshot()
    pool = Pool([facts("h100", snap), facts("a100", snap)], model="Qwen2-72B")
    pool.set_loads([PlanLoad(running=4, waiting=6, queued_tokens=200_000), PlanLoad()])
    d = router().route(req(8000), pool, 0.0)
    assert d.chosen == 1
    assert d.ttft_s is not None and d.ttft_s[0] > d.ttft_s[1]


def test_a_normal_request_overtakes_queued_low_priority_work_and_a_low_priority_one_does_not() -> None:
    pool = idle(mixed_pool(("h100",)))
    pool.set_loads([PlanLoad(waiting=5, queued_tokens=50_000, queued_low_tokens=50_000)])
    normal, _ = predict(req(1000), pool, None)
    low, _ = predict(req(1000, priority=1), pool, None)
    assert low[0] > 10 * normal[0]


def test_prefill_chunks_queued_on_a_plan_slow_the_tokens_of_a_short_answer() -> None:
    pool = idle(mixed_pool(("h100",)))
    _, alone = predict(req(1000, 16), pool, None)
    pool.set_loads([PlanLoad(waiting=3, queued_tokens=30_000)])
    _, shared = predict(req(1000, 16), pool, None)
    _, long_answer = predict(req(1000, 4000), pool, None)
    assert shared[0] > 3 * alone[0]
    assert alone[0] < long_answer[0] < shared[0]


def test_a_deadline_is_the_ttft_yardstick_and_plans_that_miss_it_rank_last() -> None:
    pool = idle(mixed_pool())
    ttft, tpot = predict(req(30_000), pool, None)
    deadline = float(sorted(ttft)[1]) * 1.01  # the H100 and the A100 meet it, the L40S does not
    _, ok = score(req(30_000, deadline_s=deadline), pool, ttft, tpot, pool.base_ok)
    assert ok is not None and [gpu_of(pool, i) for i in range(3) if ok[i]] == ["H100-SXM", "A100-80G"]
    d = router().route(req(30_000, deadline_s=deadline), pool, 0.0)
    assert gpu_of(pool, d.order[-1]) == "L40S"


def test_a_long_prompt_avoids_the_plan_whose_many_decodes_its_prefill_would_stall() -> None:
    from scheduler.router.predicted_latency import prefill_s, stall_s

    snap = mixed_snapshot()
    pool = Pool([facts("h100", snap), facts("h100", snap, kv_tokens=400_000)], model="Qwen2-72B")
    # plan 0 decodes 100 short answers and has no queue; plan 1 decodes nothing but has a queue
    pool.set_loads([PlanLoad(running=100), PlanLoad(waiting=1, queued_tokens=2000)])
    r = req(8000, 16)
    ttft, _ = predict(r, pool, None)
    assert ttft[0] < ttft[1]  # alone, the request's own first token would come sooner on plan 0
    stall = stall_s(r, prefill_s(r, pool, None), pool)
    assert stall[1] == 0.0 and stall[0] > 0.0
    assert router().route(r, pool, 0.0).chosen == 1
