"""Live push of fleet state to the browsers (the doorbell that wakes a long poll: console/fleet/doorbell.py).

Called from `transaction.on_commit` only: what is pushed has been committed.
"""

from __future__ import annotations

import logging
from typing import Any

import redis
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

from console.fleet import signals

log = logging.getLogger(__name__)

CLUSTER_GROUP = "cluster"


def node_payload(node: Any) -> dict[str, Any]:
    return {
        "node_id": node.node_id,
        "hostname": node.hostname,
        "rack": node.rack,
        "schedulable": node.schedulable,
        "unschedulable_reason": node.unschedulable_reason,
        "last_seen_at": node.last_seen_at.isoformat() if node.last_seen_at else None,
        "engines": node.engines,
    }


def gpu_payload(gpu: Any) -> dict[str, Any]:
    return {
        "uuid": gpu.uuid,
        "node_id": gpu.node.node_id,
        "index": gpu.index,
        "model": gpu.model,
        "nvlink_group": gpu.nvlink_group,
        "mem_total_bytes": gpu.mem_total_bytes,
        "mem_used_bytes": gpu.mem_used_bytes,
        "sm_util": gpu.sm_util,
        "temperature_c": gpu.temperature_c,
        "healthy": gpu.healthy,
        "allocatable": gpu.allocatable,
        "xid_errors": gpu.xid_errors,
        "ecc_errors": gpu.ecc_errors,
        "updated_at": gpu.updated_at.isoformat() if gpu.updated_at else None,
    }


def cluster_state(node_pks: list[int] | None = None) -> dict[str, Any]:
    """The whole cluster (or the given nodes) as the dashboard draws it."""
    from console.fleet.models import Gpu, Node

    nodes = Node.objects.all()
    # each GPU's node for its id only: not its engines and capabilities JSON, once per GPU (issue 19)
    gpus = Gpu.objects.filter(present=True).select_related("node").only(
        *(f.name for f in Gpu._meta.concrete_fields), "node__node_id")
    if node_pks is not None:
        nodes = nodes.filter(pk__in=node_pks)
        gpus = gpus.filter(node__pk__in=node_pks)
    return {"nodes": [node_payload(n) for n in nodes], "gpus": [gpu_payload(g) for g in gpus]}


def push_report(delta: dict[str, Any], *, node_id: str, topology_changed: bool) -> None:
    """A committed report's delta to every dashboard (through the process's pusher thread), and the
    gearbox told at once when its GPUs moved."""
    from console.fleet import pusher

    pusher.enqueue(delta)
    if topology_changed:
        signals.topology_changed.send(sender=None, node_ids=[node_id])


def push_nodes(node_pks: list[int], *, topology_changed: bool = False) -> None:
    """Send the new state of these nodes to every dashboard, and tell the gearbox if GPUs moved."""
    if not node_pks:
        return
    from console.fleet import pusher

    delta = cluster_state(node_pks)
    layer = get_channel_layer()
    if layer is not None:
        try:
            async_to_sync(pusher.send_delta)(layer, delta, pusher.extra_groups(delta))
        except (OSError, redis.RedisError) as exc:
            # The push is best effort: the state is committed and the next push carries it.
            log.warning("live push failed: %s", exc)
    if topology_changed:
        signals.topology_changed.send(sender=None, node_ids=[n["node_id"] for n in delta["nodes"]])
