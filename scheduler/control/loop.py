"""The gear control loop: observe the world, then step(now) -> ControlOutput.

One loop for every driver: the console's tick (console/gearbox/ticks.py) builds the observation
from its database and persists the output through its actions; the simulator's FlexPipe policy
(agents/sim/flexpolicy.py) builds it from the simulated fleet and carries the output out through
its TransitionDriver. The shape is vLLM v1's `schedule() -> SchedulerOutput` and Ray autoscaler
v2's reconciler: pure, deterministic, no I/O, no clock but `now_s`.

The rules, in order, for each deployment, highest priority first (then `index`):

 1. A deployment being deleted is left alone (no step).
 2. Plans an agent no longer runs (`lost_plans`: it came back without them, or they died under
    it; dropped by the driver before observing: it owns the routing table) make the step a
    TOPOLOGY one.
 3. A pending emergency comes first. A running transition is asked to roll back (unless it is
    the emergency's own, already asked, or past SWITCH: it ends first); with nothing running
    the gearbox decides the EMERGENCY trigger towards the emergency target, and a switch
    starts a transition of kind emergency (a staged one remembers no second stage: the request
    stands, and decides again once the first stage is done). Its book is not folded.
 4. Nothing is decided while a transition runs (its end is a new observation).
 5. The back-off book is folded: each finished transition (a refusal at PREPARE backs its new
    plans off, a DONE ends the streak), then entries whose GPUs changed are reset. Before rule
    6: a refusal is known at once.
 6. Mirror first, then decide: until the agents reported what the last transition left
    (`reports_mirror_last`) their memory is the old picture; the step waits (`waiting_for_reports`).
    The simulator's reports are instant: always True there.
 7. A staged switch whose first stage is done decides its second stage (the gearbox's
    `staged_target`), of the first stage's kind; a first stage that rolled back ends the path.
 8. A periodic step on a gear that lost GPUs is a topology step (whichever notices first).
 9. No gear - none yet (the console's new deployment), or none left (its driver dropped every plan
    of it: rule 2; the simulator seeds its baselines at t=0, so only this): the baseline comes
    up through a requested MANUAL decision relabelled with the step's trigger ("bring the
    baseline gear up"; ADVISE in advisory mode), waiting while any of its GPUs was never
    reported; when it does not fit, the best feasible gear. Requests wait in the deployment's
    queue meanwhile (nothing admitted is lost); each topology step tries again. A deployment
    at zero (rule 9b released it: `at_zero`) stays there, deciding nothing, while no request is
    held for it; with `waiting` > 0 - or once it may not rest at zero any more (an operator
    changed its bounds) - it comes up the same way (the step's `wake`: a cold start; the reason
    says how many requests wait).
9b. Idle to zero (scheduler/pool/zero.py). On a periodic step with no staged second stage owed,
    a deployment whose `idle_to_zero_s` is set, with `min_replicas` 0 and mode auto (pinned,
    emergency and advisory ones hold: operators win), whose load window is fresh and shows no
    arrivals nor backlog for longer than its idle time (counted from `up_since_s` at the
    earliest), releases its gear: the step's `release`, no decision. The driver drains the gear
    (nothing admitted is lost: held requests wait for rule 9's wake-up) and frees its GPUs.
10. With `skip_cooldown_stays` (the simulator), a valid, serving gear inside its cooldown on a
    periodic step, with no staged second stage owed, stays without a call (gearbox rule 3 makes
    that call a STAY whatever the candidates are); nothing is recorded - unless the gearbox says
    the gear is overloaded (`gearbox.overloaded`: its queue grows), for the cooldown holds no
    upshift out of an overloaded gear: then the step goes on to rules 11-12.
11. TWU (seed 004 section 3.2; scheduler/pool/autoscale.py). On a periodic step with no staged
    second stage owed, the deployment's TWU samples (`twu`; None: its load window priced over
    the current gear's plans, `autoscale.gear_twu_samples` - what both drivers pass) go through
    `autoscale.scale_signal` with the loop's `scale` watermarks and the gearbox's windows and
    cooldown - no second hysteresis: the cooldown is `cooldown_until`, the one rule 10 and the
    gearbox read; pinned and emergency-mode deployments, and silence, hold. OUT (the mean TWU of
    both windows above the high watermark, 0.85) or IN (both below the low one, 0.4) makes the
    decision of rule 12 a LOAD one that asks for more or less capacity (`capacity_ask`: the
    candidates that go the other way are left out, bar one that meets the SLOs the current gear
    misses), its reasons led by the signal's; gain against cost x hysteresis still decides, and
    an operator's pin holds (the gearbox's rule 3). HOLD leaves the step to rule 12 as it was.
    On a rising load (`gearbox.planned_load`: the long window's least-squares slope, forecast at
    now + `trend_lead_s`) the OUT test reads the TWU means x the forecast's rise, and the gearbox
    plans for the forecast: both scale out ahead of the tide. IN reads the level alone, and waits
    while the load climbs (`Planned.slope_t`).
12. Otherwise scheduler.gearbox.decide with the folded back-off and the staged target. A SWITCH
    starts a transition (kind AUTO, or the first stage's kind for a second stage). A staged
    path ends when a transition starts, on a second stage, or on anything but DEFERRED.

13. Priority (scheduler/pool/priority.py). A deployment in AUTO mode whose rule-12 decision
    starts nothing, whose current gear does not stand and no candidate of which stands (it cannot
    meet its SLOs on the GPUs left to it) may take GPUs from deployments of lower priority that
    can yield (nothing running, not pinned, not deleting): `priority.choose_givers` releases them
    lowest priority first until the gearbox, on the pool with their GPUs free, switches it to a
    standing gear (or weighs a standing candidate it could not switch to yet; with none standing
    - a backlog no gear works off at once - a gear of 1.1x the capacity it reaches without them).
    GPUs already free that would do are kept from the lower priorities in this step instead. Its step names the takeover (`takes`, a reason naming each giver); it starts
    nothing yet. Each giver, decided later in the same step, decides as a TOPOLOGY step with the
    given GPUs kept from it (`gives_to`, a reason naming the taker) - it shrinks or moves through
    its own transition, then releases them - and no other deployment may plan on any GPU of the
    taker's target in this step. A giver with nowhere to go (no gear fits on what is left to it:
    its decision starts nothing) unloads: its step's `release` (rule 9b's path - the driver drains
    its gear, nothing admitted is lost, and frees its GPUs), the reason naming the taker; it comes
    back through rule 9 once GPUs fit it again (its requests wait meanwhile) - but not onto the
    GPUs it gave while its driver holds them from it (`keep_off`: a step for it alone would
    otherwise see them free before the taker's). The taker switches onto the given GPUs at a
    later step, once they are free.

14. Soft limits (seed 004 section 3.2; scheduler/pool/autoscale.py `admission_shares`). Before
    anyone decides, the step prices the pool's TWU: each deployment's mean TWU over the short
    window (rule 11's samples, computed once per step) on each GPU of its gear, summed where
    plans share a GPU, averaged over the pool's GPUs (healthy ones that are schedulable or that
    an observed deployment holds; a free GPU counts 0, another tenant's is not the pool's:
    twu.pool_twu). Over the soft limit (`scale.soft_limit_twu`, 0.8) the heavier models' weights
    (`model_weights`) shrink, and deployments of one priority decide in the order of their
    model's weight factor, highest first, then `index`: a heavy model's scheduling priority is
    lowered, so the light ones' scale-outs get free GPUs first - nobody is refused, the heavy one
    plans on what is left, and its requests wait in its queue. A deployment decided after a
    lighter one for that reason says so in its decision (the last reason). At or under the soft
    limit every factor is 1 and the order is priority then `index`, as before. The output carries
    the pool's TWU and the shares (`ControlOutput.pool_twu`, `shares`).

Across deployments (scheduler/pool/sharing.py): up to `max_models_per_gpu` deployments (seed
004 section 4.2: 2; LoopConfig) share a GPU by memory fraction. Each decision's snapshot shows a
GPU another deployment holds as partly used - its reported use, at least what the others booked
there (`FleetState.booked` and their current gears) plus this deployment's own plans - so the
planner only places plans that fit under 92% beside them (invariant 4); a GPU that already holds
`max_models_per_gpu` other deployments, or whose bookings are unknown, is unschedulable. The GPUs
and bytes a transition started in this step books count for the deployments decided after it.
With `max_models_per_gpu=1` no GPU is shared: two deployments never plan on one GPU. The GPUs
fine-tune and batch jobs hold (`FleetState.jobs`) are unschedulable, except that a deployment of
higher priority may take a running job's when no switch without them is worth it
(scheduler/pool/jobs.py rule 5); the driver makes the job yield before the PREPARE runs there.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from scheduler import gearbox
from scheduler.backoff import NO_BACKOFF, Backoff, refusal
from scheduler.booking import plans_memory
from scheduler.control.state import (
    ControlOutput,
    DeploymentState,
    FirstStage,
    FleetState,
    LoopConfig,
    Start,
    Step,
)
from scheduler.gearbox import CapacityAsk, Mode, Outcome, Trigger, cooldown_until, standing
from scheduler.plan import Gear
from scheduler.pool.autoscale import (
    AdmissionShares,
    Direction,
    ScaleSignal,
    TwuSample,
    admission_shares,
    gear_twu_samples,
    model_weights,
    scale_signal,
    window_mean,
)
from scheduler.pool.jobs import decide_around_jobs
from scheduler.pool.priority import Holder, Takeover, choose_givers
from scheduler.pool.sharing import shared_snapshot
from scheduler.pool.twu import pool_gpus, pool_twu
from scheduler.pool.zero import idle_signal, never_to_zero, quiet_since_s, wake_reason
from scheduler.topology import Snapshot
from scheduler.transition import Kind, Phase, lost_gpus

BRING_UP_REASON = "nothing runs yet: bring the baseline gear up"
ABORTABLE_PHASES = frozenset({"prepare", "switch"})  # past SWITCH a transition rolls forward
_ASKS = {Direction.OUT: CapacityAsk.MORE, Direction.IN: CapacityAsk.LESS}  # rule 11: the TWU signal's ask
# rule 13: with no gear standing even on the lower priorities' GPUs, they are taken only for a gear
# that serves this much more than the best the taker reaches without them (capacity, requests/s)
_TAKE_GAIN = 1.1


def decision_snapshot(base: Snapshot, held_by_others: Iterable[str]) -> Snapshot:
    """`base` with the GPUs other deployments hold marked unschedulable."""
    taken = set(held_by_others)
    if not taken:
        return base
    return replace(base, gpus=tuple(replace(g, schedulable=False) if g.uuid in taken else g for g in base.gpus))


def fold_backoff(state: DeploymentState, fleet: FleetState, now_s: float) -> Backoff:
    """Rule 5: the book after the transitions that ended since it was folded."""
    book = state.backoff if state.backoff is not None else NO_BACKOFF
    for f in state.finished:
        if f.record.phase is Phase.DONE:
            book = book.succeeded()
        elif (why := refusal(f.record)) is not None:
            snap = f.snapshot if f.snapshot is not None else fleet.snapshot
            book = book.failed(f.record.new_plans, f.at_s, why, snap, extra=fleet.node_epochs)
    return book.observe(fleet.snapshot, extra=fleet.node_epochs, now_s=now_s)


def has_lost_gpus(gear: Gear | None, snapshot: Snapshot) -> bool:
    return gear is not None and any(lost_gpus(p, snapshot) for p in gear.plans)


def unreported(gear: Gear, snapshot: Snapshot) -> list[str]:
    """GPUs of `gear` no agent has reported yet (registered without a report, or unknown)."""
    return [u for u in gear.gpu_uuids if (g := snapshot.gpu_by_uuid.get(u)) is None or g.last_seen_s == 0]


@dataclass
class _Pool:
    """What one step knows of the pool across deployments (updated as each one decides)."""

    held: dict[str, set[str]]  # deployment -> GPUs it holds (and those a start of this step books)
    booked: dict[str, dict[str, int]]  # deployment -> GPU -> bytes booked there
    states: Mapping[str, DeploymentState]  # the observed deployments, by name
    reserved: dict[str, str] = field(default_factory=dict)  # GPU -> the taker it is kept for (rule 13)
    gives: dict[str, Takeover] = field(default_factory=dict)  # giver -> the takeover it gives to

    def withheld(self, name: str) -> frozenset[str]:
        return frozenset(u for u, taker in self.reserved.items() if taker != name)


def _merge_max(a: Mapping[str, int], b: Mapping[str, int]) -> dict[str, int]:
    out = dict(a)
    for u, n in b.items():
        out[u] = max(out.get(u, 0), n)
    return out


def can_yield(state: DeploymentState) -> bool:
    """Rule 13: a deployment that may give GPUs now."""
    return (state.running is None and not state.deleting and state.emergency_target is None
            and state.deployment.mode is not Mode.PINNED and state.reports_mirror_last and state.current is not None)


class ControlLoop:
    """observe(deployments, fleet), then step(now_s, trigger) -> ControlOutput (module docstring)."""

    def __init__(self, config: LoopConfig | None = None) -> None:
        self.config = config if config is not None else LoopConfig()
        self._deployments: tuple[DeploymentState, ...] = ()
        self._fleet: FleetState | None = None
        self.calls = 0  # gearbox.decide calls (the replay reports them)
        self._samples: dict[str, tuple[TwuSample, ...]] = {}  # this step's TWU samples by deployment (rules 11, 14)

    def observe(self, deployments: Iterable[DeploymentState], fleet: FleetState) -> None:
        """What the next step decides on (replaces the previous observation)."""
        deps = tuple(deployments)
        names = [d.deployment.id for d in deps]
        if len(set(names)) != len(names):
            raise ValueError(f"deployments: ids must be unique; got {names}")
        self._deployments, self._fleet = deps, fleet

    def step(self, now_s: float, trigger: Trigger = Trigger.PERIODIC) -> ControlOutput:
        """Decide for every observed deployment, highest priority first (rules: module docstring)."""
        if trigger not in (Trigger.PERIODIC, Trigger.TOPOLOGY):
            raise ValueError(f"trigger: a step is periodic or topology; got {trigger.value!r}")
        fleet = self._fleet
        if fleet is None:
            raise ValueError("observe: nothing observed yet; call observe() before step()")
        pool = _Pool({k: set(v) for k, v in fleet.held.items()}, {k: dict(v) for k, v in fleet.booked.items()},
                     {d.deployment.id: d for d in self._deployments})
        for d in self._deployments:
            if d.current is not None:
                name = d.deployment.id
                pool.booked[name] = _merge_max(pool.booked.get(name, {}), plans_memory(d.current.plans, d.model))
        steps: list[Step] = []
        wakes: list[float] = []
        self._samples = {}
        twu, shares = self._soft_limits(fleet, now_s)  # rule 14
        factor = shares.factors if shares is not None and twu is not None else {}
        order = sorted(self._deployments,
                       key=lambda d: (-d.deployment.priority, -factor.get(d.deployment.model, 1.0), d.index))
        for state in order:
            if state.deleting:  # rule 1
                continue
            step = self._one(state, fleet, pool, now_s, trigger)
            if step.decision is not None and twu is not None and shares is not None:
                step = self._after_lighter(step, state, order, factor, twu)
            steps.append(step)
            name = state.deployment.id
            if step.start is not None:
                target = step.start.target
                pool.held.setdefault(name, set()).update(target.gpu_uuids)
                old = set(state.current.plans) if state.current is not None else set()
                new = plans_memory([p for p in target.plans if p not in old], state.model)
                mine = pool.booked.setdefault(name, {})
                for u, b in new.items():
                    mine[u] = mine.get(u, 0) + b
            if step.takes is not None:  # rule 13: its givers decide later in this step, kept off
                # every GPU of the taker's target (not only those they give: a giver that moved onto
                # another of them would be asked again at the next step)
                for g in step.takes.gives:
                    pool.gives[g.giver] = step.takes
                for u in step.takes.target.gpu_uuids:
                    pool.reserved.setdefault(u, name)
            wakes += self._wakes(state, step, now_s)
        return ControlOutput(now_s, tuple(steps), min(wakes) if wakes else None, pool_twu=twu, shares=shares)

    # --- rule 14 ----------------------------------------------------------------------------
    def _soft_limits(self, fleet: FleetState, now_s: float) -> tuple[float | None, AdmissionShares | None]:
        """The pool's TWU and each model's admission share (rule 14); (None, None) without weights
        or with fewer than two models."""
        cfg = self.config
        live = [d for d in self._deployments if not d.deleting]
        models = {d.deployment.model for d in live}
        if not cfg.model_weights or len(models) < 2:
            return None, None
        held = set().union(*fleet.held.values()) if fleet.held else set()
        per_gpu: dict[str, float] = {}
        for d in live:
            if d.current is None:
                continue
            mean = window_mean(self._twu_samples(d, fleet, now_s), now_s, cfg.gearbox.short_window_s)
            if mean is None:  # silence: its GPUs count 0, as a GPU nothing reports on
                continue
            for u in d.current.gpu_uuids:
                per_gpu[u] = per_gpu.get(u, 0.0) + mean
                held.add(u)
        twu = pool_twu(per_gpu, pool_gpus(fleet.snapshot, held))
        demand = {d.deployment.model: 1.0 for d in live if d.current is not None or d.waiting > 0}
        return twu, admission_shares(model_weights(cfg.model_weights, models), twu, demand=demand, config=cfg.scale)

    @staticmethod
    def _after_lighter(step: Step, state: DeploymentState, order: list[DeploymentState], factor: Mapping[str, float],
                       twu: float) -> Step:
        """Rule 14: the step of a deployment decided after a lighter one of its priority says why."""
        mine = factor.get(state.deployment.model, 1.0)
        before = [d.deployment.id for d in order[:order.index(state)]
                  if d.deployment.priority == state.deployment.priority and d.index > state.index
                  and factor.get(d.deployment.model, 1.0) > mine]
        if not before or step.decision is None:
            return step
        why = (f"pool TWU {twu:.2f} over the soft limit: its model {state.deployment.model} weighs x {mine:.2f} "
               f"now, so it decided after lighter {', '.join(before)} (seed 004 soft limit; nothing refused)")
        return replace(step, decision=replace(step.decision, reasons=(*step.decision.reasons, why)))

    # --- one deployment ---------------------------------------------------------------------
    def _one(self, state: DeploymentState, fleet: FleetState, pool: _Pool, now_s: float,
             trigger: Trigger) -> Step:
        name = state.deployment.id
        if state.lost_plans:  # rule 2
            trigger = Trigger.TOPOLOGY
        if state.emergency_target is not None:  # rule 3
            return self._emergency(state, fleet, pool, now_s, trigger)
        if state.running is not None:  # rule 4
            return Step(name, trigger)
        book = fold_backoff(state, fleet, now_s)  # rule 5
        if not state.reports_mirror_last:  # rule 6
            return Step(name, trigger, waiting_for_reports=True, backoff=book)
        staged, kind, clear = None, Kind.AUTO, False  # rule 7
        if state.staged is not None:
            kind = state.staged.kind
            if state.staged.first_stage is FirstStage.DONE:
                staged = state.staged.target
            elif state.staged.first_stage is FirstStage.ENDED:
                clear = True
        if trigger is Trigger.PERIODIC and has_lost_gpus(state.current, fleet.snapshot):  # rule 8
            trigger = Trigger.TOPOLOGY
        if state.current is None:  # rule 9
            if state.at_zero and state.waiting <= 0 and never_to_zero(state.idle_to_zero_s, state.min_replicas,
                                                                       state.deployment.mode) is None:
                return Step(name, trigger, clear_staged=clear, backoff=book)
            return self._bring_up(state, fleet, pool, now_s, trigger, book)
        cfg = self.config
        if trigger is Trigger.PERIODIC and staged is None:  # rule 9b
            idle = idle_signal(state.load, now_s, idle_to_zero_s=state.idle_to_zero_s, min_replicas=state.min_replicas,
                               mode=state.deployment.mode, up_since_s=state.up_since_s,
                               fresh_s=cfg.gearbox.short_window_s)
            if idle.release:
                return Step(name, trigger, clear_staged=clear, backoff=book, release=idle.reason)
        giving = pool.gives.get(name)
        if giving is not None:  # rule 13: decide with the given GPUs kept from it
            d = self._decide(state, fleet, pool, now_s, Trigger.TOPOLOGY, book=book)
            d = replace(d, reasons=(giving.giver_reason(name), *d.reasons))
            start = self._start_of(d, Kind.AUTO)
            # nowhere to go (no gear fits on what is left to it): it unloads - rule 9b's release
            release = giving.unload_reason(name) if start is None else None
            return Step(name, Trigger.TOPOLOGY, d, start, clear_staged=clear or state.staged is not None,
                        backoff=book, gives_to=giving.taker, release=release, given=giving.given_by(name))
        until = cooldown_until(state.deployment, cfg.gearbox)
        if (cfg.skip_cooldown_stays and staged is None and state.serving and trigger is Trigger.PERIODIC
                and until is not None and now_s < until
                and not gearbox.overloaded(state.current, state.model, fleet.snapshot, state.load, now_s,
                                           state.deployment.slo, cfg.gearbox)):  # rule 10
            return Step(name, trigger, clear_staged=clear, backoff=book)
        signal = self._twu_signal(state, fleet, now_s) if trigger is Trigger.PERIODIC and staged is None else None
        ask = _ASKS.get(signal.direction) if signal is not None else None  # rule 11
        if ask is not None:
            trigger = Trigger.LOAD
        d = self._decide(state, fleet, pool, now_s, trigger, book=book, staged=staged, ask=ask)  # rule 12
        if ask is not None and signal is not None:
            d = replace(d, reasons=(f"TWU asks for {ask.value} capacity: {signal.reason}", *d.reasons))
        start_kind = kind if d.stage == 2 else Kind.AUTO
        start = self._start_of(d, start_kind)
        takes = None
        if start is None and staged is None and cfg.take_from_lower and not self._stands(state, d):  # rule 13
            takes = self._take(state, fleet, pool, now_s, trigger, book, d)
            if takes is not None:
                d = replace(d, reasons=(*d.reasons, takes.taker_reason()))
        ends = state.staged is not None and (start is not None or d.stage == 2 or d.outcome is not Outcome.DEFERRED)
        return Step(name, trigger, d, start, clear_staged=clear or ends, backoff=book, takes=takes)

    def _emergency(self, state: DeploymentState, fleet: FleetState, pool: _Pool, now_s: float,
                   trigger: Trigger) -> Step:
        name = state.deployment.id
        run = state.running
        if run is not None:
            # (the first stage of a staged downshift is the emergency's own: it is not rolled back)
            abort = None
            if run.phase in ABORTABLE_PHASES and not run.abort_requested and run.kind is not Kind.EMERGENCY:
                abort = "emergency downshift"
            return Step(name, trigger, abort=abort, emergency=True)
        assert state.emergency_target is not None  # noqa: S101 - the caller checked
        d = self._decide(state, fleet, pool, now_s, Trigger.EMERGENCY, requested=state.emergency_target)
        start = self._start_of(d, Kind.EMERGENCY)
        # a staged downshift remembers no second stage: the standing request decides it again
        return Step(name, trigger, d, replace(start, staged_target=None) if start else None, emergency=True)

    def _bring_up(self, state: DeploymentState, fleet: FleetState, pool: _Pool, now_s: float,
                  trigger: Trigger, book: Backoff) -> Step:
        name = state.deployment.id
        baseline = state.deployment.baseline
        if baseline is None:
            raise ValueError(f"baseline: {name} has no gear and no baseline to bring up")
        if unreported(baseline, fleet.snapshot):
            # its agents registered but have not reported yet: decide nothing on GPUs nobody has
            # seen; a report that brings them is a topology event, a new step
            return Step(name, trigger, waiting_for_reports=True, backoff=book)
        d = self._decide(state, fleet, pool, now_s, Trigger.MANUAL, requested=baseline, book=book)
        if d.outcome is Outcome.SWITCH:
            outcome = Outcome.ADVISE if state.deployment.mode is Mode.ADVISORY else Outcome.SWITCH
            d = replace(d, trigger=trigger, outcome=outcome, reasons=(BRING_UP_REASON,))
        else:
            d = self._decide(state, fleet, pool, now_s, trigger, book=book)
        wake = state.at_zero
        if wake:
            d = replace(d, reasons=(wake_reason(state.waiting), *d.reasons))
        return Step(name, trigger, d, self._start_of(d, Kind.AUTO), backoff=book, wake=wake)

    # --- helpers ----------------------------------------------------------------------------
    def _view(self, state: DeploymentState, base: Snapshot, pool: _Pool) -> Snapshot:
        """The snapshot this deployment decides on: the pool shared by memory fraction, less the
        GPUs kept for a higher-priority taker (module docstring)."""
        name = state.deployment.id
        return shared_snapshot(base, name, pool.held, pool.booked, own_bytes=pool.booked.get(name),
                               max_models_per_gpu=self.config.max_models_per_gpu,
                               withheld=pool.withheld(name) | state.keep_off)

    def _stands(self, state: DeploymentState, d: gearbox.Decision) -> bool:
        """Rule 13: it meets its SLOs on what is left to it (its gear, or a candidate, stands)."""
        if state.deployment.mode is not Mode.AUTO or d.workload is None or d.trigger is Trigger.EMERGENCY:
            return True  # not ours to act on (advisory, pinned), or no load to judge by
        if d.current_valid and standing(d.current_estimate, d.workload, self.config.gearbox):
            return True
        return any(c.standing for c in d.candidates)

    def _take(self, state: DeploymentState, fleet: FleetState, pool: _Pool, now_s: float, trigger: Trigger,
              book: Backoff, mine: gearbox.Decision) -> Takeover | None:
        """Rule 13: which lower-priority deployments give which GPUs (scheduler.pool.priority)."""
        name = state.deployment.id
        have_rps = max([c.estimate.capacity_rps for c in mine.candidates]
                       + [mine.current_estimate.capacity_rps if mine.current_estimate is not None else 0.0])
        holders = [Holder(n, s.deployment.priority, frozenset(pool.held.get(n, ())), can_yield(s) and n not in pool.gives)
                   for n, s in pool.states.items() if n != name]

        def try_with(released: tuple[Holder, ...]) -> Gear | None:
            gone = {h.id for h in released}
            free: dict[str, int] = {}
            for h in released:
                for u, b in pool.booked.get(h.id, {}).items():
                    free[u] = free.get(u, 0) + b
            base = replace(fleet.snapshot, gpus=tuple(
                replace(g, mem_used_bytes=max(0, g.mem_used_bytes - free[g.uuid])) if g.uuid in free else g
                for g in fleet.snapshot.gpus))
            trial = _Pool({n: g for n, g in pool.held.items() if n not in gone},
                          {n: b for n, b in pool.booked.items() if n not in gone}, pool.states, dict(pool.reserved))
            d = self._decide(state, fleet, trial, now_s, trigger, book=book, view=self._view(state, base, trial))
            if d.outcome is Outcome.SWITCH and d.target is not None and any(
                    c.standing and c.gear == d.target for c in d.candidates):
                return d.target
            # the gearbox may stay for reasons of the switch (its gain against the path's cost):
            # the GPUs go to the best standing candidate it can reach, else its best standing one;
            # with none standing (a backlog no gear works off at once), to the one that serves the
            # most, if it serves `_TAKE_GAIN` more than the best the taker has without them
            stands = [c for c in d.candidates if c.standing]
            reach = [c for c in stands if c.path is None or c.path.executable]
            if stands:
                return (reach or stands)[0].gear
            best = max(d.candidates, key=lambda c: c.estimate.capacity_rps, default=None)
            if best is not None and best.estimate.capacity_rps > _TAKE_GAIN * have_rps:
                return best.gear
            return None

        # GPUs already free that would let it stand (the gearbox stayed for reasons of the path):
        # kept from the lower priorities in this step, taken from nobody
        if (free := try_with(())) is not None:
            for u in free.gpu_uuids:
                pool.reserved.setdefault(u, name)
            return None
        return choose_givers(name, state.deployment.priority, holders, try_with)

    def _twu_samples(self, state: DeploymentState, fleet: FleetState, now_s: float) -> tuple[TwuSample, ...]:
        """Rules 11 and 14: the deployment's TWU samples - given, else its load window priced over its
        current gear - once per step."""
        assert state.current is not None  # noqa: S101 - callers checked
        name = state.deployment.id
        if name not in self._samples:
            self._samples[name] = state.twu if state.twu is not None else gear_twu_samples(
                state.load, state.current, state.model, fleet.snapshot, now_s, self.config.gearbox)
        return self._samples[name]

    def _twu_signal(self, state: DeploymentState, fleet: FleetState, now_s: float) -> ScaleSignal:
        """Rule 11: the TWU scale signal of a deployment with a gear."""
        assert state.current is not None  # noqa: S101 - rule 9 came first
        cfg = self.config
        samples = self._twu_samples(state, fleet, now_s)
        planned = gearbox.planned_load(state.load, now_s, cfg.gearbox)  # the trend: OUT sooner, no IN into a rise
        return scale_signal(samples, now_s, state.deployment, config=cfg.scale, gearbox=cfg.gearbox,
                            rise=planned.rise, slope_t=planned.slope_t)

    def _decide(self, state: DeploymentState, fleet: FleetState, pool: _Pool, now_s: float,
                trigger: Trigger, *, requested: Gear | None = None, book: Backoff | None = None,
                staged: Gear | None = None, ask: CapacityAsk | None = None,
                view: Snapshot | None = None) -> gearbox.Decision:
        def decide(snapshot: Snapshot) -> gearbox.Decision:
            self.calls += 1
            return gearbox.decide(state.deployment, state.current, snapshot, state.load, now_s, trigger=trigger,
                                  requested_gear=requested, history=fleet.history, staged_target=staged,
                                  backoff=book if book is not None else state.backoff, model=state.model,
                                  config=self.config.gearbox, planner_options=state.planner_options,
                                  capacity_ask=ask)

        snap = view if view is not None else self._view(state, fleet.snapshot, pool)
        # job GPUs: taken only when nothing else will do (scheduler/pool/jobs.py rule 5)
        return decide_around_jobs(decide, snap, fleet.jobs, state.deployment.priority)

    @staticmethod
    def _start_of(d: gearbox.Decision, kind: Kind) -> Start | None:
        if d.outcome is not Outcome.SWITCH or d.target is None:
            return None
        return Start(d.target, kind, d.stage, d.staged_target if d.stage == 1 else None)

    def _wakes(self, state: DeploymentState, step: Step, now_s: float) -> list[float]:
        """When this deployment could decide differently with nothing new observed."""
        out = []
        until = cooldown_until(state.deployment, self.config.gearbox)
        if until is not None and until > now_s:
            out.append(until)
        book = step.backoff if step.backoff is not None else state.backoff
        if book is not None and book.hold_until_s is not None and book.hold_until_s > now_s:
            out.append(book.hold_until_s)
        if (state.current is not None and state.idle_to_zero_s is not None and state.min_replicas == 0
                and state.deployment.mode is Mode.AUTO and step.release is None):
            since = quiet_since_s(state.load, state.up_since_s)  # rule 9b: when its idle time runs out
            if since is not None and since + state.idle_to_zero_s > now_s:
                out.append(since + state.idle_to_zero_s)
        return out


__all__ = ["BRING_UP_REASON", "ControlLoop", "decision_snapshot", "fold_backoff", "has_lost_gpus", "unreported"]
