"""Live push of gearbox changes to the browsers (called from transaction.on_commit only).

Best effort, like console.fleet.live: the state is committed; a page that missed a push reads
it on its next load. Group GEARBOX_GROUP (the Overview, the Deployments list) and the deployment's
own group (console.dashboard.groups.deployment_group: its page) get {"type": "gearbox.event",
"event": {...}}. The fleet's deltas and the audit entries reach a deployment's group through the
routers below (registered in console.gearbox.receivers): a deployment page hears its own
deployment only (issue 19).
"""

from __future__ import annotations

import logging
from typing import Any

import redis
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

from console.dashboard.groups import deployment_group

log = logging.getLogger(__name__)

GEARBOX_GROUP = "gearbox"


# audit events of changes that push nothing themselves (the transitions and decisions push their own)
OPERATOR_EVENTS = frozenset({
    "gearbox.mode_set", "gearbox.gear_pinned", "gearbox.gear_unpinned", "gearbox.emergency_requested",
    "gearbox.decision_approved", "gearbox.deployment_created", "gearbox.deployment_updated",
    "gearbox.transition_abort_requested",
})


def _send(event: dict[str, Any]) -> None:
    layer = get_channel_layer()
    if layer is None:
        return
    message = {"type": "gearbox.event", "event": event}
    try:
        async_to_sync(_send_all)(layer, [GEARBOX_GROUP, deployment_group(event["deployment"])], message)
    except (OSError, redis.RedisError) as exc:
        log.warning("gearbox live push failed: %s", exc)


async def _send_all(layer: Any, groups: list[str], message: dict[str, Any]) -> None:
    for group in groups:
        await layer.group_send(group, message)


def fleet_delta_groups(delta: dict[str, Any]) -> list[str]:
    """The deployment groups a fleet delta concerns: those whose routed plans' engines report in it,
    or whose gears (current, baseline, the running transition's target) hold one of its GPUs."""
    from console.gearbox import present
    from console.gearbox.models import ACTIVE_PHASES, Deployment, Transition

    gpus = {g.get("uuid") for g in delta.get("gpus") or ()}
    plans = {e.get("plan_id") for n in delta.get("nodes") or () for e in n.get("engines") or ()
             if isinstance(e, dict)}
    if not gpus and not plans:
        return []
    targets = dict(Transition.objects.filter(phase__in=ACTIVE_PHASES).values_list("deployment_id", "to_gear"))
    out = []
    for dep in Deployment.objects.only("pk", "name", "current_gear", "baseline_gear", "routing"):
        held: set[str] = set()
        for raw in (dep.current_gear, dep.baseline_gear, targets.get(dep.pk)):
            gear = present.parse_gear(raw)
            held.update(gear.gpu_uuids if gear is not None else ())
        if gpus & held or plans & set(present.routed_plan_ids(dep)):
            out.append(deployment_group(dep.name))
    return out


def audit_entry_groups(entry: dict[str, Any]) -> list[str]:
    """An operator verb on a deployment (which pushes nothing of its own) goes to its page."""
    name = entry.get("deployment")
    return [deployment_group(name)] if name and entry.get("event_type") in OPERATOR_EVENTS else []


def push_transition(deployment: str, seq: int) -> None:
    from console.gearbox.models import Transition

    t = Transition.objects.filter(deployment__name=deployment, seq=seq).first()
    if t is None:
        return
    _send({"kind": "transition", "deployment": deployment, "seq": seq, "phase": t.phase, "step": t.step,
           "attempt": t.attempt, "error": t.error, "transition_kind": t.kind})


def push_routing(deployment: str) -> None:
    from console.gearbox.models import Deployment

    d = Deployment.objects.filter(name=deployment).values("routing_version", "routing").first()
    if d is not None:
        _send({"kind": "routing", "deployment": deployment, "version": d["routing_version"],
               "routes": [{"plan_id": r.get("plan_id"), "weight": r.get("weight"), "frozen": r.get("frozen")}
                          for r in d["routing"]]})


def push_decision(deployment: str, decision_id: int, outcome: str, trigger: str) -> None:
    _send({"kind": "decision", "deployment": deployment, "decision": decision_id, "outcome": outcome,
           "trigger": trigger})
