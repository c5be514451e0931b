"""The gear decision: gain against switch cost x hysteresis, cooldowns, triggers, overrides.

`decide(deployment, current_gear, snapshot, load_window, now_s)` is pure: the same inputs
give the same `Decision`, which records everything the console shows and audits (DESIGN.md
invariant 5): the trigger, every candidate with its estimated gain and cost, the hysteresis
factor, the outcome and the reasons.

Rules, in the order they apply:

1. EMERGENCY (operator): go to the baseline gear (or the gear the operator accepted instead,
   `requested_gear`) now - in any mode, cooldown or not; a running transition is superseded
   (the executor rolls it back first). Already there: STAY (idempotent). Not valid on this
   snapshot: BLOCKED, with why and what to do, and the planner's best safe gears as the
   candidates, best first (`safe_rank`: meets the SLOs, then the most goodput, then the fewest
   GPUs) - what an operator may accept as the emergency target instead.
2. MANUAL (operator, with a requested gear): switch to it if it is valid; no hysteresis or
   cooldown. Not while a transition runs (DEFERRED). Without a requested gear: STAY, with every
   feasible candidate the planner has now (best first by `safe_rank`, each with its estimate,
   gain and cost) - what an operator chooses a gear override from. Any mode.
3. Automatic triggers (PERIODIC, LOAD, TOPOLOGY):
   - PINNED and EMERGENCY deployments never switch automatically: STAY (or BLOCKED when the
     gear they hold is no longer valid - an operator must act);
   - never while a transition runs: DEFERRED;
   - current gear invalid on the snapshot (GPUs lost): move now to the best feasible
     candidate; hysteresis and cooldown do not apply to an infeasible gear;
   - no load samples in the windows and a valid gear: STAY (silence is not zero load);
   - within the cooldown after a switch: STAY (the cooldown is longer after two switches
     within `flap_window_s`: anti-flapping, seed 000 section 5.3). Only switches the gearbox
     chose count (`record_switch`): a forced move - off a gear that lost GPUs, or an
     emergency downshift - is being pushed, not flapping, and starts no cooldown;
   - otherwise switch to the best candidate only if gain > cost x hysteresis and the gain
     per second is at least `min_relative_gain` of the offered output tokens/s.
   ADVISORY deployments get ADVISE where an AUTO one would SWITCH.
0. (before 1-3) The second stage of a staged switch whose first stage is done (`staged_target`):
   on to it without hysteresis or cooldown when it fits; pinned deployments stop there.

Memory across the switch (scheduler.booking, scheduler.staging): every candidate carries the
path that reaches it - direct when its new plans fit beside the current gear, else staged
through an intermediate candidate or a brief drain (priced as both switches plus the dwell, its
first stage being the decision's target), else blocked with what a full drain would take. An
operator's gear that does not fit goes the same way. Back-off (scheduler.backoff): while the
deployment backs off after refused PREPAREs automatic switches STAY, and backed-off plans are
never eligible. Plans a node's engine cannot run are never proposed (`Decision.excluded`).

Ranking. A candidate is *standing* when its estimate meets both SLOs at the offered load
with the headroom of the high watermark (`standing`). Standing candidates rank before the
others; a standing current gear is only left for another standing one (never trade the SLO
for GPUs); within a tier the larger gain beyond the threshold ranks first.

Gain and cost are in output tokens. The value of a gear per second is its goodput (output
tokens/s within the SLO) minus, once the SLOs are met, a rental charge per GPU it holds (a
share of the current gear's capacity per GPU - so among gears that meet the SLOs, one that
serves the same load with fewer GPUs is worth more). While the current gear misses its SLOs
no rent is charged in its gain: reaching the SLO is not traded against GPUs, and among the
standing candidates the one worth most after rent ranks first. Gain = (value_new -
value_old) x (horizon - time until the new gear carries the load). Cost =
`costmodel.switch_cost(...).tokens`.

Load: `LoadWindow` holds samples; the offered load is the larger of the short- and
long-window means (never plan below a dip), plus the backlog: requests waiting at the end
of the newest sample count as arrivals spread over `backlog_drain_s`, so a gear that has
fallen behind looks as loaded as it is. The LOAD trigger is reported only when both windows
agree that the current gear is over its high watermark or under its low one, so one spike
does not move the gear.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from scheduler._lazy import check_plain_dataclass, make_frozen
from scheduler.backoff import Backoff
from scheduler.booking import Overbooking, describe
from scheduler.costmodel import (
    DEFAULT_EFFICIENCY,
    Efficiency,
    Estimate,
    PlanProfile,
    Slo,
    SwitchCost,
    Workload,
    combine_estimates,
    estimate_plan,
    steady_state,
    switch_cost,
)
from scheduler.modelspec import ModelSpec, model_spec
from scheduler.plan import Gear, Plan, stage_bytes_per_gpu, validate_gear, validate_plan
from scheduler.planner import DEFAULT_OPTIONS, PlannerOptions, plan_candidates
from scheduler.staging import (
    DIRECT,
    PathKind,
    SwitchPath,
    blocked_note,
    combine,
    conflicts,
    drain_gear,
    drain_s,
    dwell_tokens,
    fits_after,
    outage_cost,
)
from scheduler.topology import DEFAULT_POLICY, AtomicBlock, BlockPolicy, FragmentHistory, Snapshot, partition

MAX_VIAS = 4  # intermediate gears a staged switch is priced through (the direct candidates worth most)


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

    def __post_init__(self) -> None:
        if not 1.3 <= self.hysteresis <= 1.5:
            raise ValueError(f"hysteresis: must be within [1.3, 1.5], got {self.hysteresis}")
        for name in ("cooldown_s", "long_cooldown_s", "flap_window_s", "horizon_s", "short_window_s", "long_window_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0")
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


# --- helpers ---------------------------------------------------------------------------------------
def offered_load(window: LoadWindow, now_s: float, config: GearboxConfig = DEFAULT_CONFIG) -> Workload | None:
    """The load to plan for: the larger of the short- and long-window means, backlog included."""
    return _larger(window.over(now_s, config.short_window_s, config.backlog_drain_s),
                   window.over(now_s, config.long_window_s, config.backlog_drain_s))


def _larger(short: Workload | None, long: Workload | None) -> Workload | None:
    if short is None:
        return long
    if long is None:
        return short
    return short if short.rate_rps >= long.rate_rps else long


def cooldown_until(deployment: Deployment, config: GearboxConfig = DEFAULT_CONFIG) -> float | None:
    """When automatic switching is allowed again (None: never switched)."""
    times = sorted(deployment.last_switch_times_s)
    if not times:
        return None
    last = times[-1]
    flapping = len(times) >= 2 and last - times[-2] <= config.flap_window_s
    return last + (config.long_cooldown_s if flapping else config.cooldown_s)


def record_switch(deployment: Deployment, now_s: float, *, forced: bool, keep: int = 4) -> Deployment:
    """The deployment after a switch started at `now_s`: a chosen switch joins the recent
    switch times (cooldown, anti-flapping); a forced one (`Decision.forced`) does not - being
    pushed off broken GPUs, or down by an operator, is not flapping, and counting it would hold
    the gear for a (long) cooldown just when the load or the returning GPUs call for a move."""
    if forced:
        return deployment
    times = (*sorted(deployment.last_switch_times_s)[-(keep - 1):], now_s) if keep > 1 else (now_s,)
    return replace(deployment, last_switch_times_s=times)


def margin_load(workload: Workload, config: GearboxConfig = DEFAULT_CONFIG, *, shrinking: bool = False) -> Workload:
    """The load a standing gear must still carry within its SLOs: the offered load over the
    watermark (the high one; the shrink one for a gear that would give GPUs back)."""
    return workload.scaled(1.0 / (config.shrink_watermark if shrinking else config.high_watermark))


def standing(est: Estimate | None, workload: Workload, config: GearboxConfig = DEFAULT_CONFIG, *,
             shrinking: bool = False, at_margin: Estimate | None = None) -> bool:
    """Whether a gear meets both SLOs at this load with room to spare: served in full below
    the high watermark, and at least `standing_attainment` of its output within the SLOs -
    and, given its estimate `at_margin` (under `margin_load`), still within them there: a
    tight TPOT is missed well before a plan saturates, so utilisation alone is no margin. A
    gear that would give GPUs back (`shrinking`) must stay below `shrink_watermark` instead:
    the band between the two keeps a shrink from landing where the next rise of the load
    calls for growing again - and the cooldown (the long one after a second switch) would
    hold the small gear through that rise."""
    if est is None:
        return False
    if workload.rate_rps <= 0:
        return True
    limit = config.shrink_watermark if shrinking else config.high_watermark
    if est.capacity_rps <= 0 or est.utilization > limit:
        return False
    if at_margin is not None and (at_margin.overloaded or at_margin.goodput_tokens_s
                                  < config.standing_attainment * at_margin.throughput_tokens_s):
        return False
    return est.goodput_tokens_s >= config.standing_attainment * est.throughput_tokens_s


def gear_footprint(gear: Gear, model: ModelSpec, snapshot: Snapshot) -> dict[str, int]:
    """Memory the gear holds per GPU (weights + KV reserve), capped at what is reported used:
    what the deployment would give back when it leaves those GPUs."""
    out: dict[str, int] = {}
    for plan in gear.plans:
        for st in plan.all_stages:
            if st.layer_start < 0 or st.layer_end > model.num_layers or st.layer_end <= st.layer_start:
                continue
            need = stage_bytes_per_gpu(st, model, plan.kv_reserve_tokens)
            for u in st.gpu_uuids:
                g = snapshot.gpu_by_uuid.get(u)
                if g is not None:
                    out[u] = out.get(u, 0) + min(need, g.mem_used_bytes)
    return out


@dataclass
class _Current:
    gear: Gear | None
    valid: bool
    reasons: list[str]
    estimate: Estimate | None
    profiles: dict[Plan, PlanProfile] = field(default_factory=dict)


def _evaluate_current(gear: Gear | None, model: ModelSpec, snapshot: Snapshot, workload: Workload, slo: Slo,
                      blocks: Sequence[AtomicBlock], reclaim: Mapping[str, int], policy: BlockPolicy,
                      eff: Efficiency) -> _Current:
    if gear is None:
        return _Current(None, False, ["no current gear"], None)
    reasons = validate_gear(gear, snapshot, model, blocks=blocks, reclaimable_bytes=reclaim, policy=policy)
    valid = not reasons
    # estimate the plans that still work; traffic of the broken ones is lost
    ok_plans = []
    ok_weights = []
    profiles: dict[Plan, PlanProfile] = {}
    for plan, w in zip(gear.plans, gear.weights, strict=False):
        # a valid gear's plans are valid (validate_gear checked each); else check them one by one
        if not valid and validate_plan(plan, snapshot, model, blocks=blocks, reclaimable_bytes=reclaim,
                                       policy=policy):
            continue
        prof = PlanProfile.build(plan, model, snapshot, eff)
        profiles[plan] = prof
        ok_plans.append(prof)
        ok_weights.append(w)
    if not ok_plans:
        return _Current(gear, valid, reasons, None, profiles)
    total = sum(ok_weights)
    weights = [w / total for w in ok_weights] if total > 0 else [1.0 / len(ok_weights)] * len(ok_weights)
    ests = [estimate_plan(p, workload.scaled(w), slo) for p, w in zip(ok_plans, weights, strict=True)]
    est = combine_estimates(ests, weights, workload)
    if not valid:
        # the survivors only carry their own share; the rest of the traffic is not served
        kept = total if total > 0 else 0.0
        est = combine_estimates(
            [estimate_plan(p, workload.scaled(w * kept), slo) for p, w in zip(ok_plans, weights, strict=True)],
            weights, workload.scaled(kept))
    return _Current(gear, valid, reasons, est, profiles)


def _value(est: Estimate | None, rent_tokens_s_per_gpu: float) -> float:
    if est is None:
        return 0.0
    return est.goodput_tokens_s - rent_tokens_s_per_gpu * est.gpus


# --- the decision ----------------------------------------------------------------------------------
def decide(
    deployment: Deployment,
    current_gear: Gear | None,
    snapshot: Snapshot,
    load_window: LoadWindow,
    now_s: float,
    *,
    trigger: Trigger = Trigger.PERIODIC,
    requested_gear: Gear | None = None,
    transition_running: bool = False,
    history: FragmentHistory | None = None,
    staged_target: Gear | None = None,
    backoff: Backoff | None = None,
    model: ModelSpec | None = None,
    config: GearboxConfig = DEFAULT_CONFIG,
    planner_options: PlannerOptions | None = None,
    policy: BlockPolicy = DEFAULT_POLICY,
    eff: Efficiency = DEFAULT_EFFICIENCY,
) -> Decision:
    """Decide whether `deployment` should change gear now (module docstring: the rules).

    `trigger` is what the caller saw (tick, topology event, operator); `requested_gear` is
    the operator's choice for MANUAL. `history` supplies block stability. `staged_target`: the
    gear a staged switch goes on to once its first stage is done (`Decision.staged_target` of the
    decision that started it; its drivers keep it). `backoff`: the deployment's back-off after
    refused PREPAREs (scheduler.backoff): automatic switches wait, and backed-off plans are not
    proposed. Pure and deterministic: no I/O, no clock but `now_s`.
    """
    spec = model if model is not None else model_spec(deployment.model)
    factor = config.hysteresis
    part = partition(snapshot, policy)
    blocks = part.blocks
    short_load = load_window.over(now_s, config.short_window_s, config.backlog_drain_s)
    long_load = load_window.over(now_s, config.long_window_s, config.backlog_drain_s)
    window_load = _larger(short_load, long_load)  # offered_load, from the two windows read once
    workload = window_load or Workload(0.0, 512.0, 128.0)
    reclaim = gear_footprint(current_gear, spec, snapshot) if current_gear is not None else {}
    cur = _evaluate_current(current_gear, spec, snapshot, workload, deployment.slo, blocks, reclaim, policy, eff)
    cur_id = current_gear.gear_id if current_gear is not None else None
    cap_per_gpu = 0.0
    if cur.estimate is not None and cur.estimate.gpus > 0:
        cap_per_gpu = cur.estimate.capacity_rps * workload.output_tokens_mean / cur.estimate.gpus
    rent = config.gpu_rent * cap_per_gpu
    cur_gpus = cur.estimate.gpus if cur.valid and cur.estimate is not None else 0

    # a plan's estimate by (profile, load, routing weight), for this decision only: replicas of
    # one unit type share their profile, so a gear of n equal replicas costs one estimate
    plan_estimates: dict[tuple[PlanProfile, Workload, float], Estimate] = {}

    def at_load(gear: Gear, load: Workload, known: Mapping[Plan, PlanProfile]) -> Estimate:
        """The gear's estimate at `load`; `known`: profiles already built, by plan."""
        ests = []
        for plan, w in zip(gear.plans, gear.weights, strict=True):
            prof = known.get(plan)
            if prof is None:
                prof = PlanProfile.build(plan, spec, snapshot, eff)
            key = (prof, load, w)
            est = plan_estimates.get(key)
            if est is None:
                # estimate_plan(prof, load.scaled(w), slo), without building the scaled Workload:
                # the steady state depends on the load's shape, not its rate
                est = plan_estimates[key] = steady_state(prof, load, deployment.slo).estimate(load.rate_rps * w)
            ests.append(est)
        return combine_estimates(ests, gear.weights, load)

    # the margin loads (`margin_load`), built once: every candidate is checked at one of the two
    margin_loads: dict[bool, Workload] = {}

    def stands(gear: Gear, est: Estimate, known: Mapping[Plan, PlanProfile]) -> bool:
        shrinking = 0 < est.gpus < cur_gpus
        if not standing(est, workload, config, shrinking=shrinking):
            return False  # (the cheap test first)
        load = margin_loads.get(shrinking)
        if load is None:
            load = margin_loads[shrinking] = margin_load(workload, config, shrinking=shrinking)
        return standing(est, workload, config, shrinking=shrinking, at_margin=at_load(gear, load, known))

    cur_standing = (cur.valid and current_gear is not None and cur.estimate is not None
                    and stands(current_gear, cur.estimate, cur.profiles))
    cool_until = cooldown_until(deployment, config)
    reasons: list[str] = []
    left_out: list[str] = []  # the planner's exclusions (engine capabilities), for the candidate list
    unplaced: list[str] = []  # why the planner found no gear at all (weigh_all), for the reasons

    def finish(outcome: Outcome, target: Gear | None, evals: Sequence[CandidateEval], why: Sequence[str],
               value: float | None = None, *, stage: int = 0, staged: Gear | None = None) -> Decision:
        return Decision(
            deployment_id=deployment.id,
            now_s=now_s,
            trigger=trigger,
            outcome=outcome,
            factor=factor,
            current_gear_id=cur_id,
            current_valid=cur.valid,
            current_value_tokens_s=value if value is not None else _value(cur.estimate, rent),
            current_estimate=cur.estimate,
            target=target,
            workload=window_load,
            candidates=tuple(evals),
            reasons=tuple(why),
            cooldown_until_s=cool_until,
            stage=stage,
            staged_target=staged,
            excluded=tuple(left_out),
        )

    def evaluate(gear: Gear, est: Estimate, note: str,
                 profiles: Mapping[Plan, PlanProfile] | None = None, *, cost: SwitchCost | None = None,
                 path: SwitchPath | None = None) -> CandidateEval:
        # the candidate's profiles, and the current gear's (plans it keeps)
        known = {**cur.profiles, **profiles} if profiles else cur.profiles
        if profiles:
            profiles_of[gear] = profiles
        if cost is None:
            cost = switch_cost(current_gear, gear, spec, snapshot, workload, current_estimate=cur.estimate,
                               target_estimate=est, eff=eff, profiles=known)
        value = _value(est, rent)
        # rent only trades GPUs against tokens once the SLOs are met (module docstring)
        charged = rent if cur_standing else 0.0
        gain = (_value(est, charged) - _value(cur.estimate, charged)) * max(0.0, config.horizon_s
                                                                            - cost.time_to_effect_s)
        threshold = cost.tokens * factor
        return make_frozen(CandidateEval, {"gear": gear, "estimate": est, "value_tokens_s": value, "gain_tokens": gain,
                                           "cost": cost, "threshold_tokens": threshold, "passes": gain > threshold,
                                           "note": note, "standing": stands(gear, est, known), "path": path})

    def estimate_of(gear: Gear) -> Estimate:
        return at_load(gear, workload, cur.profiles)

    # --- memory across the switch (scheduler.booking, scheduler.staging) ---------------------
    profiles_of: dict[Gear, Mapping[Plan, PlanProfile]] = {}  # candidates' profiles, by gear
    output_p99 = workload.output_quantile(0.99)

    def routed(e: CandidateEval, vias: Sequence[CandidateEval],
               found: Sequence[Overbooking] | None = None) -> CandidateEval:
        """`e` with the path that reaches it: direct when its new plans fit beside the current
        gear; else the cheaper of a staged switch (via one of `vias`) and a brief drain, priced
        as both switches plus what is lost in between; else blocked (it says what it would take).
        `found`: its conflicts, when the caller has them."""
        if found is None:
            found = conflicts(current_gear, e.gear, spec, snapshot)
        if not found:
            return e if e.path is not None else replace(e, path=DIRECT)
        known = {**cur.profiles, **profiles_of.get(e.gear, {})}
        options: list[tuple[PathKind, Gear, SwitchCost]] = []
        firsts: list[tuple[Gear, Estimate, SwitchCost, PathKind]] = [
            (v.gear, v.estimate, v.cost, "staged") for v in vias if v.gear != e.gear]
        sub = drain_gear(current_gear, found, snapshot)
        if sub is not None:
            sub_est = estimate_of(sub)
            sub_cost = switch_cost(current_gear, sub, spec, snapshot, workload, current_estimate=cur.estimate,
                                   target_estimate=sub_est, eff=eff, profiles=cur.profiles)
            firsts.append((sub, sub_est, sub_cost, "drain"))
        for gear1, est1, cost1, kind in firsts:
            if not fits_after(current_gear, gear1, e.gear, spec, snapshot):
                continue
            second = switch_cost(gear1, e.gear, spec, snapshot, workload, current_estimate=est1,
                                 target_estimate=e.estimate, eff=eff,
                                 profiles={**known, **profiles_of.get(gear1, {})})
            total = combine(cost1, second, dwell_tokens(cur.estimate, est1, second.time_to_effect_s))
            options.append((kind, gear1, total))
        if not options:
            outage_s, outage_tokens = outage_cost(e.cost, cur.estimate, drain_s(cur.estimate, output_p99))
            note = blocked_note(found, outage_s, outage_tokens)
            return replace(e, passes=False, note=f"{e.note}; {note}" if e.note else note,
                           path=SwitchPath("blocked", conflicts=tuple(found), note=note))
        kind, gear1, total = min(options, key=lambda o: (o[2].tokens, _gear_order(o[1])))
        how = (f"staged via {gear1.shape()}" if kind == "staged"
               else f"brief drain: {len(current_gear.plans) - len(gear1.plans) if current_gear else 0} plan(s)"
                    f" released first, {gear1.shape()} serving meanwhile")
        note = f"does not fit beside the current gear ({describe(found)}); {how}"
        return repriced(e, total, SwitchPath(kind, via=gear1, conflicts=tuple(found), note=note))

    def repriced(e: CandidateEval, cost: SwitchCost, path: SwitchPath) -> CandidateEval:
        """`e` weighed again with another cost (its path's): the estimate and standing are the gear's."""
        charged = rent if cur_standing else 0.0
        gain = (_value(e.estimate, charged) - _value(cur.estimate, charged)) * max(0.0, config.horizon_s
                                                                                - cost.time_to_effect_s)
        threshold = cost.tokens * factor
        return replace(e, cost=cost, gain_tokens=gain, threshold_tokens=threshold, passes=gain > threshold, path=path)

    def with_paths(evals: Sequence[CandidateEval]) -> list[CandidateEval]:
        found = [conflicts(current_gear, e.gear, spec, snapshot) for e in evals]
        direct = [e for e, f in zip(evals, found, strict=True) if not f]
        # intermediates: the direct candidates worth most (a staged switch dwells on one briefly)
        vias = sorted(direct, key=lambda v: (-v.value_tokens_s, v.cost.tokens, _gear_order(v.gear)))[:MAX_VIAS]
        return [routed(e, vias, f) for e, f in zip(evals, found, strict=True)]

    def backed_off(e: CandidateEval, book: Backoff) -> CandidateEval:
        hit = book.blocked(e.gear, now_s, snapshot)
        if e.path is not None and e.path.via is not None:
            hit += book.blocked(e.path.via, now_s, snapshot)
        if not hit:
            return e
        until = max(h.until_s for h in hit)
        note = f"backing off until t={until:.0f} s (a PREPARE of it was refused: {hit[0].reason[:120]})"
        return replace(e, passes=False, note=f"{e.note}; {note}" if e.note else note,
                       path=SwitchPath("blocked", conflicts=e.path.conflicts if e.path else (), note=note))

    def operator_path(ev: CandidateEval) -> CandidateEval:
        """An operator's gear (the baseline, a requested gear) with the path that reaches it:
        intermediates come from the planner, asked only when the gear does not fit beside."""
        if not conflicts(current_gear, ev.gear, spec, snapshot):
            return replace(ev, path=DIRECT)
        found = plan_candidates(spec, snapshot, workload, slo=deployment.slo, options=planner_options or DEFAULT_OPTIONS,
                                blocks=blocks, reclaimable_bytes=reclaim,
                                prefer_gpus=current_gear.gpu_uuids if current_gear else (),
                                keep=current_gear.plans if current_gear is not None else (), policy=policy, eff=eff)
        pool = [evaluate(c.gear, c.estimate, c.kind, c.profiles) for c in found.feasible
                if c.gear not in (current_gear, ev.gear)]
        return with_paths([ev, *pool])[0] if pool else routed(ev, [])

    def operator_finish(ev: CandidateEval, why: list[str], what: str) -> Decision:
        path = ev.path
        if path is None or path.kind == "direct":
            return finish(Outcome.SWITCH, ev.gear, [ev], why)
        if not path.executable or path.via is None:
            return finish(Outcome.BLOCKED, None, [ev], [*why, f"{what}: the gear {path.note}"])
        return finish(Outcome.SWITCH, path.via, [ev], [*why, f"stage 1 of 2: {path.note}; then on to"
                                                             f" {ev.gear.shape()}"], stage=1, staged=ev.gear)

    # 0. the second stage of a staged switch whose first stage is done (its drivers ask)
    ignore_cooldown = direct_only = False
    if staged_target is not None and trigger is not Trigger.EMERGENCY and not transition_running:
        # (an emergency's own staged downshift is not this: its request stays pending until the
        # emergency trigger reaches the gear it holds)
        if deployment.mode in (Mode.PINNED, Mode.EMERGENCY):
            return finish(Outcome.STAY, None, [], [f"{deployment.mode.value}: the staged switch toward "
                                                   f"{staged_target.shape()} stops here"])
        problems = validate_gear(staged_target, snapshot, spec, blocks=blocks, reclaimable_bytes=reclaim,
                                 policy=policy)
        found = conflicts(current_gear, staged_target, spec, snapshot)
        if cur.valid and not problems and not found:
            ev = evaluate(staged_target, estimate_of(staged_target), "second stage of a staged switch")
            act2 = Outcome.SWITCH if deployment.mode is Mode.AUTO else Outcome.ADVISE
            return finish(act2, staged_target, [replace(ev, path=DIRECT)], [
                f"stage 2 of 2: on to {staged_target.shape()} (weighed with the first stage: no hysteresis or"
                " cooldown)"], stage=2)
        why = problems[:2] or ([describe(found)] if found else []) or ["the current gear is not valid"]
        reasons.append(f"the staged switch toward {staged_target.shape()} cannot go on ({'; '.join(why)});"
                       " deciding afresh")
        ignore_cooldown = True  # the intermediate gear was never meant to stay
        direct_only = True  # and no new staged path from it: one failed already (no loop of first stages)

    def weigh_all(note: str) -> list[CandidateEval]:
        """Every feasible candidate but the current gear, weighed with the path that reaches it
        (memory across the switch), best first by `safe_rank`."""
        found = plan_candidates(spec, snapshot, workload, slo=deployment.slo, options=planner_options or DEFAULT_OPTIONS,
                                blocks=blocks, reclaimable_bytes=reclaim,
                                prefer_gpus=current_gear.gpu_uuids if current_gear else (), policy=policy, eff=eff)
        left_out.extend(x for x in found.excluded if x not in left_out)
        if not found.feasible:
            unplaced.extend(x for x in found.infeasible if x not in unplaced)
        return sorted(with_paths([evaluate(c.gear, c.estimate, note or c.kind, c.profiles) for c in found.feasible
                                  if c.gear != current_gear]), key=safe_rank)

    # 1. emergency: the baseline (or the gear an operator accepted instead), now, whatever the mode
    if trigger is Trigger.EMERGENCY:
        base = requested_gear or deployment.baseline
        if base is None:
            return finish(Outcome.BLOCKED, None, weigh_all("offered: the planner's best safe gear")[:5],
                          ["emergency: the deployment has no baseline gear yet; to fix: set one"])
        what = "the baseline gear" if base == deployment.baseline else "the accepted emergency gear"
        if current_gear is not None and base.gear_id == cur_id:
            return finish(Outcome.STAY, None, [], [f"emergency: already on {what} (nothing to do)"])
        problems = validate_gear(base, snapshot, spec, blocks=blocks, reclaimable_bytes=reclaim, policy=policy)
        if problems:
            offers = weigh_all("offered: the planner's best safe gear")[:5]
            fix = ("to fix: restore its GPUs, set a new baseline, or downshift to the planner's best safe gear "
                   f"{offers[0].gear.shape()} instead" if offers else
                   "to fix: restore its GPUs or set a new baseline (no other gear fits the fleet now)")
            return finish(Outcome.BLOCKED, None, offers, [f"emergency: {what} cannot run on this snapshot: "
                                                         + "; ".join(problems[:5]), fix])
        ev = evaluate(base, estimate_of(base), "baseline" if base == deployment.baseline else "accepted by an operator")
        why = [f"emergency downshift to {what} (operator)"]
        if transition_running:
            why.append("supersedes the running transition (the executor rolls it back first)")
            return finish(Outcome.SWITCH, base, [ev], why)
        ev = operator_path(ev)
        return operator_finish(ev, why, "emergency")

    # 2. manual: the operator's gear, if valid
    if trigger is Trigger.MANUAL:
        if requested_gear is None:
            listed = weigh_all("")
            return finish(Outcome.STAY, None, listed, [f"manual: {len(listed)} candidate gear(s) an operator may "
                                                       "choose from, best first", *unplaced[:5]])
        if transition_running:
            return finish(Outcome.DEFERRED, None, [], ["manual: a transition is running; retry when it ends"])
        if requested_gear.gear_id == cur_id:
            return finish(Outcome.STAY, None, [], ["manual: already on the requested gear"])
        problems = validate_gear(requested_gear, snapshot, spec, blocks=blocks, reclaimable_bytes=reclaim,
                                 policy=policy)
        if planner_options is not None:  # the registry version's requirements (scheduler.requirements)
            problems += planner_options.requires.gear_refusals(requested_gear.plans, snapshot)
        if problems:
            return finish(Outcome.BLOCKED, None, [], ["manual: the requested gear is not valid: "
                                                     + "; ".join(problems[:5])])
        ev = operator_path(evaluate(requested_gear, estimate_of(requested_gear), "requested by an operator"))
        return operator_finish(ev, ["manual switch requested by an operator"], "manual")

    # 3. automatic
    if not cur.valid and current_gear is not None:
        reasons.append("current gear is not valid on this snapshot: " + "; ".join(cur.reasons[:3]))
    if deployment.mode in (Mode.PINNED, Mode.EMERGENCY):
        held = ("emergency: holds its gear until an operator releases it" if deployment.mode is Mode.EMERGENCY
                else "pinned: never switched automatically")
        if not cur.valid:
            return finish(Outcome.BLOCKED, None, [], reasons + [f"{held}; an operator must act (emergency or a "
                                                                "gear override)"])
        return finish(Outcome.STAY, None, [], [held])
    if transition_running:
        return finish(Outcome.DEFERRED, None, [], reasons + ["a transition is running; decide again when it ends"])
    # load trigger: both windows agree that the current gear is over/under its watermarks
    if trigger is Trigger.PERIODIC and cur.estimate is not None and cur.estimate.capacity_rps > 0:
        short, long = short_load, long_load
        if short is not None and long is not None:
            cap = cur.estimate.capacity_rps
            us, ul = short.rate_rps / cap, long.rate_rps / cap
            if min(us, ul) > config.high_watermark or max(us, ul) < config.low_watermark:
                trigger = Trigger.LOAD
                reasons.append(f"load: utilisation {us:.0%} (short window) and {ul:.0%} (long window)")
    in_cooldown = cur.valid and cool_until is not None and now_s < cool_until and not ignore_cooldown
    if window_load is None:
        if cur.valid:
            # missing telemetry is not zero load: never shed GPUs on silence
            return finish(Outcome.STAY, None, [], reasons + ["no load samples in the windows; keeping the gear"
                                                             " until load is known"])
        reasons.append("no load samples in the windows; placing for zero load")

    stability = history.stabilities(now_s) if history is not None else {}
    options = planner_options or DEFAULT_OPTIONS
    if deployment.latency_critical and not options.latency_critical:
        options = PlannerOptions(**{**options.__dict__, "latency_critical": True})
    cands = plan_candidates(
        spec, snapshot, workload, slo=deployment.slo, options=options, blocks=blocks, stability=stability,
        reclaimable_bytes=reclaim, prefer_gpus=current_gear.gpu_uuids if current_gear else (),
        keep=current_gear.plans if current_gear is not None and cur.valid else (), policy=policy, eff=eff,
    )
    left_out.extend(cands.excluded)
    if cap_per_gpu == 0.0 and cands.feasible:
        # nothing runs now: charge the rent against the most GPU-efficient candidate
        cap_per_gpu = max(c.estimate.capacity_rps * workload.output_tokens_mean / max(1, c.estimate.gpus)
                          for c in cands.feasible)
        rent = config.gpu_rent * cap_per_gpu
    evals = with_paths([evaluate(c.gear, c.estimate, c.kind, c.profiles) for c in cands.feasible
                        if c.gear != current_gear])
    if evals and all(e.path is not None and e.path.kind != "direct" for e in evals):
        best_path = min(evals, key=lambda e: (not (e.path is not None and e.path.executable), e.cost.tokens))
        assert best_path.path is not None  # noqa: S101 - every eval has one here
        reasons.append(f"no candidate fits beside the current gear; it would take: {best_path.gear.shape()}"
                       f" {best_path.path.note.split('; ', 1)[-1]}")
    if backoff is not None and backoff.entries:
        evals = [backed_off(e, backoff) for e in evals]
    if direct_only:
        evals = [e if e.path is None or not e.path.staged else replace(e, passes=False, note=(
            f"{e.note}; not now: the staged switch before it could not go on") if e.note else
            "not now: the staged switch before it could not go on") for e in evals]
    cur_value = _value(cur.estimate, rent)

    def rank(e: CandidateEval) -> tuple[object, ...]:
        # NOTE(ranking): standing candidates first. Within them the surplus over the threshold
        # counts the rent even when the current gear's gain does not (the cheapest gear that
        # meets the SLOs wins); the others rank by their surplus alone.
        surplus = e.gain_tokens - e.threshold_tokens
        if e.standing and not cur_standing:
            horizon = max(0.0, config.horizon_s - e.cost.time_to_effect_s)
            surplus = (e.value_tokens_s - cur_value) * horizon - e.threshold_tokens
        return (not e.standing, -surplus, e.estimate.gpus, _gear_order(e.gear))

    evals.sort(key=rank)
    act = Outcome.SWITCH if deployment.mode is Mode.AUTO else Outcome.ADVISE

    def switch_to(best: CandidateEval, why: list[str]) -> Decision:
        path = best.path
        if path is not None and path.staged and path.via is not None:
            return finish(act, path.via, evals, [*why, f"stage 1 of 2: {path.note}"], stage=1, staged=best.gear)
        return finish(act, best.gear, evals, why)
    offered_tokens_s = workload.rate_rps * workload.output_tokens_mean

    if not cur.valid:
        reachable = [e for e in evals if e.path is None or (e.path.executable and not (direct_only and e.path.staged))]
        if not reachable:
            return finish(Outcome.BLOCKED, None, evals, reasons + ["no feasible gear to move to"] + list(cands.infeasible))
        # a gear that meets the SLOs first (the cheapest of them after rent); else the most goodput
        best = max(reachable, key=lambda e: (e.standing, (e.value_tokens_s if e.standing
                                                          else e.estimate.goodput_tokens_s)
                                             - e.cost.tokens / max(1.0, config.horizon_s),
                                             -e.estimate.gpus, _gear_order(e.gear)))
        return switch_to(best, reasons + [
            f"moving at once to {best.gear.shape()} (hysteresis and cooldown do not apply to an invalid gear)"])
    holding = backoff.holding(now_s) if backoff is not None else None
    if holding is not None:
        return finish(Outcome.STAY, None, evals, reasons + [
            f"backing off until t={holding:.0f} s after {backoff.streak if backoff else 0} refused transition(s)"
            " in a row (scheduler.backoff): no automatic switch before then"])
    if in_cooldown:
        assert cool_until is not None
        return finish(Outcome.STAY, None, evals, reasons + [
            f"cooldown: no automatic switch until t={cool_until:.0f} s"
            + (" (long cooldown: two switches within the flap window)" if _flapping(deployment, config) else "")])
    def worth_it(e: CandidateEval) -> bool:
        # a tiny gain never moves the gear, however cheap the move
        horizon = max(0.0, config.horizon_s - e.cost.time_to_effect_s)
        return e.gain_tokens > config.min_relative_gain * offered_tokens_s * horizon

    # a standing gear is only left for another standing one
    eligible = [e for e in evals if e.standing] if cur_standing else evals
    passing = [e for e in eligible if e.passes and worth_it(e) and (e.path is None or e.path.executable)]
    if not passing:
        why = reasons + ["no candidate's gain beats its cost x hysteresis"]
        if eligible:
            top = eligible[0]
            why.append(f"best: {top.gear.shape()} gain {top.gain_tokens:.0f} tokens vs threshold"
                       f" {top.threshold_tokens:.0f} (cost {top.cost.tokens:.0f} x {factor}); a switch also"
                       f" needs {config.min_relative_gain:.0%} of the offered output tokens/s")
        if cur_standing and len(eligible) < len(evals):
            why.append("the current gear meets its SLOs: only gears that meet them too are considered")
        why.extend(cands.infeasible)
        return finish(Outcome.STAY, None, evals, why)
    best = passing[0]
    return switch_to(best, reasons + [
        f"{best.gear.shape()}{' (meets the SLOs)' if best.standing else ''}: gain {best.gain_tokens:.0f} tokens"
        f" > cost {best.cost.tokens:.0f} x {factor}"])


def safe_rank(e: CandidateEval) -> tuple[object, ...]:
    """The order of safe gears for an emergency: meets the SLOs first, then the most goodput, then the
    fewest GPUs (a deterministic tie-break last). Switch cost does not count: it is an emergency."""
    return (not e.standing, -e.estimate.goodput_tokens_s, e.estimate.gpus, _gear_order(e.gear))


def _gear_order(gear: Gear) -> tuple[tuple[str, ...], ...]:
    """A deterministic tie-break that needs no content digest."""
    return tuple(p.gpu_uuids for p in gear.plans)


def _flapping(deployment: Deployment, config: GearboxConfig) -> bool:
    times = sorted(deployment.last_switch_times_s)
    return len(times) >= 2 and times[-1] - times[-2] <= config.flap_window_s


__all__ = [
    "CandidateEval", "DEFAULT_CONFIG", "Decision", "Deployment", "GearboxConfig", "LoadSample", "LoadWindow",
    "Mode", "Outcome", "Trigger", "cooldown_until", "decide", "gear_footprint", "margin_load", "offered_load",
    "record_switch", "safe_rank", "standing",
]
