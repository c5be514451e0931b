"""A deployment's life through the API and the console: created from a registry version, changed,
deleted (drained first). The scenario loader (manage.py load_scenario_deployments) creates the
scenarios' deployments through actions.do_sync_deployment instead.

    do_create_deployment(*, name, model_version, ttft_ms, tpot_ms, ..., baseline_gear, actor)
    do_change_deployment(deployment, changes, *, actor)   SLO, priority, replica bounds, idle time
    do_delete_deployment(deployment, *, actor)            "deleted" now, or "draining" first (admin)
    finish_deletions(now)                                 the tick: delete what has drained

Creating (operator): the model version comes from the registry - one that may be loaded (verified,
or awaiting its first agent's hash) - and the model is planned with its spec (console/registry/
specs.spec_for: the catalog, or the version's own config.json). The baseline gear is an operator's
spec (console/gearbox/override.py's format) or "auto": the planner's best gear that fits the fleet
now; either is checked against invariant 4 as an override is (override.resolve_gear). Every field
is checked before anything is stored: a bad one is a 400 naming it, and nothing is stored (the row
and its audit entry are one transaction). The gearbox brings the baseline up on its next tick,
which the creation asks for at once.

Changing (operator): the SLO, priority, replica bounds and idle time, checked together (min_replicas
<= max_replicas after the change; scaling to zero needs min_replicas 0), audited with before and
after. Nothing switches because of it; the next decision weighs the new values.

Deleting - nothing admitted is lost silently (DESIGN.md invariant 1):

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

import math
import re
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from console.audit.chain import record
from console.fleet.actions import Rejected, do_issue_command
from console.fleet.models import AgentCommand, Node
from console.gearbox import live
from console.gearbox.actions import _active, _locked, _who
from console.gearbox.models import Deployment
from console.registry.specs import spec_for

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



# --- creating and changing -----------------------------------------------------------------------------
NEW_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
LOADABLE = ("verified", "awaiting_agent")  # (as console/gearbox/rollout.py: what may be loaded)
PRIORITY_RANGE = (-1000, 1000)
MAX_REPLICAS = 256
CHANGEABLE = ("ttft_ms", "tpot_ms", "priority", "min_replicas", "max_replicas", "idle_to_zero_s")
DEFAULTS: dict[str, Any] = {"priority": 0, "min_replicas": 1, "max_replicas": 8, "idle_to_zero_s": None}


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_fields(v: Mapping[str, Any]) -> dict[str, str]:
    """The errors of the SLO, priority, replica and idle fields of `v` (all of them present), by field."""
    errors: dict[str, str] = {}
    for field in ("ttft_ms", "tpot_ms"):
        x = v[field]
        if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x) or x <= 0:
            errors[field] = f"must be a number of milliseconds > 0; got {x!r}"
    low, high = PRIORITY_RANGE
    if not _integer(v["priority"]) or not low <= v["priority"] <= high:
        errors["priority"] = f"must be an integer from {low} to {high} (higher is served first); got {v['priority']!r}"
    lo, hi = v["min_replicas"], v["max_replicas"]
    if not _integer(lo) or not 0 <= lo <= MAX_REPLICAS:
        errors["min_replicas"] = f"must be an integer from 0 to {MAX_REPLICAS}; got {lo!r}"
    if not _integer(hi) or not 1 <= hi <= MAX_REPLICAS:
        errors["max_replicas"] = f"must be an integer from 1 to {MAX_REPLICAS}; got {hi!r}"
    if not errors.keys() & {"min_replicas", "max_replicas"} and lo > hi:
        errors["min_replicas"] = f"must be at most max_replicas ({hi}); got {lo}"
    idle = v["idle_to_zero_s"]
    if idle is not None:
        if isinstance(idle, bool) or not isinstance(idle, int | float) or not math.isfinite(idle) or idle <= 0:
            errors["idle_to_zero_s"] = f"must be a number of seconds > 0, or null (never scale to zero); got {idle!r}"
        elif _integer(lo) and lo > 0:
            errors["idle_to_zero_s"] = (f"scaling to zero needs min_replicas 0 (it is {lo}): set min_replicas to 0, "
                                        "or idle_to_zero_s to null")
    return errors


def _version(raw: object) -> Any:
    from console.registry.models import ModelVersion

    if not _integer(raw) or not 1 <= raw < 2**62:  # type: ignore[operator]
        raise Rejected(400, {"model_version": f"must be a registry version's id (an integer >= 1); got {raw!r}"})
    v = ModelVersion.objects.filter(pk=raw).first()
    if v is None:
        raise Rejected(400, {"model_version": f"no model version {raw} in the registry"})
    if v.status not in LOADABLE:
        raise Rejected(400, {"model_version": f"{v.name} {v.version} is {v.status}: only a verified version (or "
                                              "one awaiting its first agent's hash) can be deployed"})
    try:
        spec_for(v)
    except ValueError as exc:
        raise Rejected(400, {"model_version": str(exc)}) from None
    return v


def _baseline(dep: Deployment, raw: object) -> tuple[Any, str]:
    """The baseline gear `raw` names ("auto" or a spec), checked on the fleet now; errors name baseline_gear."""
    from console.gearbox.override import resolve_gear

    try:
        if raw == "auto":
            return resolve_gear(dep, gear_id="auto", spec=None, allow_auto=True)
        if not isinstance(raw, dict):
            raise Rejected(400, {"baseline_gear": '"auto" (the planner chooses) or a gear spec: '
                                                  '{"plans": [{"stages": [{"gpus": ["node/0", ...]}]}]}'})
        return resolve_gear(dep, gear_id=None, spec=raw)
    except Rejected as exc:
        renamed = {("baseline_gear" + k[len("spec"):] if k.startswith("spec") else "baseline_gear"): why
                   for k, why in exc.errors.items()}
        raise Rejected(400 if exc.status == 409 else exc.status, renamed) from None


def do_create_deployment(*, name: object, model_version: object, ttft_ms: object, tpot_ms: object,
                         baseline_gear: object = "auto", priority: object = 0, min_replicas: object = 1,
                         max_replicas: object = 8, idle_to_zero_s: object = None, mode: object = Deployment.AUTO,
                         latency_critical: object = False, actor: Any) -> Deployment:
    """A new deployment of a registry version (module docstring). Rejected naming the field; nothing stored."""
    from console.gearbox import tasks

    who, user = _who(actor)
    values: dict[str, Any] = {"ttft_ms": ttft_ms, "tpot_ms": tpot_ms, "priority": priority, "min_replicas": min_replicas,
              "max_replicas": max_replicas, "idle_to_zero_s": idle_to_zero_s}
    errors = _check_fields(values)
    if not isinstance(name, str) or not NEW_NAME_RE.fullmatch(name):
        errors["name"] = ("must be 1 to 64 letters, digits, '.', '_' or '-', starting with a letter or a digit; "
                          f"got {str(name)[:80]!r}")
    if mode not in (Deployment.AUTO, Deployment.ADVISORY):
        errors["mode"] = f"must be auto or advisory (pin it once it runs); got {str(mode)[:40]!r}"
    if not isinstance(latency_critical, bool):
        errors["latency_critical"] = "must be true or false"
    try:
        version = _version(model_version)
    except Rejected as exc:
        errors.update(exc.errors)
    if errors:
        raise Rejected(400, errors)
    assert isinstance(name, str)
    if Deployment.objects.filter(name=name).exists():
        raise Rejected(409, {"name": f"a deployment {name!r} exists already: change it (PATCH) or pick another name"})
    now = timezone.now()
    values = {k: (float(v) if k in ("ttft_ms", "tpot_ms") or (k == "idle_to_zero_s" and v is not None) else v)
              for k, v in values.items()}
    dep = Deployment(name=name, model_name=version.name, model_version=version, mode=mode,
                     latency_critical=latency_critical, baseline_by=who, created_by=user, created_at=now,
                     updated_at=now, baseline_gear={}, **values)
    gear, how = _baseline(dep, baseline_gear)
    dep.baseline_gear = gear.to_dict()
    with transaction.atomic():
        try:
            with transaction.atomic():  # (a savepoint: another request may have taken the name meanwhile)
                dep.save(force_insert=True)
        except IntegrityError:
            raise Rejected(409, {"name": f"a deployment {name!r} exists already"}) from None
        record("gearbox.deployment_created", actor=who, user=user, at=now, deployment=name,
               summary=f"{name}: {version.name} {version.version}, baseline {gear.shape()} ({how}), "
                       f"priority {dep.priority}, replicas {dep.min_replicas}-{dep.max_replicas}",
               after={**values, "model_version": version.version, "mode": mode, "baseline_gear_id": gear.gear_id,
                      "latency_critical": latency_critical},
               data={"model_version_id": version.pk, "sha256": version.sha256, "how": how})
        transaction.on_commit(lambda: live.push_routing(name))  # the pages list it at once
        transaction.on_commit(lambda: tasks.enqueue(tasks.tick, trigger="periodic", deployment=name))
    return dep


def do_change_deployment(deployment: Deployment | str, changes: Mapping[str, Any], *, actor: Any) -> Deployment:
    """Change the SLO, priority, replica bounds or idle time (module docstring); audited, nothing switches."""
    who, user = _who(actor)
    unknown = sorted(set(changes) - set(CHANGEABLE))
    if unknown:
        raise Rejected(400, {unknown[0][:100]: f"cannot be changed here; changeable: {', '.join(CHANGEABLE)}"})
    with transaction.atomic():
        dep = _locked(deployment)
        if dep.deleting_since is not None:
            raise Rejected(409, {"deployment": f"{dep.name} is being deleted (drained)"})
        before = {k: getattr(dep, k) for k in CHANGEABLE}
        after = {**before, **changes}
        errors = _check_fields(after)
        if errors:
            raise Rejected(400, errors)
        after = {k: (float(v) if k in ("ttft_ms", "tpot_ms") or (k == "idle_to_zero_s" and v is not None) else v)
                 for k, v in after.items()}
        changed = [k for k in CHANGEABLE if after[k] != before[k]]
        if not changed:
            return dep
        for k in changed:
            setattr(dep, k, after[k])
        dep.updated_at = timezone.now()
        dep.save(update_fields=[*changed, "updated_at"])
        record("gearbox.deployment_changed", actor=who, user=user, at=dep.updated_at, deployment=dep.name,
               summary=f"{dep.name}: " + ", ".join(f"{k} {before[k]} -> {after[k]}" for k in changed),
               before={k: before[k] for k in changed}, after={k: after[k] for k in changed})
        name = dep.name
        transaction.on_commit(lambda: live.push_routing(name))
    return dep


__all__ = ["CHANGEABLE", "DEFAULTS", "do_change_deployment", "do_create_deployment", "do_delete_deployment",
           "finish_deletions"]
