"""The Celery application (broker and settings from Django's settings, CELERY_*), and `enqueue`:
how every request path sends a task.

A request path never waits on the broker for long and never fails after its transaction
committed because the broker is away (issue 18: a Redis outage made writes hang ~20 s and then
answer 500 although committed). `enqueue`:

- sends without subscribing to the task's result (ignore_result: the Redis result backend
  reconnected 20 times, a second apart, before raising inside apply_async) and with a short
  publish retry (CELERY_TASK_PUBLISH_RETRY_POLICY);
- on a broker error logs it, keeps the task as owed in this process and returns False - the
  state it acts on is committed, so the task is only late;
- sends what is owed again before the next task it sends, and whenever `flush_owed()` is called
  (each agent report does: so the topology tick a GPU failure owed during an outage runs at the
  first report after the broker is back, not at the next beat).

Views that want to tell the caller wrap their action in `watching_broker()`: the list it yields
names the tasks that could not be sent (the API answers 202 "queued when the broker is back").
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from celery import Celery
from kombu.exceptions import KombuError
from redis.exceptions import RedisError

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")

app = Celery("flexpipe")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
app.autodiscover_tasks(["console.metrics"])  # not a Django app (no models): named here

log = logging.getLogger(__name__)
BROKER_ERRORS = (KombuError, RedisError, OSError)
MAX_OWED = 1000  # distinct tasks kept per process; past this the oldest go (the beat re-derives them)

_owed: dict[str, tuple[Any, dict[str, Any]]] = {}  # key (name + kwargs) -> (task, kwargs), oldest first
_owed_lock = threading.Lock()
_deferred: ContextVar[list[str] | None] = ContextVar("flexpipe_deferred_tasks", default=None)


def _key(task: Any, kwargs: dict[str, Any]) -> str:
    return f"{task.name}:{json.dumps(kwargs, sort_keys=True, default=str)}"


def _send(task: Any, kwargs: dict[str, Any], countdown: float | None = None) -> bool:
    try:
        task.apply_async(kwargs=kwargs, countdown=countdown, ignore_result=True)
    except BROKER_ERRORS as exc:
        log.warning("could not enqueue %s(%s): %s; it is sent when the broker answers again", task.name, kwargs, exc)
        return False
    except Exception:  # noqa: BLE001 - whatever else the client raises, the caller committed already
        log.exception("could not enqueue %s(%s); it is sent when the broker answers again", task.name, kwargs)
        return False
    return True


def enqueue(task: Any, *, countdown: float | None = None, **kwargs: Any) -> bool:
    """Send `task(**kwargs)`; True when the broker took it, False when it is owed (module docstring)."""
    if not _send(task, kwargs, countdown):
        with _owed_lock:
            _owed.pop(_key(task, kwargs), None)
            _owed[_key(task, kwargs)] = (task, kwargs)
            while len(_owed) > MAX_OWED:
                _owed.pop(next(iter(_owed)))
        watched = _deferred.get()
        if watched is not None:
            watched.append(task.name)
        return False
    flush_owed()
    return True


def owed() -> list[str]:
    """The tasks this process still owes the broker, oldest first."""
    with _owed_lock:
        return list(_owed)


def flush_owed() -> int:
    """Send what is owed, oldest first, until the broker refuses one; how many were sent."""
    sent = 0
    while True:
        with _owed_lock:
            if not _owed:
                return sent
            key, (task, kwargs) = next(iter(_owed.items()))
        if not _send(task, kwargs):
            return sent
        with _owed_lock:
            _owed.pop(key, None)
        sent += 1


@contextmanager
def watching_broker() -> Iterator[list[str]]:
    """Collect the names of the tasks that could not be sent inside the block (on_commit included)."""
    names: list[str] = []
    token = _deferred.set(names)
    try:
        yield names
    finally:
        _deferred.reset(token)
