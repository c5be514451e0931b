"""Login throttling: failed passwords counted per username and per client address, in Redis.

Why Redis and not django-axes: the counters must be shared by every web process (several daphnes
behind a balancer), expire on their own (a fixed window, no table to prune), and the login form is
the only place that checks a password (the API takes tokens, the agents theirs), so one small
counter pair beside the form is the whole feature. Window and limits:

    FLEXPIPE_LOGIN_WINDOW_S        900   failures older than this are forgotten
    FLEXPIPE_LOGIN_FAILURES_USER     5   failures of one username within the window
    FLEXPIPE_LOGIN_FAILURES_ADDR    20   failures from one address within the window (any usernames)

Past either limit every attempt is refused, the right password included, until the window ends
(the login page answers 429 saying how long). A success clears the username's count. When Redis
does not answer, logins are not throttled (logged): a broker outage must not lock operators out.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import redis
from django.conf import settings

log = logging.getLogger(__name__)


def _setting(name: str, default: int) -> int:
    return int(getattr(settings, name, default))


def _client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=0.5, socket_connect_timeout=0.5)


def _keys(username: str, addr: str) -> tuple[str, str]:
    prefix = settings.CHANNEL_LAYERS["default"]["CONFIG"].get("prefix", "flexpipe")
    user = hashlib.sha256(username.strip().lower().encode()).hexdigest()[:32]
    return f"{prefix}:login-fail:user:{user}", f"{prefix}:login-fail:addr:{addr}"


def client_address(request: Any) -> str:
    return str(request.META.get("REMOTE_ADDR") or "unknown")


def blocked_for_s(username: str, addr: str) -> int:
    """Seconds until this username and address may try again; 0 when they may now."""
    user_key, addr_key = _keys(username, addr)
    try:
        with _client().pipeline() as pipe:
            pipe.get(user_key).ttl(user_key).get(addr_key).ttl(addr_key)
            user_n, user_ttl, addr_n, addr_ttl = pipe.execute()
    except (redis.RedisError, OSError) as exc:
        log.warning("login throttle: Redis does not answer (%s); not throttling", exc)
        return 0
    waits = []
    if int(user_n or 0) >= _setting("FLEXPIPE_LOGIN_FAILURES_USER", 5):
        waits.append(max(1, int(user_ttl)))
    if int(addr_n or 0) >= _setting("FLEXPIPE_LOGIN_FAILURES_ADDR", 20):
        waits.append(max(1, int(addr_ttl)))
    return max(waits, default=0)


def failed(username: str, addr: str) -> None:
    window_s = _setting("FLEXPIPE_LOGIN_WINDOW_S", 900)
    try:
        with _client().pipeline() as pipe:
            for key in _keys(username, addr):
                # the window starts at the first failure (NX): later failures do not extend it
                pipe.incr(key).expire(key, window_s, nx=True)
            pipe.execute()
    except (redis.RedisError, OSError) as exc:
        log.warning("login throttle: could not count a failure (%s)", exc)


def succeeded(username: str, addr: str) -> None:
    try:
        _client().delete(_keys(username, addr)[0])
    except (redis.RedisError, OSError) as exc:
        log.warning("login throttle: could not clear the count (%s)", exc)
