"""prefix_affinity: the index of what each plan recently served (GPU and host tiers, LRU, head
kept longest) and the score it gives; chained block hashes."""

from __future__ import annotations

import pytest

from scheduler.router import Pool, block_hashes
from scheduler.router.prefix_affinity import PrefixIndex, score
from tests.scheduler.router.builders import MODEL, copies, facts, idle, mixed_snapshot, req, router


def pool_of(n: int) -> Pool:
    return idle(Pool(copies(facts("h100"), n), model="Qwen2-72B"))


def test_block_hashes_are_chained_full_blocks_equal_exactly_for_equal_prefixes() -> None:
    a = block_hashes(list(range(1200)), 512)
    b = block_hashes(list(range(1024)) + [7] * 176, 512)
    c = block_hashes([9] + list(range(1, 1200)), 512)
    assert len(a) == 2 and a == b  # the partial third block is not hashed
    assert c[0] != a[0] and c[1] != a[1]  # a different first token changes every later block
    assert block_hashes(list(range(100)), 512) == ()
    with pytest.raises(ValueError, match="block_tokens"):
        block_hashes([1], 0)


def test_the_longest_held_run_from_the_first_block_is_the_match_per_plan() -> None:
    pool = pool_of(3)
    idx = PrefixIndex(512)
    idx.record(pool.ids[0], (1, 2, 3, 4), gpu_blocks=100)
    idx.record(pool.ids[1], (1, 2, 9), gpu_blocks=100)
    got = idx.match((1, 2, 3, 4, 5), pool)
    assert got is not None
    gpu, total = got
    assert gpu.tolist() == [4, 2, 0] and total is gpu
    assert idx.match((7, 1, 2), pool) is None  # nobody holds the first block: no hit anywhere


def test_a_full_gpu_tier_evicts_the_tail_first_and_keeps_the_shared_head() -> None:
    pool = pool_of(1)
    idx = PrefixIndex(512)
    pid = pool.ids[0]
    idx.record(pid, (1, 2, 3, 4), gpu_blocks=4)
    idx.record(pid, (1, 2, 8, 9), gpu_blocks=4)  # the same head, a new tail: the old tail goes
    got = idx.match((1, 2, 3, 4), pool)
    assert got is not None and got[0].tolist() == [2]
    assert idx.size(pid) == 4


def test_evicted_blocks_stay_on_the_host_tier_and_count_less() -> None:
    pool = pool_of(1)
    idx = PrefixIndex(512)
    pid = pool.ids[0]
    idx.record(pid, (1, 2, 3, 4), gpu_blocks=4, host_blocks=8)
    idx.record(pid, (5, 6, 7, 8), gpu_blocks=4, host_blocks=8)  # (1..4) moved to the host tier
    got = idx.match((1, 2, 3, 4), pool)
    assert got is not None
    gpu, total = got
    assert gpu.tolist() == [0] and total.tolist() == [4]
    assert idx.hits((1, 2, 3, 4), pool) == [(0, 0, 4)]  # (slot, GPU-tier blocks, GPU + host blocks)
    s, cached, at = score(req(4 * 512 + 100), idx.hits((1, 2, 3, 4), pool), 1, block_tokens=512,
                          host_tier_weight=0.5)
    assert s is not None and cached is not None
    assert cached.tolist() == [0.5 * 4 * 512] and at == [(0, cached[0], s[0])]
    assert s[0] == pytest.approx(100 * 1024 / 2148)
    idx.record(pid, (1, 2), gpu_blocks=4, host_blocks=8)  # back on the GPU: off the host tier
    got = idx.match((1, 2, 3), pool)
    assert got is not None and got[0].tolist() == [2] and got[1].tolist() == [3]


def test_a_hit_never_covers_the_last_prompt_token() -> None:
    pool = pool_of(1)
    idx = PrefixIndex(512)
    idx.record(pool.ids[0], (1, 2), gpu_blocks=10)
    s, cached, _ = score(req(1024), idx.hits((1, 2), pool), 1, block_tokens=512, host_tier_weight=0.5)
    assert cached is not None and cached.tolist() == [1023]


def test_a_forgotten_plan_holds_nothing_and_its_bit_is_reused() -> None:
    pool = pool_of(2)
    idx = PrefixIndex(512)
    idx.record(pool.ids[0], (1, 2), gpu_blocks=10)
    idx.forget(pool.ids[0])
    assert idx.match((1, 2), pool) is None and idx.size(pool.ids[0]) == 0
    idx.record(pool.ids[1], (1,), gpu_blocks=10)
    got = idx.match((1, 2), pool)
    assert got is not None and got[0].tolist() == [0, 1]


