"""The emergency downshift: a mode that holds, like a pin, until an operator releases it.

    do_emergency_downshift(deployment, *, reason, actor, gear_id=None)   go to the baseline now
    do_release_emergency(deployment, *, actor, mode="auto")              hand the gear back

Seed 000 section 6.3 ("in online serving always add an emergency downshift button ... a manual
escape hatch saves you when automation is wrong") and DESIGN.md invariant 6. What an operator gets:

* The request is checked against the fleet at once. When the target cannot run (its GPUs are
  lost or taken), nothing changes but a recorded, audited *blocked* decision, and the answer
  says why, what to do, and offers the planner's best safe gear instead (`offers`: meets the
  SLOs, then the most goodput - scheduler.gearbox.safe_rank). Asking again with that gear's id
  (`gear_id`) takes it as the emergency target, clearly not the baseline.
* Otherwise the deployment's mode becomes `emergency` at once, with the target as its held
  gear (`pinned_gear`): the gearbox never switches it automatically (scheduler.gearbox rule 3),
  whatever the load, cooldown or not. The downshift itself is a transition of kind emergency
  started by the next tick (a running transition is asked to roll back first: the control
  loop's rule 3, scheduler/control/loop.py; console/gearbox/control.py carries it out).
* It holds until an operator releases it (`do_release_emergency`, to auto, advisory or pinned).
  Asking again while it is pending, running or holding changes nothing (audited as repeated).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from django.db import transaction
from django.utils import timezone

from console.audit.chain import record
from console.fleet.actions import Rejected
from console.gearbox.actions import (
    _active,
    _decide,
    _gear,
    _gear_id,
    _kick,
    _locked,
    _who,
    do_record_decision,
    held_gpus,
)
from console.gearbox.executor import build_executor
from console.gearbox.models import Decision, Deployment, Transition
from console.gearbox.names import gear_name, load_names, readable
from console.gearbox.snapshot import fleet_snapshot
from scheduler import gearbox
from scheduler.gearbox import Outcome, Trigger
from scheduler.plan import Gear

OFFER_LABEL = "the planner's best safe gear - not the baseline"
STATES = ("requested", "holding", "already_requested", "already_running", "blocked")


@dataclass(frozen=True)
class Emergency:
    state: str  # one of STATES
    transition: Transition | None = None  # the running transition it asked to roll back, or the emergency one
    decision: Decision | None = None  # blocked: the decision that says why
    reasons: tuple[str, ...] = ()  # blocked: why, and what to do
    offers: tuple[dict[str, Any], ...] = field(default_factory=tuple)  # blocked: safe gears, best first


def emergency_target(dep: Deployment) -> Gear:
    """The gear an emergency takes the deployment to: the one it holds in emergency mode, else the baseline."""
    held = _gear(dep, "pinned_gear") if dep.mode == Deployment.EMERGENCY else None
    return held or Gear.from_dict(dep.baseline_gear)


def offers_of(decision: gearbox.Decision | Mapping[str, Any]) -> list[dict[str, Any]]:
    """The safe gears a blocked emergency decision offers instead, best first (id, name, estimate)."""
    d = decision if isinstance(decision, gearbox.Decision) else gearbox.Decision.from_dict(decision)
    if d.trigger is not Trigger.EMERGENCY or d.outcome is not Outcome.BLOCKED:
        return []
    names = load_names()
    return [{"gear_id": c.gear.gear_id, "name": gear_name(c.gear, names), "shape": c.gear.shape(),
             "gpu_count": len(c.gear.gpu_uuids), "label": OFFER_LABEL, "meets_slo": c.standing,
             "estimate": {"goodput_tokens_s": c.estimate.goodput_tokens_s, "capacity_rps": c.estimate.capacity_rps,
                          "ttft_p99_s": c.estimate.ttft_p99_s, "tpot_p99_s": c.estimate.tpot_p99_s}}
            for c in d.candidates]


def do_emergency_downshift(deployment: Deployment | str, *, reason: str, actor: Any,
                           gear_id: str | None = None) -> Emergency:
    """Go to the baseline now (or to `gear_id`, a safe gear a blocked request offered); hold it
    (module docstring). Works in every mode, pinned included; idempotent."""
    who, user = _who(actor)
    if not isinstance(reason, str) or not reason.strip():
        raise Rejected(400, {"reason": "required: say why the deployment must go back to its baseline"})
    reason = reason.strip()
    now = timezone.now()
    name = deployment if isinstance(deployment, str) else deployment.name
    dep = Deployment.objects.filter(name=name).first()
    if dep is None:
        raise Rejected(404, {"deployment": f"no deployment {name!r}"})
    base, held = fleet_snapshot(now), held_gpus()
    target = Gear.from_dict(dep.baseline_gear)
    if gear_id is not None and gear_id != target.gear_id:
        offered = _decide(dep, base, held, now, Trigger.EMERGENCY, running=_active(dep) is not None)
        chosen = next((c.gear for c in offered.candidates if c.gear.gear_id == gear_id), None)
        if offered.outcome is not Outcome.BLOCKED or chosen is None:
            raise Rejected(409, {"gear_id": f"{gear_id} is not offered as the emergency gear now: "
                                            + ("the baseline can run, downshift to it"
                                               if offered.outcome is not Outcome.BLOCKED
                                               else "offers are the planner's best safe gears; ask again")})
        target = chosen
    with transaction.atomic():
        dep = _locked(name)
        active = _active(dep)
        repeated = _repeated(dep, active, target)
        if repeated is not None:
            record("gearbox.emergency_repeated", actor=who, user=user, at=now, deployment=dep.name,
                   transition_seq=active.seq if active else None,
                   summary=f"{dep.name}: emergency downshift asked again ({repeated.replace('_', ' ')}): "
                           f"{reason[:120]}", data={"reason": reason, "state": repeated})
            return Emergency(repeated, active)
        d = _decide(dep, base, held, now, Trigger.EMERGENCY, requested=target, running=active is not None)
        if d.outcome is Outcome.BLOCKED:
            row = do_record_decision(dep, d, actor=actor, now=now, note=f"emergency refused: {reason}")
            offers = offers_of(d)
            record("gearbox.emergency_blocked", actor=who, user=user, at=now, deployment=dep.name,
                   decision_id=row.pk, summary=f"{dep.name}: emergency downshift blocked: {d.reasons[0][:150]}",
                   data={"reason": reason, "reasons": list(d.reasons), "offers": [o["gear_id"] for o in offers]})
            names = load_names()
            return Emergency("blocked", active, row, tuple(readable(r, names) for r in d.reasons), tuple(offers))
        before = {"mode": dep.mode, "pinned_gear_id": _gear_id(dep.pinned_gear)}
        state = "holding" if d.outcome is Outcome.STAY and active is None else "requested"
        dep.mode, dep.pinned_gear = Deployment.EMERGENCY, target.to_dict()
        dep.emergency_reason, dep.emergency_actor, dep.updated_at = reason, who, now
        dep.emergency_requested_at = now if state == "requested" else None
        dep.save(update_fields=["mode", "pinned_gear", "emergency_requested_at", "emergency_reason",
                                "emergency_actor", "updated_at"])
        Decision.objects.filter(deployment=dep, approval=Decision.PENDING).update(approval=Decision.SUPERSEDED)
        if active is not None and active.phase in ("prepare", "switch"):
            build_executor(actor=who).store.request_abort(dep.name, active.seq, f"emergency downshift: {reason}")
        what = "the baseline" if target.gear_id == _gear_id(dep.baseline_gear) else f"{target.shape()} ({OFFER_LABEL})"
        record("gearbox.emergency_requested", actor=who, user=user, at=now, deployment=dep.name,
               transition_seq=active.seq if active else None,
               summary=f"{dep.name}: emergency downshift to {what} {'requested' if state == 'requested' else 'holds'}"
                       f": {reason[:150]}",
               before=before, after={"mode": dep.mode, "pinned_gear_id": target.gear_id},
               data={"reason": reason, "target_gear_id": target.gear_id, "state": state,
                     "running_transition": active.seq if active else None,
                     "running_phase": active.phase if active else None})
        if state == "requested":
            from console.gearbox import tasks

            transaction.on_commit(lambda: tasks.enqueue(tasks.tick, trigger="emergency", deployment=name))
            if active is not None:
                _kick(name, active.seq)
        return Emergency(state, active)


def _repeated(dep: Deployment, active: Transition | None, target: Gear) -> str | None:
    """Why asking for this emergency again changes nothing, or None (it is a new request)."""
    if dep.mode != Deployment.EMERGENCY or _gear_id(dep.pinned_gear) != target.gear_id:
        return None
    if dep.emergency_requested_at is not None:
        return "already_requested"
    if active is not None and active.kind == Transition.EMERGENCY and _gear_id(active.to_gear) == target.gear_id:
        return "already_running"
    if active is None and _gear_id(dep.current_gear) == target.gear_id:
        return "holding"
    return None  # it held a gear it did not reach (its transition rolled back): ask again


@transaction.atomic
def do_release_emergency(deployment: Deployment | str, *, actor: Any, mode: str = Deployment.AUTO) -> Deployment:
    """An operator hands the gear back: auto, advisory, or pinned (to the gear running now)."""
    who, user = _who(actor)
    if mode not in (Deployment.AUTO, Deployment.ADVISORY, Deployment.PINNED):
        raise Rejected(400, {"mode": f"must be auto, advisory or pinned; got {mode!r}"})
    dep = _locked(deployment)
    if dep.mode != Deployment.EMERGENCY:
        raise Rejected(409, {"mode": f"{dep.name} holds no emergency downshift (mode {dep.mode})"})
    if mode == Deployment.PINNED and dep.current_gear is None:
        raise Rejected(409, {"mode": "nothing runs yet to pin; release to auto or advisory"})
    now = timezone.now()
    before = {"mode": dep.mode, "pinned_gear_id": _gear_id(dep.pinned_gear),
              "pending": dep.emergency_requested_at is not None}
    dep.mode = mode
    dep.pinned_gear = dep.current_gear if mode == Deployment.PINNED else None
    dep.emergency_requested_at, dep.updated_at = None, now
    dep.save(update_fields=["mode", "pinned_gear", "emergency_requested_at", "updated_at"])
    record("gearbox.emergency_released", actor=who, user=user, at=now, deployment=dep.name,
           summary=f"{dep.name}: emergency released, mode {mode}", before=before,
           after={"mode": mode, "pinned_gear_id": _gear_id(dep.pinned_gear)})
    return dep


def same_as_last(dep: Deployment, d: gearbox.Decision) -> bool:
    last = Decision.objects.filter(deployment=dep).order_by("-id").values("trigger", "outcome", "reasons").first()
    return (last is not None and last["trigger"] == d.trigger.value and last["outcome"] == d.outcome.value
            and last["reasons"] == list(d.reasons))


__all__ = ["OFFER_LABEL", "Emergency", "do_emergency_downshift", "do_release_emergency", "emergency_target",
           "offers_of", "same_as_last"]
