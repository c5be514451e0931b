"""Rolling a model version out, explicitly: registering a version changes nothing that serves.

    do_rollout_version(deployment, version, *, actor, gear_id=None, spec=None)

A deployment serves one registry version (`Deployment.model_version`: the weights its plans load,
the tokenizer the gateway uses). An operator rolls another version of the same model out:

* nothing runs yet: the version is bound at once (nothing serves, so nothing changes);
* otherwise a transition of kind rollout brings the new version up as shadow plans *beside* the
  running gear - on GPUs it does not hold (the best safe gear of the planner there, or the
  operator's `gear_id` / `spec`, checked against invariant 4 like an override) - through the
  usual table: PREPARE (each agent loads the weights, checked against the version's SHA-256, and
  the version's tokenizer and warm-up on the shadow plan: agents/shadow_check.py), the canary
  (a share of new requests), the flip, the hand-over, the release of the old plans. Only at DONE
  does the deployment serve the new version (console/gearbox/ports.py); a failed check or step
  rolls back, and the old version keeps serving. Audited at each step.

Refused: a version of another model (400 naming `version`), one that may not be loaded
(quarantined, retired, still verifying: 409), the version it serves already, a running
transition, an emergency (409); no room beside the running gear (409: free GPUs, or override
to a smaller gear first).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from django.db import transaction
from django.utils import timezone

from console.audit.chain import record
from console.fleet.actions import Rejected
from console.gearbox.actions import (
    _active,
    _decide,
    _gear_id,
    _locked,
    _not_in_emergency,
    _start,
    _who,
    do_record_decision,
    held_gpus,
    scheduler_deployment,
)
from console.gearbox.models import Deployment, Transition
from console.gearbox.names import gear_name, load_names
from console.gearbox.override import resolve_gear
from console.gearbox.snapshot import decision_snapshot, fleet_snapshot, gear_gpus, load_window
from console.registry.specs import planner_options, spec_for
from scheduler import gearbox
from scheduler.gearbox import Mode, Outcome, Trigger
from scheduler.transition import Kind

LOADABLE = ("verified", "awaiting_agent")


def _version(version: Any) -> Any:
    from console.registry.models import ModelVersion

    if isinstance(version, ModelVersion):
        return version
    row = ModelVersion.objects.filter(pk=version).first() if isinstance(version, int) else None
    if row is None:
        raise Rejected(404, {"version": f"no model version {version!r}"})
    return row


def do_rollout_version(deployment: Deployment | str, version: Any, *, actor: Any, gear_id: str | None = None,
                       spec: object = None) -> tuple[str, Transition | None]:
    """Roll `version` out to the deployment (module docstring). Returns ("bound" | "started" |
    "already_serving", the rollout transition or None)."""
    who, user = _who(actor)
    name = deployment if isinstance(deployment, str) else deployment.name
    dep = Deployment.objects.filter(name=name).first()
    if dep is None:
        raise Rejected(404, {"deployment": f"no deployment {name!r}"})
    v = _version(version)
    if v.name != dep.model_name:
        raise Rejected(400, {"version": f"{v.name} {v.version} is a version of {v.name}; {dep.name} serves "
                                        f"{dep.model_name}"})
    if dep.model_version_id == v.pk:
        return "already_serving", None
    if v.status not in LOADABLE:
        raise Rejected(409, {"version": f"{v.name} {v.version} is {v.status}: only a verified version (or one "
                                        "awaiting its first agent's hash) can be rolled out"})
    _not_in_emergency(dep)
    if _active(dep) is not None:
        raise Rejected(409, {"deployment": f"{dep.name} is in a transition; roll out once it ended"})
    now = timezone.now()
    if dep.current_gear is None:
        with transaction.atomic():
            dep = _locked(name)
            before = dep.model_version.version if dep.model_version is not None else None
            dep.model_version, dep.updated_at = v, now
            dep.save(update_fields=["model_version", "updated_at"])
            record("gearbox.version_rolled_out", actor=who, user=user, at=now, deployment=dep.name,
                   summary=f"{dep.name}: serves {v.name} {v.version} from its first gear on (nothing ran yet)",
                   before={"model_version": before}, after={"model_version": v.version},
                   data={"model_version_id": v.pk, "sha256": v.sha256})
        return "bound", None

    base = fleet_snapshot(now)
    own = gear_gpus(dep.current_gear)
    if gear_id is None and spec is None:
        target = _beside(dep, base, own, now, v)
        how = "the planner's best safe gear beside the running one"
    else:
        target, how = resolve_gear(dep, gear_id=gear_id, spec=spec, snap=decision_snapshot(base, own), requires=v)
        how += ", beside the running gear"
    overlap = set(target.gpu_uuids) & own
    if overlap:
        names = load_names()
        raise Rejected(409, {"gear_id" if gear_id else "spec": "a rollout's shadow plans need GPUs the running gear "
                             "does not hold: " + ", ".join(sorted(names.get(u, u) for u in overlap))})
    with transaction.atomic():
        dep = _locked(name)
        d = _decide(dep, base, held_gpus(), now, Trigger.MANUAL, requested=target)
        row = do_record_decision(dep, d, actor=actor, now=now, note=f"rollout of {v.name} {v.version}")
        if d.outcome is not Outcome.SWITCH or d.target is None:
            raise Rejected(409, {"deployment": "the gearbox refused the rollout's gear: " + "; ".join(d.reasons[:3])})
        started = _start(dep, d.target, kind=Kind.ROLLOUT, decision=row, actor=who, model_version=v)
        if started is None:
            raise Rejected(409, {"deployment": "another transition started first"})
        serving = dep.model_version.version if dep.model_version is not None else "no registry version"
        record("gearbox.rollout_started", actor=who, user=user, at=now, deployment=dep.name, decision_id=row.pk,
               transition_seq=started.seq,
               summary=f"{dep.name}: rolling {v.name} {v.version} out (serving {serving}) on "
                       f"{gear_name(d.target, load_names())}, transition #{started.seq}",
               data={"model_version_id": v.pk, "version": v.version, "sha256": v.sha256, "how": how,
                     "gear_id": d.target.gear_id, "from_gear_id": _gear_id(dep.current_gear)})
    return "started", started


def _beside(dep: Deployment, base: Any, own: set[str], now: Any, version: Any) -> Any:
    """The planner's best safe gear on GPUs neither the running gear nor any other deployment holds,
    meeting the rolled-out version's placement requirements."""
    held = held_gpus()
    others = set().union(*[g for n, g in held.items() if n != dep.name]) if held else set()
    view = decision_snapshot(base, others | own)
    sched = replace(scheduler_deployment(dep), mode=Mode.AUTO, last_switch_times_s=())
    listed = gearbox.decide(sched, None, view, load_window(dep.load_window), now.timestamp(), trigger=Trigger.MANUAL,
                            model=spec_for(dep), planner_options=planner_options(version))
    if not listed.candidates:
        raise Rejected(409, {"deployment": f"no room beside {dep.name}'s running gear for the new version's shadow "
                                           "plans: free GPUs, or override to a smaller gear first"})
    return listed.candidates[0].gear


__all__ = ["LOADABLE", "do_rollout_version"]
