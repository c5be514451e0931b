"""The console's driver of the control loop (scheduler.control): the database in, the actions out.

`decide_all` is one loop step for the deployments a tick decides (console/gearbox/ticks.py):

* observe: each deployment as the loop reads it (`observe`) - its gears, load window, back-off
  book and the transitions that ended since it was folded, its staged switch, the transition
  that runs, whether the agents reported what the last one left, a pending emergency. Plans an
  agent no longer runs (it came back without them, or reports they died under it) are dropped first (actions.drop_lost_plans: the routing table is ours
  to write), and the loop is told (its rule 2); the GPUs such a plan's other nodes still hold
  until they answer its release are kept off it (console/gearbox/lost_release.py);
* step: scheduler.control.ControlLoop (the rules, in order, are in its docstring);
* persist: each step through the existing actions (`persist`): the folded back-off, the end of a
  staged path, the decision (actions.do_record_decision), its transition (actions._start), the
  stage it remembers, and for an emergency the abort it asks for and the request it clears; a
  release to zero (rule 9b) and the wake-up's audit entry through console/gearbox/zero.py.
  A transition whose target lands on GPUs a fine-tune or batch job holds is not started: the
  jobs are asked to yield (console/gearbox/admission.py step 3) and the decision's note says
  so; the deployment switches at a later tick, once they are free.

Two ticks may race: both decide, one claims the seq (ports.DjangoStore.create), the other's
decision is noted as not started.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from django.conf import settings
from django.db import transaction

from console.fleet import fragments
from console.fleet.models import AgentCommand, Node
from console.gearbox import actions, admission, lost_release, zero  # (tests patch them here)
from console.gearbox.actions import GEARBOX, Decided
from console.gearbox.executor import build_executor
from console.gearbox.models import ACTIVE_PHASES, Deployment, Transition
from console.gearbox.snapshot import gear_gpus, load_window
from console.registry.specs import planner_options, spec_for
from scheduler.backoff import Backoff
from scheduler.control import (
    ControlLoop,
    DeploymentState,
    Finished,
    FirstStage,
    FleetState,
    LoopConfig,
    Running,
    Staged,
    Step,
)
from scheduler.gearbox import Outcome, Trigger
from scheduler.plan import Gear
from scheduler.pool.autoscale import ScaleConfig
from scheduler.pool.jobs import JobState
from scheduler.topology import FragmentHistory, Snapshot
from scheduler.transition import Kind, TransitionRecord


@dataclass(frozen=True)
class Observed:
    """One deployment's observation and what its persistence needs besides."""

    row: Deployment
    state: DeploymentState
    folded_seq: int  # the newest ended transition `state.finished` covers (the book's new mark)


def reports_mirror_last_transition(dep: Deployment, base: Snapshot, now: datetime) -> bool:
    """Mirror first, then decide (the loop's rule 6): the GPUs the deployment's last transition
    touched must have been reported since the agents acknowledged its last command. Before that
    their memory is the agents' old picture (the old plan not yet freed) and the new gear would
    look over-full. Agents report right after a command they executed, so this holds within
    moments; GPUs that are out (lost, cordoned) and a transition older than two report intervals
    hold nothing up."""
    last = (Transition.objects.filter(deployment=dep, finished_at__isnull=False).order_by("-seq")
            .values("seq", "from_gear", "to_gear", "finished_at").first())
    if last is None:
        return True
    if now.timestamp() - last["finished_at"].timestamp() > 2 * float(settings.FLEXPIPE_REPORT_INTERVAL_S):
        return True
    acked = (AgentCommand.objects.filter(deployment=dep.name, transition_seq=last["seq"], acked_at__isnull=False)
             .order_by("-acked_at").values_list("acked_at", flat=True).first())
    if acked is None:
        return True  # no agent did anything: nothing to mirror
    nodes = base.node_by_id
    for u in gear_gpus(last["from_gear"]) | gear_gpus(last["to_gear"]):
        g = base.gpu_by_uuid.get(u)
        if g is None or not g.healthy or not g.schedulable or not nodes[g.node_id].schedulable:
            continue
        if g.last_seen_s < acked.timestamp():
            return False
    return True


def _finished(dep: Deployment, now: datetime) -> tuple[tuple[Finished, ...], int]:
    """The transitions that ended since the back-off was last folded, and the newest seq seen."""
    seen = int((dep.backoff or {}).get("seq") or 0)
    out = []
    for t in Transition.objects.filter(deployment=dep, seq__gt=seen, phase__in=("done", "rolled_back")).order_by("seq"):
        seen = t.seq
        try:
            rec = TransitionRecord.from_dict(t.record)
        except ValueError:
            continue
        out.append(Finished(rec, t.finished_at.timestamp() if t.finished_at else now.timestamp()))
    return tuple(out), seen


