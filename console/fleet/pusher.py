"""Reports' live deltas, sent from one thread per process instead of inside each report's request.

A report used to read its node and GPUs back (two queries) and wait for the channel layer's
group_send (several Redis round trips through async_to_sync) before it answered the agent: on a
loaded 2-core machine that was ~45 ms of a ~130 ms report (issue 19). Now the report hands the
delta it already holds in memory to `enqueue` (on commit: only committed state is pushed) and
answers; a daemon thread running its own event loop merges what came in over FLUSH_S (the newest
state of each node and GPU: console.dashboard.coalesce.Merged) and sends it as one group_send to
the fleet's pages, and one to each deployment page it concerns (console.dashboard.groups).
The browsers' sockets coalesce again for their pages (console/dashboard/coalesce.py).

Best effort, as every push is: the state is committed, a push lost with its process is carried by
the node's next report, and a page that reconnects gets the whole state. The queue is bounded: past
MAX_PENDING deltas waiting (the layer is away) the oldest are merged away, never blocking a report.
A forked process (a live test server) starts its own thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import Any

import redis

from console.dashboard.coalesce import Merged

log = logging.getLogger(__name__)

FLUSH_S = 0.05  # how long deltas gather before one send
MAX_PENDING = 10_000


class _Pusher:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._merged = Merged()
        self._pending = 0
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.sent = 0  # group_sends done (tests, metrics)

    def enqueue(self, delta: dict[str, Any]) -> None:
        with self._lock:
            self._merged.add(delta)  # merging by node and GPU keeps it bounded by the fleet's size
            self._pending = min(self._pending + 1, MAX_PENDING)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="fleet-pusher", daemon=True)
                self._thread.start()
        self._wake.set()

    def _take(self) -> dict[str, Any] | None:
        with self._lock:
            if not self._pending:
                return None
            self._pending = 0
            return self._merged.take()

    def _run(self) -> None:
        from channels.layers import get_channel_layer

        layer = get_channel_layer()
        loop = asyncio.new_event_loop()  # this thread's own: the layer's Redis connections stay open on it
        while True:
            self._wake.wait()
            self._wake.clear()
            loop.run_until_complete(asyncio.sleep(FLUSH_S))
            delta = self._take()
            if delta is None or layer is None:
                continue
            try:
                loop.run_until_complete(send_delta(layer, delta, extra_groups(delta, pooled=True)))
                self.sent += 1
            except (OSError, redis.RedisError) as exc:
                log.warning("live push failed: %s", exc)


def extra_groups(delta: dict[str, Any], *, pooled: bool = False) -> list[str]:
    """The pages' groups a delta concerns besides the fleet's (console.dashboard.groups: the
    deployments whose GPUs or plans it touches), read on the database pool when `pooled`."""
    from console import db_pool
    from console.dashboard import groups

    if pooled:
        return db_pool.call(groups.extra_groups, "cluster.delta", delta)  # type: ignore[no-any-return]
    return groups.extra_groups("cluster.delta", delta)


async def send_delta(layer: Any, delta: dict[str, Any], extra: list[str]) -> None:
    """One delta to the fleet's pages (the heatmap, the Overview) and to the groups in `extra`."""
    from console.fleet.live import CLUSTER_GROUP

    message = {"type": "cluster.delta", "delta": delta}
    for group in (CLUSTER_GROUP, *extra):
        await layer.group_send(group, message)


_pusher = _Pusher()


def _forget_after_fork() -> None:
    global _pusher
    _pusher = _Pusher()


os.register_at_fork(after_in_child=_forget_after_fork)


def enqueue(delta: dict[str, Any]) -> None:
    _pusher.enqueue(delta)


def sent() -> int:
    return _pusher.sent
