"""Startup checks of the three loops' periods (scheduler/control/correction.py: the time scales).

flexpipe.W001  the global correction runs more than 5x slower than the engines' local loop (seed 003
               corollary 4: it corrects too late); a ratio under 1 (global faster than local) too:
               the two loops then fight over the same knobs
flexpipe.E001  a period that is not a finite number > 0 (the global one may be 0: off)
flexpipe.E002  the global correction is not faster than the gear loop (FLEXPIPE_TICK_S): it would
               correct what the gears are about to change
"""

from __future__ import annotations

import math
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Warning, register

from scheduler.control.correction import MAX_LOOP_RATIO


@register()
def loop_periods(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    local = float(settings.FLEXPIPE_LOCAL_LOOP_S)
    glob = float(settings.FLEXPIPE_GLOBAL_LOOP_S)
    gear = float(settings.FLEXPIPE_TICK_S)
    out: list[CheckMessage] = []
    for name, value, zero_ok in (("FLEXPIPE_LOCAL_LOOP_S", local, False), ("FLEXPIPE_GLOBAL_LOOP_S", glob, True),
                                 ("FLEXPIPE_TICK_S", gear, False)):
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
            out.append(Error(f"{name} must be a finite number of seconds > 0{' (or 0: off)' if zero_ok else ''}; "
                             f"got {value!r}", id="flexpipe.E001"))
    if out or glob == 0:
        return out
    if glob >= gear:
        out.append(Error(f"FLEXPIPE_GLOBAL_LOOP_S ({glob:g} s) must be below the gear loop's FLEXPIPE_TICK_S "
                         f"({gear:g} s)", id="flexpipe.E002"))
    ratio = glob / local
    if ratio > MAX_LOOP_RATIO or ratio < 1:
        out.append(Warning(
            f"FLEXPIPE_GLOBAL_LOOP_S / FLEXPIPE_LOCAL_LOOP_S is {ratio:g} ({glob:g} s / {local:g} s)",
            hint=f"seed 003 corollary 4: keep the global correction between 1x and {MAX_LOOP_RATIO:g}x the "
                 "local loop (100 ms / 500 ms): slower corrects too late, faster fights the local loop",
            id="flexpipe.W001"))
    return out
