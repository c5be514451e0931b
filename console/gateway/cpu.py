"""CPU-bound steps of a gateway request (parse the body, render the chat template, tokenize) run
here, on a small thread pool, never on daphne's event loop.

The loop serves every agent's long poll, every websocket and every API call of the process: three
2.4 MB prompts tokenized on it froze /healthz for 9.3 s. Tokenizing here releases the GIL while the
Rust tokenizer works (tokens.ModelTokenizer.encode), so the loop keeps answering.

Bounded both ways:

    FLEXPIPE_GATEWAY_CPU_THREADS   threads that do the work (default 2)
    FLEXPIPE_GATEWAY_CPU_QUEUE     requests working or waiting for a thread (default 16); one more
                                   is refused with 429 and Retry-After instead of queueing without end
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from django.conf import settings

T = TypeVar("T")


class Busy(Exception):
    """Every slot of the pool is taken: the caller answers 429."""


_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_slots: dict[int, asyncio.Semaphore] = {}  # per event loop (tests run several)
_running = 0  # jobs on a thread right now (read by tests and metrics)


def _forget_after_fork() -> None:
    # A forked process (a live test server, a preforking server) has none of the parent's threads: a
    # pool made before the fork would take jobs and never run them. Each process makes its own.
    global _pool, _lock, _running
    _pool, _lock, _running = None, threading.Lock(), 0
    _slots.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=int(getattr(settings, "FLEXPIPE_GATEWAY_CPU_THREADS", 2)),
                                       thread_name_prefix="gateway-cpu")
        return _pool


def _slots_of(loop: asyncio.AbstractEventLoop) -> asyncio.Semaphore:
    sem = _slots.get(id(loop))
    if sem is None:
        sem = _slots[id(loop)] = asyncio.Semaphore(int(getattr(settings, "FLEXPIPE_GATEWAY_CPU_QUEUE", 16)))
    return sem


def running() -> int:
    """How many jobs are on a pool thread now."""
    return _running


def _counted(fn: Callable[..., T], *args: Any) -> T:
    global _running
    with _lock:
        _running += 1
    try:
        return fn(*args)
    finally:
        with _lock:
            _running -= 1


async def run(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) on the pool; raises Busy at once when every slot is taken."""
    loop = asyncio.get_running_loop()
    sem = _slots_of(loop)
    if sem.locked():
        raise Busy()
    async with sem:
        return await loop.run_in_executor(_executor(), _counted, fn, *args)
