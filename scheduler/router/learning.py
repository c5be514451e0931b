"""Routing weights that learn from what happened, rolled out against round-robin with a way back.

Seed 003 (corollaries 3 and 5, and its "cold start can degrade" rule): the router's score weights
come from a feedback loop on real latencies, but a learned policy goes live only through a
cold start on round-robin, then 10% -> 50% -> 100% of traffic, each stage compared with
round-robin on the same window, and it is rolled back when its SLA-violation rate exceeds
round-robin's x 1.05. A sudden shift it has not seen (a new model, a viral prompt) sends the
traffic back to round-robin for a while.

The update: Hedge (multiplicative weights) over the score terms
---------------------------------------------------------------
Each scoring plugin (predicted_latency, prefix_affinity, topology_affinity) is an "expert" whose
advice for a request is its score of each candidate plan. When a request the learned policy routed
finishes, each term's *advocacy* of the plan it went to is that plan's score relative to the
other candidates' (min-max over the candidates: 1 = it ranked the chosen plan best, 0 = worst,
0.5 when it could not tell them apart). The loss of a term is its advocacy when the request missed
its SLO (it argued for a bad choice) and one minus it when the request met it (it argued against
a good one). Hedge then multiplies each weight by exp(-eta x loss) and rescales the weights to the
total the configuration started with, so the sum's scale - what the ties and the deadline rule in
pick.py compare - does not drift.

Why Hedge and not online gradient descent: the feedback is an indicator (met / missed), which has
no gradient - OGD would need a made-up differentiable surrogate; the losses are bounded in [0, 1],
which is exactly Hedge's setting, with regret O(sqrt(T log K)) against the best fixed term for K
terms; multiplicative updates keep every weight positive with no projection step, and a floor
(min_share of the total) keeps a term that is wrong for a while able to come back after a drift,
which plain Hedge would take exponentially long to do.

The rollout (RolloutController)
-------------------------------
Stages: COLD (everything on round-robin, for cold_start_s: the baseline is collected) ->
CANARY (shares[0], 10%) -> ... -> FULL (shares[-1], 100%). A request goes to the learned policy
when its key hashes below the stage's share (the same request key always lands on the same arm).
At FULL a control share (holdback, default 5%) stays on round-robin: a comparison needs
round-robin on the same window, and one from before a drift says nothing about after it - the
seed's "100%" leaves no control, so we keep a small one and say so.

At the end of each window (window_s) with at least min_requests on each arm: learned rate >
round-robin rate x rollback_ratio -> ROLLED_BACK (all round-robin for hold_s, then CANARY
again); otherwise the stage's window counts as passed and, after stage_windows passed windows,
the next stage begins. An anomaly - the window's arrival rate more than anomaly_z standard
deviations from the recent windows', or the set of plans changing - -> FALLBACK (round-robin for
hold_s, then CANARY). Every stage change is an event with both violation rates, for the audit.
"""

from __future__ import annotations

import enum
import hashlib
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class HedgeConfig:
    eta: float = 0.05  # learning rate
    min_share: float = 0.05  # no term falls below this share of the total

    def __post_init__(self) -> None:
        if not self.eta > 0:
            raise ValueError(f"eta: must be > 0; got {self.eta}")
        if not 0 <= self.min_share < 1:
            raise ValueError(f"min_share: must be in [0, 1); got {self.min_share}")


def advocacy(scores: Mapping[str, Sequence[float]], candidates: Sequence[int], chosen: int) -> dict[str, float]:
    """Per term, how strongly it ranked the chosen slot among the candidate slots (0..1)."""
    out = {}
    for term, per_slot in scores.items():
        values = [float(per_slot[i]) for i in candidates]
        lo, hi = min(values), max(values)
        out[term] = 0.5 if hi - lo < 1e-12 else (float(per_slot[chosen]) - lo) / (hi - lo)
    return out


def hedge_update(weights: Mapping[str, float], advocated: Mapping[str, float], violated: bool,
                 config: HedgeConfig = HedgeConfig()) -> dict[str, float]:
    """The weights after one finished request (module docstring); the total is kept."""
    total = sum(weights.values())
    if total <= 0:
        return dict(weights)
    raw = {}
    for term, w in weights.items():
        a = min(1.0, max(0.0, advocated.get(term, 0.5)))
        loss = a if violated else 1.0 - a
        raw[term] = w * math.exp(-config.eta * loss)
    s = sum(raw.values())
    shares = {t: v / s for t, v in raw.items()}
    floor = config.min_share
    low = [t for t, v in shares.items() if v < floor]
    if low and len(low) < len(shares):
        rest = 1.0 - floor * len(low)
        above = sum(v for t, v in shares.items() if t not in low)
        shares = {t: floor if t in low else v / above * rest for t, v in shares.items()}
    return {t: v * total for t, v in shares.items()}


