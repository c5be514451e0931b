"""The global correction's hints as agent commands (agents/protocol/: `apply_hints`).

`do_send_hints` queues one `apply_hints` per leader node, each payload checked with
agents.protocol.check_payload first: a bad hint is refused (Rejected 400, naming the field) and
nothing is queued, for any node. The command key carries the node's epoch and the hints version,
so the same hints for the same registration queue nothing new. An agent's ok-ack of an apply_hints
is checked too (console.fleet.actions.do_ack_command: check_result; 400 naming the field).
What decides the hints is console/gearbox/correction.py.

The table is bounded where it is written (as ServingSample is, console/fleet/retention.py):
`prune_hint_commands` drops apply_hints commands older than the protocol's longest ttl (an hour),
which nothing reads any more - the gateway reads the last hour's newest per plan.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta

from django.db import transaction

from agents.protocol import MAX_HINT_TTL_S, NodeCommandKind, SchemaError, check_payload
from console.fleet.models import AgentCommand, Node

APPLY = NodeCommandKind.APPLY_HINTS.value


def hints_payload(deployment: str, hints_version: int, ttl_s: float, plans: Sequence[Mapping[str, object]]
                  ) -> dict[str, object]:
    return {"deployment": deployment, "hints_version": hints_version, "ttl_s": ttl_s,
            "plans": [dict(p) for p in plans]}


@transaction.atomic
def do_send_hints(deployment: str, hints_version: int, ttl_s: float,
                  by_node: Mapping[str, Sequence[Mapping[str, object]]], *, now: datetime) -> list[AgentCommand]:
    """Queue the hints of one correction step, per leader node (module docstring). Raises
    Rejected(400) naming every bad field ("payload.plans[0].batch_scale"; with several
    nodes, prefixed "nodes.<node id>.") and every node the console does not know ("nodes.<node
    id>"); then nothing is queued."""
    from console.fleet.actions import Rejected, do_issue_command

    nodes = {n.node_id: n for n in Node.objects.filter(node_id__in=list(by_node))}
    errors: dict[str, str] = {}
    payloads: dict[str, dict[str, object]] = {}
    for node_id, plans in sorted(by_node.items()):
        if node_id not in nodes:
            errors[f"nodes.{node_id}"] = f"unknown node {node_id!r}"
            continue
        payload = hints_payload(deployment, hints_version, ttl_s, plans)
        try:
            payloads[node_id] = check_payload(APPLY, payload)
        except SchemaError as exc:
            errors.update({f"nodes.{node_id}.{k}" if len(by_node) > 1 else k: v for k, v in exc.errors.items()})
    if errors:
        raise Rejected(400, errors)
    out = []
    for node_id, payload in payloads.items():
        node = nodes[node_id]
        out.append(do_issue_command(node, key=f"apply_hints/{node_id}@{node.epoch}/{deployment}/{hints_version}",
                                    kind=APPLY, payload=payload, now=now))
    return out


def prune_hint_commands(*, now: datetime) -> int:
    """Delete the apply_hints commands older than any hint lives (module docstring); how many."""
    old = AgentCommand.objects.filter(kind=APPLY, created_at__lt=now - timedelta(seconds=MAX_HINT_TTL_S))
    return int(old.delete()[0])


__all__ = ["APPLY", "do_send_hints", "hints_payload", "prune_hint_commands"]
