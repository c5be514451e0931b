"""The console's global correction loop: Celery beat's `gearbox.correct`, every FLEXPIPE_GLOBAL_LOOP_S.

Each run reads, per deployment, the routes of its routing table that take traffic (weight > 0, not
frozen) and what each plan's leader last reported of it (`Node.engines`: running, waiting, KV in
use, finished and slo_violations over the report's interval); steps the process's
scheduler.control.correction.GlobalCorrection (the rules are there); and sends the hints that are
due (changed, or half their ttl old) to the leaders as `apply_hints` commands
(console/fleet/hints.py). A report's finished and slo_violations are counted once, by the
report's time, however many runs read it.

The weight multipliers are applied where requests are routed: the gateway reads the newest live
hint per plan from the queued commands (console/gateway/routing.py `_hinted`), the simulated
fleet from its leaders' hint books (agents/sim/hints.py); the thresholds by the engines.

What it does not do: its inputs are as fresh as the agents' reports (FLEXPIPE_REPORT_INTERVAL_S,
or at once after a change), not 500 ms. The loop's memory (multipliers, thresholds, windows) lives in the worker process that runs it: a
worker that restarts starts from the engines' defaults, with versions from its wall clock (ms) so
that the agents take its hints as newer. With no worker or no beat nothing is sent, and every
engine is back at its own defaults one ttl later: the local loops keep running on their own.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from django.utils import timezone

from console.fleet.hints import do_send_hints, prune_hint_commands
from console.fleet.models import Node
from console.gearbox.models import Deployment
from scheduler.control.correction import GlobalCorrection, PlanSignal

_lock = threading.Lock()
_loop: GlobalCorrection | None = None
_counted: dict[tuple[str, str], datetime | None] = {}  # (node, plan) -> the report time whose counts went in
_pruned_s = [-float("inf")]  # when this process last pruned the old hint commands
PRUNE_EVERY_S = 60.0


def loop() -> GlobalCorrection:
    global _loop
    if _loop is None:
        _loop = GlobalCorrection(start_version=int(time.time() * 1000))
    return _loop


def reset() -> None:
    """Forget the loop's memory (tests)."""
    global _loop
    with _lock:
        _loop = None
        _counted.clear()
        _pruned_s[0] = -float("inf")


def _signal(plan_id: str, node: Node, report: Mapping[str, Any]) -> PlanSignal | None:
    fresh = _counted.get((node.node_id, plan_id)) != node.reported_at
    _counted[(node.node_id, plan_id)] = node.reported_at
    try:
        finished = int(report.get("finished") or 0) if fresh else 0
        return PlanSignal(plan_id, int(report.get("running") or 0), int(report.get("waiting") or 0),
                          kv_usage=float(report.get("kv_usage") or 0.0), finished=finished,
                          violated=min(finished, int(report.get("slo_violations") or 0)) if fresh else 0)
    except (TypeError, ValueError):
        return None  # a stored report that no longer reads (an older console's): the plan sits this one out


def correct(now_s: float | None = None) -> dict[str, object]:
    """One run (module docstring); returns what was sent, per deployment: {hints_version, imbalance, nodes}."""
    now_s = time.time() if now_s is None else now_s
    with _lock:
        if now_s - _pruned_s[0] >= PRUNE_EVERY_S:
            _pruned_s[0] = now_s
            prune_hint_commands(now=timezone.now())
        deployments = list(Deployment.objects.filter(deleting_since=None).order_by("name"))
        # Only the nodes that lead a routed plan, and only what a signal reads: this runs every
        # FLEXPIPE_GLOBAL_LOOP_S, and reading the whole fleet each time cost the worker a tenth of
        # a core at 1,000 nodes (issue 19).
        leading = {str(r["nodes"][0]) for dep in deployments for r in (dep.routing if isinstance(dep.routing, list) else [])
                   if isinstance(r, dict) and isinstance(r.get("nodes"), list) and r["nodes"]}
        nodes = {n.node_id: n for n in Node.objects.filter(node_id__in=leading).only("node_id", "engines", "reported_at")}
        out: dict[str, object] = {}
        for dep in deployments:
            signals: list[PlanSignal] = []
            leaders: dict[str, str] = {}
            for route in dep.routing if isinstance(dep.routing, list) else []:
                if not isinstance(route, dict) or route.get("frozen") or not route.get("weight"):
                    continue
                plan_id, names = route.get("plan_id"), route.get("nodes") or []
                node = nodes.get(str(names[0])) if names else None
                if not isinstance(plan_id, str) or node is None:
                    continue
                report = next((e for e in node.engines if isinstance(e, dict) and e.get("plan_id") == plan_id), None)
                sig = _signal(plan_id, node, report) if report is not None else None
                if sig is not None:
                    signals.append(sig)
                    leaders[plan_id] = node.node_id
            if not signals:
                continue
            g = loop()
            step = g.step(now_s, dep.name, signals)
            due = g.due(step, now_s)
            if not due:
                continue
            by_node: dict[str, list[dict[str, object]]] = defaultdict(list)
            for h in due:
                by_node[leaders[h.plan_id]].append(h.to_dict())
            do_send_hints(dep.name, step.hints_version, step.ttl_s, by_node, now=timezone.now())
            out[dep.name] = {"hints_version": step.hints_version, "imbalance": round(step.imbalance, 4),
                             "nodes": sorted(by_node)}
        return out


__all__ = ["correct", "loop", "reset"]
