"""Every write of the gearbox is one of these actions (STYLE.md: `do_<verb>_<noun>(..., *, actor)`).

Each runs in one database transaction, writes its audit entry (console.audit.chain, linked to
the deployment, the transition and the decision) in that transaction, and notifies (live push,
Celery) only on commit. `actor` is a user (checked for the operator role) or a system name
such as "system:gearbox". Bad input raises `Rejected` naming the field, and changes nothing.

Operator actions:
    do_set_mode(deployment, mode, *, actor)                 auto | advisory (pinned: do_pin_gear)
    do_pin_gear(deployment, *, actor)                       pin the current gear: no automatic switch
    do_unpin_gear(deployment, *, actor, mode="auto")        back to auto (or advisory)
    do_approve_decision(decision, *, actor)                 advisory mode: start the advised transition
    do_request_gear(deployment, gear, *, actor)             manual switch to an operator's gear
The emergency downshift and its release: console/gearbox/emergency.py.
    do_set_latency_critical(deployment, value, *, actor)    keep its plans off blocks that keep shrinking
The gearbox (ticks.py) and the scenario loader:
    do_decide_gear(deployment, *, trigger, now, base, held, actor)   one decision, and its transition
    do_record_load(deployment, sample)                      append a load sample (telemetry: not audited)
    do_record_serving(deployment, served)                   a point of the serving charts' history (telemetry)
    do_sync_deployment(..., actor)                          create or update a deployment (idempotent)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from console.accounts.roles import OPERATOR, has_role
from console.audit.chain import actor_of, record
from console.fleet import fragments
from console.fleet.actions import Rejected
from console.fleet.models import AgentCommand, Node
from console.gearbox import live, lost_release, repeats
from console.gearbox.executor import build_executor
from console.gearbox.models import ACTIVE_PHASES, Decision, Deployment, GpuReservation, Transition
from console.gearbox.snapshot import KEEP_LOAD_S, decision_snapshot, fleet_snapshot, gear_gpus, load_window
from console.registry.specs import planner_options, spec_for
from scheduler import gearbox
from scheduler.backoff import Backoff
from scheduler.costmodel import Slo
from scheduler.gearbox import LoadSample, Mode, Outcome, Trigger
from scheduler.plan import Gear, validate_gear
from scheduler.topology import FragmentHistory, Snapshot
from scheduler.transition import Kind

GEARBOX = "system:gearbox"


def _who(actor: Any) -> tuple[str, Any | None]:
    """(audit actor string, user or None); a user must hold the operator role."""
    if isinstance(actor, str):
        return actor, None
    if not has_role(actor, OPERATOR):
        raise Rejected(403, {"actor": "steering the gears needs the operator role"})
    return actor_of(actor), actor


def _locked(deployment: Deployment | str) -> Deployment:
    name = deployment if isinstance(deployment, str) else deployment.name
    row = Deployment.objects.select_for_update().filter(name=name).first()
    if row is None:
        raise Rejected(404, {"deployment": f"no deployment {name!r}"})
    return row


def _not_in_emergency(dep: Deployment) -> None:
    if dep.mode == Deployment.EMERGENCY:
        raise Rejected(409, {"mode": f"{dep.name} holds an emergency downshift: release it first "
                                     "(POST /api/v1/deployments/{name}/release)"})


def _active(dep: Deployment) -> Transition | None:
    return Transition.objects.filter(deployment=dep, phase__in=ACTIVE_PHASES).first()


def scheduler_deployment(dep: Deployment) -> gearbox.Deployment:
    """The deployment as scheduler.gearbox.decide sees it."""
    # only the switches the gearbox chose start a cooldown (gearbox.record_switch): not an
    # emergency downshift, nor a forced move off a gear that had lost GPUs
    # (nor the second stage of a staged switch: its first stage counted for both)
    # (a deployment not stored yet - one being created, its baseline chosen - has switched never)
    times = [] if dep.pk is None else list(
        Transition.objects.filter(deployment=dep, phase="done", from_gear__isnull=False, finished_at__isnull=False)
        .exclude(kind=Transition.EMERGENCY)
        .exclude(decision__decision__current_valid=False)
        .exclude(decision__decision__stage=2)
        .order_by("-seq").values_list("finished_at", flat=True)[:5])
    return gearbox.Deployment(
        id=dep.name, model=dep.model_name, slo=Slo(ttft_ms=dep.ttft_ms, tpot_ms=dep.tpot_ms),
        baseline=Gear.from_dict(dep.baseline_gear) if dep.baseline_gear else None, priority=dep.priority, mode=Mode(dep.mode),
        last_switch_times_s=tuple(sorted(t.timestamp() for t in times)), latency_critical=dep.latency_critical)


def _gear(dep: Deployment, field: str) -> Gear | None:
    raw = getattr(dep, field)
    return Gear.from_dict(raw, field) if raw else None


def _summary(d: gearbox.Decision) -> list[dict[str, object]]:
    return [{"gear_id": c.gear.gear_id, "shape": c.gear.shape(), "gain_tokens": c.gain_tokens,
             "cost_tokens": c.cost.tokens, "threshold_tokens": c.threshold_tokens, "factor": d.factor,
             "passes": c.passes, "value_tokens_s": c.value_tokens_s, "note": c.note} for c in d.candidates]


# --- decisions -----------------------------------------------------------------------------------
@transaction.atomic
def do_record_decision(dep: Deployment, decision: gearbox.Decision, *, actor: Any, now: datetime,
                       note: str = "") -> Decision:
    """Store and audit one gearbox decision (advisory ones wait for an operator's approval); a "stay"
    that repeats the newest one is counted on it instead (console/gearbox/repeats.py)."""
    who, user = _who(actor)
    approval = Decision.PENDING if decision.outcome is Outcome.ADVISE else Decision.NONE
    fields: dict[str, Any] = dict(
        trigger=decision.trigger.value, outcome=decision.outcome.value,
        factor=decision.factor, current_gear_id=decision.current_gear_id or "",
        target_gear_id=decision.target_gear_id or "", candidates=_summary(decision), reasons=list(decision.reasons),
        decision=decision.to_dict(), actor=who, note=note, approval=approval)
    last = repeats.newest(dep)
    if repeats.repeat_of(last, fields):
        assert last is not None  # noqa: S101 - repeat_of says so
        fresh = {k: fields[k] for k in ("factor", "candidates", "reasons", "decision")}
        Decision.objects.filter(pk=last.pk).update(repeats=F("repeats") + 1, last_at=now, **fresh)
        last.refresh_from_db()
        transaction.on_commit(lambda: live.push_decision(dep.name, last.pk, last.outcome, last.trigger))
        return last
    if approval == Decision.PENDING:
        Decision.objects.filter(deployment=dep, approval=Decision.PENDING).update(approval=Decision.SUPERSEDED)
    row = Decision.objects.create(deployment=dep, at=now, last_at=now, **fields)
    ended = repeats.ended_run(last)
    target = decision.target.shape() if decision.target else "-"
    record("gearbox.decision", actor=who, user=user, at=now, deployment=dep.name, decision_id=row.pk,
           summary=f"{dep.name}: {decision.outcome.value} ({decision.trigger.value}) -> {target}: "
                   + "; ".join(decision.reasons)[:200],
           data={"trigger": decision.trigger.value, "outcome": decision.outcome.value, "factor": decision.factor,
                 "current_gear_id": decision.current_gear_id, "target_gear_id": decision.target_gear_id,
                 "candidates": row.candidates[:10], "reasons": list(decision.reasons), "note": note,
                 **({"ends_run": ended} if ended else {})})
    transaction.on_commit(lambda: live.push_decision(dep.name, row.pk, row.outcome, row.trigger))
    return row


def _start(dep: Deployment, gear: Gear, *, kind: Kind, decision: Decision | None, actor: str,
           model_version: Any | None = None) -> Transition | None:
    """Claim the next seq and create the transition (None: another one is active). Its new plans
    load `model_version` (a rollout's), else the version the deployment serves. Callers hold a
    database transaction: the row and its version commit together, before any worker advances it."""
    ex = build_executor(actor=actor)
    rec = ex.start(dep.name, gear, kind=kind, model=dep.model_name,
                   decision_ref=str(decision.pk) if decision is not None else None)
    if rec is None:
        return None
    version_id = model_version.pk if model_version is not None else dep.model_version_id
    if version_id is not None:
        Transition.objects.filter(deployment=dep, seq=rec.seq).update(model_version_id=version_id)
    row = Transition.objects.get(deployment=dep, seq=rec.seq)
    _kick(dep.name, rec.seq)
    return row


def _kick(deployment: str, seq: int | None = None) -> None:
    from console.gearbox import tasks

    transaction.on_commit(lambda: tasks.enqueue(tasks.advance, deployment=deployment, seq=seq))


@dataclass(frozen=True)
class Decided:
    decision: Decision | None  # None: nothing was decided (a transition runs, or reports are awaited)
    transition: Transition | None  # the transition it started, if any
    waiting_for_reports: bool = False  # decide again in a moment: the agents' reports are about to catch up


def _decide(dep: Deployment, base: Snapshot, held: Mapping[str, set[str]], now: datetime, trigger: Trigger, *,
            requested: Gear | None = None, running: bool = False, history: FragmentHistory | None = None,
            staged: Gear | None = None) -> gearbox.Decision:
    others = set().union(*[g for name, g in held.items() if name != dep.name]) if held else set()
    snap = decision_snapshot(base, others)
    return gearbox.decide(scheduler_deployment(dep), _gear(dep, "current_gear"), snap, load_window(dep.load_window),
                          now.timestamp(), trigger=trigger, requested_gear=requested, transition_running=running,
                          model=spec_for(dep), planner_options=planner_options(dep),
                          history=history if history is not None else fragments.load_history(),
                          backoff=Backoff.from_dict(dep.backoff.get("book") if dep.backoff else None),
                          staged_target=staged)


def _remember_stage(dep: Deployment, d: gearbox.Decision, started: Transition | None, kind: Kind) -> None:
    """After an operator's decision (the loop's own: console/gearbox/control.persist): a first
    stage that started is remembered (its second follows when it is done); anything else ends a
    staged path on its way."""
    if d.stage == 1 and d.staged_target is not None and started is not None:
        Deployment.objects.filter(pk=dep.pk).update(staged_gear=d.staged_target.to_dict(), staged_seq=started.seq,
                                                    staged_kind=kind.value)
    elif dep.staged_gear is not None and (started is not None or d.stage == 2 or d.outcome is not Outcome.DEFERRED):
        Deployment.objects.filter(pk=dep.pk).update(staged_gear=None, staged_seq=0, staged_kind="")


def do_decide_gear(deployment: Deployment | str, *, trigger: Trigger, now: datetime, base: Snapshot,
                   held: Mapping[str, set[str]], actor: str = GEARBOX,
                   history: FragmentHistory | None = None) -> Decided:
    """One control-loop step for the deployment, recorded, and the transition it calls for
    (console/gearbox/control.py drives scheduler.control.ControlLoop: the rules are there)."""
    from console.gearbox.control import decide_all

    name = deployment if isinstance(deployment, str) else deployment.name
    return decide_all([name], trigger=trigger, now=now, base=base, held=held, history=history,
                      actor=actor).get(name, Decided(None, None))


def lost_plans(dep: Deployment) -> dict[str, list[str]]:
    """Plans of the deployment's routing that a node of theirs no longer runs: plan_id -> nodes.

    A node's `lost_plans` is what its agent did not list at its last registration (it came back
    without them) or in its last report that listed its plans (they died under it); a plan that
    has been prepared there again since that list (plan ids are content hashes: the gearbox may
    well bring the same plan back) is alive, not lost."""
    on: dict[str, list[str]] = {}
    for r in dep.routing or ():
        if isinstance(r, dict) and r.get("plan_id"):
            on[str(r["plan_id"])] = [str(n) for n in r.get("nodes") or ()]
    if not on:
        return {}
    out: dict[str, list[str]] = {}
    nodes = Node.objects.filter(node_id__in={n for ns in on.values() for n in ns})
    for node in nodes.only("pk", "node_id", "lost_plans", "lost_at", "registered_at"):
        for pid in node.lost_plans or {}:
            if node.node_id not in on.get(pid, ()):
                continue
            revived = AgentCommand.objects.filter(node=node, kind="prepare_plan", payload__plan_id=pid,
                                                  state=AgentCommand.OK,
                                                  acked_at__gte=node.lost_at or node.registered_at)
            if not revived.exists():
                out.setdefault(pid, []).append(node.node_id)
    return out


def drop_lost_plans(deployment: Deployment | str, *, now: datetime, actor: str = GEARBOX) -> list[str]:
    """Take the plans an agent no longer runs (it came back without them, or its report says they
    died under it: lost_plans) out of the deployment's gear and routing, and free what they had
    booked - but on a node of theirs that still runs its stage, which is told to release it and
    keeps its GPUs booked until it answers (console/gearbox/lost_release.py); returns their ids.

    Their sequences died with the engines; what is left of the gear keeps serving with
    the weights renormalised, and the decision that follows (a topology event) replaces what was
    lost - bringing a gear up from nothing when no plan is left. Never while a transition runs:
    its commands to that agent fail and it rolls back first."""
    name = deployment if isinstance(deployment, str) else deployment.name
    with transaction.atomic():
        row = _locked(name)
        if _active(row) is not None:
            return []
        lost = lost_plans(row)
        if not lost:
            return []
        routes = [r for r in row.routing if isinstance(r, dict) and r.get("plan_id") not in lost]
        open_weight = sum(float(r.get("weight", 0.0)) for r in routes if not r.get("frozen"))
        for r in routes:
            if not r.get("frozen"):
                w = float(r.get("weight", 0.0))
                r["weight"] = w / open_weight if open_weight > 0 else 1.0 / max(1, len(routes))
        current = _gear(row, "current_gear")
        kept = [(p, w) for p, w in zip(current.plans, current.weights, strict=True)
                if p.plan_id not in lost] if current is not None else []
        total = sum(w for _, w in kept)
        gear = (Gear(current.model, tuple(p for p, _ in kept),
                     tuple(w / total if total > 0 else 1.0 / len(kept) for _, w in kept))
                if current is not None and kept else None)
        before = {"version": row.routing_version, "current_gear_id": current.gear_id if current else None}
        # the plans' other nodes still hold their stages: told to release them, booked until they answer
        told = lost_release.do_release_lost_plans(row, lost, version=row.routing_version + 1, now=now, actor=actor)
        row.routing, row.routing_version = routes, row.routing_version + 1
        row.current_gear = gear.to_dict() if gear is not None else None
        row.updated_at = now
        row.save(update_fields=["routing", "routing_version", "current_gear", "updated_at"])
        where = ", ".join(f"{p} on {'/'.join(n)}" for p, n in sorted(lost.items()))
        left = f"{gear.shape()} keeps serving" if gear is not None else "nothing serves until a new gear is up"
        record("gearbox.plans_lost", actor=actor, at=now, deployment=name,
               summary=f"{name}: dropped {len(lost)} plan(s) their agent no longer runs ({where}); {left}",
               data={"plans": {p: n for p, n in sorted(lost.items())}, "released_on": told},
               before=before,
               after={"version": row.routing_version, "current_gear_id": gear.gear_id if gear else None})
    transaction.on_commit(lambda: live.push_routing(name))
    return sorted(lost)


@transaction.atomic
def do_record_load(deployment: Deployment, sample: LoadSample) -> None:
    """Append one load sample to the deployment's window (telemetry: not audited)."""
    dep = _locked(deployment)
    window = load_window(dep.load_window)
    if window.samples and window.samples[-1].t_s >= sample.t_s:
        return
    dep.load_window = window.add(sample, keep_s=KEEP_LOAD_S).to_dict()
    dep.save(update_fields=["load_window"])


