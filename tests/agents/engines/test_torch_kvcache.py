"""The paged KV cache: block allocation, freeing, running out, and the tensor storage."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agents.engines.torch.kvcache import BlockAllocator, KVCacheFullError, PagedKVCache

pytestmark = pytest.mark.timeout(60)


def test_a_sequence_gets_a_new_block_only_when_it_crosses_a_block_boundary() -> None:
    alloc = BlockAllocator(num_blocks=8, block_size=4)
    assert alloc.ensure("a", 1) == (0,)
    assert alloc.ensure("a", 4) == (0,)
    assert alloc.ensure("a", 5) == (0, 1)
    assert alloc.ensure("b", 9) == (2, 3, 4)
    assert alloc.num_free_blocks == 3
    assert alloc.capacity_tokens == 32


def test_freeing_returns_the_blocks_and_is_idempotent() -> None:
    alloc = BlockAllocator(num_blocks=4, block_size=2)
    alloc.ensure("a", 3)
    alloc.ensure("b", 2)
    assert alloc.free("a") == 2
    assert alloc.free("a") == 0
    assert alloc.num_free_blocks == 3
    assert not alloc.has("a")
    # the freed ids are handed out again
    assert set(alloc.ensure("c", 6)) == {0, 1, 3}


def test_running_out_raises_a_capacity_error_and_changes_nothing() -> None:
    alloc = BlockAllocator(num_blocks=3, block_size=4)
    alloc.ensure("a", 8)
    before = alloc.block_table("a")
    with pytest.raises(KVCacheFullError, match="needs 2 more block") as info:
        alloc.ensure("a", 13)
    assert info.value.free_blocks == 1
    assert alloc.block_table("a") == before
    assert alloc.num_free_blocks == 1
    assert not alloc.can_ensure("b", 5)
    with pytest.raises(KVCacheFullError):
        alloc.ensure("b", 5)
    assert not alloc.has("b")


def test_unknown_sequences_and_bad_sizes_are_named() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(0, 4)
    with pytest.raises(ValueError, match="block_size"):
        BlockAllocator(4, 0)
    with pytest.raises(KeyError, match="seq_id"):
        BlockAllocator(4, 4).block_table("nope")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcd"), st.integers(0, 40), st.booleans()), max_size=40))
def test_every_block_is_free_or_owned_by_exactly_one_sequence(ops: list[tuple[str, int, bool]]) -> None:
    alloc = BlockAllocator(num_blocks=10, block_size=4)
    lengths: dict[str, int] = {}
    for seq, n, free in ops:
        if free:
            alloc.free(seq)
            lengths.pop(seq, None)
            continue
        want = max(n, lengths.get(seq, 0))
        try:
            alloc.ensure(seq, want)
            lengths[seq] = want
        except KVCacheFullError:
            pass
        owned = [b for s in lengths for b in alloc.block_table(s)]
        assert len(owned) == len(set(owned))
        assert len(owned) + alloc.num_free_blocks == alloc.num_blocks
        for s, length in lengths.items():
            assert len(alloc.block_table(s)) == alloc.blocks_for(length)


def test_the_cache_reads_back_what_was_written_through_a_scattered_block_table() -> None:
    cache = PagedKVCache(num_layers=2, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=8)
    table = torch.tensor([4, 1, 5])
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(2, 10, 2, 8, generator=gen)
    v = torch.randn(2, 10, 2, 8, generator=gen)
    cache.write_sequence(table, k, v)
    k2, v2 = cache.read_sequence(table, 10)
    assert torch.equal(k2, k) and torch.equal(v2, v)
    layer_k, layer_v = cache.gather(1, table, 7)
    assert torch.equal(layer_k, k[1, :7]) and torch.equal(layer_v, v[1, :7])
    # position 5 is block table[1] = 1, offset 1
    assert torch.equal(cache.k[0, 1, 1], k[0, 5])
    # other blocks untouched
    assert cache.k[:, [0, 2, 3]].abs().sum() == 0
    assert cache.nbytes == 2 * 2 * 6 * 4 * 2 * 8 * 4
