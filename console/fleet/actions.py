"""Every write to the fleet goes through one of these actions.

Each is one transaction; the live push to the browsers happens in `transaction.on_commit`, so
nobody ever sees state that was rolled back. Races between two writers (two reports of one
node, a report and the heartbeat sweep) are settled by conditional updates, not by locks held
across I/O.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import connection, transaction

from agents.protocol import CommandKind, NodeCommandKind, RegisterRequest, Report, SchemaError, check_result
from console.accounts.auth import hash_token
from console.audit.chain import actor_of, record
from console.fleet import doorbell, links, live, writes
from console.fleet.models import AgentCommand, Gpu, Node


class Rejected(Exception):
    """A request the controller refuses. `errors` names each offending field; nothing was stored."""

    def __init__(self, status: int, errors: dict[str, str]) -> None:
        self.status = status
        self.errors = errors
        super().__init__("; ".join(f"{k}: {v}" for k, v in errors.items()))


def new_agent_token() -> str:
    return "fpa_" + secrets.token_urlsafe(32)


def enroll_token_matches(token: str) -> bool:
    expected = getattr(settings, "FLEXPIPE_ENROLL_TOKEN", "")
    return bool(expected) and hmac.compare_digest(token.encode(), expected.encode())


def unknown_token() -> Rejected:
    return Rejected(401, {"Authorization": "unknown agent token"})


def node_for_token(token: str) -> Node | None:
    """The node whose agent token this is."""
    if not token:
        return None
    # No ORDER BY (first() would sort the one match by pk): an ack starts here (issue 19)
    return next(iter(Node.objects.filter(token_hash=hash_token(token)).order_by()[:1]), None)


@dataclass(frozen=True)
class AgentRef:
    """The node an agent token was found to belong to: what a report is claimed with."""

    pk: int
    node_id: str
    token_hash: str


_agents: dict[str, AgentRef] = {}  # token hash -> AgentRef, this process's (agent_for_token)
AGENTS_REMEMBERED = 20_000  # past this many tokens the memory starts again: a bound, not a policy


def agent_for_token(token: str, *, remembered: bool = True) -> AgentRef | None:
    """The node an agent token belongs to, remembered by this process: a fleet's reports skip the
    query (issue 19). Only for a report: do_ingest_report reads the node's row, locked, and refuses
    the report (401) when the hash is not the node's any more - rotated or revoked since, by any
    process - so a remembered token never writes. The long poll and the ack read and write without
    such a check: the poll reads its node with its commands (node_and_open_commands), the ack with
    node_for_token."""
    if not token:
        return None
    digest = hash_token(token)
    if remembered and (ref := _agents.get(digest)) is not None:
        return ref
    row = next(iter(Node.objects.filter(token_hash=digest).order_by().values_list("pk", "node_id")[:1]), None)
    if row is None:
        _agents.pop(digest, None)
        return None
    if len(_agents) >= AGENTS_REMEMBERED:
        _agents.clear()
    ref = _agents[digest] = AgentRef(row[0], row[1], digest)
    return ref


def forget_agents() -> None:
    """Forget every remembered token (tests; the memory is only ever an optimisation)."""
    _agents.clear()


@dataclass(frozen=True)
class Registration:
    node: Node
    agent_token: str | None  # set only when a new token was issued (enrollment)


@transaction.atomic
def do_register_node(req: RegisterRequest, *, token: str, now: datetime) -> Registration:
    """Register (or re-register) an agent. The token is its own, or the cluster's join token.

    Invariant 8 (DESIGN.md): an agent is only itself.
    - With its own token an agent may only speak for its own node.
    - The join token enrolls a node id nobody holds yet, and hands out a fresh agent token. A node
      that is enrolled already is re-enrolled only with its own token, or with one an operator
      issued for it (do_issue_agent_token: the operator's approval); the join token alone would
      let anyone who holds it rotate the real agent's token out and take its place.
    - A GPU uuid present on another node stays that node's: registering it is refused (403 naming
      `gpus[i].uuid`). One that its old node no longer lists (re-racked) may move.
    """
    existing = Node.objects.select_for_update().filter(node_id=req.node_id).first()
    own = node_for_token(token)
    issued: str | None = None
    if own is not None:
        if own.node_id != req.node_id:
            raise Rejected(403, {"node_id": f"this agent token belongs to node {own.node_id!r}"})
    elif enroll_token_matches(token):
        if existing is not None:
            raise Rejected(403, {"node_id": (
                f"node {req.node_id!r} is enrolled already: register with its own agent token, or ask an "
                f"operator to approve re-enrolling it (POST /api/v1/nodes/{req.node_id}/agent-token, or "
                f"manage.py issue_agent_token {req.node_id}) and register with the token issued")})
        issued = new_agent_token()
    else:
        raise Rejected(401, {"Authorization": "unknown agent token and not the cluster's join token"})
    owners = dict(Gpu.objects.filter(uuid__in=[g.uuid for g in req.gpus], present=True)
                  .exclude(node__node_id=req.node_id).values_list("uuid", "node__node_id"))
    taken = {f"gpus[{i}].uuid": f"GPU {g.uuid!r} belongs to node {owners[g.uuid]!r}; an agent registers only "
                                f"its own GPUs"
             for i, g in enumerate(req.gpus) if g.uuid in owners}
    if taken:
        raise Rejected(403, taken)

    node = existing or Node(node_id=req.node_id, registered_at=now)
    node.hostname = req.hostname
    node.agent_version = req.agent_version
    node.rack = req.rack or ""
    node.backends = list(req.backends)
    node.capabilities = dict(req.capabilities or {})
    node.data_addr = req.data_addr or ""
    if issued:
        node.token_hash = hash_token(issued)
    node.epoch = (node.epoch or 0) + 1
    node.last_seq = 0
    node.registered_at = now
    node.last_seen_at = now
    node.schedulable = True
    node.unschedulable_reason = ""
    # An agent that lists what it runs (None: it does not say; nothing is assumed lost)
    lost = _lost_on(node, req.plans) if req.plans is not None else {}
    node.lost_plans, node.lost_at = lost, now
    node.save()

    # A GPU that moved to this node from another one (re-racked, not listed there any more) keeps
    # its uuid: re-home it.
    listed = {g.uuid for g in req.gpus}
    Gpu.objects.filter(node=node, present=True).exclude(uuid__in=listed).update(present=False)
    for info in req.gpus:
        Gpu.objects.filter(node=node, index=info.index, present=True).exclude(uuid=info.uuid).update(present=False)
        Gpu.objects.update_or_create(
            uuid=info.uuid,
            defaults={
                "node": node,
                "index": info.index,
                "model": info.model,
                "mem_total_bytes": info.mem_total_bytes,
                "nvlink_group": info.nvlink_group or "",
                "custom_spec": info.custom_spec,
                "present": True,
            },
        )
    record("fleet.node_registered", actor=actor_of(agent=node.node_id), at=now,
           summary=f"{node.node_id} {'enrolled' if issued else 'registered'} with {len(req.gpus)} GPU(s), "
                   f"epoch {node.epoch}",
           data={"epoch": node.epoch, "enrolled": bool(issued), "credential": "join token" if issued else "agent token",
                 "hostname": req.hostname,
                 "agent_version": req.agent_version, "gpus": [g.uuid for g in req.gpus]})
    if lost:
        record("fleet.plans_lost", actor=actor_of(agent=node.node_id), at=now,
               summary=f"{node.node_id} came back without {len(lost)} plan(s) it ran: {', '.join(lost)}",
               data={"epoch": node.epoch, "plans": list(lost), "listed": list(req.plans or ())})
    # a topology event: the gearbox ticks, drops the lost plans from their gears and replaces them
    transaction.on_commit(lambda: live.push_nodes([node.pk], topology_changed=True))
    links.request_probes(node, now=now)  # measure its links to the others, and theirs to it
    return Registration(node, issued)


@transaction.atomic
def do_issue_agent_token(node_id: str, *, actor: str, user: object | None = None, now: datetime) -> tuple[Node, str]:
    """An operator approves (re-)enrolling `node_id`: a new agent token for it, rotating the old one
    out. The token is returned once, never stored (only its hash); the node's agent registers with it.
    A node id nobody enrolled yet is created, so closed clusters can enroll nodes this way too."""
    token = new_agent_token()
    node, created = Node.objects.select_for_update().get_or_create(
        node_id=node_id, defaults={"hostname": node_id, "agent_version": "", "token_hash": hash_token(token),
                                   "registered_at": now})
    if not created:
        Node.objects.filter(pk=node.pk).update(token_hash=hash_token(token))
    record("fleet.agent_token_issued", actor=actor, user=user, at=now,
           summary=f"agent token {'issued' if created else 'rotated'} for {node_id}: its agent registers with it",
           data={"node_id": node_id, "created": created, "prefix": token[:8]})
    return node, token


def _lost_on(node: Node, listed: Iterable[str], *, judged_after: datetime | None = None) -> dict[str, int]:
    """The plans routed to this node that its agent does not list: plan_id -> the node's epoch.

    With `judged_after` (a report's), a plan whose prepare_plan on this node is still open, or was
    acked at or after that moment, is not judged: the agent may have built its list before it held
    the plan (a report is built after the previous one was answered, so what was acked before that
    answer is in it)."""
    missing = _plans_routed_to(node.node_id) - set(listed)
    if missing and judged_after is not None:
        prepares = AgentCommand.objects.filter(node=node, kind=CommandKind.PREPARE_PLAN.value,
                                               payload__plan_id__in=sorted(missing))
        fresh = prepares.filter(state__in=AgentCommand.OPEN_STATES) | prepares.filter(
            state=AgentCommand.OK, acked_at__gte=judged_after)
        missing -= {str(pid) for pid in fresh.values_list("payload__plan_id", flat=True)}
    return {pid: node.epoch for pid in sorted(missing)}


def _note_lost_plans(row: Node, report: Report, *, now: datetime) -> list[str]:
    """A report that lists the plans its agent runs (after the claim, in its transaction; `row`:
    the node as the report read it, locked, so before its claim): the plans placed here that it
    does not run any more are noted lost, in the same place a registration notes them
    (Node.lost_plans; the gearbox drops them). Returns those newly lost."""
    assert report.plans is not None  # noqa: S101 - the caller checks
    # the previous report's time (the claim made it prev_reported_at), or the registration's
    since = max(t for t in (row.reported_at, row.registered_at) if t is not None)
    lost = _lost_on(row, report.plans, judged_after=since)
    before = dict(row.lost_plans or {})
    if not lost and not before:
        return []
    Node.objects.filter(pk=row.pk).update(lost_plans=lost, lost_at=now)
    new = [pid for pid in lost if pid not in before]
    if new:
        record("fleet.plans_lost", actor=actor_of(agent=row.node_id), at=now,
               summary=f"{row.node_id} reports it no longer runs {len(new)} plan(s) placed there: {', '.join(new)}",
               data={"epoch": row.epoch, "seq": report.seq, "plans": new, "listed": list(report.plans)})
    return new


def _plans_routed_to(node_id: str) -> set[str]:
    """Plans some deployment's routing table says run (partly) on this node."""
    from console.gearbox.models import Deployment  # the gearbox builds on the fleet, not the reverse

    deployments = Deployment.objects.all()
    if connection.vendor == "postgresql":  # jsonb @>: only the deployments with a route here leave the database
        deployments = deployments.filter(routing__contains=[{"nodes": [node_id]}])
    out: set[str] = set()
    for routing in deployments.values_list("routing", flat=True):
        for route in routing or ():
            if isinstance(route, dict) and node_id in (route.get("nodes") or ()):
                out.add(str(route.get("plan_id", "")))
    out.discard("")
    return out


@transaction.atomic
def do_ingest_report(agent: Node | AgentRef, report: Report, *, now: datetime) -> int:
    """Store one report of `agent` (the node its token was found to belong to, or the node itself):
    latest GPU state, a history sample per changed GPU, links, engine metrics.

    Invariant: a report is applied entirely or not at all, and only if its (epoch, seq) is
    newer than everything accepted before and the token it came with is still its node's - the
    conditional update below claims the seq, and a rejection raised after it rolls the claim back
    with the rest.
    """
    # The node's row locked (what it says holds until this commits), its GPUs, and on PostgreSQL an
    # asynchronous commit (https://www.postgresql.org/docs/current/wal-async-commit.html): a WAL
    # flush is a millisecond at best and tens behind another writer's, per report. What it risks: a
    # crash of the database server itself may forget the reports committed in its last moments (at
    # most 3 x wal_writer_delay, 600 ms by default), never part of one. The agent hears of the crash
    # as a failed report and sends a full one next (agents/protocol/), which says again all that was
    # forgotten, with a seq newer than any forgotten. Only reports: registrations, acks and
    # operators' writes wait for the disk.
    locked, rows = writes.node_with_gpus(agent.pk, commit_async=True)
    gpus = {g.uuid: g for g in rows}
    if locked is None or locked.token_hash != agent.token_hash:  # rotated or revoked since agent_for_token saw it
        _agents.pop(agent.token_hash, None)
        raise unknown_token()
    if report.node_id != locked.node_id:
        raise Rejected(403, {"node_id": f"this agent token belongs to node {locked.node_id!r}"})
    strangers = [g.uuid for g in report.gpus if g.uuid not in gpus]
    if strangers:
        owners = dict(Gpu.objects.filter(uuid__in=strangers, present=True).values_list("uuid", "node__node_id"))
        others = {f"gpus[{i}].uuid": f"GPU {g.uuid!r} belongs to node {owners[g.uuid]!r}, not to {locked.node_id}"
                  for i, g in enumerate(report.gpus) if g.uuid in owners}
        if others:
            raise Rejected(403, others)
        raise Rejected(400, {f"gpus[{i}].uuid": f"GPU {g.uuid!r} is not registered on {locked.node_id}; register again"
                             for i, g in enumerate(report.gpus) if g.uuid not in gpus})
    if report.links or report.collectives:
        strangers = links.unknown_peers(report, set(Node.objects.values_list("node_id", flat=True)))
        if strangers:
            raise Rejected(400, strangers)

    claimed = writes.claim_report(locked.pk, token_hash=locked.token_hash, epoch=report.epoch, seq=report.seq,
                                  now=now, engines=[e.__dict__ for e in report.engines])
    if not claimed:
        current = Node.objects.values("epoch", "last_seq").get(pk=locked.pk)
        if report.epoch != current["epoch"]:
            raise Rejected(409, {"epoch": f"stale epoch {report.epoch}; the current one is {current['epoch']}"})
        raise Rejected(409, {"seq": f"stale seq {report.seq}; last accepted is {current['last_seq']}"})

    # Only what changed is written (issue 19: a report's cost grows with its change, not with the node):
    # a GPU whose state the report repeats keeps its row and gets no history sample; the node's
    # reported_at says it was seen. A delta report (report.full is False) lists only changed GPUs anyway.
    was_schedulable = locked.schedulable
    topology_changed = False
    changed: list[Gpu] = []
    for g in report.gpus:
        row = gpus[g.uuid]
        state = (g.mem_used_bytes, g.mem_total_bytes, g.sm_util, g.temperature_c, g.healthy, g.allocatable,
                 g.xid_errors, g.ecc_errors)
        if _gpu_state(row) == state:
            continue
        if row.healthy != g.healthy or row.allocatable != g.allocatable:
            topology_changed = True
        (row.mem_used_bytes, row.mem_total_bytes, row.sm_util, row.temperature_c, row.healthy, row.allocatable,
         row.xid_errors, row.ecc_errors) = state
        row.updated_at = now
        changed.append(row)
    writes.store_changed_gpus(changed, now=now)

    links.store_links(locked, report, now=now)
    # Plans that died under the running agent: a topology event, as for an agent that came back without them
    if report.plans is not None and _note_lost_plans(locked, report, now=now):
        topology_changed = True

    # A node that speaks again after a heartbeat timeout is back in the pool.
    if not was_schedulable:
        back = Node.objects.filter(pk=locked.pk, schedulable=False).update(schedulable=True, unschedulable_reason="")
        if back:
            topology_changed = True
            record("fleet.node_schedulable", actor=actor_of(agent=locked.node_id), at=now,
                   summary=f"{locked.node_id} reports again: schedulable")
    # The live delta from what is in memory - no reading back - sent by the process's pusher thread
    # (console/fleet/pusher.py) once this commits; the gearbox hears of a topology change at once.
    locked.last_seq, locked.last_seen_at, locked.reported_at = report.seq, now, now
    locked.engines = [e.__dict__ for e in report.engines]
    if not was_schedulable and topology_changed:
        locked.schedulable, locked.unschedulable_reason = True, ""
    delta = {"nodes": [live.node_payload(locked)], "gpus": [live.gpu_payload(row) for row in changed]}
    transaction.on_commit(lambda: live.push_report(delta, node_id=locked.node_id, topology_changed=topology_changed))
    return report.seq


def _gpu_state(row: Gpu) -> tuple[object, ...]:
    return (row.mem_used_bytes, row.mem_total_bytes, row.sm_util, row.temperature_c, row.healthy, row.allocatable,
            row.xid_errors, row.ecc_errors)


@transaction.atomic
def do_sweep_heartbeats(*, now: datetime, timeout_s: float | None = None) -> list[str]:
    """Mark every node whose agent has been silent longer than the timeout unschedulable."""
    timeout_s = settings.FLEXPIPE_HEARTBEAT_TIMEOUT_S if timeout_s is None else timeout_s
    limit = now - timedelta(seconds=timeout_s)
    silent = Node.objects.filter(schedulable=True, last_seen_at__lt=limit)
    ids = list(silent.values_list("pk", flat=True))
    if not ids:
        return []
    # Conditional on the same predicate: a report that lands meanwhile keeps its node schedulable.
    Node.objects.filter(pk__in=ids, schedulable=True, last_seen_at__lt=limit).update(
        schedulable=False, unschedulable_reason=f"no report for more than {timeout_s:g} s")
    marked = list(Node.objects.filter(pk__in=ids, schedulable=False).values_list("pk", "node_id"))
    for _, node_id in marked:
        record("fleet.node_unschedulable", actor=actor_of(system="heartbeat"), at=now,
               summary=f"{node_id}: no report for more than {timeout_s:g} s", data={"timeout_s": timeout_s})
    transaction.on_commit(lambda: live.push_nodes([pk for pk, _ in marked], topology_changed=True))
    return [node_id for _, node_id in marked]


@transaction.atomic
def do_issue_command(node: Node, *, key: str, kind: str, payload: dict[str, object], now: datetime,
                     deployment: str = "", transition_seq: int | None = None, step: str = "") -> AgentCommand:
    """Queue a command for an agent; the same key returns the command issued before."""
    cmd, created = AgentCommand.objects.get_or_create(
        key=key,
        defaults={"node": node, "kind": kind, "payload": payload, "deployment": deployment,
                  "transition_seq": transition_seq, "step": step, "created_at": now},
    )
    if created:
        transaction.on_commit(lambda: doorbell.ring(node.node_id))
    return cmd


def open_commands(node: Node, after: int) -> list[AgentCommand]:
    return list(AgentCommand.objects.filter(node=node, id__gt=after, state__in=AgentCommand.OPEN_STATES)
                .order_by("id")[:writes.POLL_LIMIT])


def node_and_open_commands(token: str, after: int) -> tuple[Node | None, list[AgentCommand]]:
    """A long poll's start: the token's node (its id and node_id) and open_commands, in one query."""
    if not token:
        return None, []
    return writes.node_with_open_commands(hash_token(token), after)


def mark_delivered(commands: list[AgentCommand], *, now: datetime) -> None:
    AgentCommand.objects.filter(pk__in=[c.pk for c in commands], state=AgentCommand.PENDING).update(
        state=AgentCommand.DELIVERED, delivered_at=now)


@transaction.atomic
def do_ack_command(node: Node, command_id: int, *, status: str, detail: str, result: dict[str, object],
                   now: datetime) -> AgentCommand:
    """Record an agent's answer. Repeating the same final answer is harmless; changing it is refused."""
    cmd = AgentCommand.objects.select_for_update().filter(pk=command_id, node=node).first()
    if cmd is None:
        if AgentCommand.objects.filter(pk=command_id).exists():
            raise Rejected(403, {"id": f"command {command_id} is another node's; this agent token is {node.node_id}'s"})
        raise Rejected(404, {"id": f"no command {command_id} for node {node.node_id}"})
    final = {"ok": AgentCommand.OK, "failed": AgentCommand.FAILED, "running": AgentCommand.RUNNING}[status]
    if status == "ok" and cmd.kind == NodeCommandKind.APPLY_HINTS.value:
        try:  # what the console keeps of a hint's answer is what the protocol says (console/fleet/hints.py)
            check_result(cmd.kind, result)
        except SchemaError as exc:
            raise Rejected(400, exc.errors) from exc
    if cmd.state in (AgentCommand.OK, AgentCommand.FAILED):
        if cmd.state != final:
            raise Rejected(409, {"status": f"command {command_id} was already acknowledged as {cmd.state}"})
        return cmd
    AgentCommand.objects.filter(pk=cmd.pk).update(state=final, acked_at=now, detail=detail, result=result)
    cmd.refresh_from_db()
    from console.fleet import signals  # late import: signals lets other apps react without a cycle

    transaction.on_commit(lambda: signals.command_acked.send(sender=AgentCommand, command=cmd))
    return cmd


__all__ = [
    "AgentRef",
    "Rejected",
    "Registration",
    "do_ack_command",
    "do_ingest_report",
    "do_issue_agent_token",
    "do_issue_command",
    "do_register_node",
    "do_sweep_heartbeats",
    "agent_for_token",
    "forget_agents",
    "hash_token",
    "mark_delivered",
    "node_for_token",
    "node_and_open_commands",
    "open_commands",
    "unknown_token",
]