SERVING_KEEP_S = 3600.0  # the serving charts' history


def do_record_serving(deployment: Deployment, served: Mapping[str, Any] | None) -> bool:
    """Keep one point of the deployment's serving history (what present.serving summed from its
    engines' latest reports) when a newer report came in; drop points older than an hour. Telemetry:
    not audited. True when a point was stored."""
    from django.utils.dateparse import parse_datetime

    from console.gearbox.models import ServingSample

    at = parse_datetime(str(served.get("reported_at"))) if served and served.get("reported_at") else None
    if at is None:
        return False
    last = ServingSample.objects.filter(deployment=deployment).order_by("-at").values_list("at", flat=True).first()
    if last is not None and last >= at:
        return False
    assert served is not None
    ServingSample.objects.create(deployment=deployment, at=at, tokens_per_s=float(served.get("tokens_per_s") or 0.0),
                                 ttft_p50_ms=served.get("ttft_p50_ms"), ttft_p95_ms=served.get("ttft_p95_ms"),
                                 tpot_p95_ms=served.get("tpot_p95_ms"), running=int(served.get("running") or 0),
                                 waiting=int(served.get("waiting") or 0))
    ServingSample.objects.filter(deployment=deployment, at__lt=at - timedelta(seconds=SERVING_KEEP_S)).delete()
    return True


