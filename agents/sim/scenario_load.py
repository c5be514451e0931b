"""The load of a scenario file (../shared/SCENARIOS.md `workload`): each deployment's arrivals -
Poisson at a rate (a number, [t_s, rps] points, or a rate series file: agents/sim/rateseries.py)
with prompt and output length distributions, or a trace CSV of requests. agents/sim/scenario.py
reads the rest of the file and calls read_workload; errors name the key's path as it does.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from agents.schema import ObjectReader, Problems
from agents.sim.rateseries import read_series_rate

DISTS = ("lognormal", "fixed", "uniform")
ARRIVALS = ("poisson", "trace")


@dataclass(frozen=True)
class DistSpec:
    dist: str  # lognormal | fixed | uniform
    mean: float | None = None  # lognormal: mean of the distribution itself
    sigma: float | None = None  # lognormal: sigma of its log
    value: int | None = None  # fixed
    min: int | None = None  # uniform
    max: int | None = None  # lognormal: clip; uniform: upper bound

    def expected(self) -> float:
        if self.dist == "fixed":
            return float(self.value or 0)
        if self.dist == "uniform":
            return ((self.min or 0) + (self.max or 0)) / 2
        return float(self.mean or 0)


@dataclass(frozen=True)
class TraceRow:
    t_s: float
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class WorkloadSpec:
    deployment: str
    arrival: str  # poisson | trace
    rate_points: tuple[tuple[float, float], ...] = ()  # piecewise-linear (t_s, rps); one point = constant
    prompt_tokens: DistSpec | None = None
    output_tokens: DistSpec | None = None
    trace: tuple[TraceRow, ...] = ()

    def rate_rps(self, t_s: float) -> float:
        """Arrival rate at t_s: linear between points, flat outside them."""
        pts = self.rate_points
        if not pts:
            return 0.0
        if t_s <= pts[0][0]:
            return pts[0][1]
        for (t0, r0), (t1, r1) in zip(pts, pts[1:], strict=False):
            if t_s <= t1:
                return r0 + (r1 - r0) * (t_s - t0) / (t1 - t0)
        return pts[-1][1]

    def max_rate_rps(self) -> float:
        return max((r for _, r in self.rate_points), default=0.0)


def _read_dist(dr: ObjectReader | None) -> DistSpec | None:
    if dr is None:
        return None
    dist = dr.str("dist", choices=DISTS)
    spec: DistSpec | None = None
    if dist == "lognormal":
        mean = dr.num("mean", min=0.0, exclusive_min=True)
        sigma = dr.num("sigma", min=0.0)
        mx = dr.int("max", min=1)
        if None not in (mean, sigma, mx):
            spec = DistSpec("lognormal", mean=mean, sigma=sigma, max=mx)
    elif dist == "fixed":
        value = dr.int("value", min=1)
        if value is not None:
            spec = DistSpec("fixed", value=value)
    elif dist == "uniform":
        lo = dr.int("min", min=1)
        hi = dr.int("max", min=1)
        if lo is not None and hi is not None:
            if hi < lo:
                dr.fail("max", f"must be >= min ({lo}); got {hi}")
            else:
                spec = DistSpec("uniform", min=lo, max=hi)
    dr.done()
    return spec


def _read_rate(wr: ObjectReader, base_dir: Path | None) -> tuple[tuple[float, float], ...] | None:
    raw = wr.raw("rate_rps")
    path = wr.child_path("rate_rps")
    if raw is None:
        return None
    if isinstance(raw, dict):
        return read_series_rate(wr.obj("rate_rps"), base_dir)
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        if raw < 0:
            wr.fail("rate_rps", f"must be >= 0; got {raw}")
            return None
        return ((0.0, float(raw)),)
    if not isinstance(raw, list) or not raw:
        wr.fail("rate_rps", "must be a number or a non-empty list of [t_s, rps] pairs")
        return None
    points: list[tuple[float, float]] = []
    for i, item in enumerate(raw):
        ok = (isinstance(item, list) and len(item) == 2
              and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in item))
        if not ok:
            wr.problems.add(f"{path}[{i}]", "must be a pair [t_s, rps] of numbers")
            return None
        t, rps = float(item[0]), float(item[1])
        if rps < 0:
            wr.problems.add(f"{path}[{i}]", f"rps must be >= 0; got {rps}")
            return None
        if points and t <= points[-1][0]:
            wr.problems.add(f"{path}[{i}]", f"t_s must increase; {t} follows {points[-1][0]}")
            return None
        points.append((t, rps))
    return tuple(points)


def _read_trace(wr: ObjectReader, base_dir: Path | None) -> tuple[TraceRow, ...] | None:
    name = wr.str("trace")
    if name is None:
        return None
    path = Path(name) if Path(name).is_absolute() or base_dir is None else base_dir / name
    try:
        with open(path, newline="") as fh:
            reader = csv.DictReader(fh)
            want = ["t_s", "prompt_tokens", "output_tokens"]
            if reader.fieldnames is None or [c.strip() for c in reader.fieldnames] != want:
                wr.fail("trace", f"{name}: columns must be {','.join(want)}; got {reader.fieldnames}")
                return None
            rows: list[TraceRow] = []
            last_t = -1.0
            for line_no, row in enumerate(reader, start=2):
                try:
                    t_s = float(row["t_s"])
                    prompt, output = int(row["prompt_tokens"]), int(row["output_tokens"])
                except (TypeError, ValueError):
                    wr.fail("trace", f"{name} line {line_no}: t_s must be a number, token counts integers")
                    return None
                if t_s < last_t or prompt < 1 or output < 1:
                    wr.fail("trace", f"{name} line {line_no}: t_s must not decrease and token counts must be >= 1")
                    return None
                last_t = t_s
                rows.append(TraceRow(t_s, prompt, output))
    except OSError as exc:
        wr.fail("trace", f"cannot read {path}: {exc.strerror}")
        return None
    return tuple(rows)


def read_workload(r: ObjectReader, deployments: set[str], base_dir: Path | None,
                   problems: Problems) -> list[WorkloadSpec]:
    out: list[WorkloadSpec] = []
    wlist = r.list("workload", min_len=1)
    if wlist is None:
        return out
    for wr in wlist.objects():
        dep = wr.str("deployment")
        arrival = wr.str("arrival", choices=ARRIVALS)
        if dep is not None and dep not in deployments:
            wr.fail("deployment", f"unknown deployment {dep!r}; define it under models")
            dep = None
        if arrival == "poisson":
            rate = _read_rate(wr, base_dir)
            prompt = _read_dist(wr.obj("prompt_tokens"))
            output = _read_dist(wr.obj("output_tokens"))
            wr.done()
            if None not in (dep, rate, prompt, output):
                out.append(WorkloadSpec(dep, "poisson", rate, prompt, output))  # type: ignore[arg-type]
        elif arrival == "trace":
            trace = _read_trace(wr, base_dir)
            wr.done()
            if dep is not None and trace is not None:
                out.append(WorkloadSpec(dep, "trace", trace=trace))
        else:
            wr.done()
    return out
