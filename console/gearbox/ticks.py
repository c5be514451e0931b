"""The gearbox tick: one step of the control loop for every deployment (highest priority first).

A tick reads the fleet once (console.gearbox.snapshot), records the blocks' trajectories in the
fragment history (console.fleet.fragments), samples each deployment's load from its engines'
reports, then takes one step of scheduler.control.ControlLoop through its console driver
(console/gearbox/control.py: the database in, the actions out). The loop's rules - emergency
first, back-off folded, reports mirrored, staged switches, baseline bring-up, GPUs held across
deployments - are in one docstring, scheduler/control/loop.py. Fine-tune and batch jobs are
settled before the decisions and admitted onto what is left free after them (inference decides
first; console/gearbox/admission.py).
"""

from __future__ import annotations

import logging
from datetime import datetime

from django.conf import settings
from django.utils import timezone

from console.fleet import fragments
from console.gearbox import admission, lost_release, present
from console.gearbox.actions import do_record_load, do_record_serving, held_gpus
from console.gearbox.control import decide_all
from console.gearbox.lifecycle import finish_deletions
from console.gearbox.models import Deployment, Transition
from console.gearbox.snapshot import fleet_snapshot, load_sample
from scheduler.gearbox import Trigger

log = logging.getLogger(__name__)

TRIGGERS = {"periodic": Trigger.PERIODIC, "topology": Trigger.TOPOLOGY, "emergency": Trigger.PERIODIC,
            "ended": Trigger.PERIODIC}


def _load_settled(dep: Deployment, now: datetime) -> bool:
    """Its engines' arrival counts describe its load: no transition runs, and the last one ended a
    report interval ago (counts over an interval that straddles a switch - or the moment the
    first plan came up - undercount what the gateway offered and would shift the gear down)."""
    last = Transition.objects.filter(deployment=dep).order_by("-seq").values("phase", "finished_at").first()
    if last is None:
        return True
    if last["finished_at"] is None:
        return False
    return (now - last["finished_at"]).total_seconds() >= float(settings.FLEXPIPE_REPORT_INTERVAL_S)


def tick(*, trigger: str = "periodic", deployment: str | None = None, now: datetime | None = None) -> dict[str, object]:
    """Decide for every deployment (or one). Returns what it did, for logs and tests."""
    if trigger not in TRIGGERS:
        raise ValueError(f"trigger: must be one of {', '.join(TRIGGERS)}; got {trigger!r}")
    now = now or timezone.now()
    deleted = finish_deletions(now)
    try:
        base = fleet_snapshot(now)
    except ValueError as exc:  # reports that contradict each other: decide nothing on them
        log.warning("gearbox tick skipped: the fleet does not make a valid snapshot (%s)", exc)
        return {"skipped": str(exc)}
    jobs = admission.settle(base, now)  # done, crashed, past their deadline: before anyone decides
    lost_release.do_free_released_bookings(now=now, deployment=deployment)  # what lost plans' answered releases held
    held = held_gpus()
    engines = present.engine_reports()  # the engines' latest reports: serving history
    history = fragments.do_observe_blocks(base, now=now)  # every decision of this tick reads it
    decided, started, waiting = [], [], []
    deps = Deployment.objects.order_by("-priority", "name")
    if deployment is not None:
        deps = deps.filter(name=deployment)
    names = []
    for dep in deps:
        if dep.deleting_since is not None:
            continue
        do_record_serving(dep, present.serving(present.routed_plan_ids(dep), engines))
        if _load_settled(dep, now):
            sample = load_sample([r.get("plan_id", "") for r in dep.routing if isinstance(r, dict)], now)
            if sample is not None:
                do_record_load(dep, sample)
        names.append(dep.name)
    steps = decide_all(names, trigger=TRIGGERS[trigger], now=now, base=base, held=held, history=history)
    for name in names:
        done = steps.get(name)
        if done is None:
            continue
        if done.waiting_for_reports:
            waiting.append(name)
        if done.decision is not None:
            decided.append(f"{name}:{done.decision.outcome}")
        if done.transition is not None:
            started.append(f"{name}#{done.transition.seq}")
    jobs += admission.admit(base, now)
    out: dict[str, object] = {"trigger": trigger, "decided": decided, "started": started, "waiting": waiting}
    if jobs:
        out["jobs"] = jobs
    if deleted:
        out["deleted"] = deleted
    return out