class Stage(enum.StrEnum):
    COLD = "cold"  # round-robin only: the baseline
    CANARY = "canary"  # a share of the traffic, the rest on round-robin
    FULL = "full"  # all but the control holdback
    ROLLED_BACK = "rolled_back"  # it did worse than round-robin: round-robin for a while
    FALLBACK = "fallback"  # an anomaly: round-robin for a while


@dataclass(frozen=True)
class RolloutConfig:
    cold_start_s: float = 600.0
    window_s: float = 300.0
    stage_windows: int = 1  # windows passed before the next stage
    shares: tuple[float, ...] = (0.1, 0.5, 1.0)
    holdback: float = 0.05  # at FULL, this share stays on round-robin (the control)
    rollback_ratio: float = 1.05
    min_requests: int = 30  # per arm and window, for a comparison
    hold_s: float = 600.0  # after a rollback or an anomaly
    anomaly_z: float = 4.0
    anomaly_windows: int = 6  # recent windows the arrival rate is compared with

    def __post_init__(self) -> None:
        checks = {
            "cold_start_s": self.cold_start_s >= 0, "window_s": self.window_s > 0,
            "stage_windows": self.stage_windows >= 1, "rollback_ratio": self.rollback_ratio >= 1.0,
            "shares": bool(self.shares) and all(a < b for a, b in zip((0.0, *self.shares), self.shares,
                                                                        strict=False)) and self.shares[-1] <= 1.0,
            "holdback": 0 <= self.holdback < 1, "min_requests": self.min_requests >= 1, "hold_s": self.hold_s >= 0,
            "anomaly_z": self.anomaly_z > 0, "anomaly_windows": self.anomaly_windows >= 2,
        }
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"{bad[0]}: out of range ({getattr(self, bad[0])!r})")


@dataclass(frozen=True)
class StageChange:
    at_s: float
    before: Stage
    after: Stage
    share: float  # the learned policy's share from now on
    reason: str
    learned_violation_rate: float | None
    rr_violation_rate: float | None


@dataclass
class _Window:
    start_s: float
    requests: dict[str, int] = field(default_factory=lambda: {"learned": 0, "rr": 0})
    violations: dict[str, int] = field(default_factory=lambda: {"learned": 0, "rr": 0})
    arrivals: int = 0

    def rate(self, arm: str) -> float | None:
        n = self.requests[arm]
        return self.violations[arm] / n if n else None


