"""Live push of new audit entries to the browsers watching the audit page."""

from __future__ import annotations

import json
import logging
from typing import Any

import redis
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

from console.dashboard import groups

log = logging.getLogger(__name__)
AUDIT_GROUP = "audit"


def entry_payload(entry: Any) -> dict[str, Any]:
    body = json.loads(entry.body)
    return {
        "seq": entry.seq, "at": body["at"], "event_type": entry.event_type, "actor": entry.actor,
        "deployment": entry.deployment, "transition_seq": entry.transition_seq, "decision_id": entry.decision_id,
        "summary": entry.summary, "data": body.get("data"), "before": body.get("before"),
        "after": body.get("after"), "hash": entry.hash, "prev_hash": entry.prev_hash,
    }


def push_entry(entry: Any) -> None:
    layer = get_channel_layer()
    if layer is None:
        return
    payload = entry_payload(entry)
    message = {"type": "audit.entry", "entry": payload}
    try:
        # the audit page's group, and the pages an entry concerns (console.dashboard.groups)
        async_to_sync(_send_all)(layer, [AUDIT_GROUP, *groups.extra_groups("audit.entry", payload)], message)
    except (OSError, redis.RedisError) as exc:
        log.warning("audit push failed: %s", exc)


async def _send_all(layer: Any, names: list[str], message: dict[str, Any]) -> None:
    for name in names:
        await layer.group_send(name, message)
