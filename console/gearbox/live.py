"""Live push of gearbox changes to the browsers (called from transaction.on_commit only).

Best effort, like console.fleet.live: the state is committed; a page that missed a push reads
it on its next load. Group GEARBOX_GROUP gets {"type": "gearbox.event", "event": {...}}.
"""

from __future__ import annotations

import logging
from typing import Any

import redis
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

log = logging.getLogger(__name__)

GEARBOX_GROUP = "gearbox"


def _send(event: dict[str, Any]) -> None:
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        async_to_sync(layer.group_send)(GEARBOX_GROUP, {"type": "gearbox.event", "event": event})
    except (OSError, redis.RedisError) as exc:
        log.warning("gearbox live push failed: %s", exc)


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
