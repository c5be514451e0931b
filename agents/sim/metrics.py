"""What a replay measures, and how it is summarised.

`Recorder` collects during a run: every request's fate (finished with its times, or failed with
a reason), output tokens per time bin, cluster changes and what they broke, gear changes, and
the inputs of the utilisation figures. `summarize` turns that into the numbers `bench.replay`
prints and writes. Definitions (all latencies in seconds):

* tokens: output tokens generated within [0, duration_s] (the run's throughput; requests still
  running at the end are drained afterwards, their later tokens are not counted here).
* finished / lost: requests that completed / that ended with an explicit error. Admitted =
  finished + lost, always (a request is never silently gone; `check_conservation`).
* goodput_rps: finished requests that met both SLOs (TTFT <= slo.ttft_ms, mean time per output
  token <= slo.tpot_ms), per second of the scenario.
* TTFT, end-to-end, TPOT percentiles: over all finished requests of all deployments.
* The time series, the after-event figure and the steady figure use TTFT P95 by arrival time
  ("P95" below) - the latency a user feels first, and the seed's "P95 latency".
* worst_p95_after_event_s: for each cluster change (scenario events and timed returns), the
  P95 of the requests arriving in 5-minute windows starting at the change and every minute
  after it for 10 minutes; the worst window over all changes. Windows with fewer than
  `MIN_WINDOW_REQUESTS` requests are skipped.
* steady_p95_s: the P95 of the requests that arrive after a 5-minute warm-up and before the
  first cluster change (the whole run after warm-up when nothing happens): the undisturbed
  baseline, as the seed's "~380 ms before the preemption".
* event_to_serving_s: per change, 0.0 when it broke no serving plan; else the time until the
  deployments it broke serve with a new gear again (null if they never do).
* mem_util: GPU memory actually in use by our plans (weights + KV held, not the reserve) over
  the memory of the GPUs we hold (ours: not another tenant's, not failed), averaged over time.
  compute_util: model FLOPs utilisation - the linear layers' FLOPs of every token our plans
  computed (prompt chunks, recomputes and decode steps) over the dense BF16 peak of the GPUs we
  hold. (Not NVML's "a kernel ran" share, which rewards spreading thin batches over many GPUs.)
  Both over [0, duration_s]. gpu_hours_held: GPU-hours our plans held (from launch to release),
  each GPU counted once while any of our plans holds it (two plans sharing it are one GPU held).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

WARMUP_S = 300.0  # the steady figure ignores the first minutes (the first gear change)
WINDOW_S = 300.0  # the "5-minute" of the after-event figure
WINDOW_STEP_S = 60.0
AFTER_EVENT_S = 600.0  # windows start up to this long after a change
MIN_WINDOW_REQUESTS = 20


@dataclass
class SwitchRecord:
    """One gear change of one deployment, as a policy carried it out."""

    deployment: str
    started_s: float  # decision taken
    serving_s: float | None = None  # the new gear took traffic
    done_s: float | None = None  # the old plans released (or rolled back)
    from_shape: str = ""
    to_shape: str = ""
    trigger: str = ""  # what started it: topology, periodic, load, loss, oracle, ...
    outcome: str = "running"  # running | done | rolled_back
    migrated: int = 0  # sequences whose KV moved
    replayed: int = 0  # sequences recomputed on the new gear
    stayed: int = 0  # sequences left to finish on the old plans

    def to_dict(self) -> dict[str, Any]:
        return {
            "deployment": self.deployment, "started_s": _r(self.started_s), "serving_s": _r(self.serving_s),
            "done_s": _r(self.done_s), "from": self.from_shape, "to": self.to_shape, "trigger": self.trigger,
            "outcome": self.outcome, "migrated": self.migrated, "replayed": self.replayed, "stayed": self.stayed,
        }


@dataclass
class ChangeRecord:
    """One cluster change and what it broke."""

    t_s: float
    kind: str
    node: str | None
    text: str
    broke: dict[str, float | None] = field(default_factory=dict)  # deployment -> time it served again

    def to_serving_s(self) -> float | None:
        if not self.broke:
            return 0.0
        if any(v is None for v in self.broke.values()):
            return None
        return max(v - self.t_s for v in self.broke.values() if v is not None)


class Recorder:
    """Everything a run records (module docstring)."""

    def __init__(self, deployments: Sequence[str], slo_s: dict[str, tuple[float, float]], duration_s: float,
                 bin_s: float) -> None:
        self.deployments = list(deployments)
        self.dep_index = {d: i for i, d in enumerate(self.deployments)}
        self.slo_s = slo_s  # deployment -> (ttft_s, tpot_s)
        self.duration_s = duration_s
        self.bin_s = bin_s
        self.nbins = max(1, math.ceil(duration_s / bin_s))
        self.token_bins = [0.0] * self.nbins
        self.tokens_after = 0.0  # generated after duration_s (the drain)
        self.admitted = [0] * len(self.deployments)
        # finished requests, column-wise (cheap to append, cheap to turn into arrays)
        self.f_dep: list[int] = []
        self.f_arrival: list[float] = []
        self.f_ttft: list[float] = []
        self.f_e2e: list[float] = []
        self.f_tpot: list[float] = []
        self.f_ok: list[bool] = []
        self.f_output: list[int] = []
        self.f_prompt: list[int] = []
        self.f_replays: list[int] = []
        self.failed: list[tuple[int, str, float, str]] = []  # (rid, deployment, t_s, reason)
        self.changes: list[ChangeRecord] = []
        self.switches: list[SwitchRecord] = []
        self.gear_timeline: list[tuple[float, str, str, int]] = []  # (t_s, deployment, shape, gpus)
        self.open_breaks: dict[str, list[ChangeRecord]] = {}
        self.util: tuple[float, float] | None = None  # (mem_util, compute_util), set at duration_s
        self.gpu_hours = 0.0  # GPU-hours our plans held over [0, duration_s], set then too
        self.end_s = 0.0  # when the last request finished (the drain's end)

    def add_deployment(self, deployment: str, slo_s: tuple[float, float]) -> None:
        """Record a deployment that joined after the start (the live fleet: one the console created)."""
        if deployment in self.dep_index:
            raise ValueError(f"deployment: {deployment!r} is recorded already")
        self.dep_index[deployment] = len(self.deployments)
        self.deployments.append(deployment)
        self.slo_s[deployment] = slo_s
        self.admitted.append(0)

    # --- hot path ---------------------------------------------------------------------------
    def tokens(self, t0: float, t1: float, n: float) -> None:
        """n output tokens generated evenly over [t0, t1]."""
        bin_s = self.bin_s
        b = int(t1 / bin_s)
        if t1 <= self.duration_s and (t1 <= t0 or int(t0 / bin_s) == b):
            self.token_bins[min(b, self.nbins - 1)] += n
            return
        if t1 <= t0:
            self.tokens_after += n
            return
        # spread over the bins the span crosses (rare: spans are short)
        rate = n / (t1 - t0)
        t = t0
        while t < t1:
            if t >= self.duration_s:
                self.tokens_after += rate * (t1 - t)
                return
            b = int(t / bin_s)
            edge = min(t1, (b + 1) * bin_s, self.duration_s)
            self.token_bins[min(b, self.nbins - 1)] += rate * (edge - t)
            t = edge

    def finished(self, deployment: str, arrival_s: float, first_s: float, finish_s: float, output: int,
                 replays: int, prompt: int = 0) -> None:
        i = self.dep_index[deployment]
        ttft = first_s - arrival_s
        tpot = (finish_s - first_s) / (output - 1) if output > 1 else 0.0
        slo_ttft, slo_tpot = self.slo_s[deployment]
        self.f_dep.append(i)
        self.f_arrival.append(arrival_s)
        self.f_ttft.append(ttft)
        self.f_e2e.append(finish_s - arrival_s)
        self.f_tpot.append(tpot)
        self.f_ok.append(ttft <= slo_ttft and tpot <= slo_tpot)
        self.f_output.append(output)
        self.f_prompt.append(prompt)
        self.f_replays.append(replays)
        if finish_s > self.end_s:
            self.end_s = finish_s

    # --- changes and gears ------------------------------------------------------------------
    def change(self, t_s: float, kind: str, node: str | None, text: str, broke: Sequence[str]) -> None:
        rec = ChangeRecord(t_s, kind, node, text, {d: None for d in broke})
        self.changes.append(rec)
        for d in broke:
            self.open_breaks.setdefault(d, []).append(rec)

    def gear_serving(self, deployment: str, t_s: float, shape: str, gpus: int) -> None:
        """A new gear of `deployment` takes traffic: it closes what earlier changes broke."""
        self.gear_timeline.append((t_s, deployment, shape, gpus))
        for rec in self.open_breaks.pop(deployment, []):
            rec.broke[deployment] = t_s


def _r(v: float | None, digits: int = 6) -> float | None:
    """Rounded for JSON (stable text across platforms; finite or null)."""
    if v is None or not math.isfinite(v):
        return None
    return round(float(v), digits)


def _pct(values: np.ndarray, q: float) -> float | None:
    if values.size == 0:
        return None
    return float(np.percentile(values, q))


def check_conservation(rec: Recorder, in_system: int) -> None:
    """Invariant 1: admitted = finished + failed (+ what is still in the system)."""
    admitted = sum(rec.admitted)
    ended = len(rec.f_dep) + len(rec.failed)
    if admitted != ended + in_system:
        raise AssertionError(
            f"conservation: admitted {admitted} != finished {len(rec.f_dep)} + failed {len(rec.failed)}"
            f" + in the system {in_system}")


def summarize(rec: Recorder, *, switch_count: int, restarts: int = 0) -> dict[str, Any]:
    """The per-policy figures (module docstring). Plain JSON types, rounded, deterministic."""
    arrival = np.asarray(rec.f_arrival, dtype=float)
    ttft = np.asarray(rec.f_ttft, dtype=float)
    e2e = np.asarray(rec.f_e2e, dtype=float)
    tpot = np.asarray(rec.f_tpot, dtype=float)
    ok = np.asarray(rec.f_ok, dtype=bool)
    dep = np.asarray(rec.f_dep, dtype=int)
    duration = rec.duration_s
    change_times = sorted({c.t_s for c in rec.changes})
    steady_end = change_times[0] if change_times else duration
    steady = ttft[(arrival >= min(WARMUP_S, steady_end / 2)) & (arrival < steady_end)]
    if steady.size < MIN_WINDOW_REQUESTS:
        steady = ttft
    worst: float | None = None
    per_change: dict[float, float | None] = {}
    for t_e in change_times:
        start = t_e
        mine: float | None = None
        while start <= t_e + AFTER_EVENT_S and start < duration:
            sel = ttft[(arrival >= start) & (arrival < start + WINDOW_S)]
            if sel.size >= MIN_WINDOW_REQUESTS:
                p = float(np.percentile(sel, 95))
                mine = p if mine is None else max(mine, p)
            start += WINDOW_STEP_S
        per_change[t_e] = mine
        if mine is not None:
            worst = mine if worst is None else max(worst, mine)
    switch_durations = [s.serving_s - s.started_s for s in rec.switches if s.serving_s is not None]
    mem_util, compute_util = rec.util if rec.util is not None else (0.0, 0.0)
    per_dep: dict[str, Any] = {}
    for i, name in enumerate(rec.deployments):
        sel = dep == i
        per_dep[name] = {
            "admitted": rec.admitted[i],
            "finished": int(sel.sum()),
            "lost": sum(1 for f in rec.failed if f[1] == name),
            "goodput_rps": _r(float(ok[sel].sum()) / duration),
            "slo_attainment": _r(float(ok[sel].mean()) if sel.any() else None),
            "ttft_p50_s": _r(_pct(ttft[sel], 50)),
            "ttft_p95_s": _r(_pct(ttft[sel], 95)),
            "ttft_p99_s": _r(_pct(ttft[sel], 99)),
            "tpot_p50_s": _r(_pct(tpot[sel], 50)),
            "tpot_p95_s": _r(_pct(tpot[sel], 95)),
            "e2e_p95_s": _r(_pct(e2e[sel], 95)),
        }
    # time series: tokens/s per bin; P95 TTFT of the requests arriving in each bin
    bins = rec.nbins
    bin_idx = np.minimum((arrival / rec.bin_s).astype(int), bins - 1) if arrival.size else np.zeros(0, int)
    order = np.argsort(bin_idx, kind="stable")
    sorted_bins = bin_idx[order]
    sorted_ttft = ttft[order]
    edges = np.searchsorted(sorted_bins, np.arange(bins + 1))
    p95_series: list[float | None] = []
    for b in range(bins):
        chunk = sorted_ttft[edges[b]:edges[b + 1]]
        p95_series.append(_r(float(np.percentile(chunk, 95)), 4) if chunk.size >= 5 else None)
    return {
        "tokens": int(round(sum(rec.token_bins))),
        "tokens_incl_drain": int(round(sum(rec.token_bins) + rec.tokens_after)),
        "admitted": sum(rec.admitted),
        "finished": int(ttft.size),
        "lost": len(rec.failed),
        "goodput_rps": _r(float(ok.sum()) / duration),
        "slo_attainment": _r(float(ok.mean()) if ok.size else None),
        "ttft_p50_s": _r(_pct(ttft, 50)),
        "ttft_p95_s": _r(_pct(ttft, 95)),
        "ttft_p99_s": _r(_pct(ttft, 99)),
        "e2e_p50_s": _r(_pct(e2e, 50)),
        "e2e_p95_s": _r(_pct(e2e, 95)),
        "e2e_p99_s": _r(_pct(e2e, 99)),
        "tpot_p50_s": _r(_pct(tpot, 50)),
        "tpot_p95_s": _r(_pct(tpot, 95)),
        "worst_p95_after_event_s": _r(worst),
        "worst_p95_after_each_change_s": [_r(per_change.get(c.t_s)) for c in rec.changes],
        "steady_p95_s": _r(_pct(steady, 95)),
        "switches": switch_count,
        "restarts": restarts,
        "switch_durations_s": [_r(d, 3) for d in switch_durations],
        "event_to_serving_s": [_r(c.to_serving_s(), 3) for c in rec.changes],
        "mem_util": _r(mem_util, 4),
        "gpu_hours_held": _r(rec.gpu_hours, 3),
        "compute_util": _r(compute_util, 4),
        "replayed_requests": int(sum(1 for r in rec.f_replays if r > 0)),
        "drain_end_s": _r(rec.end_s, 3),
        "failures": [{"rid": rid, "deployment": d, "t_s": _r(t, 3), "reason": why} for rid, d, t, why in rec.failed[:20]],
        "per_deployment": per_dep,
        "series": {
            "bin_s": rec.bin_s,
            "tokens_per_s": [_r(v / rec.bin_s, 3) for v in rec.token_bins],
            "ttft_p95_s": p95_series,
        },
        "switch_log": [s.to_dict() for s in rec.switches],
        "gear_timeline": [[_r(t, 3), d, shape, gpus] for t, d, shape, gpus in rec.gear_timeline],
    }