class RolloutController:
    """Which arm a new request takes, and the stage machine (module docstring). Pure: time is passed in."""

    def __init__(self, config: RolloutConfig = RolloutConfig(), *, start_s: float = 0.0) -> None:
        self.config = config
        self.stage = Stage.COLD
        self.level = -1  # index into config.shares while CANARY / FULL
        self.since_s = start_s
        self.passed = 0
        self.events: list[StageChange] = []
        self.window = _Window(start_s)
        self.rates: list[float] = []  # arrivals per second of recent windows
        self.plans: frozenset[str] | None = None
        self.worst_ratio = 0.0  # largest learned / round-robin violation ratio over compared windows
        self.compared = 0

    @property
    def share(self) -> float:
        if self.stage is Stage.CANARY:
            return self.config.shares[self.level]
        if self.stage is Stage.FULL:
            return self.config.shares[-1] * (1.0 - self.config.holdback)
        return 0.0

    def arm(self, key: str) -> str:
        """"learned" or "rr" for a request (its key: the request id); counts the arrival."""
        self.window.arrivals += 1
        share = self.share
        if share <= 0:
            return "rr"
        h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") / 2**64
        return "learned" if h < share else "rr"

    def finished(self, arm: str, violated: bool) -> None:
        if arm not in ("learned", "rr"):
            raise ValueError(f"arm: must be 'learned' or 'rr'; got {arm!r}")
        self.window.requests[arm] += 1
        self.window.violations[arm] += int(violated)

    def plans_seen(self, plan_ids: frozenset[str], now_s: float) -> StageChange | None:
        """The deployment's plans now: a change (a new model version, a new plan) is an anomaly."""
        before, self.plans = self.plans, plan_ids
        if before is not None and before != plan_ids and self.stage in (Stage.CANARY, Stage.FULL):
            return self._go(Stage.FALLBACK, now_s, "the plans changed: back on round-robin while it settles",
                            None, None)
        return None

    def tick(self, now_s: float) -> StageChange | None:
        """Call often; acts at the end of a window (and of a cold start or a hold)."""
        cfg = self.config
        if self.stage is Stage.COLD and now_s - self.since_s >= cfg.cold_start_s:
            self._close_window(now_s)
            return self._go(Stage.CANARY, now_s, f"cold start on round-robin over ({cfg.cold_start_s:g} s)",
                            None, None, level=0)
        if self.stage in (Stage.ROLLED_BACK, Stage.FALLBACK) and now_s - self.since_s >= cfg.hold_s:
            self._close_window(now_s)
            return self._go(Stage.CANARY, now_s, f"held on round-robin for {cfg.hold_s:g} s: trying again",
                            None, None, level=0)
        if now_s - self.window.start_s < cfg.window_s:
            return None
        w = self._close_window(now_s)
        rate = w.arrivals / max(1e-9, now_s - w.start_s)
        recent = self.rates[-cfg.anomaly_windows - 1:-1]
        if self.stage in (Stage.CANARY, Stage.FULL) and len(recent) >= 2:
            mean, sd = statistics.fmean(recent), statistics.pstdev(recent)
            if abs(rate - mean) > cfg.anomaly_z * max(sd, 0.05 * mean, 1e-9):
                return self._go(Stage.FALLBACK, now_s, f"arrival rate {rate:.2f}/s against {mean:.2f}/s recently: "
                                f"an anomaly, back on round-robin", w.rate("learned"), w.rate("rr"))
        if self.stage not in (Stage.CANARY, Stage.FULL):
            return None
        learned, rr = w.rate("learned"), w.rate("rr")
        if learned is None or rr is None or min(w.requests.values()) < cfg.min_requests:
            return None  # too few requests on an arm to compare: the window does not count
        self.compared += 1
        ratio = learned / rr if rr > 0 else (math.inf if learned > 0 else 1.0)
        self.worst_ratio = max(self.worst_ratio, ratio)
        if learned > rr * cfg.rollback_ratio:
            return self._go(Stage.ROLLED_BACK, now_s, f"SLA violations {learned:.1%} against round-robin's "
                            f"{rr:.1%} (x{cfg.rollback_ratio:g} allowed): rolled back", learned, rr)
        self.passed += 1
        if self.passed >= cfg.stage_windows and self.level < len(cfg.shares) - 1:
            nxt = self.level + 1
            after = Stage.FULL if nxt == len(cfg.shares) - 1 else Stage.CANARY
            return self._go(after, now_s, f"SLA violations {learned:.1%} against round-robin's {rr:.1%}: "
                            f"on to {cfg.shares[nxt]:.0%}", learned, rr, level=nxt)
        return None

    def _close_window(self, now_s: float) -> _Window:
        w = self.window
        self.rates.append(w.arrivals / max(1e-9, now_s - w.start_s))
        del self.rates[:-(self.config.anomaly_windows + 1)]
        self.window = _Window(now_s)
        return w

    def _go(self, stage: Stage, now_s: float, reason: str, learned: float | None, rr: float | None, *,
            level: int = -1) -> StageChange:
        before = self.stage
        self.stage, self.level, self.since_s, self.passed = stage, level, now_s, 0
        change = StageChange(now_s, before, stage, self.share, reason, learned, rr)
        self.events.append(change)
        return change


def learned_weights(weights: Mapping[str, float], history: Sequence[tuple[Mapping[str, float], bool]],
                    config: HedgeConfig = HedgeConfig()) -> dict[str, float]:
    """Replay a sequence of (advocacy, violated) through hedge_update (tests, benches)."""
    out = dict(weights)
    for adv, violated in history:
        out = hedge_update(out, adv, violated, config)
    return out


__all__ = ["HedgeConfig", "RolloutConfig", "RolloutController", "Stage", "StageChange", "advocacy",
           "hedge_update", "learned_weights"]
