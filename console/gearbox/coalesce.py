"""One pending tick per deployment (or per fleet): events merged within a short window (issue 19).

Before, every registration, report change and heartbeat sweep queued a full tick of its own
(enrolling 400 nodes queued 244 ticks, and a GPU change waited 18-31 s behind them). Now an event
asks for a tick through `request_tick`: a Redis key "a tick is pending" is set with SET NX, and only
the event that set it queues the task, with a countdown of FLEXPIPE_TICK_COALESCE_S so the events
of that window ride on it. The tick clears the key as it starts (`started`), before it reads the
fleet: an event that arrives while it runs sets the key again and queues exactly one more tick, so
the last state always gets a tick. A deployment waiting for its agents' reports is ticked again the
same way (console.gearbox.tasks.tick): two ticks that both find it waiting queue one re-tick.

The key expires after FLEXPIPE_TICK_PENDING_TTL_S (default: the beat period): if the queued task is
lost (a worker killed before acking, a purged queue), events are merged into nothing for at most
that long - no longer than the beat's own periodic tick takes to decide anyway. When Redis does
not answer, the tick is sent without merging (console.celery.enqueue keeps it owed).

    FLEXPIPE_TICK_COALESCE_S     0.5   how long events wait for others to merge with
    FLEXPIPE_TICK_PENDING_TTL_S  =FLEXPIPE_TICK_S  how long a pending mark outlives a lost task

Measured on the 2-core dev machine, enrolling 100 nodes (register + first report, ~0.35 s each):
with one solo worker, 100 ticks ran before, 43 now (never more than one pending); with no worker
taking them, 100 queued before, 4 now (one per mark TTL).
"""

from __future__ import annotations

import logging
from typing import Any

import redis
from django.conf import settings

log = logging.getLogger(__name__)


def _client() -> redis.Redis:
    """The broker's Redis: the mark lives beside the queue it describes."""
    from console.celery import app

    return redis.Redis.from_url(str(app.conf.broker_url or settings.REDIS_URL), socket_timeout=0.5,
                                socket_connect_timeout=0.5)


def _prefix() -> str:
    """Named after the queue, so whoever sends to it and whoever works it agree on the key."""
    from console.celery import app

    return f"{app.conf.task_default_queue}:tick-pending:"


def pending_key(trigger: str, deployment: str | None) -> str:
    """The mark of a pending `trigger` tick of one deployment (`*`: every deployment)."""
    return f"{_prefix()}{trigger}:{deployment or '*'}"


def window_s() -> float:
    return max(0.0, float(getattr(settings, "FLEXPIPE_TICK_COALESCE_S", 0.5)))


def _ttl_ms() -> int:
    ttl_s = float(getattr(settings, "FLEXPIPE_TICK_PENDING_TTL_S", settings.FLEXPIPE_TICK_S))
    return max(1, int(1000 * max(ttl_s, 2 * window_s(), 1.0)))


def request_tick(task: Any, *, trigger: str, deployment: str | None = None, countdown_s: float | None = None) -> bool:
    """Queue `task(trigger=..., deployment=...)` in `countdown_s` (default: the merge window) unless
    one is pending already; True when this call queued it (or sent it unmerged: Redis did not answer)."""
    from console.celery import enqueue

    kwargs: dict[str, Any] = {"trigger": trigger}
    if deployment is not None:
        kwargs["deployment"] = deployment
    try:
        fresh = bool(_client().set(pending_key(trigger, deployment), 1, nx=True, px=_ttl_ms()))
    except (redis.RedisError, OSError) as exc:
        log.warning("tick coalescing: Redis does not answer (%s); sending the %s tick unmerged", exc, trigger)
        enqueue(task, **kwargs)
        return True
    if not fresh:
        return False
    enqueue(task, countdown=(window_s() if countdown_s is None else countdown_s) or None, **kwargs)
    return True


def started(trigger: str, deployment: str | None) -> None:
    """A tick begins: from now on an event needs a tick of its own (module docstring)."""
    try:
        _client().delete(pending_key(trigger, deployment))
    except (redis.RedisError, OSError) as exc:
        log.warning("tick coalescing: could not clear the pending mark (%s); it expires on its own", exc)


def forget_all() -> int:
    """Drop every pending mark (tests that purge the queue: the ticks they marked are gone)."""
    client = _client()
    keys = list(client.scan_iter(match=f"{_prefix()}*"))
    return int(client.delete(*keys)) if keys else 0
