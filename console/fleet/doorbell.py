"""The doorbell that wakes an agent's pending long poll when a command is issued for its node.

Ringing publishes the node id on one Redis pub/sub channel. Each process (each event loop: tests
run several) has at most one listener: a task with one Redis connection, subscribed while at least
one poll waits, that sets the waiting polls' asyncio.Events. A thousand waiting polls cost one Redis
client, not a thousand (issue 19: one client and one BLPOP per poll, re-issued every 5 s, before).

A ring while nobody listens is lost on purpose: a poll queries the node's open commands before it
waits and again after each wake. It learns its node from that first query (the token says which),
so it registers its waiter after it; a ring heard in between is in the listener's record
(Listener.mark, rang_since) and the poll queries once more. From registration on, a ring is kept in
the waiter's Event. While the listener has no subscription (Redis away, or not subscribed yet) a waiter
is told to fall back to re-querying every second, as the poll did on Redis errors before.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import redis
import redis.asyncio as aioredis
from django.conf import settings

log = logging.getLogger(__name__)

RETRY_S = 1.0  # after a Redis error: reconnect this often; waiters re-query this often meanwhile


def channel() -> str:
    return f"{settings.CHANNEL_LAYERS['default']['CONFIG'].get('prefix', 'flexpipe')}:doorbell"


def ring(node_id: str) -> None:
    """Wake the node's pending long poll (if any, in any process) so it fetches its new command at once."""
    try:
        client = redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=1, socket_timeout=2)
        try:
            client.publish(channel(), node_id)
        finally:
            client.close()
    except (redis.RedisError, OSError) as exc:
        log.warning("doorbell for %s failed (the agent finds the command on its next poll): %s", node_id, exc)


class Waiter:
    """One waiting poll: `rung` is set by a ring for its node or when the listener loses Redis."""

    def __init__(self, listener: Listener, node_id: str) -> None:
        self.listener = listener
        self.node_id = node_id
        self.rung = asyncio.Event()

    @property
    def reliable(self) -> bool:
        """Whether a ring reaches this waiter now; if not, the poll re-queries every RETRY_S."""
        return self.listener.subscribed.is_set()


class Listener:
    """The process's (the event loop's) one subscription; runs only while someone waits."""

    def __init__(self) -> None:
        self.waiters: dict[str, set[Waiter]] = {}
        self.subscribed = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.client: Any = None  # the one Redis connection (tests read its client name)
        # What was heard, for a poll that learns its node only after its first query (mark/rang_since):
        self.generation = 0  # subscriptions made so far
        self.rings = 0  # rings heard so far
        self.last_ring: dict[str, int] = {}  # node id -> the number of its latest ring (bounded by the fleet)

    def mark(self) -> tuple[int, int] | None:
        """Where the listener stands now; None while it hears nothing (not subscribed)."""
        return (self.generation, self.rings) if self.subscribed.is_set() else None

    def rang_since(self, mark: tuple[int, int] | None, node_id: str) -> bool:
        """Whether a ring for the node may have come since `mark`: yes when it did, and whenever
        the listener did not hear throughout (not subscribed then or now, or subscribed anew)."""
        if mark is None or not self.subscribed.is_set() or mark[0] != self.generation:
            return True
        return self.last_ring.get(node_id, 0) > mark[1]

    def add(self, node_id: str) -> Waiter:
        waiter = Waiter(self, node_id)
        self.waiters.setdefault(node_id, set()).add(waiter)
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._run(), name="flexpipe-doorbell")
        return waiter

    def remove(self, waiter: Waiter) -> None:
        group = self.waiters.get(waiter.node_id)
        if group is not None:
            group.discard(waiter)
            if not group:
                del self.waiters[waiter.node_id]
        if not self.waiters and self.task is not None:
            self.task.cancel()  # nobody waits: let go of the connection
            self.task = None
            self.subscribed.clear()

    def _ring(self, node_id: str) -> None:
        self.rings += 1
        self.last_ring[node_id] = self.rings
        for waiter in self.waiters.get(node_id, ()):
            waiter.rung.set()

    def _ring_all(self) -> None:
        for group in self.waiters.values():
            for waiter in group:
                waiter.rung.set()

    async def _run(self) -> None:
        me = asyncio.current_task()
        while self.waiters:
            client = aioredis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=2)
            self.client = client
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(channel())
                self.generation += 1
                self.subscribed.set()
                # Rings sent before the subscription took are lost: let every waiter query once more.
                self._ring_all()
                async for message in pubsub.listen():
                    if message.get("type") == "message":
                        data = message["data"]
                        self._ring(data.decode() if isinstance(data, bytes) else str(data))
            except (aioredis.RedisError, OSError) as exc:
                log.warning("doorbell listener lost Redis (polls re-query every %gs): %s", RETRY_S, exc)
            finally:
                if self.task is me:  # not when a newer task took over after remove() cancelled this one
                    self.subscribed.clear()
                    self._ring_all()
                    self.client = None
                try:
                    await pubsub.aclose()
                    await client.aclose()
                except (aioredis.RedisError, OSError):  # already gone
                    pass
            await asyncio.sleep(RETRY_S)


_listeners: dict[int, Listener] = {}  # per event loop id


def listener() -> Listener:
    loop = asyncio.get_running_loop()
    found = _listeners.get(id(loop))
    if found is None or getattr(found, "_loop", None) is not loop:
        found = Listener()
        found._loop = loop  # type: ignore[attr-defined]  # an id may be reused by a later loop
        _listeners[id(loop)] = found
    return found


@asynccontextmanager
async def waiting(node_id: str) -> AsyncIterator[Waiter]:
    """Register a waiter for the node for the block's duration (a poll that queried before: Listener.rang_since)."""
    current = listener()
    waiter = current.add(node_id)
    try:
        yield waiter
    finally:
        current.remove(waiter)
