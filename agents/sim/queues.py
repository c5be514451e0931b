"""What a simulated engine keeps besides its batch: the queue of sequences waiting for admission,
in priority order, and the prefix cache of KV blocks it computed.

`WaitQueue` orders waiting sequences by priority class (lower first, vLLM's convention), then -
with length buckets (scheduler/buckets.py) - by bucket, shortest first, then earliest deadline
(absolute: arrival + the request's deadline; none is latest), then the order they came in - with
`appendleft` (a preempted sequence, recomputed before anything newer of its class and deadline)
ahead of every `append`. Buckets in the queue as well as in the round: a short prompt that arrives
behind a queue of 5K-token ones is admitted before them, not only prefilled beside them once they
are in (on the Azure code trace most of the short prompts' TTFT tail is that wait). Within a class
the long prompts wait while shorter ones keep coming; a class of its own (priority) is what orders
past that. With every request at the default priority, no deadline and no buckets this is exactly
the FIFO deque it replaces. It also keeps the prompt tokens its
sequences still have to prefill, in total and of low-priority requests (what the router's queue
estimate reads, without a walk over the queue per decision).

`PrefixCache` is vLLM's automatic prefix caching at the trace's block size: the hashes of the
full prompt blocks a plan computed, least recently used first, at most `capacity_blocks` - the
plan's KV reserve in blocks, because cached blocks live in the same KV memory as running
sequences. A request whose first blocks are cached skips their prefill (at least its last token
is always recomputed, for its logits). The cache is honest on compute and conservative on
memory: a hit saves the prefill, but the sequence still reserves KV for its whole prompt (no
block sharing is credited to admission). Blocks are touched last-to-first, so a prompt's shared
head outlives its tail (vLLM frees a finished sequence's blocks in that order). A plan that
stops loses its cache; a new plan starts cold. With KV tiers (agents/sim/kvtiers.py) what the
cache evicts goes to `spill`, oldest first: the node's host tier.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agents.sim.request import Request
    from scheduler.buckets import LengthBuckets


class WaitQueue:
    """A pipe's waiting sequences (module docstring). Supports the deque operations the engine
    and the executor use: append, appendleft, popleft, [0], remove, clear, len, iteration."""

    __slots__ = ("_heap", "_n", "tokens", "low_tokens", "buckets")

    def __init__(self, buckets: LengthBuckets | None = None) -> None:
        self._heap: list[tuple[int, int, float, int, Request]] = []
        self._n = 0
        self.buckets = buckets  # None: one queue whatever the prompt's length
        self.tokens = 0  # prompt tokens still to prefill, over the queue
        self.low_tokens = 0  # ... of low-priority (priority > 0) sequences

    def _push(self, req: Request, front: bool) -> None:
        self._n += 1
        deadline = req.deadline_at if req.deadline_at is not None else math.inf
        bucket = self.buckets.of(req.prompt) if self.buckets is not None else 0
        heapq.heappush(self._heap, (req.priority, bucket, deadline, -self._n if front else self._n, req))
        left = req.need - req.done
        self.tokens += left
        if req.priority > 0:
            self.low_tokens += left

    def append(self, req: Request) -> None:
        self._push(req, False)

    def appendleft(self, req: Request) -> None:
        self._push(req, True)

    def _took(self, req: Request) -> None:
        left = req.need - req.done
        self.tokens -= left
        if req.priority > 0:
            self.low_tokens -= left

    def popleft(self) -> Request:
        req = heapq.heappop(self._heap)[-1]
        self._took(req)
        return req

    def __getitem__(self, i: int) -> Request:
        if i != 0:
            raise IndexError("WaitQueue: only [0], the next to admit")
        return self._heap[0][-1]

    def remove(self, req: Request) -> None:
        for k, entry in enumerate(self._heap):
            if entry[-1] is req:
                self._heap[k] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                self._took(req)
                return
        raise ValueError(f"WaitQueue.remove: request {req.rid} is not queued")

    def clear(self) -> None:
        self._heap = []
        self.tokens = self.low_tokens = 0

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """In admission order."""
        return (entry[-1] for entry in sorted(self._heap, key=lambda e: e[:4]))


class PrefixCache:
    """KV blocks a plan computed, by hash, least recently used first (module docstring)."""

    __slots__ = ("_lru", "capacity_blocks", "block_tokens", "hit_tokens", "spill")

    def __init__(self, capacity_blocks: int, block_tokens: int) -> None:
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.capacity_blocks = capacity_blocks
        self.block_tokens = block_tokens
        self.hit_tokens = 0  # prompt tokens whose prefill hits skipped (accounting)
        self.spill: Callable[[list[int]], None] | None = None  # gets evicted blocks (KV tiers); None: dropped

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, h: int) -> bool:
        return h in self._lru

    def match(self, blocks: Sequence[int], prompt_tokens: int) -> int:
        """How many of the request's first full blocks are cached (touched: they are in use)."""
        lru = self._lru
        usable = min(len(blocks), prompt_tokens // self.block_tokens)
        n = 0
        while n < usable and blocks[n] in lru:
            n += 1
        for i in range(n - 1, -1, -1):
            lru.move_to_end(blocks[i])
        return n

    def insert(self, blocks: Sequence[int]) -> None:
        """Blocks just computed (touched last-to-first), evicting the least recently used."""
        if self.capacity_blocks <= 0:
            return
        lru = self._lru
        for i in range(len(blocks) - 1, -1, -1):
            h = blocks[i]
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
        over = len(lru) - self.capacity_blocks
        if over > 0:
            gone = [lru.popitem(last=False)[0] for _ in range(over)]
            if self.spill is not None:
                self.spill(gone)