# --- operators -----------------------------------------------------------------------------------
@transaction.atomic
def do_set_mode(deployment: Deployment | str, mode: str, *, actor: Any) -> Deployment:
    who, user = _who(actor)
    if mode not in (Deployment.AUTO, Deployment.ADVISORY):
        raise Rejected(400, {"mode": f"must be auto or advisory (pin a gear with the pin action); got {mode!r}"})
    dep = _locked(deployment)
    _not_in_emergency(dep)
    if dep.mode == mode:
        return dep
    before = {"mode": dep.mode, "pinned_gear_id": _gear_id(dep.pinned_gear)}
    dep.mode, dep.pinned_gear, dep.updated_at = mode, None, timezone.now()
    dep.save(update_fields=["mode", "pinned_gear", "updated_at"])
    if mode == Deployment.AUTO:
        Decision.objects.filter(deployment=dep, approval=Decision.PENDING).update(approval=Decision.SUPERSEDED)
    record("gearbox.mode_set", actor=who, user=user, at=dep.updated_at, deployment=dep.name,
           summary=f"{dep.name}: mode {before['mode']} -> {mode}", before=before, after={"mode": mode})
    return dep


@transaction.atomic
def do_pin_gear(deployment: Deployment | str, *, actor: Any) -> Deployment:
    """Pin the current gear: the gearbox never switches it automatically (emergency still works)."""
    who, user = _who(actor)
    dep = _locked(deployment)
    _not_in_emergency(dep)
    if dep.current_gear is None:
        raise Rejected(409, {"current_gear": "nothing runs yet; pin once the first transition brought a gear up"})
    if dep.mode == Deployment.PINNED and dep.pinned_gear == dep.current_gear:
        return dep
    before = {"mode": dep.mode}
    dep.mode, dep.pinned_gear, dep.updated_at = Deployment.PINNED, dep.current_gear, timezone.now()
    dep.save(update_fields=["mode", "pinned_gear", "updated_at"])
    Decision.objects.filter(deployment=dep, approval=Decision.PENDING).update(approval=Decision.SUPERSEDED)
    record("gearbox.gear_pinned", actor=who, user=user, at=dep.updated_at, deployment=dep.name,
           summary=f"{dep.name}: pinned to {Gear.from_dict(dep.current_gear).shape()}", before=before,
           after={"mode": dep.mode, "pinned_gear_id": _gear_id(dep.pinned_gear)})
    return dep


