"""Issue 19: pushes coalesced per socket - at most the configured rate, and the last state always arrives."""

from __future__ import annotations

import asyncio

import pytest

from console.dashboard.coalesce import Coalescer, Merged, Shared


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


async def _settle() -> None:
    """Let every task that can run, run (no clock moves)."""
    for _ in range(10):
        await asyncio.sleep(0)


class _Builds:
    """A build the test lets finish (`release`), recording the state it read when it started."""

    def __init__(self, clock: Clock, state: list[int]) -> None:
        self.clock, self.state = clock, state
        self.started: list[int] = []
        self.gate = asyncio.Event()
        self.fail = False

    async def __call__(self) -> int:
        read = self.state[0]
        self.started.append(read)
        await self.gate.wait()
        if self.fail:
            raise RuntimeError("the database went away")
        return read

    async def release(self) -> None:
        self.gate.set()
        for _ in range(10):
            await _settle()
        self.gate.clear()


@pytest.mark.asyncio
async def test_sockets_poked_by_one_event_share_one_build_and_none_reads_older_than_its_event() -> None:
    clock, state = Clock(), [1]
    builds = _Builds(clock, state)
    shared: Shared[int] = Shared(builds, gather_s=0, clock=clock)
    clock.t = 10.0  # the event (a report) every Overview socket heard
    readers = [asyncio.ensure_future(shared.get(newer_than=10.0)) for _ in range(3)]
    await _settle()
    await builds.release()
    assert [await r for r in readers] == [1, 1, 1]
    assert shared.builds == 1  # three browsers, one build

    # an event after a build started is not in that build: its socket waits for the next one
    clock.t = 11.0
    early = asyncio.ensure_future(shared.get(newer_than=11.0))
    await _settle()
    assert shared.builds == 2
    state[0], clock.t = 2, 12.0  # a report commits while the build runs
    late = asyncio.ensure_future(shared.get(newer_than=12.0))
    await _settle()
    assert shared.builds == 2  # one build at a time: the newer one starts when this one ends
    await builds.release()
    assert await early == 1
    await _settle()
    assert shared.builds == 3 and builds.started == [1, 1, 2]
    await builds.release()
    assert await late == 2

    # a failed build fails its callers; the next get builds again
    builds.fail, clock.t = True, 13.0
    failing = asyncio.ensure_future(shared.get(newer_than=13.0))
    await _settle()
    await builds.release()
    with pytest.raises(RuntimeError, match="went away"):
        await failing
    builds.fail, clock.t = False, 14.0
    again = asyncio.ensure_future(shared.get(newer_than=13.0))  # the failed build is new enough, but failed
    await _settle()
    await builds.release()
    with pytest.raises(RuntimeError):
        await again
    fresh = asyncio.ensure_future(shared.get(newer_than=14.0))
    await _settle()
    await builds.release()
    assert await fresh == 2 and shared.builds == 5


@pytest.mark.asyncio
async def test_sockets_that_hear_the_event_while_a_build_gathers_join_it() -> None:
    clock, state = Clock(), [1]
    builds = _Builds(clock, state)
    shared: Shared[int] = Shared(builds, gather_s=0.02, clock=clock, sleep=clock.sleep)
    clock.t = 10.0
    first = asyncio.ensure_future(shared.get(newer_than=10.0))
    await _settle()
    state[0] = 2  # the next report commits before the build reads
    second = asyncio.ensure_future(shared.get(newer_than=10.01))  # heard it a little later
    await clock.advance(0.01)
    await clock.advance(0.02)
    assert builds.started == [2]  # started after both events: what both need
    await builds.release()
    assert (await first, await second) == (2, 2) and shared.builds == 1
