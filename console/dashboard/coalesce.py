"""Pushes coalesced per socket: at most one every FLEXPIPE_PUSH_MIN_INTERVAL_S, the last state always sent.

A fleet of agents reports every few milliseconds in all; a live page needs the state a few times a
second. Each socket's consumer pokes its `Coalescer` on every event; the coalescer runs the flush at
once when the last one is older than the interval, otherwise when the interval is up - once, for
every event that came meanwhile. A flush reads the state when it runs (or sends what `Merged`
gathered), so what arrives last is the newest committed state; an event that comes while a flush
runs gets a flush of its own after it. Pages' messages are whole states or keyed upserts, so
skipping the ones in between changes nothing the page shows at the end.

A push that reads the whole fleet (the Overview's) costs more as the fleet grows: with `busy_share`
its interval stretches to its last flush's duration / busy_share (0.25: a quarter of a core at most),
so a large fleet's Overview updates less often instead of starving the agents' reports.

Why per socket and not per group: a socket reads the state its own page needs (a deployment page
its deployment only), and a slow socket only delays itself. What several sockets of one process
read alike (the Overview's whole fleet) they read through one `Shared` build: a flush takes a build
that started after its socket's latest event (`Coalescer.poked_at`), so what one report makes every
open Overview read costs one build, not one per browser (issue 19: the fleet view per report per
browser was N^2), and none of them sees a state older than its event.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Coalescer:
    def __init__(self, every_s: float, flush: Callable[[], Awaitable[None]], *, busy_share: float | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        if every_s < 0:
            raise ValueError(f"every_s: must be >= 0; got {every_s}")
        if busy_share is not None and not 0 < busy_share <= 1:
            raise ValueError(f"busy_share: must be in (0, 1]; got {busy_share}")
        self.every_s, self._flush, self._clock, self._sleep = every_s, flush, clock, sleep
        self.busy_share = busy_share
        self.gap_s = every_s  # the interval now: every_s, or longer while flushes are costly
        self._dirty = False
        self._last = float("-inf")
        self._task: asyncio.Task[None] | None = None
        self.flushes = 0
        self.poked_at = float("-inf")  # when the latest event came (a Shared build must be newer)

    def poke(self) -> None:
        """Something changed: a flush will follow (at once, or when the interval is up)."""
        self._dirty = True
        self.poked_at = self._clock()
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while self._dirty:
            wait = self._last + self.gap_s - self._clock()
            if wait > 0:
                await self._sleep(wait)
            self._dirty = False
            self._last = self._clock()
            self.flushes += 1
            await self._flush()
            if self.busy_share is not None:
                # a costly flush (the whole fleet's view) spaces the next ones out, so this socket's
                # pushes take at most busy_share of the process however large the fleet grows
                self.gap_s = max(self.every_s, (self._clock() - self._last) / self.busy_share)

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None


class Shared(Generic[T]):
    """One build of a costly state for every caller of this process's event loop that needs it newer
    than a time (module docstring). `get(newer_than)` returns the result of a build that started at
    or after `newer_than`: the pending, running or last one when it did, else a new one, started once
    the build in progress (an older one) ends, so the database sees one build at a time. A new build
    starts `gather_s` after it is asked for: one event reaches each socket a little apart, and the
    sockets it reaches meanwhile join that build. A build that failed fails its callers; the next get
    builds again."""

    def __init__(self, build: Callable[[], Awaitable[T]], *, gather_s: float = 0.02,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self._build, self._clock, self._sleep, self.gather_s = build, clock, sleep, gather_s
        self._task: asyncio.Future[T] | None = None
        self._started = float("-inf")  # +inf while the build waits to start: it will be newer than any ask
        self._loop: asyncio.AbstractEventLoop | None = None
        self.builds = 0

    async def get(self, newer_than: float) -> T:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # a build belongs to its loop (tests run several)
            self._loop, self._task, self._started = loop, None, float("-inf")
        while True:
            task = self._task
            if task is not None and self._started >= newer_than:
                return await asyncio.shield(task)
            if task is not None and not task.done():
                await asyncio.wait({task})  # an older build: let it end, then start a newer one
                continue
            self._started = float("inf")
            self.builds += 1
            self._task = asyncio.ensure_future(self._gather_then_build())

    async def _gather_then_build(self) -> T:
        await self._sleep(self.gather_s)
        self._started = self._clock()
        return await self._build()


class Merged:
    """Cluster deltas gathered between two flushes: nodes by node_id and GPUs by uuid, the newest of
    each (console.fleet.live.cluster_state's shape)."""

    def __init__(self) -> None:
        self.nodes: dict[str, dict[str, Any]] = {}
        self.gpus: dict[str, dict[str, Any]] = {}

    def add(self, delta: dict[str, Any]) -> None:
        for n in delta.get("nodes") or ():
            self.nodes[n["node_id"]] = n
        for g in delta.get("gpus") or ():
            self.gpus[g["uuid"]] = g

    def take(self) -> dict[str, Any]:
        out = {"nodes": list(self.nodes.values()), "gpus": list(self.gpus.values())}
        self.nodes, self.gpus = {}, {}
        return out