@transaction.atomic
def do_unpin_gear(deployment: Deployment | str, *, actor: Any, mode: str = Deployment.AUTO) -> Deployment:
    who, user = _who(actor)
    if mode not in (Deployment.AUTO, Deployment.ADVISORY):
        raise Rejected(400, {"mode": f"must be auto or advisory; got {mode!r}"})
    dep = _locked(deployment)
    _not_in_emergency(dep)
    if dep.mode != Deployment.PINNED:
        return dep
    before = {"mode": dep.mode, "pinned_gear_id": _gear_id(dep.pinned_gear)}
    dep.mode, dep.pinned_gear, dep.updated_at = mode, None, timezone.now()
    dep.save(update_fields=["mode", "pinned_gear", "updated_at"])
    record("gearbox.gear_unpinned", actor=who, user=user, at=dep.updated_at, deployment=dep.name,
           summary=f"{dep.name}: unpinned, mode {mode}", before=before, after={"mode": mode})
    return dep


@transaction.atomic
def do_approve_decision(decision: Decision | int, *, actor: Any) -> Transition:
    """Advisory mode: start the transition a pending decision advised, if it still makes sense."""
    who, user = _who(actor)
    pk = decision if isinstance(decision, int) else decision.pk
    row = Decision.objects.select_for_update().filter(pk=pk).first()
    if row is None:
        raise Rejected(404, {"decision": f"no decision {pk}"})
    dep = _locked(row.deployment)
    if row.approval != Decision.PENDING:
        raise Rejected(409, {"decision": f"decision {pk} is not waiting for approval ({row.approval or 'none'})"})
    current_id = _gear_id(dep.current_gear) or ""
    if row.current_gear_id != current_id:
        raise Rejected(409, {"decision": "stale: the deployment changed gear since; wait for a new decision"})
    if _active(dep) is not None:
        raise Rejected(409, {"deployment": "a transition is running; approve once it ended"})
    advised = gearbox.Decision.from_dict(row.decision)
    target = advised.target
    if target is None:
        raise Rejected(409, {"decision": "it advises no gear"})
    base = fleet_snapshot(timezone.now())
    problems = validate_gear(target, decision_snapshot(base, _held_by_others(dep)), spec_for(dep),
                             reclaimable_bytes=gearbox.gear_footprint(_gear(dep, "current_gear"),
                                                                      spec_for(dep), base)
                             if dep.current_gear else None)
    if problems:
        raise Rejected(409, {"decision": "stale: the advised gear no longer fits: " + "; ".join(problems[:3])})
    now = timezone.now()
    started = _start(dep, target, kind=Kind.APPROVED, decision=row, actor=who)
    if started is None:
        raise Rejected(409, {"deployment": "another transition started first"})
    _remember_stage(dep, advised, started, Kind.APPROVED)  # a staged switch: its second stage follows
    row.approval, row.approved_by, row.approved_at = Decision.APPROVED, user, now
    row.save(update_fields=["approval", "approved_by", "approved_at"])
    record("gearbox.decision_approved", actor=who, user=user, at=now, deployment=dep.name, decision_id=row.pk,
           transition_seq=started.seq, summary=f"{dep.name}: approved decision {row.pk} -> {target.shape()} "
                                               f"(transition #{started.seq})")
    return started


