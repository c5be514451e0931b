"""The global correction loop and the engines' hint book: the two faster time scales under the gears.

Three loops, each slower than the one below it (seed 003, "independent decisions, global correction"):

* the **local loop** of each engine (FLEXPIPE_LOCAL_LOOP_S, default 100 ms): admission and the
  batch-token threshold of every round, decided by the engine alone;
* the **global correction** (FLEXPIPE_GLOBAL_LOOP_S, default 500 ms): `GlobalCorrection.step`
  reads every plan of a deployment and sends each a `Hint` - a router weight multiplier and a
  scale of the engine's batch-token threshold - over the agent protocol (`apply_hints`,
  agents/protocol/);
* the **gear loop** (FLEXPIPE_TICK_S, 15 s: scheduler/control/loop.py), which changes plans.

Seed 003 corollary 4: the global loop runs at most 5x slower than the local one (100 ms / 500 ms);
faster, it couples with the local loop and oscillates, slower it corrects too late. The console
warns about a ratio above 5 and refuses a global period that reaches the gear loop's
(console/gearbox/checks.py).

A global loop that is down leaves the local loops running: a hint carries `ttl_s`, after which
the engine's `HintBook` returns its own defaults (weight multiplier 1, its own threshold). Hints
never start, stop or admit anything; they only move two knobs inside bounds.

The rules of `GlobalCorrection.step`, per deployment, in order:

 1. A plan's load is (running + waiting) / capacity (capacity: its relative throughput, 1 when
    unknown). Imbalance = population std / mean of the plans' loads (0 with fewer than two plans
    or no load at all).
 2. Weights (a weak lever: the router ranks plans by its score and uses a plan's weight only to
    break a tie, as "outstanding requests relative to weight": scheduler/router/pick.py).
    Imbalance above `imbalance_high`: the most loaded plan's multiplier is divided by
    (1 + weight_step), the least loaded's multiplied by it, both inside [weight_min, weight_max].
    Imbalance below `imbalance_low` (hysteresis): every multiplier moves one step back towards 1.
    In between: held.
 3. Batching, per plan: a scale of the engine's own batch-token threshold, in
    [batch_scale_min, 1]. The verdict is the plan's SLA-violation rate (finished requests that
    missed TTFT or TPOT over finished requests) over the last `window_s`, counting only what
    finished after the plan's last move (what finished before it was served under the old
    setting), and no verdict under `min_samples` such requests. In order:
    a. held for `batch_hold_s` after a move (anti-windup: the next verdict is on traffic served
       under the new setting, not on the window that caused the move);
    b. verdict above `violation_target`: the scale is divided by `batch_step`, not under
       batch_scale_min (smaller rounds: each token sooner, lower TTFT and TPOT);
    c. verdict at or under `violation_target / 2` (hysteresis) with the scale below 1: multiplied by
       `batch_step`, never past 1 (the violations cleared: back towards the engine's default);
    d. no verdict for `window_s` since the last move (too little traffic to judge by): one step
       back towards 1;
    e. otherwise held.
    Never above 1: a bigger threshold only helps when admission queueing, not the rounds, is the
    limit, and no engine report tells the two apart (TTFT holds both); in the simulator a fixed 2x
    against the engines alone did not help at 9-10 rps and hurt at 12-15 (python -m bench.correction).
    Measured (python -m bench.correction, SLO attainment, engines alone -> with this loop): seed 3,
    6 and 9 rps 100% -> 100%, 12 rps 98.34% -> 98.48%, 13 rps 91.63% -> 92.65%, 14 rps 44.13% ->
    65.07%; seeds 3-12 at 12 rps 97.74% -> 97.75% on average, seed by seed -0.38 to +0.25 points
    (at 13 rps -0.52 to +23.08). It reacts to a burst a window late: a fixed 0.5 does better there
    (99.46% at 12 rps), at the cost of TTFT when the load is light.
    The hint's direction says where the scale stands: **speed_up** below 1, **hold** at 1
    (**slow_down**, above 1, is the protocol's, for a hint set by hand).

    A scale, not a token count: each engine multiplies its own threshold by it (vLLM's default
    is 2048 tokens per step, the torch engine's 256), so one rule serves every engine.
 4. Every hint of a step carries the step's `hints_version` (strictly increasing: a loop that
    restarts starts from `start_version`, the console's wall clock in ms) and `ttl_s`. `due`
    says which hints to send: those that changed since last sent, and those last sent
    ttl_s / 2 ago or more (refreshed before the engine drops them).

An engine's `HintBook` keeps, per deployment, the newest hints_version it applied and ignores an
older or equal one (a delayed command cannot undo a newer correction).

Pure, deterministic, no clock but `now_s`.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

LOCAL_LOOP_S = 0.1  # seed 003: the per-engine batching loop, every 100 ms
GLOBAL_LOOP_S = 0.5  # seed 003: the global correction signal, every 500 ms
MAX_LOOP_RATIO = 5.0  # seed 003 corollary 4: global at most 5x the local period


class Direction(enum.StrEnum):
    SPEED_UP = "speed_up"  # smaller batch-token threshold: lower latency per token
    SLOW_DOWN = "slow_down"  # bigger batch-token threshold: more throughput, slower rounds
    HOLD = "hold"


@dataclass(frozen=True)
class CorrectionConfig:
    imbalance_high: float = 0.25  # std/mean of load above which weight moves
    imbalance_low: float = 0.10  # below which multipliers return towards 1
    weight_step: float = 0.25  # multiplicative step of a weight multiplier
    weight_min: float = 0.5
    weight_max: float = 2.0
    violation_target: float = 0.05  # SLA-violation rate the batching rule aims under
    window_s: float = 10.0  # the sliding window of SLA outcomes
    min_samples: int = 20  # finished requests (since the last move) before the rate says anything
    batch_step: float = 1.5
    # after a threshold move the plan's threshold is held this long (rule 3a): without a hold the
    # rule integrates over a window that lags its own moves and winds up to a bound (the first
    # rule, which also grew above 1, in python -m bench.correction at 12 rps: 93.8% SLO attainment
    # with [1/8, 8] and no hold, 98.3% with no loop). One window by default: the next verdict is
    # then on a window served wholly under the new setting
    batch_hold_s: float = 10.0
    batch_scale_min: float = 0.5  # of the engine's own batch-token threshold; the most is 1 (rule 3)
    ttl_s: float = 5.0  # a hint lasts this long unless refreshed (10 global periods)

    def __post_init__(self) -> None:
        for name in ("imbalance_high", "weight_step", "violation_target", "window_s", "ttl_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name}: must be a finite number > 0; got {value!r}")
        if not 0 <= self.imbalance_low <= self.imbalance_high:
            raise ValueError(f"imbalance_low: must be in [0, imbalance_high]; got {self.imbalance_low!r}")
        if not 0 < self.weight_min <= 1 <= self.weight_max:
            raise ValueError(f"weight_min, weight_max: need 0 < min <= 1 <= max; got {self.weight_min}, "
                             f"{self.weight_max}")
        if not self.batch_step > 1:
            raise ValueError(f"batch_step: must be > 1; got {self.batch_step!r}")
        if not 0 < self.batch_scale_min <= 1:
            raise ValueError(f"batch_scale_min: must be in (0, 1]; got {self.batch_scale_min!r}")
        if not (math.isfinite(self.batch_hold_s) and self.batch_hold_s >= 0):
            raise ValueError(f"batch_hold_s: must be a finite number >= 0; got {self.batch_hold_s!r}")
        if self.min_samples < 1:
            raise ValueError(f"min_samples: must be >= 1; got {self.min_samples!r}")


@dataclass(frozen=True)
class PlanSignal:
    """What the global loop reads of one plan at a step (its engine report's figures)."""

    plan_id: str
    running: int
    waiting: int
    kv_usage: float = 0.0  # 0..1
    capacity: float = 1.0  # relative throughput (1: all plans alike)
    finished: int = 0  # requests finished since the previous step
    violated: int = 0  # of those, the ones that missed the SLO

    def __post_init__(self) -> None:
        if self.running < 0 or self.waiting < 0 or self.finished < 0 or not 0 <= self.violated <= self.finished:
            raise ValueError(f"{self.plan_id}: running, waiting, finished >= 0 and 0 <= violated <= finished; got "
                             f"{self.running}, {self.waiting}, {self.finished}, {self.violated}")
        if not (math.isfinite(self.capacity) and self.capacity > 0):
            raise ValueError(f"{self.plan_id}.capacity: must be a finite number > 0; got {self.capacity!r}")

    @property
    def load(self) -> float:
        return (self.running + self.waiting) / self.capacity


@dataclass(frozen=True)
class Hint:
    """One plan's correction: the wire form is `apply_hints`' plans[i] (agents/protocol/)."""

    plan_id: str
    direction: Direction
    weight_multiplier: float
    batch_scale: float  # times the engine's own batch-token threshold

    def to_dict(self) -> dict[str, object]:
        return {"plan_id": self.plan_id, "direction": self.direction.value,
                "weight_multiplier": self.weight_multiplier, "batch_scale": self.batch_scale}


@dataclass(frozen=True)
class Hints:
    """A step's output for one deployment."""

    deployment: str
    hints_version: int
    ttl_s: float
    imbalance: float
    hints: tuple[Hint, ...]
    violation_rates: Mapping[str, float | None] = field(default_factory=dict)


class SlidingWindow:
    """(time, finished, violated) tallies of the last `window_s` seconds; the rate over them.
    (scheduler.router.learning's windows are tumbling comparison windows of a rollout: another thing.)"""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._items: deque[tuple[float, int, int]] = deque()
        self.finished = 0
        self.violated = 0

    def add(self, now_s: float, finished: int, violated: int) -> None:
        if finished:
            self._items.append((now_s, finished, violated))
            self.finished += finished
            self.violated += violated
        self.trim(now_s)

    def trim(self, now_s: float) -> None:
        while self._items and self._items[0][0] <= now_s - self.window_s:
            _, f, v = self._items.popleft()
            self.finished -= f
            self.violated -= v

    def rate(self, min_samples: int = 1) -> float | None:
        return self.violated / self.finished if self.finished >= min_samples else None

    def rate_since(self, since_s: float, min_samples: int = 1) -> float | None:
        """The rate over what the window holds from after `since_s`."""
        finished = violated = 0
        for t, f, v in self._items:
            if t > since_s:
                finished += f
                violated += v
        return violated / finished if finished >= min_samples else None


def imbalance(loads: Iterable[float]) -> float:
    """Population std / mean of the loads; 0 with fewer than two, or none loaded."""
    values = list(loads)
    if len(values) < 2:
        return 0.0
    mean = statistics.fmean(values)
    return statistics.pstdev(values) / mean if mean > 0 else 0.0


def _clamp(value: float, lo: float, hi: float) -> float:
    return min(hi, max(lo, value))


def _towards_one(value: float, step: float) -> float:
    """One multiplicative step from value towards 1, never past it."""
    return min(1.0, value * step) if value < 1 else max(1.0, value / step)


class GlobalCorrection:
    """The global loop's memory (multipliers, thresholds, windows, what was sent); rules in the
    module docstring."""

    def __init__(self, config: CorrectionConfig = CorrectionConfig(), *, start_version: int = 0) -> None:
        self.config = config
        self.version = start_version  # the last hints_version issued
        self.weights: dict[tuple[str, str], float] = {}
        self.batch: dict[tuple[str, str], float] = {}
        self.moved: dict[tuple[str, str], float] = {}  # when a plan's threshold last moved
        self.windows: dict[tuple[str, str], SlidingWindow] = {}
        self.sent: dict[tuple[str, str], tuple[Hint, float]] = {}  # last sent hint and when

    def step(self, now_s: float, deployment: str, plans: Sequence[PlanSignal]) -> Hints:
        cfg = self.config
        self.version += 1
        ids = {p.plan_id for p in plans}
        for key in [k for k in self.weights if k[0] == deployment and k[1] not in ids]:
            self._forget(key)  # a plan gone with a gear change
        keys = [(deployment, p.plan_id) for p in plans]
        imb = imbalance(p.load for p in plans)
        # rule 2: weights
        if imb > cfg.imbalance_high:
            busiest = max(range(len(plans)), key=lambda i: (plans[i].load, plans[i].plan_id))
            idlest = min(range(len(plans)), key=lambda i: (plans[i].load, plans[i].plan_id))
            self._scale_weight(keys[busiest], 1 / (1 + cfg.weight_step))
            self._scale_weight(keys[idlest], 1 + cfg.weight_step)
        elif imb < cfg.imbalance_low:
            for key in keys:
                w = self.weights.get(key, 1.0)
                back = w * (1 + cfg.weight_step) if w < 1 else w / (1 + cfg.weight_step)
                self.weights[key] = min(back, 1.0) if w < 1 else max(back, 1.0)
        # rule 3: batching
        hints, rates = [], {}
        for key, p in zip(keys, plans, strict=True):
            window = self.windows.setdefault(key, SlidingWindow(cfg.window_s))
            window.add(now_s, p.finished, p.violated)
            moved = self.moved.get(key, -math.inf)
            rate = window.rate_since(moved, cfg.min_samples)
            rates[p.plan_id] = rate
            batch = before = self.batch.get(key, 1.0)
            if now_s - moved < cfg.batch_hold_s:
                pass  # 3a: held, the verdict is on traffic served under the new setting
            elif rate is not None and rate > cfg.violation_target:
                batch = max(cfg.batch_scale_min, batch / cfg.batch_step)  # 3b
            elif rate is not None and rate <= cfg.violation_target / 2 and batch < 1:
                batch = min(1.0, batch * cfg.batch_step)  # 3c
            elif rate is None and now_s - moved >= cfg.window_s:
                batch = _towards_one(batch, cfg.batch_step)  # 3d
            self.batch[key] = batch
            if batch != before:
                self.moved[key] = now_s
            direction = Direction.SPEED_UP if batch < 1 else Direction.SLOW_DOWN if batch > 1 else Direction.HOLD
            hints.append(Hint(p.plan_id, direction, round(self.weights.get(key, 1.0), 6), round(batch, 6)))
        return Hints(deployment, self.version, cfg.ttl_s, imb, tuple(hints), rates)

    def due(self, hints: Hints, now_s: float) -> list[Hint]:
        """The hints to send now (rule 4), marked sent."""
        out = []
        for h in hints.hints:
            key = (hints.deployment, h.plan_id)
            last = self.sent.get(key)
            changed = last is None or (last[0].weight_multiplier, last[0].batch_scale) != (
                h.weight_multiplier, h.batch_scale)
            if changed or now_s - last[1] >= hints.ttl_s / 2:  # type: ignore[index]
                self.sent[key] = (h, now_s)
                out.append(h)
        return out

    def _scale_weight(self, key: tuple[str, str], factor: float) -> None:
        cfg = self.config
        self.weights[key] = _clamp(self.weights.get(key, 1.0) * factor, cfg.weight_min, cfg.weight_max)

    def _forget(self, key: tuple[str, str]) -> None:
        for book in (self.weights, self.batch, self.moved, self.windows, self.sent):
            book.pop(key, None)


@dataclass(frozen=True)
class Applied:
    """What an engine holds for one plan: a hint and until when."""

    hint: Hint
    version: int
    until_s: float


class HintBook:
    """An agent's hints, per (deployment, plan): the newest version wins, each lapses after its ttl.
    The engine's local loop asks `batch_tokens` and `weight` on every round; with no live hint
    (none sent, expired, or the global loop down) they are the engine's own defaults."""

    def __init__(self) -> None:
        self.versions: dict[str, int] = {}  # per deployment, the newest hints_version applied here
        self.held: dict[tuple[str, str], Applied] = {}

    def apply(self, deployment: str, version: int, ttl_s: float, hints: Iterable[Hint], now_s: float) -> bool:
        """Hold these hints; False (nothing changes) when `version` is not newer than the last
        applied for this deployment."""
        if version <= self.versions.get(deployment, 0):
            return False
        self.versions[deployment] = version
        for h in hints:
            self.held[(deployment, h.plan_id)] = Applied(h, version, now_s + ttl_s)
        return True

    def live(self, deployment: str, plan_id: str, now_s: float) -> Hint | None:
        got = self.held.get((deployment, plan_id))
        if got is None:
            return None
        if now_s >= got.until_s:
            del self.held[(deployment, plan_id)]
            return None
        return got.hint

    def batch_tokens(self, deployment: str, plan_id: str, now_s: float, default: int) -> int:
        """The engine's threshold: its own (`default`) times the live hint's scale, at least 1."""
        h = self.live(deployment, plan_id, now_s)
        return default if h is None else max(1, int(default * h.batch_scale))

    def weight(self, deployment: str, plan_id: str, now_s: float) -> float:
        h = self.live(deployment, plan_id, now_s)
        return 1.0 if h is None else h.weight_multiplier


def hints_from_payload(payload: Mapping[str, object]) -> tuple[str, int, float, list[Hint]]:
    """(deployment, hints_version, ttl_s, hints) of an `apply_hints` payload that
    agents.protocol.check_payload accepted."""
    plans = payload["plans"]
    assert isinstance(plans, list)  # noqa: S101 - checked by the protocol
    hints = [Hint(str(p["plan_id"]), Direction(p["direction"]), float(p["weight_multiplier"]),
                  float(p["batch_scale"])) for p in plans]
    return (str(payload["deployment"]), int(payload["hints_version"]),  # type: ignore[call-overload]
            float(payload["ttl_s"]), hints)  # type: ignore[arg-type]


__all__ = ["GLOBAL_LOOP_S", "LOCAL_LOOP_S", "MAX_LOOP_RATIO", "Applied", "CorrectionConfig", "Direction",
           "GlobalCorrection", "Hint", "HintBook", "Hints", "PlanSignal", "SlidingWindow", "hints_from_payload",
           "imbalance"]
