"""memory_bound: weights + KV x (prompt + max_tokens) + activations <= 92% of each GPU, and the KV
reserve - never fits (filtered) apart from does not fit now (skipped while another plan has room)."""

from __future__ import annotations

from scheduler.plan import stage_bytes_per_gpu
from scheduler.router import PlanLoad, Pool, plan_facts
from scheduler.router.memory_bound import memory_bound
from tests.scheduler.router.builders import (
    MODEL,
    facts,
    gpu_of,
    idle,
    mixed_pool,
    mixed_snapshot,
    req,
    router,
    tp4,
)


def test_a_prompt_larger_than_the_l40s_plans_kv_is_filtered_from_it_with_the_reason() -> None:
    pool = idle(mixed_pool())
    l40s = next(i for i in range(pool.n) if gpu_of(pool, i) == "L40S")
    cap = pool.facts[l40s].kv_capacity_tokens
    ever, now = memory_bound(req(cap, 100), pool)
    assert not ever[l40s] and not now[l40s] and ever.sum() == 2
    d = router().route(req(cap, 100), pool, 0.0)
    assert l40s not in d.order and d.chosen is not None
    assert d.reason(l40s) == (f"memory_bound: needs {cap + 100} KV tokens (prompt + max_tokens); "
                              f"its KV reserve holds {cap}")
    assert "filtered" in d.explain()["plans"][l40s]


def test_a_plan_past_its_bound_by_what_its_engine_reported_is_skipped_while_another_has_room() -> None:
    snap = mixed_snapshot()
    pool = Pool([facts("h100", snap), facts("a100", snap)], model="Qwen2-72B")
    full = pool.facts[0].kv_capacity_tokens - 500  # the H100 plan's engine: almost all its KV in use
    pool.set_loads([PlanLoad(kv_used_tokens=full), PlanLoad()])
    d = router().route(req(1000, 100), pool, 0.0)
    assert d.order == (1,)
    assert d.reason(0).startswith(f"memory_bound: {full} of its ")
    assert "1100 more do not fit now" in d.reason(0)


def test_when_every_plan_is_full_now_the_request_queues_at_the_best_instead_of_failing() -> None:
    snap = mixed_snapshot()
    pool = Pool([facts("h100", snap), facts("a100", snap)], model="Qwen2-72B")
    pool.set_loads([PlanLoad(kv_used_tokens=f.kv_capacity_tokens) for f in pool.facts])
    d = router().route(req(1000, 100), pool, 0.0)
    assert d.relaxed and sorted(d.order) == [0, 1]
    assert gpu_of(pool, d.order[0]) == "H100-SXM"


def test_what_others_hold_on_a_gpu_tightens_the_bound_below_the_kv_reserve() -> None:
    # the snapshot counts the plan's own weights and KV reserve on its GPUs; 6 GB more on each
    # L40S is another tenant's, which leaves the plan less KV than it reserved
    before = mixed_snapshot()
    plan = tp4("l40s", before)
    own = stage_bytes_per_gpu(plan.stages[0], MODEL, plan.kv_reserve_tokens)
    after = mixed_snapshot(used_bytes={"l40s": own + 6 * 10**9})
    pool = Pool([plan_facts(plan, MODEL, after)], model="Qwen2-72B")
    reserve = plan.kv_reserve_tokens
    assert memory_bound(req(reserve // 10, 1), pool)[0][0]
    ever, _ = memory_bound(req(reserve // 2, 1), pool)
    assert not ever[0]
    assert "GPU l40s-g0: KV and activations would need" in router().route(req(reserve // 2, 1), pool, 0.0).reason(0)
