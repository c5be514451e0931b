"""The database calls of a long-waiting request run on a small shared pool of threads.

Django gives each request under ASGI its own thread for its sync calls (asgiref's
ThreadSensitiveContext), and the PostgreSQL connection a call opens is that thread's until the
request ends (conn_max_age=0 closes it only then). A long poll waits up to 30 s between two short
queries: each pending poll held a thread and an idle connection, and a default PostgreSQL
(max_connections=100) refused every request past ~95 agents (issue 19).

Why a pool of threads and not Django's connection pool: Django 5.2 pools connections
(OPTIONS["pool"]) only with psycopg_pool, which requirements.txt does not have, and a pool of
connections alone would not free the threads. Here the request keeps asgiref's thread-sensitive
rules (one call at a time, in order) but borrows a thread of this pool per call. So a thousand
waiting polls hold no thread and no connection; at most FLEXPIPE_POLL_DB_THREADS (default 4) of
their queries run at once.

A pool thread keeps its connection from call to call (at most one per thread: the pool's size
bounds them), whatever CONN_MAX_AGE says for the request threads that come and go: opening one
per call - a PostgreSQL backend forked for every agent report - was a large part of a report's
cost on a busy machine. A connection is closed when it broke (Django's usability check after an
error) or when a call left a transaction open, so the next call never inherits one.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any

from django.conf import settings
from django.db import connections

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def _forget_after_fork() -> None:
    # A forked process (a live test server) has none of the parent's threads: it makes its own pool.
    global _pool, _lock
    _pool, _lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


def pool() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=settings.FLEXPIPE_POLL_DB_THREADS,
                                       thread_name_prefix="poll-db")
        return _pool


def _closing(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    finally:
        _keep_or_close()


def _keep_or_close() -> None:
    """After a call on a pool thread: keep its connection for the next call (module docstring)."""
    for conn in connections.all(initialized_only=True):
        if conn.connection is None:
            continue
        if conn.in_atomic_block or (conn.errors_occurred and not conn.is_usable()):
            conn.close()
        else:
            conn.errors_occurred = False
            conn.close_at = None  # Django's close_old_connections (request_finished) keeps it too


def call(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """Run a database read from a thread of the process's own (the fleet pusher's) on the pool, and
    wait for it: its connection is one of the pool's, not one more held by that thread."""
    return pool().submit(_closing, fn, *args, **kwargs).result()


class Borrowed(Executor):
    """One request's thread-sensitive calls on the shared pool (for ThreadSensitiveContext(executor=)).

    asgiref awaits each call before the request makes the next, so they still run one at a time.
    """

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        return pool().submit(_closing, fn, *args, **kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        pass  # the pool is shared by every request; it lives as long as the process