def test_matching_sixty_four_plans_finds_each_ones_run_across_the_walks_strides() -> None:
    pool = pool_of(64)
    idx = PrefixIndex(512)
    runs = [(i * 37) % 101 + 1 for i in range(64)]  # 1..101 blocks: ends inside, at and past a stride
    for pid, run in zip(pool.ids, runs, strict=True):
        idx.record(pid, tuple(range(run)), gpu_blocks=200)
    got = idx.match(tuple(range(120)), pool)
    assert got is not None and got[0].tolist() == runs
    short = idx.match(tuple(range(5)), pool)
    assert short is not None and short[0].tolist() == [min(r, 5) for r in runs]


def test_the_router_sends_a_conversations_next_turn_where_its_prefix_is() -> None:
    snap = mixed_snapshot()
    pool = idle(Pool(copies(facts("h100", snap), 4), model="Qwen2-72B"))
    r = router(3)
    turn1 = req(8000, 50, blocks=tuple(range(15)))
    first = r.route(turn1, pool, 0.0)
    assert first.chosen is not None
    r.admitted(first, first.chosen)
    turn2 = req(9000, 50, blocks=tuple(range(17)))
    second = r.route(turn2, pool, 1.0)
    assert second.chosen == first.chosen
    assert second.scores["prefix_affinity"][first.chosen] == pytest.approx(100 * 15 * 512 / 9000)
    assert second.ttft_s is not None and second.ttft_s[first.chosen] < second.ttft_s.max() / 3


RESTORE_S_PER_TOKEN = MODEL.kv_bytes_per_token / (4 * 64e9)  # Qwen2-72B's KV over four Gen5 x16 links


def priced_pool(n: int, restore_s_per_token: float = RESTORE_S_PER_TOKEN) -> Pool:
    f = facts("h100", host_kv_tokens=100 * 512, host_restore_s_per_token=restore_s_per_token)
    return idle(Pool(copies(f, n), model="Qwen2-72B"))


def test_a_priced_host_hit_counts_the_prefill_it_saves_less_the_copy() -> None:
    pool = priced_pool(1)
    idx = PrefixIndex(512)
    pid = pool.ids[0]
    idx.record(pid, (1, 2, 3, 4), gpu_blocks=4, host_blocks=8)
    idx.record(pid, (1, 5, 6, 7), gpu_blocks=4, host_blocks=8)  # (2, 3, 4) to the host tier
    hits = idx.hits((1, 2, 3, 4), pool)
    assert hits == [(0, 1, 4)]
    _, cached, _ = score(req(4 * 512 + 100), hits, 1, block_tokens=512, host_tier_weight=0.5, pool=pool)
    assert cached is not None
    b, c_half = pool.pre_b_list[0], pool.pre_c_half_list[0]
    g, t = 512.0, 2048.0
    saved = (b + c_half * t) * t - (b + c_half * g) * g
    weight = 1 - RESTORE_S_PER_TOKEN * (t - g) / saved
    assert 0.9 < weight < 1.0  # a PCIe copy is far cheaper than an H100 group's prefill, not free
    assert cached[0] == pytest.approx(g + weight * (t - g))
    # a copy dearer than the prefill it replaces is worth nothing
    dear = priced_pool(1, restore_s_per_token=1.0)
    _, cached, _ = score(req(4 * 512 + 100), idx.hits((1, 2, 3, 4), dear), 1, block_tokens=512,
                         host_tier_weight=0.5, pool=dear)
    assert cached is not None and cached[0] == pytest.approx(g)


def test_the_router_prefers_a_host_tier_hit_over_a_miss_and_a_gpu_hit_over_both() -> None:
    pool = priced_pool(3)
    r = router()
    blocks = tuple(range(10, 26))  # sixteen blocks
    r.index.record(pool.ids[0], blocks, gpu_blocks=16, host_blocks=100)
    r.index.record(pool.ids[0], tuple(range(100, 116)), gpu_blocks=16, host_blocks=100)  # -> its host tier
    ask = req(16 * 512 + 100, 50, blocks=blocks)
    d = r.route(ask, pool, 0.0)
    assert d.chosen == 0  # its host copy beats recomputing on an idle twin
    assert d.cached_tokens is not None and 0 < d.cached_tokens[0] < 16 * 512
    r.index.record(pool.ids[2], blocks, gpu_blocks=16, host_blocks=100)
    d = r.route(ask, pool, 0.0)
    assert d.chosen == 2  # on the GPU already: no copy at all
