"""What is left of a lost plan on its other nodes: released, and booked until they answer.

A plan can span several nodes (a pipeline over nodes). When one of them loses it - its agent came
back without it, or its report says the engine died (actions.lost_plans) - actions.drop_lost_plans
takes it out of the deployment's routing and gear. The other nodes still run their stages and
hold those GPUs' memory: nobody but the console can tell them to let go.

    do_release_lost_plans(dep, lost, *, version, now, actor)   drop_lost_plans: tell the others
    do_free_released_bookings(*, now, actor, deployment=None)  the tick: free what answered releases held
    kept_booked(dep)                                           the GPUs still awaited: off its own planner

Releasing (in drop_lost_plans' transaction, the deployment row locked): each other node of the plan
that still runs it - it answers (schedulable) and did not lose the plan itself - gets `release_plan`
with drain_timeout_s 0 (the plan's sequences died with its lost stage: nothing is left to drain),
audited as `gearbox.lost_plan_released`, one entry per node. Its key is
gearbox.lost/<deployment>/<plan_id>/<node_id>/<created>/<version>: a second look at the same drop
(the routing version it commits) issues nothing new, while a plan lost again after the gearbox
brought the same plan back (plan ids are content hashes), or a deployment made again under an old
name, gets a release of its own. The plan's bookings (GpuReservation) on the nodes that lost it, or
that no longer answer, are freed at once; those on a node told to release stay: its agent holds
that memory until it answers, so the GPUs stay booked - held, their bytes counted, for the other
deployments' planners (actions.held_gpus, booked_bytes) and kept off the deployment's own
(`kept_booked`: the loop's keep_off).

Freeing (each tick, before it reads what is held: console/gearbox/ticks.py): a booking kept for a
release goes once the release is acknowledged, or its ack failed (the agent did what it could; its
next report shows what memory is left), or its node no longer answers (the heartbeat marked it
unschedulable) - audited as `gearbox.lost_plan_freed` with which. The ack asks for a tick of the
deployment (console/gearbox/receivers.py), so that is at once. A booking of a plan the deployment
runs again (routed, current, or in a running transition) belongs to that plan now: left alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from django.db import transaction

from agents.protocol import CommandKind
from console.audit.chain import record
from console.fleet.actions import do_issue_command
from console.fleet.models import AgentCommand, Gpu, Node
from console.gearbox.models import ACTIVE_PHASES, Deployment, GpuReservation, Transition
from scheduler.plan import Gear

KEY = "gearbox.lost"  # the release commands' keys start with it (no transition issues them)
GEARBOX = "system:gearbox"


def _prefix(dep: Deployment) -> str:
    return f"{KEY}/{dep.name}/"


def _plan_nodes(dep: Deployment) -> dict[str, list[str]]:
    """plan_id -> its nodes (leader first), as the routing table says."""
    return {str(r["plan_id"]): [str(n) for n in r.get("nodes") or ()]
            for r in dep.routing or () if isinstance(r, dict) and r.get("plan_id")}


def do_release_lost_plans(dep: Deployment, lost: Mapping[str, Sequence[str]], *, version: int, now: datetime,
                          actor: str = GEARBOX) -> dict[str, list[str]]:
    """The lost plans `lost` (plan_id -> the nodes that lost it) leave the deployment: tell their other
    nodes to release them and free the rest of their bookings (module docstring). Call it in the
    transaction that drops them, with the deployment locked and its routing still listing them;
    `version` is the routing version the drop commits. Returns plan_id -> the nodes told."""
    on = _plan_nodes(dep)
    others = {n for pid, gone in lost.items() for n in on.get(pid, ()) if n not in gone}
    answering = {n.node_id: n for n in Node.objects.filter(node_id__in=others, schedulable=True)}
    told: dict[str, list[str]] = {}
    for pid in sorted(lost):
        for node_id in on.get(pid, ()):
            node = answering.get(node_id)
            if node is None or node_id in lost[pid]:
                continue
            gpus = sorted(GpuReservation.objects.filter(deployment=dep, plan_id=pid,
                                                        gpu_uuid__in=Gpu.objects.filter(node=node).values("uuid"))
                          .values_list("gpu_uuid", flat=True))
            cmd = do_issue_command(
                node, key=f"{_prefix(dep)}{pid}/{node_id}/{dep.created_at.timestamp():.6f}/{version}",
                kind=CommandKind.RELEASE_PLAN.value, now=now, deployment=dep.name, step="release",
                payload={"plan_id": pid, "deployment": dep.name, "drain_timeout_s": 0.0})
            told.setdefault(pid, []).append(node_id)
            record("gearbox.lost_plan_released", actor=actor, at=now, deployment=dep.name,
                   summary=f"{dep.name}: {pid} lost on {'/'.join(lost[pid])}; {node_id} is told to release its "
                           f"stage ({len(gpus)} GPU(s) stay booked until it answers)",
                   data={"plan_id": pid, "node_id": node_id, "lost_on": list(lost[pid]), "command_id": cmd.pk,
                         "gpus": gpus, "drain_timeout_s": 0.0, "routing_version": version})
    for pid in lost:
        rows = GpuReservation.objects.filter(deployment=dep, plan_id=pid)
        if told.get(pid):
            rows = rows.exclude(gpu_uuid__in=Gpu.objects.filter(node__node_id__in=told[pid]).values("uuid"))
        rows.delete()
    return told


def _alive(dep: Deployment) -> set[str]:
    """The plans the deployment runs or is bringing up: routed, current, or in a running transition."""
    ids = set(_plan_nodes(dep))
    gears = [dep.current_gear]
    for pair in Transition.objects.filter(deployment=dep, phase__in=ACTIVE_PHASES).values_list("from_gear", "to_gear"):
        gears += list(pair)
    for raw in gears:
        if raw:
            try:
                ids |= {p.plan_id for p in Gear.from_dict(raw).plans}
            except ValueError:
                continue
    return ids


@dataclass(frozen=True)
class Kept:
    """The bookings a lost plan's release holds on one node."""

    plan_id: str
    command: AgentCommand  # the newest release of that plan sent there
    gpus: tuple[str, ...]  # its GPUs still booked for the plan

    @property
    def freed_because(self) -> str | None:
        """Why the booking may go now (None: the release is still awaited)."""
        if self.command.state == AgentCommand.OK:
            return "acked"
        if self.command.state == AgentCommand.FAILED:
            return "failed"
        if not self.command.node.schedulable:
            return "node_lost"
        return None


