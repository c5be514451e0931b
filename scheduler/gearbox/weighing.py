"""How one decision weighs a gear: `Weighing` holds the decision's inputs, the current gear as
it is on the snapshot, the rent and the memos its steps share, and prices every gear the steps
look at - its estimate and standing, its gain against cost x hysteresis, the path that reaches it
under the memory a transition holds (scheduler.booking, scheduler.staging), its back-off - and
builds the `Decision` (`finish`). The steps themselves are in `decision`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from scheduler._lazy import make_frozen
from scheduler.backoff import Backoff
from scheduler.booking import Overbooking, describe
from scheduler.costmodel import (
    Efficiency,
    Estimate,
    PlanProfile,
    SwitchCost,
    Workload,
    combine_estimates,
    steady_state,
    switch_cost,
)
from scheduler.gearbox.measures import (
    _evaluate_current,
    _gear_order,
    _larger,
    _value,
    cooldown_until,
    gear_footprint,
    margin_load,
    overloaded,
    planned_load,
    rent_off,
    safe_rank,
    standing,
)
from scheduler.gearbox.values import (
    CandidateEval,
    CapacityAsk,
    Decision,
    Deployment,
    GearboxConfig,
    LoadWindow,
    Outcome,
    Trigger,
)
from scheduler.modelspec import ModelSpec, model_spec
from scheduler.plan import Gear, Plan
from scheduler.planner import DEFAULT_OPTIONS, Candidates, PlannerOptions, plan_candidates
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
from scheduler.topology import BlockPolicy, FragmentHistory, Snapshot, partition

MAX_VIAS = 4  # intermediate gears a staged switch is priced through (the direct candidates worth most)


class Weighing:
    """One decision in progress: its inputs, the current gear as it is on the snapshot, the rent,
    the reasons gathered so far, and the memos its steps share (estimates by profile and load,
    candidates' profiles). What every step weighs a gear with: `evaluate` (gain against cost x
    hysteresis, standing), `with_paths`/`routed` (memory across the switch), `backed_off`,
    `operator_path`, and `finish` (the `Decision`)."""

    def __init__(self, deployment: Deployment, current_gear: Gear | None, snapshot: Snapshot,
                 load_window: LoadWindow, now_s: float, *, trigger: Trigger, requested_gear: Gear | None,
                 transition_running: bool, history: FragmentHistory | None, staged_target: Gear | None,
                 backoff: Backoff | None, model: ModelSpec | None, config: GearboxConfig,
                 planner_options: PlannerOptions | None, policy: BlockPolicy, eff: Efficiency,
                 capacity_ask: CapacityAsk | None = None) -> None:
        self.deployment = deployment
        self.current_gear = current_gear
        self.snapshot = snapshot
        self.now_s = now_s
        self.trigger = trigger  # PERIODIC becomes LOAD when both windows agree (`_load_trigger`)
        self.requested_gear = requested_gear
        self.transition_running = transition_running
        self.history = history
        self.staged_target = staged_target
        self.backoff = backoff
        self.config = config
        self.planner_options = planner_options
        self.policy = policy
        self.eff = eff
        self.spec = spec = model if model is not None else model_spec(deployment.model)
        self.factor = config.hysteresis
        self.blocks = partition(snapshot, policy).blocks
        self.short_load = load_window.over(now_s, config.short_window_s, config.backlog_drain_s)
        self.long_load = load_window.over(now_s, config.long_window_s, config.backlog_drain_s)
        self.window_load = _larger(self.short_load, self.long_load)  # offered_load, the two windows read once
        # planned_load: the level, raised to the trend's forecast while the load rises
        self.planned = planned = planned_load(load_window, now_s, config)
        self.workload = workload = planned.workload or Workload(0.0, 512.0, 128.0)
        self.reclaim = gear_footprint(current_gear, spec, snapshot) if current_gear is not None else {}
        self.cur = cur = _evaluate_current(current_gear, spec, snapshot, workload, deployment.slo, self.blocks,
                                           self.reclaim, policy, eff)
        self.cur_id = current_gear.gear_id if current_gear is not None else None
        self.cap_per_gpu = 0.0
        if cur.estimate is not None and cur.estimate.gpus > 0:
            self.cap_per_gpu = cur.estimate.capacity_rps * workload.output_tokens_mean / cur.estimate.gpus
        self.rent = config.gpu_rent * self.cap_per_gpu  # may be rebased on the candidates (`_weigh_candidates`)
        self.cur_gpus = cur.estimate.gpus if cur.valid and cur.estimate is not None else 0
        # a plan's estimate by (profile, load, routing weight), for this decision only: replicas of
        # one unit type share their profile, so a gear of n equal replicas costs one estimate
        self.plan_estimates: dict[tuple[PlanProfile, Workload, float], Estimate] = {}
        # the margin loads (`margin_load`), built once: every candidate is checked at one of the two
        self.margin_loads: dict[bool, Workload] = {}
        self.cur_standing = (cur.valid and current_gear is not None and cur.estimate is not None
                             and self.stands(current_gear, cur.estimate, cur.profiles))
        self.cool_until = cooldown_until(deployment, config)
        # the current gear's queue grows at the offered load: an upshift leaves it whatever the
        # cooldown (`decision._waiting`)
        self.overloaded = cur.valid and overloaded(current_gear, spec, snapshot, load_window, now_s, deployment.slo,
                                                   config, eff, profiles=cur.profiles)
        self.reasons: list[str] = [r] if (r := planned.reason(config)) else []
        self.left_out: list[str] = []  # the planner's exclusions (engine capabilities), for the candidate list
        self.unplaced: list[str] = []  # why the planner found no gear at all (weigh_all), for the reasons
        self.profiles_of: dict[Gear, Mapping[Plan, PlanProfile]] = {}  # candidates' profiles, by gear
        self.rent_offs: dict[Gear, float] = {}  # GPU-equivalents others time-slice, by gear (`value`)
        self.output_p99 = workload.output_quantile(0.99)
        self.ignore_cooldown = False  # a staged switch could not go on: its first stage was never meant to stay
        self.direct_only = False  # ... and no new staged path from it (no loop of first stages)
        self.capacity_ask = capacity_ask  # the TWU rule's ask (`against_ask`)

    # --- estimates and standing ----------------------------------------------------------------
    def at_load(self, gear: Gear, load: Workload, known: Mapping[Plan, PlanProfile]) -> Estimate:
        """The gear's estimate at `load`; `known`: profiles already built, by plan."""
        ests = []
        for plan, w in zip(gear.plans, gear.weights, strict=True):
            prof = known.get(plan)
            if prof is None:
                prof = PlanProfile.build(plan, self.spec, self.snapshot, self.eff)
            key = (prof, load, w)
            est = self.plan_estimates.get(key)
            if est is None:
                # estimate_plan(prof, load.scaled(w), slo), without building the scaled Workload:
                # the steady state depends on the load's shape, not its rate
                est = self.plan_estimates[key] = steady_state(prof, load, self.deployment.slo).estimate(
                    load.rate_rps * w)
            ests.append(est)
        return combine_estimates(ests, gear.weights, load)

    def estimate_of(self, gear: Gear) -> Estimate:
        return self.at_load(gear, self.workload, self.cur.profiles)

    def stands(self, gear: Gear, est: Estimate, known: Mapping[Plan, PlanProfile]) -> bool:
        # NOTE(band): a gear with fewer GPUs stands only below the shrink watermark - unless the
        # config says the TWU band is the scale-in's band and the TWU rule asked for less: its band
        # (2 x low < high) keeps the smaller gear from landing where growing is called for again,
        # and the shrink band on top vetoes every scale-in it asks for (bench.pool measured it);
        # the high watermark and the margin load still hold
        shrinking = 0 < est.gpus < self.cur_gpus and not (
            self.config.scale_in_on_twu_band and self.capacity_ask is CapacityAsk.LESS)
        if not standing(est, self.workload, self.config, shrinking=shrinking):
            return False  # (the cheap test first)
        load = self.margin_loads.get(shrinking)
        if load is None:
            load = self.margin_loads[shrinking] = margin_load(self.workload, self.config, shrinking=shrinking)
        return standing(est, self.workload, self.config, shrinking=shrinking,
                        at_margin=self.at_load(gear, load, known))

    # --- gain against cost ---------------------------------------------------------------------
    def value(self, gear: Gear | None, est: Estimate | None, rent: float) -> float:
        """`gear`'s goodput less `rent` per GPU it pays for (`measures.rent_off`: a share of the
        GPUs other deployments time-slice)."""
        if gear is None or est is None:
            return _value(est, rent)
        off = self.rent_offs.get(gear)
        if off is None:
            off = self.rent_offs[gear] = rent_off(gear, self.snapshot)
        return _value(est, rent, off)

    def gain(self, gear: Gear, est: Estimate, cost: SwitchCost) -> float:
        """(value - current value) x the horizon left once the new gear carries the load; rent only
        trades GPUs against tokens once the SLOs are met (package docstring). Leaving an overloaded
        gear gains at least the throughput it leaves unserved that the new gear serves.

        NOTE(overload): an overloaded gear's queue grows without bound, so its modelled TTFT is
        infinite and its goodput 0 - and so is that of every candidate overloaded too. By value
        alone, a gear that serves four times as much then gains nothing, and the gear stays
        where it is while the backlog (offered load) grows past every gear: stuck. What the
        bigger gear does serve of that load is what leaving is worth at least."""
        charged = self.rent if self.cur_standing else 0.0
        cur = self.cur.estimate
        per_s = self.value(gear, est, charged) - self.value(self.current_gear, cur, charged)
        if cur is not None and cur.overloaded:
            per_s = max(per_s, est.throughput_tokens_s - cur.throughput_tokens_s)
        return per_s * max(0.0, self.config.horizon_s - cost.time_to_effect_s)

    def evaluate(self, gear: Gear, est: Estimate, note: str,
                 profiles: Mapping[Plan, PlanProfile] | None = None, *, cost: SwitchCost | None = None,
                 path: SwitchPath | None = None) -> CandidateEval:
        cur = self.cur
        # the candidate's profiles, and the current gear's (plans it keeps)
        known = {**cur.profiles, **profiles} if profiles else cur.profiles
        if profiles:
            self.profiles_of[gear] = profiles
        if cost is None:
            cost = switch_cost(self.current_gear, gear, self.spec, self.snapshot, self.workload,
                               current_estimate=cur.estimate, target_estimate=est, eff=self.eff, profiles=known)
        value = self.value(gear, est, self.rent)
        gain = self.gain(gear, est, cost)
        threshold = cost.tokens * self.factor
        return make_frozen(CandidateEval, {"gear": gear, "estimate": est, "value_tokens_s": value, "gain_tokens": gain,
                                           "cost": cost, "threshold_tokens": threshold, "passes": gain > threshold,
                                           "note": note, "standing": self.stands(gear, est, known), "path": path})

    def repriced(self, e: CandidateEval, cost: SwitchCost, path: SwitchPath) -> CandidateEval:
        """`e` weighed again with another cost (its path's): the estimate and standing are the gear's."""
        gain = self.gain(e.gear, e.estimate, cost)
        threshold = cost.tokens * self.factor
        return replace(e, cost=cost, gain_tokens=gain, threshold_tokens=threshold, passes=gain > threshold, path=path)

    # --- memory across the switch (scheduler.booking, scheduler.staging) -----------------------
    def routed(self, e: CandidateEval, vias: Sequence[CandidateEval],
               found: Sequence[Overbooking] | None = None) -> CandidateEval:
        """`e` with the path that reaches it: direct when its new plans fit beside the current
        gear; else the cheaper of a staged switch (via one of `vias`) and a brief drain, priced
        as both switches plus what is lost in between; else blocked (it says what it would take).
        `found`: its conflicts, when the caller has them."""
        current_gear, spec, snapshot, workload, cur = (self.current_gear, self.spec, self.snapshot, self.workload,
                                                       self.cur)
        if found is None:
            found = conflicts(current_gear, e.gear, spec, snapshot)
        if not found:
            return e if e.path is not None else replace(e, path=DIRECT)
        known = {**cur.profiles, **self.profiles_of.get(e.gear, {})}
        options: list[tuple[PathKind, Gear, SwitchCost]] = []
        firsts: list[tuple[Gear, Estimate, SwitchCost, PathKind]] = [
            (v.gear, v.estimate, v.cost, "staged") for v in vias if v.gear != e.gear]
        sub = drain_gear(current_gear, found, snapshot)
        if sub is not None:
            sub_est = self.estimate_of(sub)
            sub_cost = switch_cost(current_gear, sub, spec, snapshot, workload, current_estimate=cur.estimate,
                                   target_estimate=sub_est, eff=self.eff, profiles=cur.profiles)
            firsts.append((sub, sub_est, sub_cost, "drain"))
        for gear1, est1, cost1, kind in firsts:
            if not fits_after(current_gear, gear1, e.gear, spec, snapshot):
                continue
            second = switch_cost(gear1, e.gear, spec, snapshot, workload, current_estimate=est1,
                                 target_estimate=e.estimate, eff=self.eff,
                                 profiles={**known, **self.profiles_of.get(gear1, {})})
            total = combine(cost1, second, dwell_tokens(cur.estimate, est1, second.time_to_effect_s))
            options.append((kind, gear1, total))
        if not options:
            outage_s, outage_tokens = outage_cost(e.cost, cur.estimate, drain_s(cur.estimate, self.output_p99))
            note = blocked_note(found, outage_s, outage_tokens)
            return replace(e, passes=False, note=f"{e.note}; {note}" if e.note else note,
                           path=SwitchPath("blocked", conflicts=tuple(found), note=note))
        kind, gear1, total = min(options, key=lambda o: (o[2].tokens, _gear_order(o[1])))
        how = (f"staged via {gear1.shape()}" if kind == "staged"
               else f"brief drain: {len(current_gear.plans) - len(gear1.plans) if current_gear else 0} plan(s)"
                    f" released first, {gear1.shape()} serving meanwhile")
        note = f"does not fit beside the current gear ({describe(found)}); {how}"
        return self.repriced(e, total, SwitchPath(kind, via=gear1, conflicts=tuple(found), note=note))

    def with_paths(self, evals: Sequence[CandidateEval]) -> list[CandidateEval]:
        found = [conflicts(self.current_gear, e.gear, self.spec, self.snapshot) for e in evals]
        direct = [e for e, f in zip(evals, found, strict=True) if not f]
        # intermediates: the direct candidates worth most (a staged switch dwells on one briefly)
        vias = sorted(direct, key=lambda v: (-v.value_tokens_s, v.cost.tokens, _gear_order(v.gear)))[:MAX_VIAS]
        return [self.routed(e, vias, f) for e, f in zip(evals, found, strict=True)]

    def backed_off(self, e: CandidateEval, book: Backoff) -> CandidateEval:
        hit = book.blocked(e.gear, self.now_s, self.snapshot)
        if e.path is not None and e.path.via is not None:
            hit += book.blocked(e.path.via, self.now_s, self.snapshot)
        if not hit:
            return e
        until = max(h.until_s for h in hit)
        note = f"backing off until t={until:.0f} s (a PREPARE of it was refused: {hit[0].reason[:120]})"
        return replace(e, passes=False, note=f"{e.note}; {note}" if e.note else note,
                       path=SwitchPath("blocked", conflicts=e.path.conflicts if e.path else (), note=note))

    @property
    def cooling(self) -> bool:
        """Within the cooldown after the last chosen switch, with a valid gear it applies to."""
        until = self.cool_until
        return self.cur.valid and until is not None and self.now_s < until and not self.ignore_cooldown

    def upshift_only(self, e: CandidateEval) -> CandidateEval:
        """`e` made ineligible unless it is an upshift (more modelled capacity than the current
        gear): what the cooldown lets out of an overloaded gear."""
        cur = self.cur.estimate
        if cur is None or e.estimate.capacity_rps > cur.capacity_rps:
            return e
        note = (f"not now: cooldown until t={self.cool_until:.0f} s, and only an upshift leaves the overloaded gear"
                f" ({e.estimate.capacity_rps:.2f} req/s, the current gear {cur.capacity_rps:.2f})")
        return replace(e, passes=False, note=f"{e.note}; {note}" if e.note else note)

    def against_ask(self, e: CandidateEval) -> CandidateEval:
        """`e` made ineligible when it goes against the capacity ask: MORE, no more modelled capacity
        than the current gear at the offered load; LESS, no fewer GPUs. A candidate that meets the
        SLOs the current gear misses is kept (never trade the SLO); with no current estimate there
        is nothing to compare against."""
        ask, cur = self.capacity_ask, self.cur.estimate
        if ask is None or cur is None or (e.standing and not self.cur_standing):
            return e
        if ask is CapacityAsk.MORE and e.estimate.capacity_rps <= cur.capacity_rps:
            note = (f"not now: TWU asks for more capacity and it has {e.estimate.capacity_rps:.2f} req/s, the current"
                    f" gear {cur.capacity_rps:.2f}")
        elif ask is CapacityAsk.LESS and e.estimate.gpus >= cur.gpus:
            note = f"not now: TWU asks for less capacity and it holds {e.estimate.gpus} GPUs, the current gear {cur.gpus}"
        else:
            return e
        return replace(e, passes=False, note=f"{e.note}; {note}" if e.note else note)

    # --- the planner's gears -------------------------------------------------------------------
    def plan(self, options: PlannerOptions, *, keep: Sequence[Plan] = (),
             stability: Mapping[str, float] | None = None) -> Candidates:
        current_gear = self.current_gear
        return plan_candidates(self.spec, self.snapshot, self.workload, slo=self.deployment.slo, options=options,
                               blocks=self.blocks, stability=stability, reclaimable_bytes=self.reclaim,
                               prefer_gpus=current_gear.gpu_uuids if current_gear else (), keep=keep,
                               policy=self.policy, eff=self.eff)

    def weigh_all(self, note: str) -> list[CandidateEval]:
        """Every feasible candidate but the current gear, weighed with the path that reaches it
        (memory across the switch), best first by `safe_rank`."""
        found = self.plan(self.planner_options or DEFAULT_OPTIONS)
        self.left_out.extend(x for x in found.excluded if x not in self.left_out)
        if not found.feasible:
            self.unplaced.extend(x for x in found.infeasible if x not in self.unplaced)
        return sorted(self.with_paths([self.evaluate(c.gear, c.estimate, note or c.kind, c.profiles)
                                       for c in found.feasible if c.gear != self.current_gear]), key=safe_rank)

    # --- an operator's gear --------------------------------------------------------------------
    def operator_path(self, ev: CandidateEval) -> CandidateEval:
        """An operator's gear (the baseline, a requested gear) with the path that reaches it:
        intermediates come from the planner, asked only when the gear does not fit beside."""
        current_gear = self.current_gear
        if not conflicts(current_gear, ev.gear, self.spec, self.snapshot):
            return replace(ev, path=DIRECT)
        found = self.plan(self.planner_options or DEFAULT_OPTIONS,
                          keep=current_gear.plans if current_gear is not None else ())
        pool = [self.evaluate(c.gear, c.estimate, c.kind, c.profiles) for c in found.feasible
                if c.gear not in (current_gear, ev.gear)]
        return self.with_paths([ev, *pool])[0] if pool else self.routed(ev, [])

    def operator_finish(self, ev: CandidateEval, why: list[str], what: str) -> Decision:
        path = ev.path
        if path is None or path.kind == "direct":
            return self.finish(Outcome.SWITCH, ev.gear, [ev], why)
        if not path.executable or path.via is None:
            return self.finish(Outcome.BLOCKED, None, [ev], [*why, f"{what}: the gear {path.note}"])
        return self.finish(Outcome.SWITCH, path.via, [ev], [*why, f"stage 1 of 2: {path.note}; then on to"
                                                                  f" {ev.gear.shape()}"], stage=1, staged=ev.gear)

    # --- the Decision --------------------------------------------------------------------------
    def finish(self, outcome: Outcome, target: Gear | None, evals: Sequence[CandidateEval], why: Sequence[str],
               value: float | None = None, *, stage: int = 0, staged: Gear | None = None) -> Decision:
        return Decision(
            deployment_id=self.deployment.id,
            now_s=self.now_s,
            trigger=self.trigger,
            outcome=outcome,
            factor=self.factor,
            current_gear_id=self.cur_id,
            current_valid=self.cur.valid,
            current_value_tokens_s=value if value is not None else self.value(self.current_gear, self.cur.estimate,
                                                                              self.rent),
            current_estimate=self.cur.estimate,
            target=target,
            workload=self.planned.workload,
            candidates=tuple(evals),
            reasons=tuple(why),
            cooldown_until_s=self.cool_until,
            stage=stage,
            staged_target=staged,
            excluded=tuple(self.left_out),
        )