@transaction.atomic
def do_request_gear(deployment: Deployment | str, gear: Mapping[str, object] | Gear, *, actor: Any,
                    reason: str = "") -> tuple[Decision, Transition | None]:
    """A manual switch to an operator's gear (validated by the gearbox: MANUAL trigger)."""
    who, _ = _who(actor)
    dep = _locked(deployment)
    _not_in_emergency(dep)
    try:
        wanted = gear if isinstance(gear, Gear) else Gear.from_dict(gear)
    except ValueError as exc:
        field, _, why = str(exc).partition(": ")
        raise Rejected(400, {field: why or str(exc)}) from None
    now = timezone.now()
    running = _active(dep) is not None
    d = _decide(dep, fleet_snapshot(now), held_gpus(), now, Trigger.MANUAL, requested=wanted, running=running)
    row = do_record_decision(dep, d, actor=actor, now=now, note=reason)
    if d.outcome is not Outcome.SWITCH or d.target is None:
        return row, None
    started = _start(dep, d.target, kind=Kind.MANUAL, decision=row, actor=who)
    _remember_stage(dep, d, started, Kind.MANUAL)  # a staged switch: its second stage follows
    return row, started


@transaction.atomic
def do_set_latency_critical(deployment: Deployment | str, value: bool, *, actor: Any) -> Deployment:
    """Mark a deployment latency-critical (or not): its plans then stay off blocks whose fragment
    history says they keep shrinking (scheduler.planner, seed 000 section 4.1). Audited."""
    who, user = _who(actor)
    if not isinstance(value, bool):
        raise Rejected(400, {"latency_critical": f"must be true or false; got {value!r}"})
    dep = _locked(deployment)
    if dep.latency_critical == value:
        return dep
    before = {"latency_critical": dep.latency_critical}
    dep.latency_critical, dep.updated_at = value, timezone.now()
    dep.save(update_fields=["latency_critical", "updated_at"])
    record("gearbox.latency_critical_set", actor=who, user=user, at=dep.updated_at, deployment=dep.name,
           summary=f"{dep.name}: {'latency-critical' if value else 'not latency-critical'}", before=before,
           after={"latency_critical": value})
    return dep


