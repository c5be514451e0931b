"""Request-rate series (../shared/traces/servegen-*-rate-week1.csv) as a workload's piecewise-linear
rate: the one reader and the one mapping onto simulated time, shared by scenario files
(`rate_rps: {series: ...}`, agents/sim/scenario.py) and the pool benchmark (agents/sim/poolscenario.py).

Format: a header `window_start_s,rate_rps`, then one row per 10-minute window (the rate is that
window's mean). A series may start at any `window_start_s`: it is shifted to start at 0. Every bad
line is a ValueError naming the file, the line and the column.

Mapping (`series_points`): the windows in [start_s, start_s + span_s) of the trace, each rate x
`scale`, as points at each window's middle divided by `compress` (trace seconds per simulated
second) - linear between them, flat before the first and after the last. A compressed day keeps
its shape and its phase between models but runs `compress` times faster, at the scaled rates (per
simulated second): the control loops (windows, cooldowns, weight loads) meet the tide `compress`
times steeper than they would in a real day.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path

from agents.schema import ObjectReader

RATE_COLUMNS = ("window_start_s", "rate_rps")
WINDOW_S = 600.0  # the servegen series' window (../shared/traces/README.md: per 10-min window)


def traces_dir() -> Path:
    """../shared/traces beside the checkout (or beside the folder of worktrees it sits in)."""
    root = Path(__file__).resolve().parent.parent.parent
    for up in (root, *root.parents[:2]):
        if (up / "shared" / "traces").is_dir():
            return up / "shared" / "traces"
    return root.parent / "shared" / "traces"


def read_rate_series(path: str | Path) -> tuple[tuple[float, float], ...]:
    """(t_s, rate_rps) per window, shifted so the first window starts at 0 (module docstring)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ValueError(f"{p}: cannot read it: {exc.strerror}") from None
    reader = csv.reader(text.splitlines())
    header = next(reader, None)
    if header is None or tuple(c.strip() for c in header) != RATE_COLUMNS:
        raise ValueError(f"{p}: header must be {','.join(RATE_COLUMNS)}; got {header}")
    rows: list[tuple[float, float]] = []
    for n, row in enumerate(reader, start=2):
        if not row:
            continue
        if len(row) != 2:
            raise ValueError(f"{p} line {n}: want 2 columns ({','.join(RATE_COLUMNS)}); got {len(row)}")
        values = []
        for col, raw in zip(RATE_COLUMNS, row, strict=True):
            try:
                v = float(raw)
            except ValueError:
                raise ValueError(f"{p} line {n}.{col}: not a number: {raw!r}") from None
            if not math.isfinite(v) or v < 0:
                raise ValueError(f"{p} line {n}.{col}: must be a finite number >= 0; got {raw!r}")
            values.append(v)
        if rows and values[0] <= rows[-1][0]:
            raise ValueError(f"{p} line {n}.window_start_s: must increase; {values[0]:g} follows {rows[-1][0]:g}")
        rows.append((values[0], values[1]))
    if not rows:
        raise ValueError(f"{p}: no windows")
    t0 = rows[0][0]
    return tuple((t - t0, r) for t, r in rows)


def span_of(series: Sequence[tuple[float, float]], start_s: float, span_s: float) -> list[tuple[float, float]]:
    """The windows that start in [start_s, start_s + span_s), times from start_s (trace seconds)."""
    chosen = [(t - start_s, r) for t, r in series if start_s <= t < start_s + span_s]
    if not chosen:
        raise ValueError(f"start_s: no window of the series lies in [{start_s:g}, {start_s + span_s:g}) s")
    return chosen


def series_points(windows: Sequence[tuple[float, float]], *, compress: float, scale: float,
                  duration_s: float) -> tuple[tuple[float, float], ...]:
    """`span_of`'s windows as (simulated t_s, rps) points at each window's middle (module docstring)."""
    return tuple((round(min(duration_s, (t + WINDOW_S / 2) / compress), 6), r * scale) for t, r in windows)


def read_series_rate(sr: ObjectReader | None, base_dir: Path | None) -> tuple[tuple[float, float], ...] | None:
    """`rate_rps: {series, start_s, span_s, compress, peak_rps}`: a rate series file (a name relative
    to the scenario, else to the shared traces folder) mapped as `series_points` does, scaled so
    its peak over the span is `peak_rps`."""
    if sr is None:
        return None
    name = sr.str("series")
    start = sr.num("start_s", 0.0, min=0.0)
    span = sr.num("span_s", min=0.0, exclusive_min=True)
    compress = sr.num("compress", 1.0, min=1.0)
    peak = sr.num("peak_rps", min=0.0, exclusive_min=True)
    sr.done()
    if None in (name, start, span, compress, peak):
        return None
    found = [d / name for d in (base_dir, traces_dir()) if d is not None and (d / name).is_file()]
    try:
        windows = span_of(read_rate_series(found[0] if found else Path(name)), start, span)
    except ValueError as exc:
        sr.fail("series", str(exc))
        return None
    top = max(r for _, r in windows)
    if top <= 0:
        sr.fail("series", f"{name}: the rate is 0 over the span")
        return None
    return series_points(windows, compress=compress, scale=peak / top, duration_s=span / compress)


__all__ = ["RATE_COLUMNS", "WINDOW_S", "read_rate_series", "read_series_rate", "series_points", "span_of", "traces_dir"]
