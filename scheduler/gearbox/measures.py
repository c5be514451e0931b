"""What a decision measures: the offered load, the cooldown, whether a gear stands (meets its
SLOs with room to spare) or is overloaded (its queue grows), the current gear as it is on the
snapshot, a gear's value, and the orders candidates are ranked in."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from scheduler.costmodel import (
    DEFAULT_EFFICIENCY,
    Efficiency,
    Estimate,
    PlanProfile,
    Slo,
    Workload,
    combine_estimates,
    estimate_plan,
)
from scheduler.gearbox.values import (
    DEFAULT_CONFIG,
    CandidateEval,
    Deployment,
    GearboxConfig,
    LoadWindow,
    Trend,
)
from scheduler.modelspec import ModelSpec
from scheduler.plan import Gear, Plan, stage_bytes_per_gpu, validate_gear, validate_plan
from scheduler.topology import AtomicBlock, BlockPolicy, Snapshot


def offered_load(window: LoadWindow, now_s: float, config: GearboxConfig = DEFAULT_CONFIG) -> Workload | None:
    """The load's level: the larger of the short- and long-window means, backlog included (what
    `planned_load` raises on a rising trend)."""
    return _larger(window.over(now_s, config.short_window_s, config.backlog_drain_s),
                   window.over(now_s, config.long_window_s, config.backlog_drain_s))


@dataclass(frozen=True)
class Planned:
    """The load a decision plans for: the level, raised to the trend's forecast while it rises."""

    workload: Workload | None  # what the gear must carry (None: no samples)
    level: Workload | None  # `offered_load`: the larger window mean, backlog included
    trend: Trend | None = None  # the long window's line, when it raised the level (else None)
    # the long window's slope in standard errors (> 0 rising, < 0 falling; 0 without a trend):
    # the TWU rule gives no GPUs back into a rise (`autoscale.scale_signal(slope_t=...)`)
    slope_t: float = 0.0

    @property
    def rise(self) -> float:
        """planned / level rate (>= 1; 1 without a rise): what the TWU rule scales its OUT test by."""
        if self.trend is None or self.workload is None or self.level is None or self.level.rate_rps <= 0:
            return 1.0
        return self.workload.rate_rps / self.level.rate_rps

    def reason(self, config: GearboxConfig) -> str:
        t = self.trend
        if t is None or self.workload is None or self.level is None:
            return ""
        return (f"load rising {t.slope_rps_s * 60:+.2f} req/s per minute (long window, {t.samples} samples): planned "
                f"for {self.workload.rate_rps:.2f} req/s, the forecast at +{config.trend_lead_s:.0f} s, over the "
                f"level {self.level.rate_rps:.2f}")


def planned_load(window: LoadWindow, now_s: float, config: GearboxConfig = DEFAULT_CONFIG) -> Planned:
    """The load to plan for: `offered_load` (the level), or - with `config.trend` and a long window
    whose least-squares slope is a significant rise (`Trend.significant`) - the line's value at now
    + `trend_lead_s` (plus the backlog) where that is higher, in the level's request shape.

    Why the trend: both windows are means, so on a ramp they trail the load by half their length,
    and a gear switched to now must then carry the load through its switch and the cooldown after
    it before the loop may grow it again: on a steep tide every step lands short. Why a lead of
    up to a cooldown: that is how long the gear chosen now must last. Why a cap on the rise: a
    burst (a step that plateaus) fits a steep line that no tide follows. Why only upward
    (max(level, forecast)): a falling forecast never lowers the load - scale-in reads the level
    alone, so no GPU is given back on a guess, and a rise that does not come costs GPU-time only
    until the level shows it (the next scale-in), never requests. And no scale-in into a rise
    (`slope_t`, read by the TWU rule): measured on tidal.yaml, a gear grown early on the forecast
    was given back at the first lull of the climb, and the long cooldown after that second switch
    held the small gear while the load doubled (goodput 0.50x the oracle's)."""
    level = offered_load(window, now_s, config)
    if not config.trend or level is None or config.trend_lead_s <= 0:
        return Planned(level, level)
    trend = window.trend(now_s, config.long_window_s)
    slope_t = trend.t_value if trend is not None else 0.0
    if trend is None or not trend.significant(config.trend_min_t):
        return Planned(level, level, slope_t=slope_t)
    newest = [s for s in window.samples if s.t_s <= now_s]
    backlog = newest[-1].backlog / config.backlog_drain_s if newest and config.backlog_drain_s > 0 else 0.0
    forecast = min(trend.at(config.trend_lead_s) + backlog, config.trend_max_rise * level.rate_rps)
    if forecast <= level.rate_rps:
        return Planned(level, level, slope_t=slope_t)
    return Planned(replace(level, rate_rps=forecast), level, trend, slope_t=slope_t)


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


def overloaded(gear: Gear | None, model: ModelSpec, snapshot: Snapshot, window: LoadWindow, now_s: float,
               slo: Slo, config: GearboxConfig = DEFAULT_CONFIG, eff: Efficiency = DEFAULT_EFFICIENCY, *,
               profiles: Mapping[Plan, PlanProfile] | None = None) -> bool:
    """Whether `gear` (valid on `snapshot`) is overloaded: the offered load (`offered_load`: the
    level, backlog included - not the trend's forecast, which is a guess) is at or above what it
    can serve, so its queue grows. Such a gear is left by an upshift whatever the cooldown (the
    gearbox's `_waiting`; the control loop's cooldown short-cut asks this first), and the gain of
    leaving it counts the throughput it leaves unserved (`Weighing.gain`). No gear, or no load
    samples (silence is not load): False. `profiles`: the plans' profiles already built."""
    level = offered_load(window, now_s, config)
    if gear is None or level is None or level.rate_rps <= 0:
        return False
    known = profiles or {}
    ests = [estimate_plan(known.get(p) or PlanProfile.build(p, model, snapshot, eff), level.scaled(w), slo)
            for p, w in zip(gear.plans, gear.weights, strict=True)]
    return combine_estimates(ests, gear.weights, level).overloaded


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


def _value(est: Estimate | None, rent_tokens_s_per_gpu: float, shared_off: float = 0.0) -> float:
    """Goodput minus the rent of the GPUs held; `shared_off`: the GPU-equivalents of them that
    other deployments time-slice (`rent_off`), which this one is not charged for."""
    if est is None:
        return 0.0
    return est.goodput_tokens_s - rent_tokens_s_per_gpu * (est.gpus - shared_off)


def rent_off(gear: Gear | None, snapshot: Snapshot) -> float:
    """How much less than its GPU count a gear pays rent for: on a GPU that other deployments hold
    too, a plan gets `compute_share` of its time (scheduler.pool.sharing) and pays that share of
    the rent, so sum(1 - compute_share) over the gear's GPUs (0.0 when it shares none).

    NOTE(rent): the pool holds a shared GPU once, whoever holds it, so its rent is split among the
    deployments time-slicing it, each charged its share - the one that joins and the one that was
    there alike. Charging the joiner a whole GPU made a shared GPU never worth taking while a free
    one remained (it runs at its share of the speed for the full rent), so no two models ever
    shared one; charging it nothing would make every free GPU look dear. Splitting it the same way
    for both sides keeps the one that was there from moving off to escape its co-tenant: its own
    GPU costs it half, a free one the whole rent."""
    if gear is None:
        return 0.0
    by_uuid = snapshot.gpu_by_uuid
    off = 0.0
    for u in set(gear.gpu_uuids):
        g = by_uuid.get(u)
        if g is not None and g.compute_share < 1.0:
            off += 1.0 - g.compute_share
    return off




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