def _staged(dep: Deployment) -> Staged | None:
    """The staged switch on its way: where its second stage goes, and where its first stage is."""
    if not dep.staged_gear:
        return None
    first = Transition.objects.filter(deployment=dep, seq=dep.staged_seq).values_list("phase", flat=True).first()
    kind = Kind(dep.staged_kind) if dep.staged_kind in {k.value for k in Kind} else Kind.AUTO
    status = (FirstStage.DONE if first == "done" else FirstStage.RUNNING if first in ACTIVE_PHASES
              else FirstStage.ENDED)
    return Staged(Gear.from_dict(dep.staged_gear, "staged_gear"), kind, status)


def observe(name: str, base: Snapshot, now: datetime, index: int = 0) -> Observed | None:
    """The deployment as the loop observes it (None: no such deployment)."""
    dep = Deployment.objects.filter(name=name).first()
    if dep is None:
        return None
    active = actions._active(dep)
    lost: list[str] = []
    if dep.deleting_since is None and active is None:
        lost = actions.drop_lost_plans(dep, now=now)
        if lost:
            dep = Deployment.objects.get(name=name)
    zero.observe_zero(dep)  # a gear back up is no longer at zero
    emergency = None
    if dep.emergency_requested_at is not None:
        from console.gearbox.emergency import emergency_target

        emergency = emergency_target(dep)
    finished, seen = _finished(dep, now)
    resting = zero.at_zero(dep)
    mirrored = (zero.released(dep) if resting else reports_mirror_last_transition(dep, base, now)) \
        if active is None else True
    up = (Transition.objects.filter(deployment=dep, phase="done", finished_at__isnull=False).order_by("-seq")
          .values_list("finished_at", flat=True).first())
    state = DeploymentState(
        deployment=actions.scheduler_deployment(dep), current=actions._gear(dep, "current_gear"),
        load=load_window(dep.load_window),
        model=spec_for(dep), planner_options=planner_options(dep),
        backoff=Backoff.from_dict(dep.backoff.get("book") if dep.backoff else None), finished=finished,
        staged=_staged(dep),
        running=Running(active.seq, Kind(active.kind), active.phase, bool(active.abort_reason))
        if active is not None else None,
        reports_mirror_last=mirrored,
        emergency_target=emergency, deleting=dep.deleting_since is not None, lost_plans=tuple(lost), index=index,
        idle_to_zero_s=dep.idle_to_zero_s, min_replicas=dep.min_replicas,
        up_since_s=up.timestamp() if up is not None else None, at_zero=resting,
        waiting=1 if resting and dep.wake_requested_at is not None else 0,
        # (and the GPUs a lost plan's other nodes still hold until they answer its release)
        keep_off=(zero.kept_off(dep, now) if resting else frozenset()) | lost_release.kept_booked(dep))
    return Observed(dep, state, seen)


def loop_config() -> LoopConfig:
    """The loop's knobs from settings: GPU sharing, the TWU watermarks and the soft-limit weights
    (FLEXPIPE_MAX_MODELS_PER_GPU, FLEXPIPE_POOL_SCALE, FLEXPIPE_POOL_MODEL_WEIGHTS). A bad value is an
    error naming its key."""
    return LoopConfig(max_models_per_gpu=int(settings.FLEXPIPE_MAX_MODELS_PER_GPU),
                      scale=ScaleConfig.from_dict(settings.FLEXPIPE_POOL_SCALE, "FLEXPIPE_POOL_SCALE"),
                      model_weights=dict(settings.FLEXPIPE_POOL_MODEL_WEIGHTS))


def decide_all(names: Sequence[str], *, trigger: Trigger, now: datetime, base: Snapshot,
               held: Mapping[str, set[str]], history: FragmentHistory | None = None,
               actor: str = GEARBOX) -> dict[str, Decided]:
    """One loop step over these deployments (module docstring); what each step did, by name."""
    observed = [o for i, n in enumerate(names) if (o := observe(n, base, now, i)) is not None]
    loop = ControlLoop(loop_config())
    jobs = admission.job_states(base)
    loop.observe([o.state for o in observed], FleetState(
        snapshot=base, history=history if history is not None else fragments.load_history(),
        held={k: frozenset(v) for k, v in held.items()}, booked=actions.booked_bytes(),
        node_epochs=dict(Node.objects.values_list("node_id", "epoch")), jobs=jobs))
    out = loop.step(now.timestamp(), trigger)
    by_name = {o.row.name: o for o in observed}
    done: dict[str, Decided] = {o.row.name: Decided(None, None) for o in observed}
    for step in out.steps:
        done[step.deployment_id] = persist(by_name[step.deployment_id], step, now, actor, jobs)
    return done