def _kept(dep: Deployment) -> list[Kept]:
    """The deployment's bookings that a release of one of its lost plans holds, by (plan, node)."""
    alive = _alive(dep)
    rows = list(GpuReservation.objects.filter(deployment=dep).exclude(plan_id__in=sorted(alive))
                .values_list("plan_id", "gpu_uuid"))
    if not rows:
        return []
    node_of = dict(Gpu.objects.filter(uuid__in={u for _, u in rows}).values_list("uuid", "node__node_id"))
    newest: dict[tuple[str, str], AgentCommand] = {}
    for c in (AgentCommand.objects.filter(deployment=dep.name, key__startswith=_prefix(dep),
                                          created_at__gte=dep.created_at, kind=CommandKind.RELEASE_PLAN.value,
                                          payload__plan_id__in=sorted({p for p, _ in rows}))
              .select_related("node").order_by("id")):
        newest[(str(c.payload.get("plan_id")), c.node.node_id)] = c
    gpus: dict[tuple[str, str], list[str]] = {}
    for pid, u in rows:
        at = (pid, node_of.get(u, ""))
        if at in newest:
            gpus.setdefault(at, []).append(u)
    return [Kept(pid, newest[(pid, node_id)], tuple(sorted(us))) for (pid, node_id), us in sorted(gpus.items())]


def kept_booked(dep: Deployment) -> frozenset[str]:
    """The GPUs whose lost plan's release is still awaited: kept off the deployment's own planner."""
    return frozenset(u for k in _kept(dep) if k.freed_because is None for u in k.gpus)


def do_free_released_bookings(*, now: datetime, actor: str = GEARBOX, deployment: str | None = None) -> list[str]:
    """Free the bookings whose lost plan's release is done (module docstring), for every deployment
    or one; returns "plan_id@node_id" for each node freed."""
    names = Deployment.objects.filter(deleting_since__isnull=True).order_by("name").values_list("name", flat=True)
    if deployment is not None:
        names = names.filter(name=deployment)
    freed: list[str] = []
    for name in names:
        seen = Deployment.objects.filter(name=name).first()
        if seen is None or not any(k.freed_because for k in _kept(seen)):
            continue  # (the common case: nothing to free, no lock taken)
        with transaction.atomic():
            # the lock order of every gearbox write (ports._lock_deployment): the deployment row first
            dep = Deployment.objects.select_for_update().filter(name=name).first()
            if dep is None:
                continue
            for k in _kept(dep):
                why = k.freed_because
                if why is None:
                    continue
                # the delete claims the rows: a racing tick that frees them too deletes none, audits nothing
                n, _ = GpuReservation.objects.filter(deployment=dep, plan_id=k.plan_id, gpu_uuid__in=k.gpus).delete()
                if not n:
                    continue
                node_id = k.command.node.node_id
                freed.append(f"{k.plan_id}@{node_id}")
                said = {"acked": "acknowledged the release", "failed": "answered the release with a failure",
                        "node_lost": "no longer answers"}[why]
                record("gearbox.lost_plan_freed", actor=actor, at=now, deployment=name,
                       summary=f"{name}: {node_id} {said}; {len(k.gpus)} GPU(s) it held for lost {k.plan_id} are free",
                       data={"plan_id": k.plan_id, "node_id": node_id, "why": why, "command_id": k.command.pk,
                             "gpus": list(k.gpus)})
    return freed


__all__ = ["KEY", "Kept", "do_free_released_bookings", "do_release_lost_plans", "kept_booked"]
