"""The gearbox's values: modes, triggers, outcomes, the deployment and the knobs it is decided
with, load samples and windows, and the decision with every candidate it weighed."""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass

from scheduler._lazy import check_plain_dataclass
from scheduler.costmodel import Estimate, Slo, SwitchCost, Workload
from scheduler.plan import Gear
from scheduler.staging import SwitchPath


class Mode(enum.StrEnum):
    AUTO = "auto"  # the gearbox switches by itself
    ADVISORY = "advisory"  # it only advises; an operator applies
    PINNED = "pinned"  # never switched automatically
    EMERGENCY = "emergency"  # holds the emergency gear, like a pin, until an operator releases it


class Trigger(enum.StrEnum):
    PERIODIC = "periodic"  # the regular tick
    TOPOLOGY = "topology"  # GPUs lost or returned, a block shrank
    LOAD = "load"  # both load windows crossed a watermark
    EMERGENCY = "emergency"  # operator: downshift to the baseline
    MANUAL = "manual"  # operator: go to this gear


class CapacityAsk(enum.StrEnum):
    """What a LOAD decision is asked for (the control loop's TWU rule, scheduler/pool/autoscale.py)."""

    MORE = "more"  # scale out: only candidates with more modelled capacity than the current gear
    LESS = "less"  # scale in: only candidates that hold fewer GPUs


class Outcome(enum.StrEnum):
    SWITCH = "switch"  # start a transition to `target`
    STAY = "stay"  # keep the current gear
    ADVISE = "advise"  # advisory mode: an AUTO deployment would switch to `target`
    DEFERRED = "deferred"  # a transition runs; decide again when it ends
    BLOCKED = "blocked"  # something must change first (reasons say what)


@dataclass(frozen=True)
class Deployment:
    """One model served by the cluster, as the gearbox needs it."""

    id: str  # deployment id
    model: str  # model name (modelspec catalog, unless a spec is passed to decide)
    slo: Slo  # latency objectives
    baseline: Gear | None  # the static plan, the emergency target (None: a deployment being created)
    priority: int = 0  # higher is served first (used by the console across deployments)
    mode: Mode = Mode.AUTO  # auto | advisory | pinned
    last_switch_times_s: tuple[float, ...] = ()  # recent switch times, oldest first
    latency_critical: bool = False  # keep its plans off blocks that keep shrinking


