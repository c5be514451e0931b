"""Shared test setup: real Redis and (where it answers) real PostgreSQL, isolated per test worker.

scripts/test.sh finds the services and exports REDIS_URL and DATABASE_URL. Here each pytest-xdist
worker gets its own Redis database number and channel-layer prefix, so websocket groups, Celery
queues and doorbells of parallel workers never see each other.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator

import pytest
import redis as redis_lib

# Live servers (daphne) are forked from a test worker that may have run torch engines. Garbage
# those left behind (cycles holding objects whose destructors expect the parent's threads) is
# collected here, in the parent, where destroying it is safe - not by the child's first GC, where
# it aborted the server ("Fatal Python error: Aborted" while garbage-collecting, seen once in a
# full run). What is alive at the fork stays frozen in the child: its GC never looks at it.
os.register_at_fork(before=lambda: (gc.collect(), gc.freeze()), after_in_parent=gc.unfreeze)

_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
_WORKER_NUM = int(_WORKER[2:]) if _WORKER[2:].isdigit() else 0
# Names unique to this run and worker: two test runs on one machine (or a stray worker left by
# one) share the Redis server, but never a Celery queue, a channel group or a doorbell.
_RUN = (os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"p{os.getpid()}")[:10]
TEST_NAMESPACE = f"fptest-{_RUN}-{_WORKER_NUM}"


def _test_redis_url() -> str:
    base = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    head = base.rsplit("/", 1)[0] if base.count("/") >= 3 else base
    return f"{head}/{8 + _WORKER_NUM % 8}"


TEST_REDIS_URL = _test_redis_url()


@pytest.fixture(scope="session", autouse=True)
def _isolated_services(django_test_environment: None) -> None:
    from django.conf import settings

    try:
        redis_lib.Redis.from_url(TEST_REDIS_URL, socket_timeout=2).ping()
    except (redis_lib.RedisError, OSError) as exc:
        pytest.exit(f"Redis at {TEST_REDIS_URL} does not answer ({exc}); run the tests with `make test`, "
                    "which finds or starts one", returncode=3)
    settings.REDIS_URL = TEST_REDIS_URL
    # Named people are made for most console tests; PBKDF2 (~0.3 s a password) would dominate the run.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    from console.settings import channel_layer

    settings.CHANNEL_LAYERS = {"default": channel_layer(TEST_REDIS_URL, TEST_NAMESPACE)}
    settings.CELERY_BROKER_URL = TEST_REDIS_URL
    settings.CELERY_RESULT_BACKEND = TEST_REDIS_URL
    settings.CELERY_TASK_DEFAULT_QUEUE = TEST_NAMESPACE
    from console.celery import app

    app.conf.update(broker_url=TEST_REDIS_URL, result_backend=TEST_REDIS_URL,
                    task_default_queue=TEST_NAMESPACE)
    from channels.layers import channel_layers

    channel_layers.backends.clear()


@pytest.fixture
def redis_client() -> redis_lib.Redis:
    return redis_lib.Redis.from_url(TEST_REDIS_URL)


def database_url_for_processes() -> str:
    """The test database as a URL, for the processes a test starts (daphne, against PostgreSQL)."""
    from django.db import connection

    s = connection.settings_dict
    auth = s["USER"] + (f":{s['PASSWORD']}" if s.get("PASSWORD") else "")
    return f"postgres://{auth}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"


def purge_tasks() -> None:
    """Empty this test worker's Celery queue, and drop the pending-tick marks of the ticks that were
    in it (console.gearbox.coalesce): a mark whose tick is gone would hold back the next event's."""
    from console.celery import app
    from console.gearbox import coalesce

    redis_lib.Redis.from_url(TEST_REDIS_URL).delete(app.conf.task_default_queue)
    coalesce.forget_all()


@pytest.fixture
def worker() -> Iterator[None]:
    """A real Celery worker (solo pool, in this process) on this test worker's own queue, emptied
    first: tasks that earlier tests' signals queued (ticks, advances) must not run here."""
    from celery.contrib.testing.worker import start_worker

    from console.celery import app

    purge_tasks()
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10,
                      queues=[app.conf.task_default_queue]):
        yield