# --- the scenario loader -------------------------------------------------------------------------
@transaction.atomic
def do_sync_deployment(*, name: str, model_name: str, ttft_ms: float, tpot_ms: float, priority: int,
                       baseline: Gear, actor: Any, mode: str = Deployment.AUTO) -> tuple[Deployment, str]:
    """Create the deployment, or bring its SLO, priority and baseline up to date. Never touches
    what runs (current gear, routing, transitions), nor a baseline an operator set
    (console/gearbox/override.do_set_baseline). Returns it and created | updated | unchanged."""
    who, user = _who(actor)
    errors: dict[str, str] = {}
    try:
        spec_for(model_name)
    except ValueError as exc:
        errors["model_name"] = str(exc)
    if baseline.model != model_name:
        errors["baseline.model"] = f"{baseline.model!r} is not the deployment's model {model_name!r}"
    for field, value in (("ttft_ms", ttft_ms), ("tpot_ms", tpot_ms)):
        if not isinstance(value, int | float) or value <= 0:
            errors[field] = "must be a number > 0"
    if mode not in (Deployment.AUTO, Deployment.ADVISORY):
        errors["mode"] = f"must be auto or advisory; got {mode!r}"
    if errors:
        raise Rejected(400, errors)
    now = timezone.now()
    wanted = {"model_name": model_name, "ttft_ms": float(ttft_ms), "tpot_ms": float(tpot_ms), "priority": priority,
              "baseline_gear": baseline.to_dict()}
    dep = Deployment.objects.select_for_update().filter(name=name).first()
    if dep is None:
        dep = Deployment.objects.create(name=name, mode=mode, created_at=now, updated_at=now, **wanted)
        record("gearbox.deployment_created", actor=who, user=user, at=now, deployment=name,
               summary=f"{name}: {model_name}, baseline {baseline.shape()}, priority {priority}", after={
                   **{k: v for k, v in wanted.items() if k != "baseline_gear"}, "baseline_gear_id": baseline.gear_id})
        return dep, "created"
    if dep.baseline_by.startswith("user:"):
        wanted["baseline_gear"] = dep.baseline_gear  # an operator set it: the file does not undo that
    before = {k: getattr(dep, k) for k in wanted}
    if before == wanted:
        return dep, "unchanged"
    for k, v in wanted.items():
        setattr(dep, k, v)
    dep.updated_at = now
    dep.save(update_fields=[*wanted, "updated_at"])
    record("gearbox.deployment_updated", actor=who, user=user, at=now, deployment=name,
           summary=f"{name}: SLO, priority or baseline changed",
           before={k: v for k, v in before.items() if k != "baseline_gear"} | {
               "baseline_gear_id": _gear_id(before["baseline_gear"])},
           after={k: v for k, v in wanted.items() if k != "baseline_gear"} | {"baseline_gear_id": baseline.gear_id})
    return dep, "updated"


