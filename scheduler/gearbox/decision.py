"""The decision: `decide` and the named steps it takes, in the order of the rules (the package
docstring states them).

`decide` builds one `Weighing` (module `weighing`) - the inputs, the current gear as measured on the snapshot, the
rent, and the memos the steps share - and runs the steps in order; each either returns the
`Decision` or leaves the weighing for the next:

0. `_second_stage`: a staged switch whose first stage is done goes on to its target, or falls
   through to a fresh decision (no cooldown, no new staged path);
1. `_emergency`: the baseline (or the gear an operator accepted), now;
2. `_manual`: the operator's requested gear, or the list to choose from;
3. automatic: `_held` (a pinned or emergency-mode deployment, a running transition),
   `_load_trigger` (both windows over or under the watermarks), `_silent` (no load samples),
   `_weigh_candidates` (the planner's gears, priced with the path that reaches each, backed
   off, ranked), `_move_off_invalid` (the current gear lost GPUs), `_waiting` (back-off
   hold, cooldown - which lets an upshift out of an overloaded gear) and `_switch_if_worth_it`
   (gain against cost x hysteresis).

Every `Decision` is built by `Weighing.finish`, with the reasons the steps gathered.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from scheduler.backoff import Backoff
from scheduler.booking import describe
from scheduler.costmodel import DEFAULT_EFFICIENCY, Efficiency
from scheduler.gearbox.measures import _flapping, _gear_order
from scheduler.gearbox.values import (
    DEFAULT_CONFIG,
    CandidateEval,
    CapacityAsk,
    Decision,
    Deployment,
    GearboxConfig,
    LoadWindow,
    Mode,
    Outcome,
    Trigger,
)
from scheduler.gearbox.weighing import Weighing
from scheduler.modelspec import ModelSpec
from scheduler.plan import Gear, validate_gear
from scheduler.planner import DEFAULT_OPTIONS, Candidates, PlannerOptions
from scheduler.staging import DIRECT, conflicts
from scheduler.topology import DEFAULT_POLICY, BlockPolicy, FragmentHistory, Snapshot


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
    capacity_ask: CapacityAsk | None = None,
) -> Decision:
    """Decide whether `deployment` should change gear now (package docstring: the rules).

    `trigger` is what the caller saw (tick, topology event, operator); `requested_gear` is
    the operator's choice for MANUAL. `history` supplies block stability. `staged_target`: the
    gear a staged switch goes on to once its first stage is done (`Decision.staged_target` of the
    decision that started it; its drivers keep it). `backoff`: the deployment's back-off after
    refused PREPAREs (scheduler.backoff): automatic switches wait, and backed-off plans are not
    proposed. `capacity_ask` (the control loop's TWU rule, with a LOAD trigger): "more" makes the
    candidates with no more modelled capacity than the current gear ineligible, "less" those that
    hold no fewer GPUs - unless one meets the SLOs the current gear misses (never trade the SLO);
    what is left is weighed as ever. Pure and deterministic: no I/O, no clock but `now_s`.
    """
    w = Weighing(deployment, current_gear, snapshot, load_window, now_s, trigger=trigger,
                  requested_gear=requested_gear, transition_running=transition_running, history=history,
                  staged_target=staged_target, backoff=backoff, model=model, config=config,
                  planner_options=planner_options, policy=policy, eff=eff, capacity_ask=capacity_ask)
    done = _second_stage(w)
    if done is not None:
        return done
    if w.trigger is Trigger.EMERGENCY:
        return _emergency(w)
    if w.trigger is Trigger.MANUAL:
        return _manual(w)
    return _automatic(w)


# --- 0. the second stage of a staged switch ----------------------------------------------------
def _second_stage(w: Weighing) -> Decision | None:
    """The second stage of a staged switch whose first stage is done (its drivers ask): on to its
    target when it fits, without hysteresis or cooldown. When it cannot go on, None, with the
    reason recorded and the fresh decision that follows freed of the cooldown and of staged paths."""
    staged_target = w.staged_target
    if staged_target is None or w.trigger is Trigger.EMERGENCY or w.transition_running:
        # (an emergency's own staged downshift is not this: its request stays pending until the
        # emergency trigger reaches the gear it holds)
        return None
    deployment = w.deployment
    if deployment.mode in (Mode.PINNED, Mode.EMERGENCY):
        return w.finish(Outcome.STAY, None, [], [f"{deployment.mode.value}: the staged switch toward "
                                                 f"{staged_target.shape()} stops here"])
    problems = validate_gear(staged_target, w.snapshot, w.spec, blocks=w.blocks, reclaimable_bytes=w.reclaim,
                             policy=w.policy)
    found = conflicts(w.current_gear, staged_target, w.spec, w.snapshot)
    if w.cur.valid and not problems and not found:
        ev = w.evaluate(staged_target, w.estimate_of(staged_target), "second stage of a staged switch")
        act2 = Outcome.SWITCH if deployment.mode is Mode.AUTO else Outcome.ADVISE
        return w.finish(act2, staged_target, [replace(ev, path=DIRECT)], [
            f"stage 2 of 2: on to {staged_target.shape()} (weighed with the first stage: no hysteresis or"
            " cooldown)"], stage=2)
    why = problems[:2] or ([describe(found)] if found else []) or ["the current gear is not valid"]
    w.reasons.append(f"the staged switch toward {staged_target.shape()} cannot go on ({'; '.join(why)});"
                     " deciding afresh")
    w.ignore_cooldown = True  # the intermediate gear was never meant to stay
    w.direct_only = True  # and no new staged path from it: one failed already (no loop of first stages)
    return None


# --- 1. emergency ------------------------------------------------------------------------------
def _emergency(w: Weighing) -> Decision:
    """The baseline (or the gear an operator accepted instead), now, whatever the mode."""
    deployment = w.deployment
    base = w.requested_gear or deployment.baseline
    if base is None:
        return w.finish(Outcome.BLOCKED, None, w.weigh_all("offered: the planner's best safe gear")[:5],
                        ["emergency: the deployment has no baseline gear yet; to fix: set one"])
    what = "the baseline gear" if base == deployment.baseline else "the accepted emergency gear"
    if w.current_gear is not None and base.gear_id == w.cur_id:
        return w.finish(Outcome.STAY, None, [], [f"emergency: already on {what} (nothing to do)"])
    problems = validate_gear(base, w.snapshot, w.spec, blocks=w.blocks, reclaimable_bytes=w.reclaim,
                             policy=w.policy)
    if problems:
        offers = w.weigh_all("offered: the planner's best safe gear")[:5]
        fix = ("to fix: restore its GPUs, set a new baseline, or downshift to the planner's best safe gear "
               f"{offers[0].gear.shape()} instead" if offers else
               "to fix: restore its GPUs or set a new baseline (no other gear fits the fleet now)")
        return w.finish(Outcome.BLOCKED, None, offers, [f"emergency: {what} cannot run on this snapshot: "
                                                       + "; ".join(problems[:5]), fix])
    ev = w.evaluate(base, w.estimate_of(base), "baseline" if base == deployment.baseline else "accepted by an operator")
    why = [f"emergency downshift to {what} (operator)"]
    if w.transition_running:
        why.append("supersedes the running transition (the executor rolls it back first)")
        return w.finish(Outcome.SWITCH, base, [ev], why)
    return w.operator_finish(w.operator_path(ev), why, "emergency")


# --- 2. manual ---------------------------------------------------------------------------------
def _manual(w: Weighing) -> Decision:
    """The operator's gear, if valid; without one, every candidate an operator may choose from."""
    requested = w.requested_gear
    if requested is None:
        listed = w.weigh_all("")
        return w.finish(Outcome.STAY, None, listed, [f"manual: {len(listed)} candidate gear(s) an operator may "
                                                     "choose from, best first", *w.unplaced[:5]])
    if w.transition_running:
        return w.finish(Outcome.DEFERRED, None, [], ["manual: a transition is running; retry when it ends"])
    if requested.gear_id == w.cur_id:
        return w.finish(Outcome.STAY, None, [], ["manual: already on the requested gear"])
    problems = validate_gear(requested, w.snapshot, w.spec, blocks=w.blocks, reclaimable_bytes=w.reclaim,
                             policy=w.policy)
    if w.planner_options is not None:  # the registry version's requirements (scheduler.requirements)
        problems += w.planner_options.requires.gear_refusals(requested.plans, w.snapshot)
    if problems:
        return w.finish(Outcome.BLOCKED, None, [], ["manual: the requested gear is not valid: "
                                                   + "; ".join(problems[:5])])
    ev = w.operator_path(w.evaluate(requested, w.estimate_of(requested), "requested by an operator"))
    return w.operator_finish(ev, ["manual switch requested by an operator"], "manual")


# --- 3. automatic ------------------------------------------------------------------------------
def _automatic(w: Weighing) -> Decision:
    """PERIODIC, LOAD and TOPOLOGY triggers: the steps below, in order."""
    held = _held(w)
    if held is not None:
        return held
    _load_trigger(w)
    silent = _silent(w)
    if silent is not None:
        return silent
    evals, cands = _weigh_candidates(w)
    if not w.cur.valid:
        return _move_off_invalid(w, evals, cands)
    waiting = _waiting(w, evals)
    if waiting is not None:
        return waiting
    if w.cooling and w.overloaded:  # in its cooldown (`_waiting`): only an upshift may leave it
        evals = [w.upshift_only(e) for e in evals]
    return _switch_if_worth_it(w, evals, cands)


def _held(w: Weighing) -> Decision | None:
    """Pinned and emergency-mode deployments never switch automatically (BLOCKED when the gear
    they hold lost GPUs); nothing while a transition runs (DEFERRED)."""
    if not w.cur.valid and w.current_gear is not None:
        w.reasons.append("current gear is not valid on this snapshot: " + "; ".join(w.cur.reasons[:3]))
    mode = w.deployment.mode
    if mode in (Mode.PINNED, Mode.EMERGENCY):
        held = ("emergency: holds its gear until an operator releases it" if mode is Mode.EMERGENCY
                else "pinned: never switched automatically")
        if not w.cur.valid:
            return w.finish(Outcome.BLOCKED, None, [], w.reasons + [f"{held}; an operator must act (emergency or a "
                                                                    "gear override)"])
        return w.finish(Outcome.STAY, None, [], [held])
    if w.transition_running:
        return w.finish(Outcome.DEFERRED, None, [], w.reasons + ["a transition is running; decide again when it ends"])
    return None


def _load_trigger(w: Weighing) -> None:
    """A tick becomes a LOAD trigger when both windows agree that the current gear is over its
    high watermark or under its low one."""
    est = w.cur.estimate
    if w.trigger is Trigger.PERIODIC and est is not None and est.capacity_rps > 0:
        short, long = w.short_load, w.long_load
        if short is not None and long is not None:
            cap = est.capacity_rps
            us, ul = short.rate_rps / cap, long.rate_rps / cap
            if min(us, ul) > w.config.high_watermark or max(us, ul) < w.config.low_watermark:
                w.trigger = Trigger.LOAD
                w.reasons.append(f"load: utilisation {us:.0%} (short window) and {ul:.0%} (long window)")


def _silent(w: Weighing) -> Decision | None:
    """No load samples in the windows: a valid gear stays (missing telemetry is not zero load:
    never shed GPUs on silence); an invalid one is placed for zero load."""
    if w.window_load is not None:
        return None
    if w.cur.valid:
        return w.finish(Outcome.STAY, None, [], w.reasons + ["no load samples in the windows; keeping the gear"
                                                             " until load is known"])
    w.reasons.append("no load samples in the windows; placing for zero load")
    return None


def _weigh_candidates(w: Weighing) -> tuple[list[CandidateEval], Candidates]:
    """The planner's candidates (block stability, latency-critical, the current plans kept), each
    weighed with the path that reaches it, backed-off ones made ineligible, ranked best first."""
    current_gear, cur = w.current_gear, w.cur
    stability = w.history.stabilities(w.now_s) if w.history is not None else {}
    options = w.planner_options or DEFAULT_OPTIONS
    if w.deployment.latency_critical and not options.latency_critical:
        options = PlannerOptions(**{**options.__dict__, "latency_critical": True})
    cands = w.plan(options, stability=stability,
                   keep=current_gear.plans if current_gear is not None and cur.valid else ())
    w.left_out.extend(cands.excluded)
    if w.cap_per_gpu == 0.0 and cands.feasible:
        # nothing runs now: charge the rent against the most GPU-efficient candidate
        w.cap_per_gpu = max(c.estimate.capacity_rps * w.workload.output_tokens_mean / max(1, c.estimate.gpus)
                            for c in cands.feasible)
        w.rent = w.config.gpu_rent * w.cap_per_gpu
    evals = w.with_paths([w.evaluate(c.gear, c.estimate, c.kind, c.profiles) for c in cands.feasible
                          if c.gear != current_gear])
    if evals and all(e.path is not None and e.path.kind != "direct" for e in evals):
        best_path = min(evals, key=lambda e: (not (e.path is not None and e.path.executable), e.cost.tokens))
        assert best_path.path is not None  # noqa: S101 - every eval has one here
        w.reasons.append(f"no candidate fits beside the current gear; it would take: {best_path.gear.shape()}"
                         f" {best_path.path.note.split('; ', 1)[-1]}")
    if w.backoff is not None and w.backoff.entries:
        book = w.backoff
        evals = [w.backed_off(e, book) for e in evals]
    if w.capacity_ask is not None:
        evals = [w.against_ask(e) for e in evals]
    if w.direct_only:
        evals = [e if e.path is None or not e.path.staged else replace(e, passes=False, note=(
            f"{e.note}; not now: the staged switch before it could not go on") if e.note else
            "not now: the staged switch before it could not go on") for e in evals]
    evals.sort(key=_ranking(w))
    return evals, cands


def _ranking(w: Weighing) -> Callable[[CandidateEval], tuple[object, ...]]:
    """The automatic order of candidates.

    NOTE(ranking): standing candidates first. Within them the surplus over the threshold counts
    the rent even when the current gear's gain does not (the cheapest gear that meets the SLOs
    wins); the others rank by their surplus alone."""
    cur_value = w.value(w.current_gear, w.cur.estimate, w.rent)
    cur_standing, horizon_s = w.cur_standing, w.config.horizon_s

    def rank(e: CandidateEval) -> tuple[object, ...]:
        surplus = e.gain_tokens - e.threshold_tokens
        if e.standing and not cur_standing:
            horizon = max(0.0, horizon_s - e.cost.time_to_effect_s)
            surplus = (e.value_tokens_s - cur_value) * horizon - e.threshold_tokens
        return (not e.standing, -surplus, e.estimate.gpus, _gear_order(e.gear))

    return rank


def _switch_to(w: Weighing, best: CandidateEval, evals: Sequence[CandidateEval], why: list[str]) -> Decision:
    """SWITCH (ADVISE for an advisory deployment) to `best`, or to the first stage of its staged path."""
    act = Outcome.SWITCH if w.deployment.mode is Mode.AUTO else Outcome.ADVISE
    path = best.path
    if path is not None and path.staged and path.via is not None:
        return w.finish(act, path.via, evals, [*why, f"stage 1 of 2: {path.note}"], stage=1, staged=best.gear)
    return w.finish(act, best.gear, evals, why)


def _move_off_invalid(w: Weighing, evals: list[CandidateEval], cands: Candidates) -> Decision:
    """The current gear lost GPUs: move at once (no hysteresis, no cooldown) to a reachable gear that
    meets the SLOs - the cheapest of them after rent - else to the one with the most goodput."""
    reachable = [e for e in evals
                 if e.path is None or (e.path.executable and not (w.direct_only and e.path.staged))]
    if not reachable:
        return w.finish(Outcome.BLOCKED, None, evals, w.reasons + ["no feasible gear to move to"]
                        + list(cands.infeasible))
    horizon_s = w.config.horizon_s
    best = max(reachable, key=lambda e: (e.standing, (e.value_tokens_s if e.standing
                                                      else e.estimate.goodput_tokens_s)
                                         - e.cost.tokens / max(1.0, horizon_s),
                                         -e.estimate.gpus, _gear_order(e.gear)))
    return _switch_to(w, best, evals, w.reasons + [
        f"moving at once to {best.gear.shape()} (hysteresis and cooldown do not apply to an invalid gear)"])


def _waiting(w: Weighing, evals: list[CandidateEval]) -> Decision | None:
    """STAY while the deployment backs off after refused PREPAREs, or within its cooldown - unless
    its gear is overloaded: the cooldown is asymmetric, it holds no upshift out of a gear whose
    queue grows (a downshift it still holds, so nothing flaps; `Weighing.upshift_only`)."""
    backoff = w.backoff
    holding = backoff.holding(w.now_s) if backoff is not None else None
    if holding is not None:
        return w.finish(Outcome.STAY, None, evals, w.reasons + [
            f"backing off until t={holding:.0f} s after {backoff.streak if backoff else 0} refused transition(s)"
            " in a row (scheduler.backoff): no automatic switch before then"])
    cool_until = w.cool_until
    if w.cooling and w.overloaded:
        est = w.cur.estimate
        assert cool_until is not None and est is not None  # noqa: S101 - cooling and overloaded say so
        offered = w.window_load.rate_rps if w.window_load is not None else 0.0
        w.reasons.append(f"cooldown until t={cool_until:.0f} s, but the gear is overloaded (offered {offered:.2f}"
                         f" req/s, capacity {est.capacity_rps:.2f}): an upshift may leave it now, nothing else")
        return None
    if w.cooling:
        return w.finish(Outcome.STAY, None, evals, w.reasons + [
            f"cooldown: no automatic switch until t={cool_until:.0f} s"
            + (" (long cooldown: two switches within the flap window)" if _flapping(w.deployment, w.config) else "")])
    return None


def _switch_if_worth_it(w: Weighing, evals: list[CandidateEval], cands: Candidates) -> Decision:
    """Switch to the best eligible candidate whose gain beats its cost x hysteresis and is at least
    `min_relative_gain` of the offered output tokens/s; a standing gear is only left for another
    standing one. Else STAY, saying how far the best one was."""
    config, workload = w.config, w.workload
    offered_tokens_s = workload.rate_rps * workload.output_tokens_mean

    def worth_it(e: CandidateEval) -> bool:
        # a tiny gain never moves the gear, however cheap the move
        horizon = max(0.0, config.horizon_s - e.cost.time_to_effect_s)
        return e.gain_tokens > config.min_relative_gain * offered_tokens_s * horizon

    eligible = [e for e in evals if e.standing] if w.cur_standing else evals
    passing = [e for e in eligible if e.passes and worth_it(e) and (e.path is None or e.path.executable)]
    if not passing:
        why = w.reasons + ["no candidate's gain beats its cost x hysteresis"]
        if eligible:
            top = eligible[0]
            why.append(f"best: {top.gear.shape()} gain {top.gain_tokens:.0f} tokens vs threshold"
                       f" {top.threshold_tokens:.0f} (cost {top.cost.tokens:.0f} x {w.factor}); a switch also"
                       f" needs {config.min_relative_gain:.0%} of the offered output tokens/s")
        if w.cur_standing and len(eligible) < len(evals):
            why.append("the current gear meets its SLOs: only gears that meet them too are considered")
        why.extend(cands.infeasible)
        return w.finish(Outcome.STAY, None, evals, why)
    best = passing[0]
    return _switch_to(w, best, evals, w.reasons + [
        f"{best.gear.shape()}{' (meets the SLOs)' if best.standing else ''}: gain {best.gain_tokens:.0f} tokens"
        f" > cost {best.cost.tokens:.0f} x {w.factor}"])
