"""The garbage collector's thresholds in the console's and the gateway's web processes.

Measured (issue 19, `python -m bench.control_plane --agents 1000`, 8,000 GPUs, the Overview
open): with Python's default thresholds (700, 10, 10) the web process ran a full (generation 2)
collection about every 2 s, each 240-300 ms long - the whole process stopped, every report in
flight with it, and that was the report p99 (328-428 ms against a p50 of 6-7 ms). What fills the
heap is the fleet's working set (the decision snapshot's per-node parts, the fleet view rebuilt for
the Overview a few times a second), and what makes a full collection is the young objects that
survive long enough to reach the old generation. With (50000, 20, 100) the same step ran one full
collection instead of 33: report p99 101 and 144 ms in two runs, push p99 0.58-0.59 s. `gc.freeze()` at start-up changed
nothing (the heap is what the process builds at run time, not what it imported); (5000, 10,
1000) gave the same p99 (100 ms) with shorter young collections but a 560 ms full one, and
(10000, 50, 1000) 112 ms.

Most of that garbage was one reference cycle per HTTP request, in Django's ASGI handler; the
console's processes serve through console/handler.py now, which has none (268,788 -> 8,340 objects
of cyclic garbage in 20 s at 1,000 agents; young collections over 5 ms 39 -> 14 in a step). What is
left to collect is the working set: ~450,000 tracked objects, two thirds of them the 1,000 pending
long polls' tasks and coroutines, replaced every 25 s - so a collection of the older generations
still stops the process for 110-220 ms now and then.

The cost: cyclic garbage lives up to 50,000 allocations longer before the young collection finds
it (memory, not correctness: reference counting frees everything else at once).

`FLEXPIPE_GC_THRESHOLDS` ("50000,20,100"; "" or "python": Python's own) sets them; a bad value
stops the process at start-up naming the setting.

**Freezing what survives** (`Freezer`, `FLEXPIPE_GC_FREEZE`): a full collection costs what the
older generations hold, and they hold the working set, which lives by reference counting. So every
second the process moves every object the collector tracks into the permanent generation
(`gc.freeze()`), which no automatic collection visits: the young collections see only what was made
since, and a full collection is as short as a young one. What dies while frozen is freed by
reference counting as before; only cyclic garbage that was frozen waits for the sweep: every 300 s
the process unfreezes everything and runs one full collection (one pause of the old length, 110-220
ms at 1,000 agents, every five minutes instead of every few seconds). "off" keeps Python's way.
Measured (issue 19, `bench.control_plane --agents 1000`, collections timed by gc.callbacks in the
web process over one run, enrolment included): without it the longest collection took 268 ms and
all of them 1,298 ms; with it 59 ms and 347 ms. The cost is memory: the cyclic garbage of up to
`sweep_s` (at 1,000 agents ~8,000 objects per 20 s, console/handler.py: ~120,000 objects).
"""

from __future__ import annotations

import gc
import threading
import time
from dataclasses import dataclass, field

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured


def thresholds(raw: str) -> tuple[int, int, int] | None:
    """The three thresholds of a FLEXPIPE_GC_THRESHOLDS value; None for Python's own."""
    text = raw.strip().lower()
    if text in ("", "python"):
        return None
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 3 or not all(v >= 1 for v in values):
        raise ImproperlyConfigured(f"FLEXPIPE_GC_THRESHOLDS: must be three positive integers "
                                   f"'gen0,gen1,gen2' (or 'python'), got {raw!r}")
    return values  # type: ignore[return-value]


def apply() -> None:
    """Set the thresholds FLEXPIPE_GC_THRESHOLDS names and check FLEXPIPE_GC_FREEZE (module
    docstring); call once at process start. The freezer starts with the server (start_freezer)."""
    global _freezer
    chosen = thresholds(str(settings.FLEXPIPE_GC_THRESHOLDS))
    periods = freeze_periods(str(settings.FLEXPIPE_GC_FREEZE))
    if chosen is not None:
        gc.set_threshold(*chosen)
    if periods is not None and _freezer is None:
        _freezer = Freezer(*periods)


def start_freezer() -> bool:
    """Start the configured Freezer's thread (once); whether one runs. console.asgi calls it when it
    finds itself under daphne: a test process that imports the ASGI app keeps Python's collector."""
    if _freezer is None:
        return False
    if _freezer._thread is None:
        _freezer.start()
    return True


def freeze_periods(raw: str) -> tuple[float, float] | None:
    """The freeze and sweep periods (seconds) of a FLEXPIPE_GC_FREEZE value; None for "off"."""
    text = raw.strip().lower()
    if text in ("off", "0", ""):
        return None
    try:
        freeze_s, sweep_s = (float(v) for v in text.split(","))
    except ValueError:
        freeze_s = sweep_s = -1.0
    if not (0 < freeze_s < sweep_s):
        raise ImproperlyConfigured(f"FLEXPIPE_GC_FREEZE: must be 'freeze_s,sweep_s' with "
                                   f"0 < freeze_s < sweep_s (or 'off'), got {raw!r}")
    return freeze_s, sweep_s


@dataclass
class Freezer:
    """Freeze the tracked objects every `freeze_s`; every `sweep_s` unfreeze them and collect all
    (module docstring). `step(now)` does what is due; `start()` runs it on a daemon thread.
    gc.freeze and gc.unfreeze only splice the collector's lists, so calling them from another
    thread, even while a collection runs a finalizer, is safe (CPython's gcmodule.c)."""

    freeze_s: float
    sweep_s: float
    last_freeze: float = 0.0
    last_sweep: float = 0.0
    sweeps: int = 0
    _thread: threading.Thread | None = field(default=None, repr=False)

    def step(self, now: float) -> str:
        """Do what is due at `now`: "sweep", "freeze" or "" (nothing)."""
        if now - self.last_sweep >= self.sweep_s:
            gc.unfreeze()
            gc.collect()
            self.last_sweep = self.last_freeze = now
            self.sweeps += 1
            gc.freeze()  # what survived the sweep is the working set: frozen again at once
            return "sweep"
        if now - self.last_freeze >= self.freeze_s:
            gc.freeze()
            self.last_freeze = now
            return "freeze"
        return ""

    def start(self) -> None:
        self.last_sweep = self.last_freeze = time.monotonic()

        def run() -> None:
            while True:
                time.sleep(self.freeze_s)
                self.step(time.monotonic())

        self._thread = threading.Thread(target=run, name="flexpipe-gc-freeze", daemon=True)
        self._thread.start()


_freezer: Freezer | None = None
