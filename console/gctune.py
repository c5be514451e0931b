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
"""

from __future__ import annotations

import gc

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
    """Set the thresholds the setting names (module docstring); call once at process start."""
    chosen = thresholds(str(settings.FLEXPIPE_GC_THRESHOLDS))
    if chosen is not None:
        gc.set_threshold(*chosen)
