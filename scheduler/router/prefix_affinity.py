"""Prefix affinity: how much of the request's prompt each plan probably still holds as KV.

The router cannot read an engine's cache, so it keeps its own picture of it, as SGLang's router
keeps an approximate tree per worker: `PrefixIndex` remembers the prompt blocks (request.py's
chained hashes) it sent to each plan, newest first, bounded by what the plan's KV reserve holds
(its GPU tier) and by what it keeps in host memory after evicting from the GPU (its host tier;
0 for an engine without KV offload). A block is evicted from the tier's least recently used end.
Blocks are touched from the last to the first, so a prompt's shared head outlives its tail - the
order vLLM's allocator frees a finished sequence's blocks in, so the head is what stays cached.

A plan's hit is the longest run of the request's blocks, from the first, that the plan holds:
`gpu` blocks all on the GPU tier, then up to `total` with the host tier's too. The score is the
share of the prompt that hits, a host block counting less than a GPU block: it is copied back
over PCIe rather than recomputed, but not free. Where the plan's facts say what a copy costs
(`host_restore_s_per_token`), the host part of a hit counts as the share of its prefill the copy
saves: with h(x) = (b + c x / 2) x the prefill time a cached prefix of x tokens saves on that
plan (its StepModel, as predicted_latency prices a hit), g GPU-tier and t GPU + host tokens,
    weight = 1 - restore_s_per_token x (t - g) / (h(t) - h(g)), clipped to [0, 1],
so predicted_latency's prefill of the rest plus the copy is what the plan will spend; without
that figure a host block counts `host_tier_weight` (a fixed share). Unlike the tree-per-worker routers
we do not compare plans by match alone: the predicted-latency plugin turns the same hit into
prefill time saved on that plan's hardware, so a long hit on a slow or busy plan can lose to a
shorter one on an idle fast plan.

Index layout: a bit per plan; per block hash, the bits of the plans holding it (one dict per
tier). Matching walks the request's blocks with a bit mask of the plans still matching, a stride
at a time (`_walk`) - its cost does not grow with the number of plans. What it returns is the few
plans that hit (`hits`), and only those are scored: the other plans' score and cached tokens are 0.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from scheduler.router._arrays import Floats
from scheduler.router.request import BLOCK_TOKENS, RouteRequest

if TYPE_CHECKING:
    from scheduler.router.pool import Pool

NAME = "prefix_affinity"


class PrefixIndex:
    """Per plan, the blocks it recently served, in a GPU and a host tier (module docstring)."""

    def __init__(self, block_tokens: int = BLOCK_TOKENS) -> None:
        self.block_tokens = block_tokens
        self._bits: dict[str, int] = {}  # plan id -> its bit
        self._free: list[int] = []  # bits of forgotten plans, for reuse
        self._next_bit = 1
        self.generation = 0  # bumps when a bit is given or taken back (pools re-read theirs)
        self._gpu: dict[int, int] = {}  # block hash -> bits of the plans holding it on the GPU tier
        self._host: dict[int, int] = {}  # ... on the host tier
        self._lru_gpu: dict[str, OrderedDict[int, None]] = {}
        self._lru_host: dict[str, OrderedDict[int, None]] = {}

    # --- bits ----------------------------------------------------------------------------
    def _bit(self, plan_id: str) -> int:
        bit = self._bits.get(plan_id)
        if bit is None:
            if self._free:
                bit = self._free.pop()
            else:
                bit = self._next_bit
                self._next_bit <<= 1
            self._bits[plan_id] = bit
            self.generation += 1
        return bit

    def _pool_bits(self, pool: Pool) -> tuple[int, dict[int, int]]:
        """(mask of the pool's plans, bit -> slot), memoised on the pool per generation."""
        memo = pool.cache.get(NAME)
        if isinstance(memo, tuple) and memo[0] == (id(self), self.generation):
            return memo[1], memo[2]
        slots = {self._bit(pid): i for i, pid in enumerate(pool.ids)}
        mask = 0
        for b in slots:
            mask |= b
        pool.cache[NAME] = ((id(self), self.generation), mask, slots)
        return mask, slots

    # --- what plans hold -------------------------------------------------------------------
    def record(self, plan_id: str, blocks: Sequence[int], gpu_blocks: int, host_blocks: int = 0) -> None:
        """`plan_id` served a prompt of these blocks: they are its newest, in a GPU tier of at most
        `gpu_blocks` blocks (evicting into a host tier of `host_blocks`)."""
        if not blocks or gpu_blocks <= 0:
            return
        bit = self._bit(plan_id)
        lru = self._lru_gpu.setdefault(plan_id, OrderedDict())
        host = self._lru_host.get(plan_id)
        gpu_tab = self._gpu
        for h in reversed(blocks):  # the head touched last: it is evicted last
            if h in lru:
                lru.move_to_end(h)
                continue
            lru[h] = None
            gpu_tab[h] = gpu_tab.get(h, 0) | bit
            if host is not None and h in host:
                del host[h]
                self._clear(self._host, h, bit)
        while len(lru) > gpu_blocks:
            old, _ = lru.popitem(last=False)
            self._clear(gpu_tab, old, bit)
            if host_blocks > 0:
                if host is None:
                    host = self._lru_host.setdefault(plan_id, OrderedDict())
                host[old] = None
                self._host[old] = self._host.get(old, 0) | bit
                while len(host) > host_blocks:
                    gone, _ = host.popitem(last=False)
                    self._clear(self._host, gone, bit)

    @staticmethod
    def _clear(table: dict[int, int], h: int, bit: int) -> None:
        left = table.get(h, 0) & ~bit
        if left:
            table[h] = left
        else:
            table.pop(h, None)

    def forget(self, plan_id: str) -> None:
        """The plan is gone (released, or lost with its GPUs): its cache went with it."""
        bit = self._bits.pop(plan_id, None)
        if bit is None:
            return
        for tab, lrus in ((self._gpu, self._lru_gpu), (self._host, self._lru_host)):
            for h in lrus.pop(plan_id, {}):
                self._clear(tab, h, bit)
        self._free.append(bit)
        self.generation += 1

    def size(self, plan_id: str) -> int:
        """Blocks on the plan's GPU tier (SGLang's "tree size": the emptiest has most room)."""
        lru = self._lru_gpu.get(plan_id)
        return len(lru) if lru is not None else 0

    # --- matching ----------------------------------------------------------------------------
    def hits(self, blocks: Sequence[int], pool: Pool) -> Hits | None:
        """The plans of the pool that hold the request's first block - a few of the pool's, and
        what a decision reads: (slot, blocks matched on the GPU tier, blocks matched on GPU +
        host tiers) each; None when no plan holds the first block."""
        if not blocks:
            return None
        mask, slots = self._pool_bits(pool)
        gpu = _walk(self._gpu, None, blocks, mask)
        both = _walk(self._gpu, self._host, blocks, mask) if self._host else gpu
        if not both:
            return None
        # (a plan holding the first block on the GPU holds it on GPU + host: `both` has every bit)
        return [(slots[bit], gpu.get(bit, 0), length) for bit, length in both.items()]

    def match(self, blocks: Sequence[int], pool: Pool) -> tuple[Floats, Floats] | None:
        """`hits` as arrays over the pool's slots: (blocks matched on the GPU tier, blocks
        matched on GPU + host tiers), the second the same array when no plan has a host tier."""
        hits = self.hits(blocks, pool)
        if hits is None:
            return None
        gpu = np.zeros(pool.n)
        total = np.zeros(pool.n) if self._host else gpu
        for slot, on_gpu, both in hits:
            gpu[slot] = on_gpu
            total[slot] = both
        return gpu, total


Hits = list[tuple[int, int, int]]  # (slot, GPU-tier blocks, GPU + host blocks) of each plan that hits


STRIDE = 8  # the walk's first step; each step is twice the last (it bisects inside the step)


def _walk(first: dict[int, int], second: dict[int, int] | None, blocks: Sequence[int], mask: int) -> dict[int, int]:
    """bit -> length of the run of `blocks` from the start that the plan holds (in `first`, or in
    either table when `second` is given), for the plans of `mask` that hold at least the first.

    The index keeps a prompt's head at least as recent as its tail (record touches the blocks
    last to first, and evicts the least recent), so a plan that holds block i of a chain holds
    every block before it: the held runs are prefixes. The walk looks at blocks STRIDE, 2 STRIDE,
    4 STRIDE... (galloping) and bisects for each plan inside the step where it dropped out -
    O(plans x log blocks) lookups instead of one per block (a 256-block prompt held by one plan:
    ~13 instead of 256; Mooncake's prompts of 90 blocks or more: 8.5 on average, 12.8 with a
    fixed stride of 8)."""
    n = len(blocks)
    get = first.get
    get2 = second.get if second is not None else _NOTHING.get  # (one loop for one table or two)

    def held(i: int) -> int:
        h = blocks[i]
        return get(h, 0) | get2(h, 0)

    def end(bit: int, lo: int, hi: int) -> int:
        """The run's length for `bit`, which holds block lo and not block hi (or hi == n)."""
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if held(mid) & bit:
                lo = mid
            else:
                hi = mid
        return lo + 1

    out: dict[int, int] = {}
    alive = mask & held(0)
    if not alive:
        return out
    prev = 0
    i = STRIDE
    while i < n:
        h = blocks[i]
        gone = alive & ~(get(h, 0) | get2(h, 0))  # (held(i), inline: this is the loop that runs)
        if gone:
            alive &= ~gone
            while gone:
                low = gone & -gone
                out[low] = end(low, prev, i)
                gone ^= low
            if not alive:
                return out
        prev = i
        i *= 2
    while alive:
        low = alive & -alive
        out[low] = end(low, prev, n)
        alive ^= low
    return out


_NOTHING: dict[int, int] = {}


def score(req: RouteRequest, hits: Hits | None, n: int, *, block_tokens: int, host_tier_weight: float,
          pool: Pool | None = None) -> tuple[Floats | None, Floats | None, list[tuple[int, float, float]]]:
    """(score 0..100 per plan, cached tokens per plan, (slot, cached tokens, score) of the plans
    that hit) over a pool of `n` plans: the share of the prompt that hits, and the tokens of it the
    plan would not recompute (a host hit priced by `pool`'s restore figures, module docstring, else
    counted at `host_tier_weight`); (None, None, []) when
    nothing hits. At least one token is always computed: the last one's logits are needed.
    Only the few plans that hit are computed; the others' 0 is where the arrays start."""
    if hits is None:
        return None, None, []
    cap = float(req.prompt_tokens - 1)
    per = 100.0 / req.prompt_tokens
    b = float(block_tokens)
    out = np.zeros(n)
    cached = np.zeros(n)
    at: list[tuple[int, float, float]] = []
    for slot, gpu_blocks, total_blocks in hits:
        gpu_tokens = min(gpu_blocks * b, cap)
        if total_blocks == gpu_blocks:
            c = gpu_tokens
        else:
            total = min(total_blocks * b, cap)
            c = gpu_tokens + _host_weight(pool, slot, gpu_tokens, total, host_tier_weight) * (total - gpu_tokens)
        cached[slot] = c
        out[slot] = c * per
        at.append((slot, c, c * per))
    return out, cached, at


def _host_weight(pool: Pool | None, slot: int, gpu_tokens: float, total_tokens: float, fixed: float) -> float:
    """What a host-tier token of this hit is worth against a GPU-tier one (module docstring)."""
    restore = pool.host_restore_list[slot] if pool is not None else None
    if restore is None or not pool.pre_b_finite:  # type: ignore[union-attr]
        return fixed
    b, c_half = pool.pre_b_list[slot], pool.pre_c_half_list[slot]  # type: ignore[union-attr]
    saved = (b + c_half * total_tokens) * total_tokens - (b + c_half * gpu_tokens) * gpu_tokens
    if saved <= 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - restore * (total_tokens - gpu_tokens) / saved))