@dataclass(frozen=True)
class GearboxConfig:
    """Knobs of the decision; defaults from seed 000."""

    hysteresis: float = 1.4  # switch only if gain > cost x this (allowed 1.3-1.5)
    cooldown_s: float = 300.0  # no automatic switch this long after the last one
    long_cooldown_s: float = 1800.0  # ... this long after two switches within flap_window_s
    flap_window_s: float = 1800.0  # see long_cooldown_s
    horizon_s: float = 600.0  # how long a gain is counted for
    gpu_rent: float = 0.2  # per GPU held: this share of the current gear's capacity per GPU, in tokens/s
    short_window_s: float = 60.0  # load windows
    long_window_s: float = 300.0
    high_watermark: float = 0.85  # utilisation above which both windows mean "more load"
    low_watermark: float = 0.30  # ... below which they mean "less load"
    min_relative_gain: float = 0.05  # a switch must gain this share of the offered output tokens/s
    backlog_drain_s: float = 60.0  # waiting requests count as arrivals spread over this long
    standing_attainment: float = 0.99  # goodput / throughput a gear needs to meet its SLOs
    shrink_watermark: float = 0.65  # a gear with fewer GPUs than the current one stands only below this
    # ... except under the TWU rule's ask for less capacity: then the TWU band (2 x low < high,
    # scheduler/pool/autoscale.py) is the scale-in's band and the gear stands below the high
    # watermark (one band on top of the other vetoed every scale-in TWU asked for; measured with it
    # on - flexpipe, same goodput and 0 lost - paper.yaml 127.7 -> 111.7 GPU-hours, 10 -> 12
    # switches; tidal.yaml 35.4 -> 34.5; bench.pool 13.2 -> 10.4). False: the shrink watermark too
    scale_in_on_twu_band: bool = True
    # trend (`LoadWindow.trend`, `measures.planned_load`): a load that rises is planned for at
    # now + trend_lead_s on the long window's least-squares line - up to a cooldown: the gear
    # chosen now must carry the load until the next switch may start, and the line already sits
    # at now, not half a window back as the means do - when the slope is trend_min_t standard
    # errors above 0 (Poisson noise on a flat load is no rise), and at most trend_max_rise x the
    # level (a burst's slope is no tide's). Only ever raises the load (max(level, forecast)):
    # nothing shrinks on a forecast. False: the level alone, as before. Measured (flexpipe /
    # oracle, goodput and GPU-hours): tide-servegen.yaml 0.898, 1.02 -> 1.000, 1.19 (seeds 1 and
    # 2: 1.13); tidal.yaml 1.000, 1.01 either way; bench.pool 10.42 -> 10.68 GPU-hours,
    # attainment 99.40% either way. 3 standard errors: tide-servegen 1.13, bench.pool 11.3;
    # bolder settings (lead 300 s, x1.5, 2) lift bench.pool's attainment to 99.96% for 14.5
    # GPU-hours, x1.1 is too timid for tide-servegen (0.898), and a lead of 360 s overshot it
    # into the long cooldown
    trend: bool = True
    trend_lead_s: float = 180.0
    trend_min_t: float = 4.0
    trend_max_rise: float = 1.2
    # no TWU scale-in while the slope is this many standard errors above 0 - nor, where that
    # scale-in would start the long cooldown (a switch within flap_window_s), unless it is this
    # many below (measured on tidal.yaml: out early on the forecast, in at a lull of the climb,
    # then the long cooldown held the small gear while the load doubled - goodput 0.50x oracle)
    trend_hold_in_t: float = 1.0
    trend_hold_flap: bool = True  # False: the long-cooldown case above is left to the plain rule

    def __post_init__(self) -> None:
        if not 1.3 <= self.hysteresis <= 1.5:
            raise ValueError(f"hysteresis: must be within [1.3, 1.5], got {self.hysteresis}")
        for name in ("cooldown_s", "long_cooldown_s", "flap_window_s", "horizon_s", "short_window_s", "long_window_s",
                     "trend_lead_s", "trend_min_t", "trend_hold_in_t"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0")
        if not self.trend_max_rise >= 1:
            raise ValueError(f"trend_max_rise: must be >= 1 (a forecast only raises the load); got {self.trend_max_rise}")
        if self.long_cooldown_s < self.cooldown_s:
            raise ValueError("long_cooldown_s: must be >= cooldown_s")
        if not 0 <= self.low_watermark < self.high_watermark:
            raise ValueError("low_watermark/high_watermark: need 0 <= low < high")
        if self.min_relative_gain < 0:
            raise ValueError("min_relative_gain: must be >= 0")
        if self.backlog_drain_s <= 0:
            raise ValueError("backlog_drain_s: must be > 0")
        if not 0 < self.standing_attainment <= 1:
            raise ValueError("standing_attainment: must be within (0, 1]")
        if not self.low_watermark <= self.shrink_watermark <= self.high_watermark:
            raise ValueError("shrink_watermark: need low_watermark <= shrink <= high_watermark")


DEFAULT_CONFIG = GearboxConfig()


@dataclass(frozen=True)
class LoadSample:
    """Load of one deployment over one reporting interval."""

    t_s: float  # end of the interval
    rate_rps: float  # arrivals per second in it
    prompt_tokens_mean: float  # mean prompt length of those arrivals
    output_tokens_mean: float  # mean output length (of the requests that finished)
    prompt_tokens_cv: float = 1.0  # spread (std / mean)
    output_tokens_cv: float = 0.6
    backlog: int = 0  # requests waiting for admission at t_s (queued, not running)


@dataclass(frozen=True)
class Trend:
    """The least-squares line through a window's arrival rates (`LoadWindow.trend`)."""

    level_rps: float  # the line at now
    slope_rps_s: float  # its slope, requests per second per second
    stderr_rps_s: float  # the slope's standard error (0: the samples lie on the line)
    samples: int  # how many samples it was fitted to

    def significant(self, min_t: float) -> bool:
        """Whether the slope is more than `min_t` standard errors above 0 (a real rise)."""
        return self.slope_rps_s > 0 and self.slope_rps_s > min_t * self.stderr_rps_s

    @property
    def t_value(self) -> float:
        """The slope in standard errors (+-inf for samples exactly on a sloped line, 0 on a flat one)."""
        if self.stderr_rps_s > 0:
            return self.slope_rps_s / self.stderr_rps_s
        return math.copysign(math.inf, self.slope_rps_s) if self.slope_rps_s else 0.0

    def at(self, lead_s: float) -> float:
        """The line at now + lead_s, never below 0."""
        return max(0.0, self.level_rps + self.slope_rps_s * lead_s)


@dataclass(frozen=True)
class LoadWindow:
    """Recent load samples of one deployment (oldest first); the gearbox reads windows of it."""

    samples: tuple[LoadSample, ...] = ()

    def add(self, sample: LoadSample, keep_s: float = 3600.0) -> LoadWindow:
        kept = tuple(s for s in self.samples if s.t_s > sample.t_s - keep_s)
        return LoadWindow(kept + (sample,))

    def over(self, now_s: float, window_s: float, backlog_drain_s: float = 0.0) -> Workload | None:
        """The mean workload of the samples in (now - window, now]; None if there are none.
        With `backlog_drain_s` > 0 the newest sample's backlog adds backlog / drain_s to the
        rate: work already waiting is load the gear must carry too."""
        chosen = [s for s in self.samples if now_s - window_s < s.t_s <= now_s]
        if not chosen:
            return None
        n = len(chosen)
        rate = sum(s.rate_rps for s in chosen) / n
        if backlog_drain_s > 0:
            rate += chosen[-1].backlog / backlog_drain_s
        weight = [max(s.rate_rps, 1e-9) for s in chosen]
        total = sum(weight)

        def mean(attr: str) -> float:
            return float(sum(getattr(s, attr) * w for s, w in zip(chosen, weight, strict=True))) / total

        return Workload(
            rate_rps=rate,
            prompt_tokens_mean=max(1.0, mean("prompt_tokens_mean")),
            output_tokens_mean=max(1.0, mean("output_tokens_mean")),
            prompt_tokens_cv=mean("prompt_tokens_cv"),
            output_tokens_cv=mean("output_tokens_cv"),
        )

    def trend(self, now_s: float, window_s: float) -> Trend | None:
        """The least-squares line of the arrival rate over the samples in (now - window, now]
        (the backlog is not in it: `over` adds that to the level); None with fewer than 3 samples
        or all at one time. Why a line and not Holt's smoothing: the window is short (a few
        minutes of reports), the fit has no state to carry between calls (the gearbox is pure
        over the window), and its standard error says whether a slope is a rise or noise."""
        chosen = [s for s in self.samples if now_s - window_s < s.t_s <= now_s]
        n = len(chosen)
        if n < 3:
            return None
        t_mean = sum(s.t_s for s in chosen) / n
        r_mean = sum(s.rate_rps for s in chosen) / n
        sxx = sum((s.t_s - t_mean) ** 2 for s in chosen)
        if sxx <= 0:
            return None
        slope = sum((s.t_s - t_mean) * (s.rate_rps - r_mean) for s in chosen) / sxx
        resid = sum((s.rate_rps - r_mean - slope * (s.t_s - t_mean)) ** 2 for s in chosen)
        stderr = math.sqrt(resid / (n - 2) / sxx)
        return Trend(r_mean + slope * (now_s - t_mean), slope, stderr, n)

    def to_dict(self) -> dict[str, object]:
        return {"samples": [
            [s.t_s, s.rate_rps, s.prompt_tokens_mean, s.output_tokens_mean, s.prompt_tokens_cv, s.output_tokens_cv]
            + ([s.backlog] if s.backlog else [])
            for s in self.samples
        ]}


@dataclass(frozen=True)
class CandidateEval:
    """One candidate as the decision weighed it."""

    gear: Gear  # the candidate gear
    estimate: Estimate  # its steady-state estimate under the offered load
    value_tokens_s: float  # goodput minus GPU rent, tokens/s
    gain_tokens: float  # (value - current value) x remaining horizon
    cost: SwitchCost  # the switch cost, in parts
    threshold_tokens: float  # cost x hysteresis: what the gain must beat
    passes: bool  # gain > threshold
    note: str = ""  # how the planner built it, or why it is not eligible
    standing: bool = False  # meets both SLOs at the offered load, with headroom (`standing`)
    path: SwitchPath | None = None  # how it is reached: direct, staged or drain (its cost is the path's), or blocked

    def to_dict(self) -> dict[str, object]:
        return {
            "gear_id": self.gear.gear_id,
            "shape": self.gear.shape(),
            "gear": self.gear.to_dict(),
            "estimate": self.estimate.to_dict(),
            "value_tokens_s": self.value_tokens_s,
            "gain_tokens": self.gain_tokens,
            "cost": self.cost.to_dict(),
            "threshold_tokens": self.threshold_tokens,
            "passes": self.passes,
            "note": self.note,
            "standing": self.standing,
            "path": self.path.to_dict() if self.path is not None else None,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> CandidateEval:
        path = d.get("path")
        return cls(
            gear=Gear.from_dict(d["gear"]),
            estimate=Estimate.from_dict(_obj(d["estimate"])),
            value_tokens_s=_num(d["value_tokens_s"]),
            gain_tokens=_num(d["gain_tokens"]),
            cost=SwitchCost.from_dict(_obj(d["cost"])),
            threshold_tokens=_num(d["threshold_tokens"]),
            passes=bool(d["passes"]),
            note=str(d.get("note", "")),
            standing=bool(d.get("standing", False)),
            path=SwitchPath.from_dict(_obj(path)) if path is not None else None,
        )


check_plain_dataclass(CandidateEval, field_names=("gear", "estimate", "value_tokens_s", "gain_tokens", "cost",
                                                  "threshold_tokens", "passes", "note", "standing", "path"))


@dataclass(frozen=True)
class Decision:
    """What the gearbox decided and why (audited, shown in the console)."""

    deployment_id: str  # whose decision
    now_s: float  # when (injected clock)
    trigger: Trigger  # what started it
    outcome: Outcome  # switch | stay | advise | deferred | blocked
    factor: float  # the hysteresis factor applied
    current_gear_id: str | None  # the gear it started from
    current_valid: bool  # whether that gear is still valid on the snapshot
    current_value_tokens_s: float  # its value (goodput - rent) under the offered load
    current_estimate: Estimate | None  # its estimate (None if nothing of it is left)
    target: Gear | None  # the gear to switch to (SWITCH/ADVISE), else None
    workload: Workload | None  # the offered load used
    candidates: tuple[CandidateEval, ...]  # every candidate weighed, best first
    reasons: tuple[str, ...]  # why this outcome, in words
    cooldown_until_s: float | None = None  # when automatic switching is allowed again
    # a staged switch (scheduler.staging): stage 1 goes to `target` on the way to `staged_target`;
    # stage 2 (its drivers ask for it once stage 1 is done) goes on to it. 0: a plain switch
    stage: int = 0
    staged_target: Gear | None = None  # stage 1: where the staged switch goes next
    excluded: tuple[str, ...] = ()  # plans the planner left out because a node's engine cannot run them, and why

    @property
    def target_gear_id(self) -> str | None:
        return self.target.gear_id if self.target is not None else None

    @property
    def forced(self) -> bool:
        """A move the deployment was pushed into (an emergency downshift, or off a gear that
        lost GPUs), or the second stage of a switch already counted: not one the gearbox chose
        now, so it starts no cooldown (`record_switch`)."""
        return (self.trigger is Trigger.EMERGENCY or (self.current_gear_id is not None and not self.current_valid)
                or self.stage == 2)

    def to_dict(self) -> dict[str, object]:
        return {
            "deployment_id": self.deployment_id,
            "now_s": self.now_s,
            "trigger": self.trigger.value,
            "outcome": self.outcome.value,
            "factor": self.factor,
            "current_gear_id": self.current_gear_id,
            "current_valid": self.current_valid,
            "current_value_tokens_s": self.current_value_tokens_s,
            "current_estimate": self.current_estimate.to_dict() if self.current_estimate else None,
            "target_gear_id": self.target_gear_id,
            "target": self.target.to_dict() if self.target else None,
            "workload": self.workload.to_dict() if self.workload else None,
            "candidates": [c.to_dict() for c in self.candidates],
            "reasons": list(self.reasons),
            "cooldown_until_s": self.cooldown_until_s,
            "stage": self.stage,
            "staged_target": self.staged_target.to_dict() if self.staged_target is not None else None,
            "excluded": list(self.excluded),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> Decision:
        try:
            current_est = d["current_estimate"]
            target = d["target"]
            workload = d["workload"]
            candidates = d["candidates"]
            reasons = d["reasons"]
            if not isinstance(candidates, list) or not isinstance(reasons, list):
                raise ValueError("decision.candidates/reasons: must be lists")
            cooldown = d.get("cooldown_until_s")
            staged = d.get("staged_target")
            stage = d.get("stage", 0)
            if stage not in (0, 1, 2):
                raise ValueError(f"decision.stage: must be 0, 1 or 2; got {stage!r}")
            return cls(
                deployment_id=str(d["deployment_id"]),
                now_s=_num(d["now_s"]),
                trigger=Trigger(str(d["trigger"])),
                outcome=Outcome(str(d["outcome"])),
                factor=_num(d["factor"]),
                current_gear_id=None if d["current_gear_id"] is None else str(d["current_gear_id"]),
                current_valid=bool(d["current_valid"]),
                current_value_tokens_s=_num(d["current_value_tokens_s"]),
                current_estimate=None if current_est is None else Estimate.from_dict(_obj(current_est)),
                target=None if target is None else Gear.from_dict(target),
                workload=None if workload is None else Workload.from_dict(_obj(workload)),
                candidates=tuple(CandidateEval.from_dict(_obj(c)) for c in candidates),
                reasons=tuple(str(r) for r in reasons),
                cooldown_until_s=None if cooldown is None else _num(cooldown),
                stage=int(stage),
                staged_target=None if staged is None else Gear.from_dict(staged, "decision.staged_target"),
                excluded=tuple(str(x) for x in _list(d.get("excluded"))),
            )
        except KeyError as exc:
            raise ValueError(f"decision.{exc.args[0]}: required") from None


def _obj(v: object) -> Mapping[str, object]:
    if not isinstance(v, Mapping):
        raise ValueError(f"decision: expected an object, got {type(v).__name__}")
    return v


def _list(v: object) -> list[object]:
    return list(v) if isinstance(v, list | tuple) else []


def _num(v: object) -> float:
    if v is None:
        return math.inf
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ValueError(f"decision: expected a number, got {v!r}")
    return float(v)
