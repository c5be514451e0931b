"""A pipe's waiting queue (priority, then length bucket if any, then deadline, then arrival; preempted first in
its class)
and its prefix cache (LRU bounded by the KV reserve, head kept longest)."""

from __future__ import annotations

import pytest

from agents.sim.engine import Request
from agents.sim.queues import PrefixCache, WaitQueue


def r(rid: int, *, priority: int = 0, deadline_s: float | None = None, prompt: int = 100, at: float = 0.0) -> Request:
    return Request(rid, "d", at, prompt, 10, priority=priority, deadline_s=deadline_s)


def test_with_one_class_and_no_deadlines_it_is_the_fifo_it_replaced() -> None:
    q = WaitQueue()
    for i in range(4):
        q.append(r(i))
    q.appendleft(r(9))  # a preempted sequence: before everything
    assert q[0].rid == 9 and [x.rid for x in q] == [9, 0, 1, 2, 3]
    assert [q.popleft().rid for _ in range(5)] == [9, 0, 1, 2, 3] and not q


def test_priority_classes_first_then_earliest_deadline_then_arrival() -> None:
    q = WaitQueue()
    q.append(r(1, priority=1))  # low priority
    q.append(r(2))  # no deadline
    q.append(r(3, deadline_s=5.0, at=2.0))  # due at 7
    q.append(r(4, deadline_s=3.0, at=1.0))  # due at 4
    q.append(r(5, priority=-1))  # urgent
    q.appendleft(r(6, priority=1))  # a preempted low-priority one: first of its class only
    assert [q.popleft().rid for _ in range(6)] == [5, 4, 3, 2, 6, 1]


def test_with_length_buckets_a_shorter_bucket_goes_first_within_its_priority_class() -> None:
    from scheduler.buckets import LengthBuckets

    q = WaitQueue(LengthBuckets())
    q.append(r(1, prompt=5000))  # 2K-32K
    q.append(r(2, prompt=40_000))  # > 32K
    q.append(r(3, prompt=300))  # < 2K: comes in last, admitted first
    q.append(r(4, prompt=6000))
    q.append(r(5, prompt=9000, priority=-1))  # an urgent class still comes before any bucket
    q.appendleft(r(6, prompt=7000))  # a preempted one: first of its class and bucket only
    assert [x.rid for x in q] == [5, 3, 6, 1, 4, 2]
    assert [q.popleft().rid for _ in range(6)] == [5, 3, 6, 1, 4, 2]
    fifo = WaitQueue()  # no buckets: arrival order whatever the lengths
    for req in (r(1, prompt=5000), r(3, prompt=300)):
        fifo.append(req)
    assert [x.rid for x in fifo] == [1, 3]


def test_it_counts_the_prompt_tokens_left_to_prefill_in_total_and_of_low_priority() -> None:
    q = WaitQueue()
    a, b, c = r(1, prompt=300), r(2, priority=2, prompt=500), r(3, prompt=700)
    for x in (a, b, c):
        q.append(x)
    assert (q.tokens, q.low_tokens) == (1500, 500)
    q.remove(b)
    assert (q.tokens, q.low_tokens, len(q)) == (1000, 0, 2)
    q.popleft()
    assert q.tokens == 700
    q.clear()
    assert (q.tokens, len(q)) == (0, 0)
    with pytest.raises(ValueError, match="not queued"):
        q.remove(a)


def test_the_prefix_cache_matches_full_blocks_from_the_first_and_evicts_tails_first() -> None:
    c = PrefixCache(capacity_blocks=4, block_tokens=512)
    c.insert((1, 2, 3))
    assert c.match((1, 2, 3, 4), prompt_tokens=4 * 512) == 3
    assert c.match((1, 2, 3), prompt_tokens=2 * 512 + 100) == 2  # only the prompt's full blocks count
    assert c.match((9, 2, 3), prompt_tokens=2048) == 0  # a run starts at the first block
    c.insert((1, 2, 7, 8))  # capacity 4: (3) was the least recent tail
    assert 3 not in c and all(h in c for h in (1, 2, 7, 8)) and len(c) == 4
    empty = PrefixCache(capacity_blocks=0, block_tokens=512)
    empty.insert((1,))
    assert len(empty) == 0
