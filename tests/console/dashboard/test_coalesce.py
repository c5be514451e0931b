"""Issue 19: pushes coalesced per socket - at most the configured rate, and the last state always arrives."""

from __future__ import annotations

import asyncio

import pytest

from console.dashboard.coalesce import Coalescer, Merged


class Clock:
    """Virtual time that only the test moves (`advance`): a sleeper wakes when it reaches its time.
    Nothing here waits for the machine."""

    def __init__(self) -> None:
        self.t = 0.0
        self._sleepers: list[tuple[float, asyncio.Future[None]]] = []

    def __call__(self) -> float:
        return self.t

    async def sleep(self, s: float) -> None:
        wake: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._sleepers.append((self.t + s, wake))
        await wake

    async def _settle(self) -> None:
        for _ in range(10):
            await asyncio.sleep(0)

    async def advance(self, dt: float) -> None:
        end = self.t + dt
        await self._settle()
        while due := [w for w in self._sleepers if w[0] <= end]:
            first = min(due, key=lambda w: w[0])
            self._sleepers.remove(first)
            self.t = first[0]
            first[1].set_result(None)
            await self._settle()
        self.t = end


def _coalescer(every_s: float, clock: Clock, seen: list[tuple[float, int]], state: list[int]) -> Coalescer:
    async def flush() -> None:
        seen.append((clock.t, state[0]))

    return Coalescer(every_s, flush, clock=clock, sleep=clock.sleep)


async def test_a_burst_is_one_push_now_and_one_when_the_interval_is_up_with_the_last_state() -> None:
    clock, seen, state = Clock(), [], [0]
    c = _coalescer(0.5, clock, seen, state)
    for i in range(1, 101):  # a hundred reports in the same instant
        state[0] = i
        c.poke()
        if i == 1:
            await clock.advance(0)  # the first push goes at once
    await clock.advance(10)
    assert seen == [(0.0, 1), (0.5, 100)]


async def test_pushes_never_come_closer_than_the_interval_and_the_last_one_follows_the_last_event() -> None:
    clock, seen, state = Clock(), [], [0]
    c = _coalescer(0.5, clock, seen, state)
    for i in range(1, 41):  # an event every 0.1 s of virtual time, for 4 s
        state[0] = i
        c.poke()
        await clock.advance(0.1)
    await clock.advance(10)
    gaps = [b[0] - a[0] for a, b in zip(seen, seen[1:], strict=False)]
    assert min(gaps) >= 0.5 - 1e-9
    assert len(seen) <= 4.0 / 0.5 + 2
    assert seen[-1][1] == 40


async def test_quiet_events_each_go_at_once() -> None:
    clock, seen, state = Clock(), [], [0]
    c = _coalescer(0.5, clock, seen, state)
    for i in range(1, 4):
        state[0] = i
        c.poke()
        await clock.advance(2.0)
    assert seen == [(0.0, 1), (2.0, 2), (4.0, 3)]


async def test_an_event_during_a_push_gets_a_push_of_its_own() -> None:
    clock, seen = Clock(), []
    c: Coalescer

    async def flush() -> None:
        seen.append(clock.t)
        if len(seen) == 1:
            c.poke()  # a report commits while this push is being read

    c = Coalescer(0.5, flush, clock=clock, sleep=clock.sleep)
    c.poke()
    await clock.advance(10)
    assert seen == [0.0, 0.5]


def test_a_negative_interval_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="every_s"):
        Coalescer(-1.0, lambda: asyncio.sleep(0))


def test_merged_deltas_keep_the_newest_of_each_node_and_gpu() -> None:
    m = Merged()
    m.add({"nodes": [{"node_id": "a", "v": 1}], "gpus": [{"uuid": "g0", "v": 1}, {"uuid": "g1", "v": 1}]})
    m.add({"nodes": [{"node_id": "a", "v": 2}, {"node_id": "b", "v": 1}], "gpus": [{"uuid": "g0", "v": 2}]})
    out = m.take()
    assert out == {"nodes": [{"node_id": "a", "v": 2}, {"node_id": "b", "v": 1}],
                   "gpus": [{"uuid": "g0", "v": 2}, {"uuid": "g1", "v": 1}]}
    assert m.take() == {"nodes": [], "gpus": []}


async def test_a_costly_push_spaces_the_next_ones_out_to_its_busy_share() -> None:
    clock, seen = Clock(), []

    async def flush() -> None:  # the whole fleet's view: 0.4 s of work each time
        seen.append(clock.t)
        await clock.sleep(0.4)

    c = Coalescer(0.5, flush, busy_share=0.25, clock=clock, sleep=clock.sleep)
    for _ in range(60):  # a report every 0.1 s for 6 s
        c.poke()
        await clock.advance(0.1)
    await clock.advance(10)
    gaps = [b - a for a, b in zip(seen, seen[1:], strict=False)]
    assert gaps and min(gaps) >= 1.6 - 1e-9  # 0.4 s / 0.25: a quarter of the time at most
    assert c.gap_s == pytest.approx(1.6)
    with pytest.raises(ValueError, match="busy_share"):
        Coalescer(0.5, flush, busy_share=0)
