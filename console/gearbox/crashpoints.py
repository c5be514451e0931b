"""Crash points for the Celery crash tests: stop this worker at a named executor probe point.

Off unless the worker's environment names a Redis key in FLEXPIPE_CRASHPOINT_KEY (only the
tests do). Then, when the executor passes the point stored under that key, the worker writes
the point under "<key>:reached" and waits there - for the test to kill it with SIGKILL by its
PID. Nothing else in the worker changes, and the probe costs nothing when the variable is unset.
"""

from __future__ import annotations

import os
import time

import redis
from django.conf import settings

ENV = "FLEXPIPE_CRASHPOINT_KEY"


def probe(point: str) -> None:
    key = os.environ.get(ENV)
    if not key:
        return
    client = redis.Redis.from_url(settings.REDIS_URL)
    armed = client.get(key)
    if armed is None or armed.decode() != point:
        return
    client.set(f"{key}:reached", f"{point}|{os.getpid()}")
    while True:  # hold here with the step half done until the test kills this process
        time.sleep(0.05)
