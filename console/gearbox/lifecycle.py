"""Deleting a deployment, drained first (admin). Creating and changing deployments through the API is
a later step; today the scenario loader creates them (manage.py load_scenario_deployments).

    do_delete_deployment(deployment, *, actor)   "deleted" now, or "draining" first
    finish_deletions(now)                        the tick: delete what has drained

Nothing admitted is lost silently (DESIGN.md invariant 1):

* a deployment whose plans run on no agent that answers (nothing runs yet, or a previous run's
  simulator is gone and its nodes missed the heartbeat) is deleted at once;
* otherwise it is drained: its routing table is emptied (version + 1: the gateway and the agents
  stop sending it new requests), each live node of each of its plans gets `release_plan` with the
  drain budget (sequences finish there; what cannot is ended with an explicit error), the gearbox
  decides nothing for it any more, and the row is deleted once every release was acknowledged,
  or its node went away, or the budget and the step timeout have passed (then audited as such).

Refused (409): while a transition runs (wait for it to end). Deleting again while it drains is a
no-op. The audit log keeps every entry of the deployment (it is append-only); its decisions,
transitions and bookings go with the row.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from console.audit.chain import record
from console.fleet.actions import Rejected, do_issue_command
from console.fleet.models import AgentCommand, Node
from console.gearbox import live
from console.gearbox.actions import _active, _locked, _who
from console.gearbox.models import Deployment

KEY = "gearbox.delete"  # the release commands' keys start with it (no transition issues them)


def _live_nodes(dep: Deployment) -> dict[str, list[str]]:
    """plan_id -> the nodes that run it and still answer (schedulable: within the heartbeat)."""
    on: dict[str, list[str]] = {}
    for r in dep.routing or ():
        if isinstance(r, dict) and r.get("plan_id"):
            on[str(r["plan_id"])] = [str(n) for n in r.get("nodes") or ()]
    alive = set(Node.objects.filter(node_id__in={n for ns in on.values() for n in ns}, schedulable=True)
                .values_list("node_id", flat=True))
    return {pid: [n for n in nodes if n in alive] for pid, nodes in on.items() if any(n in alive for n in nodes)}


def do_delete_deployment(deployment: Deployment | str, *, actor: Any) -> str:
    """Delete now ("deleted") or drain first ("draining"); see the module docstring."""
    from console.accounts.roles import ADMIN, has_role

    who, user = _who(actor)
    if user is not None and not has_role(user, ADMIN):
        raise Rejected(403, {"actor": "deleting a deployment needs the admin role"})
    now = timezone.now()
    with transaction.atomic():
        dep = _locked(deployment)
        if dep.deleting_since is not None:
            return "draining"
        active = _active(dep)
        if active is not None:
            raise Rejected(409, {"deployment": f"transition #{active.seq} of {dep.name} runs ({active.phase}); "
                                               "delete it once that ended"})
        running = _live_nodes(dep)
        if not running:
            _delete(dep, who, user, now, "nothing of it runs on an agent that answers")
            return "deleted"
        before = {"version": dep.routing_version, "routes": [r.get("plan_id") for r in dep.routing]}
        dep.routing, dep.routing_version = [], dep.routing_version + 1
        dep.deleting_since, dep.emergency_requested_at, dep.updated_at = now, None, now
        dep.save(update_fields=["routing", "routing_version", "deleting_since", "emergency_requested_at",
                                "updated_at"])
        budget = float(settings.FLEXPIPE_DRAIN_BUDGET_S)
        for plan_id, nodes in sorted(running.items()):
            for node in Node.objects.filter(node_id__in=nodes).order_by("node_id"):
                do_issue_command(node, key=f"{KEY}/{dep.name}/{dep.created_at.timestamp():.6f}/{plan_id}/{node.node_id}",
                                 kind="release_plan", now=now, deployment=dep.name, step="release",
                                 payload={"plan_id": plan_id, "deployment": dep.name, "drain_timeout_s": budget})
        record("gearbox.deployment_draining", actor=who, user=user, at=now, deployment=dep.name,
               summary=f"{dep.name}: deletion asked; draining {len(running)} plan(s) first (new requests stop now)",
               before=before, after={"version": dep.routing_version, "routes": []},
               data={"plans": {p: n for p, n in sorted(running.items())}, "drain_budget_s": budget})
        name = dep.name
        transaction.on_commit(lambda: live.push_routing(name))
    return "draining"


def _delete(dep: Deployment, who: str, user: Any, now: datetime, why: str) -> None:
    name = dep.name
    record("gearbox.deployment_deleted", actor=who, user=user, at=now, deployment=name,
           summary=f"{name} deleted ({why})",
           before={"model_name": dep.model_name, "mode": dep.mode, "current_gear": bool(dep.current_gear)},
           data={"why": why})
    dep.delete()
    transaction.on_commit(lambda: live.push_routing(name))


def _release_commands(dep: Deployment) -> Any:
    return AgentCommand.objects.filter(deployment=dep.name,
                                       key__startswith=f"{KEY}/{dep.name}/{dep.created_at.timestamp():.6f}/")


def finish_deletions(now: datetime | None = None) -> list[str]:
    """Delete each draining deployment whose plans are released (or whose wait is over); their names."""
    now = now or timezone.now()
    wait = timedelta(seconds=float(settings.FLEXPIPE_DRAIN_BUDGET_S) + float(settings.FLEXPIPE_STEP_TIMEOUT_S))
    done = []
    for name in Deployment.objects.filter(deleting_since__isnull=False).values_list("name", flat=True):
        with transaction.atomic():
            dep = Deployment.objects.select_for_update().filter(name=name, deleting_since__isnull=False).first()
            if dep is None:
                continue
            pending = [c for c in _release_commands(dep).select_related("node")
                       if c.state in AgentCommand.OPEN_STATES and c.node.schedulable]
            if pending and now - dep.deleting_since < wait:
                continue
            why = ("its plans are released" if not pending else
                   f"{len(pending)} release(s) unanswered after {wait.total_seconds():g} s: "
                   + ", ".join(sorted(f"{c.payload.get('plan_id')} on {c.node.node_id}" for c in pending)))
            _delete(dep, "system:gearbox", None, now, why)
            done.append(name)
    return done


__all__ = ["do_delete_deployment", "finish_deletions"]
