"""A sample of the router's decisions per deployment, for the deployment page: each gateway
process keeps at most one per FLEXPIPE_ROUTER_SAMPLE_S (routing.admitted), in a capped Redis list
(`KEEP` newest), written off the request path; the page reads the newest `recent(...)`.

Redis, not the database: a sample is a diagnostic, cheap to lose and written often; the audit
log keeps decisions that change state (gear changes), not per-request routing.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

import redis
from django.conf import settings

log = logging.getLogger(__name__)
KEEP = 20
PREFIX = "flexpipe:router:decisions:"


def _client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=1.0, socket_connect_timeout=1.0)


def record(deployment: str, explained: dict[str, Any]) -> None:
    """Keep one explained decision (sync; errors are logged, never raised: a lost sample is fine)."""
    push_capped(PREFIX + deployment, [explained], KEEP)


def push_capped(key: str, rows: list[dict[str, Any]], keep: int) -> None:
    """Prepend `rows` (the last one newest) to a Redis list of JSON objects cut to its newest `keep`;
    errors are logged, never raised (what these lists hold is diagnostic)."""
    try:
        pipe = _client().pipeline()
        for row in rows:
            pipe.lpush(key, json.dumps(row, separators=(",", ":"), allow_nan=False))
        pipe.ltrim(key, 0, keep - 1)
        pipe.execute()
    except (OSError, ValueError, redis.RedisError) as exc:
        log.warning("gateway: cannot keep %s: %s", key, exc)


def record_soon(deployment: str, explained: dict[str, Any]) -> None:
    """`record` on a thread of its own, so the request never waits on Redis."""
    threading.Thread(target=record, args=(deployment, explained), name="router-sample", daemon=True).start()


def recent(deployment: str, n: int = 8) -> list[dict[str, Any]]:
    """The newest `n` sampled decisions of `deployment`, newest first ([] when Redis is away)."""
    return newest_of(PREFIX + deployment, n)


def newest_of(key: str, n: int) -> list[dict[str, Any]]:
    """The newest `n` JSON objects of a list `push_capped` keeps, newest first ([] when Redis is away)."""
    try:
        raw = _client().lrange(key, 0, max(0, n - 1))
    except (OSError, redis.RedisError) as exc:
        log.warning("gateway: cannot read %s: %s", key, exc)
        return []
    out = []
    for item in raw:
        try:
            out.append(json.loads(item))
        except ValueError:
            continue
    return out