# --- helpers -------------------------------------------------------------------------------------
def _gear_id(raw: object) -> str | None:
    if not raw:
        return None
    try:
        return Gear.from_dict(raw).gear_id
    except ValueError:
        return None


def held_gpus() -> dict[str, set[str]]:
    """deployment name -> GPUs it holds: its current gear, its running transition's gears, its bookings."""
    out: dict[str, set[str]] = {}
    for dep in Deployment.objects.all():
        out[dep.name] = gear_gpus(dep.current_gear)
    for t in Transition.objects.filter(phase__in=ACTIVE_PHASES).select_related("deployment"):
        out.setdefault(t.deployment.name, set()).update(gear_gpus(t.to_gear) | gear_gpus(t.from_gear))
    for r in GpuReservation.objects.select_related("deployment"):
        out.setdefault(r.deployment.name, set()).add(r.gpu_uuid)
    return out


def booked_bytes() -> dict[str, dict[str, int]]:
    """deployment name -> GPU -> bytes its reservations book there (every plan it prepared and has
    not released): what the loop shares a GPU by (scheduler.pool.sharing)."""
    out: dict[str, dict[str, int]] = {}
    for name, u, b in GpuReservation.objects.values_list("deployment__name", "gpu_uuid", "mem_bytes"):
        per = out.setdefault(name, {})
        per[u] = per.get(u, 0) + int(b)
    return out


def _held_by_others(dep: Deployment) -> set[str]:
    held = held_gpus()
    return set().union(*[g for name, g in held.items() if name != dep.name]) if held else set()


__all__ = [
    "Decided", "Rejected", "do_approve_decision", "do_decide_gear", "do_pin_gear", "do_record_decision",
    "do_record_load", "do_request_gear", "do_set_latency_critical", "do_set_mode", "do_sync_deployment",
    "do_unpin_gear", "held_gpus", "booked_bytes", "scheduler_deployment",
]