def _wait_for_jobs(dep: Deployment, step: Step, jobs: Sequence[JobState], now: datetime, actor: str) -> str:
    """A start onto GPUs that jobs hold: ask them to yield; the note of the decision that waits
    for them ("" when no job is in the way: start it)."""
    if step.start is None:
        return ""
    hit = admission.in_the_way(jobs, step.start.target.gpu_uuids)
    return admission.do_ask_to_yield(hit, by=dep.name, now=now, actor=actor) if hit else ""


def persist(obs: Observed, step: Step, now: datetime, actor: str, jobs: Sequence[JobState] = ()) -> Decided:
    """Carry one step of the loop's output out through the actions."""
    dep = obs.row
    if step.emergency:
        return _persist_emergency(obs, step, now, actor, jobs)
    if step.backoff is not None:
        # telemetry of the decision, not an operator's act: not audited (the decision says
        # "backing off until ...")
        updated = {"book": step.backoff.to_dict(), "seq": obs.folded_seq}
        if updated != (dep.backoff or {}):
            Deployment.objects.filter(pk=dep.pk).update(backoff=updated)
            dep.backoff = updated
    if step.clear_staged and step.start is None:
        _clear_stage(dep)
    if step.release is not None:  # rule 9b: drain and release the gear (console/gearbox/zero.py)
        zero.do_scale_to_zero(dep, step.release, now=now, actor=actor, gives_to=step.gives_to, given=step.given)
        return Decided(None, None)
    d = step.decision
    if d is None:
        return Decided(None, None, waiting_for_reports=step.waiting_for_reports)
    with transaction.atomic():
        actions._locked(dep)  # the deployment row before the audit head (lock order: ports._lock_deployment)
        row = actions.do_record_decision(dep, d, actor=actor, now=now)
        started = None
        if wait := _wait_for_jobs(dep, step, jobs, now, actor):
            row.note = wait
            row.save(update_fields=["note"])
        elif step.start is not None:
            started = actions._start(dep, step.start.target, kind=step.start.kind, decision=row, actor=actor)
            if started is None:
                row.note = "not started: another transition claimed the deployment first"
                row.save(update_fields=["note"])
            elif step.wake:
                zero.do_record_wake(dep, started, now=now, actor=actor)
            if step.start.staged_target is not None and started is not None:
                # a first stage that started is remembered: its second follows when it is done
                Deployment.objects.filter(pk=dep.pk).update(staged_gear=step.start.staged_target.to_dict(),
                                                            staged_seq=started.seq, staged_kind=step.start.kind.value)
            elif step.clear_staged:
                _clear_stage(dep)
    return Decided(row, started)


def _clear_stage(dep: Deployment) -> None:
    Deployment.objects.filter(pk=dep.pk).update(staged_gear=None, staged_seq=0, staged_kind="")
    dep.staged_gear = None


def _persist_emergency(obs: Observed, step: Step, now: datetime, actor: str, jobs: Sequence[JobState] = ()
                       ) -> Decided:
    """A pending emergency's step: the roll back it asks for, or the downshift it starts. A
    target that cannot run any more stays pending (retried every tick; the page shows it blocked)."""
    from console.gearbox.emergency import same_as_last

    dep = obs.row
    who = dep.emergency_actor or actor
    run = obs.state.running
    if run is not None:
        if step.abort is not None:
            build_executor(actor=who).store.request_abort(dep.name, run.seq,
                                                          f"emergency downshift: {dep.emergency_reason}")
        return Decided(None, None)  # it rolls back (or finishes CLEANUP) first
    d = step.decision
    assert d is not None  # noqa: S101 - the loop decides an emergency with nothing running
    with transaction.atomic():
        locked = actions._locked(dep)
        if locked.emergency_requested_at is None:
            return Decided(None, None)  # another tick handled it
        if d.outcome is Outcome.BLOCKED and same_as_last(locked, d):
            return Decided(None, None)  # still blocked for the same reasons: recorded already
        row = actions.do_record_decision(locked, d, actor=who, now=now,
                                 note=f"emergency requested by {who}: {locked.emergency_reason}")
        started = None
        if wait := _wait_for_jobs(locked, step, jobs, now, who):
            row.note = f"{row.note}; {wait}" if row.note else wait
            row.save(update_fields=["note"])
            return Decided(row, None)  # the request stands: it starts once the jobs released
        if step.start is not None:
            started = actions._start(locked, step.start.target, kind=Kind.EMERGENCY, decision=row, actor=who)
            if started is None:
                return Decided(row, None)  # try again on the next tick
            if step.start.stage == 1:
                # a staged downshift (the target does not fit beside what runs): the request stands
                # until its second stage, decided when this transition is done, reaches the target
                return Decided(row, started)
        if d.outcome is not Outcome.BLOCKED:
            Deployment.objects.filter(pk=locked.pk).update(emergency_requested_at=None, updated_at=now)
    return Decided(row, started)


__all__ = ["Observed", "decide_all", "observe", "persist", "reports_mirror_last_transition"]
