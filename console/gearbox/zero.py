"""Scale to zero and wake up, in the console (the control loop's rules 9b and 9; scheduler/pool/zero.py).

    do_scale_to_zero(dep, reason, *, now, actor)   the tick: rule 9b released the gear
    do_request_wake(name)                          the gateway: a request is held for it (cold start)
    released(dep)                                  the release is done: the agents freed the GPUs
    observe_zero(dep, now)                         the tick: a deployment back up leaves zero
    do_record_wake(dep, started, *, now, actor)    the tick: the wake-up's transition started
    kept_off(dep, now)                             the tick: GPUs it gave when it unloaded (rule 13)

Scaling to zero drains, as deleting does (lifecycle.py) - nothing admitted is lost: the routing
table is emptied (version + 1: the gateway routes nothing new there; its next request is held, see
console/gateway/views.py), each live node of each plan gets `release_plan` with the drain budget
(sequences finish there), the current gear is forgotten and `zero_since` set - audited as
`gearbox.scaled_to_zero`. The GPUs go back to the pool once the agents acknowledged the releases
and reported since (`released`: until then the loop's rule 6 waits, so a wake-up never prepares
on memory the old plans still hold).

Waking: the gateway holding a request sets `wake_requested_at` (a conditional update: the first
held request of a stay at zero, the one that counts a cold start) and asks for a tick of the
deployment; the loop's rule 9 brings the baseline up (`waiting` 1), audited as
`gearbox.waking_from_zero` with how long the request has waited. Once the gear is current again
`observe_zero` clears both marks. A wake-up that rolls back leaves them: the next tick tries again.

The same release unloads a deployment of lower priority that has nowhere to go when a higher one
takes its GPUs (the loop's rule 13): its audit entry names the taker and the GPUs it gave, and
`kept_off` keeps those from it for priority.UNLOAD_HOLD_S, so a tick of it alone does not bring
it back onto them before the taker switches there.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from console.audit.chain import record
from console.audit.models import AuditEntry
from console.fleet.actions import do_issue_command
from console.fleet.models import AgentCommand, Node
from console.gearbox import live
from console.gearbox.models import Deployment
from scheduler.pool.priority import UNLOAD_HOLD_S

KEY = "gearbox.zero"  # the release commands' keys start with it (no transition issues them)


def _prefix(dep: Deployment) -> str:
    assert dep.zero_since is not None  # noqa: S101 - only at zero
    return f"{KEY}/{dep.name}/{dep.zero_since.timestamp():.6f}/"


def do_scale_to_zero(deployment: Deployment, reason: str, *, now: datetime, actor: str,
                     gives_to: str | None = None, given: tuple[str, ...] = ()) -> bool:
    """Drain and release the deployment's gear (module docstring); False when it changed meanwhile.
    `gives_to`, `given`: it unloads for a higher priority (the loop's rule 13), giving these GPUs -
    kept from it for priority.UNLOAD_HOLD_S (`kept_off`)."""
    from console.gearbox.actions import _active, _locked
    from console.gearbox.lifecycle import _live_nodes

    with transaction.atomic():
        dep = _locked(deployment)
        if dep.current_gear is None or dep.deleting_since is not None or _active(dep) is not None:
            return False
        running = _live_nodes(dep)
        before = {"gear": dep.current_gear, "version": dep.routing_version,
                  "routes": [r.get("plan_id") for r in dep.routing if isinstance(r, dict)]}
        dep.routing, dep.routing_version = [], dep.routing_version + 1
        dep.current_gear, dep.zero_since, dep.wake_requested_at, dep.updated_at = None, now, None, now
        dep.save(update_fields=["routing", "routing_version", "current_gear", "zero_since", "wake_requested_at",
                                "updated_at"])
        budget = float(settings.FLEXPIPE_DRAIN_BUDGET_S)
        for plan_id, nodes in sorted(running.items()):
            for node in Node.objects.filter(node_id__in=nodes).order_by("node_id"):
                do_issue_command(node, key=f"{_prefix(dep)}{plan_id}/{node.node_id}", kind="release_plan", now=now,
                                 deployment=dep.name, step="release",
                                 payload={"plan_id": plan_id, "deployment": dep.name, "drain_timeout_s": budget})
        record("gearbox.scaled_to_zero", actor=actor, at=now, deployment=dep.name,
               summary=f"{dep.name} scaled to zero: {reason}; draining {len(running)} plan(s), then its GPUs are free",
               before=before, after={"gear": None, "version": dep.routing_version, "routes": []},
               data={"reason": reason, "idle_to_zero_s": dep.idle_to_zero_s,
                     "plans": {p: n for p, n in sorted(running.items())}, "drain_budget_s": budget,
                     **({"gives_to": gives_to, "given": list(given)} if gives_to is not None else {})})
        name = dep.name
        transaction.on_commit(lambda: live.push_routing(name))
    return True


def released(dep: Deployment) -> bool:
    """The release to zero is done: every release_plan answered (or its node gone) and each node
    that answered reported since (its memory is the new picture)."""
    if dep.zero_since is None:
        return True
    for cmd in AgentCommand.objects.filter(deployment=dep.name, key__startswith=_prefix(dep)).select_related("node"):
        if cmd.state in AgentCommand.OPEN_STATES:
            if cmd.node.schedulable:
                return False
            continue
        reported = cmd.node.reported_at
        if cmd.acked_at is not None and cmd.node.schedulable and (reported is None or reported < cmd.acked_at):
            return False
    return True


def kept_off(dep: Deployment, now: datetime) -> frozenset[str]:
    """The GPUs a deployment that unloaded for a higher priority gave, while the hold lasts (the
    loop's `keep_off`; what its scaled_to_zero audit entry says it gave)."""
    if not at_zero(dep):
        return frozenset()
    entry = (AuditEntry.objects.filter(deployment=dep.name, event_type="gearbox.scaled_to_zero")
             .order_by("-seq").only("at", "body").first())
    if entry is None or (now - entry.at).total_seconds() >= UNLOAD_HOLD_S:
        return frozenset()
    return frozenset(str(u) for u in json.loads(entry.body).get("data", {}).get("given") or ())


def do_request_wake(name: str) -> bool:
    """A request is held for a deployment at zero: mark it and ask for a tick. True for the first
    held request of this stay at zero (the cold start); telemetry, not audited (the wake-up is)."""
    from console.gearbox import coalesce, tasks

    now = timezone.now()
    first = Deployment.objects.filter(name=name, zero_since__isnull=False, current_gear__isnull=True,
                                      wake_requested_at__isnull=True).update(wake_requested_at=now) == 1
    if first:
        coalesce.request_tick(tasks.tick, trigger="periodic", deployment=name, countdown_s=0)
    return first


def at_zero(dep: Deployment) -> bool:
    return dep.zero_since is not None and dep.current_gear is None


def observe_zero(dep: Deployment) -> None:
    """A deployment whose gear is current again is no longer at zero: clear both marks."""
    if dep.zero_since is not None and dep.current_gear is not None:
        Deployment.objects.filter(pk=dep.pk).update(zero_since=None, wake_requested_at=None)
        dep.zero_since = dep.wake_requested_at = None


def do_record_wake(dep: Deployment, started: Any, *, now: datetime, actor: str) -> None:
    """The audit entry of a wake-up whose transition started (call inside its transaction)."""
    held_s = (now - dep.wake_requested_at).total_seconds() if dep.wake_requested_at is not None else None
    zero_s = (now - dep.zero_since).total_seconds() if dep.zero_since is not None else None
    record("gearbox.waking_from_zero", actor=actor, at=now, deployment=dep.name, transition_seq=started.seq,
           summary=f"{dep.name} wakes from zero: "
                   + (f"a request is held for {held_s:.1f} s" if held_s is not None
                      else "its bounds no longer let it rest at zero") + f"; transition #{started.seq} "
                   "brings its gear up",
           data={"held_s": held_s, "at_zero_s": zero_s, "seq": started.seq})


__all__ = ["KEY", "at_zero", "do_record_wake", "do_request_wake", "do_scale_to_zero", "kept_off", "observe_zero",
           "released"]
