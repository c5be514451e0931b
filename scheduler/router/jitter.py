"""Jitter demotion (seed 003's fourth component): a plan whose first tokens come late, beyond
what its hardware and load explain, is demoted to a retry pool until it recovers.

What is measured is not the raw TTFT - on a mixed pool an L40S plan is slower than an H100 plan
by design, and a z-score of raw TTFTs would demote it for being what it is - but the residual
r = observed TTFT / the TTFT the router predicted for that request on that plan, and of those
not their level but their tail: jitter_p = p99(r) / p50(r) over the plan's residuals of the last
`window_s` (seed: 5 minutes). A plan the cost model merely mispredicts (it shares its GPUs with
another plan during a switch, its efficiency differs from the fit) has residuals that are
consistently off, not spread: its ratio stays near a healthy plan's, and it keeps its traffic.
A jittery plan (a flapping NVLink, thermal throttling, a noisy neighbour) has a heavy tail.

Its z-score is against the *other* plans (leave-one-out, robust): z = (jitter - median of the
others' jitter) / max(1.4826 x their MAD, scale_floor x their median). Leaving the plan out keeps
one bad plan from hiding itself in the spread it causes, and the floor keeps a pool of
near-identical plans from calling a small difference jitter; both make the test meaningful from
two plans up (a plain z-score over n plans can never exceed (n - 1) / sqrt(n): 1.15 with three).

A plan is demoted at z > `z_demote` and stays demoted until z < `z_recover` (hysteresis) or until
fewer than `min_samples` of its residuals remain in the window: a demoted plan gets little
traffic, so the evidence against it ages out and it is tried again, as a circuit breaker's
half-open state does.

Demoted is not removed (seed 003: on a mixed pool, kicking a card out can degrade the whole
layer). A demoted plan is priced as its tail says - its predicted TTFT x its `factor`, its ratio
over the others' median ratio - and sits in the retry pool: tried after the top-K of the healthy
plans, unless even so priced it beats the best of them (the healthy plans are that much slower:
it takes the overflow), and a candidate as any other when nothing else passes the filters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from scheduler.router._arrays import Bools, Floats

if TYPE_CHECKING:
    from scheduler.router.pool import Pool

NAME = "jitter"


@dataclass(frozen=True)
class JitterConfig:
    """Knobs of the demotion (module docstring); defaults are stated choices, not fits."""

    window_s: float = 300.0  # seed 003: TTFT p99 history over the past 5 minutes
    z_demote: float = 3.0
    z_recover: float = 1.5
    min_samples: int = 20  # a p99 of fewer residuals is not evidence
    scale_floor: float = 0.5  # the spread is at least half the others' median ratio: queueing alone
    # makes TTFT residual tails of 2-3x the median; jitter worth acting on is beyond that
    update_s: float = 5.0  # z-scores are recomputed at most this often (a 60th of the window)
    max_samples: int = 1000  # per plan, the newest kept (a p99 of 1000 is its 10th largest)
    predicted_floor_s: float = 0.01  # predictions below this count as this (overheads dominate)

    def __post_init__(self) -> None:
        if not self.window_s > 0 or not self.update_s >= 0:
            raise ValueError("jitter: window_s must be > 0 and update_s >= 0")
        if not self.z_recover <= self.z_demote:
            raise ValueError(f"jitter.z_recover: must be <= z_demote ({self.z_demote}), got {self.z_recover}")
        if self.min_samples < 1 or self.max_samples < self.min_samples:
            raise ValueError("jitter: min_samples must be >= 1 and max_samples >= min_samples")


class JitterTracker:
    """Residuals per plan and the demoted set (module docstring)."""

    def __init__(self, config: JitterConfig | None = None) -> None:
        self.config = config or JitterConfig()
        self._samples: dict[str, _Ring] = {}
        self._demoted: frozenset[str] = frozenset()
        self._factor: dict[str, float] = {}  # demoted plan -> its tail ratio over the others' median
        self._z: dict[str, float] = {}
        self._tail: dict[str, float] = {}
        self._updated_s = -1e18
        self._dirty = False
        self.version = 0  # bumps when the demoted set changes

    def observe(self, plan_id: str, now_s: float, ttft_s: float, predicted_s: float) -> None:
        """A first token came out on `plan_id`, `ttft_s` after arrival; the router had predicted
        `predicted_s`."""
        cfg = self.config
        ring = self._samples.get(plan_id)
        if ring is None:
            ring = self._samples[plan_id] = _Ring(cfg.max_samples)
        ring.add(now_s, ttft_s / max(predicted_s, cfg.predicted_floor_s))
        self._dirty = True

    def forget(self, plan_id: str) -> None:
        self._samples.pop(plan_id, None)
        self._dirty = True

    def demoted(self, now_s: float) -> frozenset[str]:
        """The plans in the retry pool now."""
        if now_s - self._updated_s >= self.config.update_s and (self._dirty or self._demoted):
            self._update(now_s)
        return self._demoted

    def demotion(self, pool: Pool, now_s: float) -> tuple[Bools, Floats] | None:
        """(mask of the pool's demoted plans, each plan's TTFT factor: 1 unless demoted); None
        when none of the pool's plans is demoted."""
        demoted = self.demoted(now_s)
        if not demoted:
            return None
        memo = pool.cache.get(NAME)
        if isinstance(memo, tuple) and memo[0] == (id(self), self.version):
            hit: tuple[Bools, Floats] | None = memo[1]
            return hit
        mask = np.array([pid in demoted for pid in pool.ids], dtype=np.bool_)
        factor = np.array([self._factor.get(pid, 1.0) for pid in pool.ids], dtype=np.float64)
        out = (mask, factor) if mask.any() else None
        pool.cache[NAME] = ((id(self), self.version), out)
        return out

    def zscores(self, now_s: float) -> dict[str, float]:
        """plan id -> its z-score at the last update (plans with enough samples)."""
        self.demoted(now_s)
        return dict(self._z)

    def _update(self, now_s: float) -> None:
        cfg = self.config
        horizon = now_s - cfg.window_s
        tail: dict[str, float] = {}  # plan -> p99 / p50 of its residuals
        for pid, ring in list(self._samples.items()):
            values = ring.since(horizon)
            if not len(values):
                del self._samples[pid]
            elif len(values) >= cfg.min_samples:
                hi = min(len(values) - 1, int(math.ceil(0.99 * len(values))) - 1)
                mid = (len(values) - 1) // 2
                part = np.partition(values, (mid, hi))
                tail[pid] = float(part[hi]) / max(float(part[mid]), 1e-9)
        z: dict[str, float] = {}
        centers: dict[str, float] = {}
        if len(tail) >= 2:
            values = np.array(list(tail.values()))
            for i, pid in enumerate(tail):
                others = np.delete(values, i)
                center = float(np.median(others))
                mad = float(np.median(np.abs(others - center)))
                scale = max(1.4826 * mad, cfg.scale_floor * center, 1e-9)
                z[pid] = (tail[pid] - center) / scale
                centers[pid] = center
        demoted = set()
        for pid, score in z.items():
            if score > cfg.z_demote or (pid in self._demoted and score >= cfg.z_recover):
                demoted.add(pid)
        frozen = frozenset(demoted)
        factor = {pid: max(1.0, tail[pid] / max(centers[pid], 1e-9)) for pid in frozen}
        if frozen != self._demoted or factor != self._factor:
            self._demoted, self._factor = frozen, factor
            self.version += 1
        self._z, self._tail = z, tail
        self._updated_s = now_s
        self._dirty = False



class _Ring:
    """The newest `size` (time, residual) samples of one plan."""

    __slots__ = ("times", "values", "n")

    def __init__(self, size: int) -> None:
        self.times = np.full(size, -np.inf)
        self.values = np.zeros(size)
        self.n = 0

    def add(self, t: float, value: float) -> None:
        i = self.n % len(self.times)
        self.times[i] = t
        self.values[i] = value
        self.n += 1

    def since(self, t: float) -> npt.NDArray[np.float64]:
        out: npt.NDArray[np.float64] = self.values[self.times >= t]
        return out
