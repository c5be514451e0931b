"""How deployments, gears, plans, transitions and decisions look to operators: one shape for all.

The REST API (api.py), the pages (views.py), their websockets (consumers.py) and the metrics
(console/metrics/gearbox.py) all read through these functions, so a page and the API never
disagree on a field. Read-only: nothing here writes. This module holds the times, the fleet, the
deployments and what each page and websocket sends; the gears and plans (present_gears.py), the
transitions (present_transitions.py), the decisions (present_decisions.py), TWU (present_twu.py)
and the operator controls (present_controls.py) live beside it, and it re-exports the first four,
so callers import only `console.gearbox.present`.

* `FleetView` is the fleet as these payloads need it, read once per request or push: each GPU's
  node and index, the atomic blocks (scheduler.topology.partition over the gearbox's own
  fleet -> Snapshot conversion) and why each left-out GPU is out, and the engines' latest reports
  by plan.
* A deployment's `health` is one of idle (nothing runs yet), ok, switching (a transition runs) or
  degraded (its gear lost GPUs, its engines report P95 latencies above the SLO, or an emergency
  downshift is pending), with the reasons in words.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.utils import timezone

from console.gearbox.models import ACTIVE_PHASES, Decision, Deployment, Job, Transition
from console.gearbox.names import load_names, names_from, readable
from scheduler.plan import Gear, Plan
from scheduler.topology import Snapshot

HEALTH_STATES = ("idle", "scaled to zero", "ok", "switching", "degraded")


# --- times -----------------------------------------------------------------------------------------
def iso(at: datetime | None) -> str | None:
    return at.astimezone(UTC).isoformat().replace("+00:00", "Z") if at is not None else None


def seconds_between(start: datetime | None, end: datetime | None) -> float | None:
    if start is None or end is None:
        return None
    return round(max(0.0, (end - start).total_seconds()), 3)


# --- the fleet -------------------------------------------------------------------------------------
@dataclass
class FleetView:
    """The fleet as the payloads need it (module docstring). `error` is set when the reports do not
    make a valid snapshot: blocks are then unknown (None), not empty."""

    gpus: dict[str, dict[str, Any]]  # uuid -> node, index, model, state
    blocks: list[dict[str, Any]] | None  # atomic blocks: id, node, rack, gpu model, GPUs, link
    block_of: dict[str, str]  # uuid -> block id
    excluded: dict[str, str]  # uuid -> why it is in no block
    engines: dict[str, list[dict[str, Any]]]  # plan id -> [latest EngineReport + node, reported_at]
    error: str = ""
    snapshot: Snapshot | None = None  # what the blocks were partitioned from (None: not built, or invalid)

    @property
    def names(self) -> dict[str, str]:
        """uuid -> node/index of every present GPU (console/gearbox/names.py)."""
        cached: dict[str, str] | None = self.__dict__.get("_names")
        if cached is None:
            cached = self.__dict__["_names"] = names_from(self.gpus)
        return cached


def fleet_view(now: datetime | None = None, *, with_blocks: bool = True) -> FleetView:
    from console.fleet.models import gpu_state
    from console.gearbox.snapshot import fleet_snapshot, node_parts
    from scheduler.topology import partition

    now = now or timezone.now()
    # The GPUs from the snapshot's per-node cache, which re-reads only the nodes that reported since
    # (console.gearbox.snapshot._NodeCache): reading all 8,000 GPU rows again for every Overview push
    # was half of its time at 1,000 nodes (issue 19), and the snapshot below reads the same parts.
    parts = node_parts()
    gpus = {g.uuid: {"node": g.node_id, "index": g.index, "model": g.model,
                     "state": gpu_state(healthy=g.healthy, allocatable=g.schedulable,
                                        node_schedulable=part.node.schedulable)}
            for part in parts for g, _spec in part.gpus}
    engines = engine_reports()
    blocks: list[dict[str, Any]] | None = None
    block_of: dict[str, str] = {}
    excluded: dict[str, str] = {}
    error = ""
    snapshot: Snapshot | None = None
    if with_blocks:
        try:
            part = partition(snap := fleet_snapshot(now, parts=parts))
        except ValueError as exc:
            error = f"the reports do not make a valid snapshot: {exc}"
        else:
            snapshot = snap
            blocks = [{"id": b.id, "node": b.node_id, "rack": b.rack, "gpu_model": b.gpu_model,
                       "gpus": list(b.gpu_uuids), "link": b.link_kind,
                       "tp_link_gbps": round(b.tp_link_bytes_per_s * 8 / 1e9, 1),
                       "mem_free_bytes": sum(b.mem_free_bytes)} for b in part.blocks]
            block_of = {u: b.id for b in part.blocks for u in b.gpu_uuids}
            excluded = dict(part.excluded)
    return FleetView(gpus, blocks, block_of, excluded, engines, error, snapshot)


def engine_reports() -> dict[str, list[dict[str, Any]]]:
    """The engines' latest reports by plan id, each with its node and when it reported (FleetView.engines).

    Alone, for the tick: it reads only the nodes' engine lists, not the fleet's GPUs."""
    from console.fleet.models import Node

    engines: dict[str, list[dict[str, Any]]] = {}
    for node_id, reports, seen in Node.objects.exclude(engines=[]).values_list("node_id", "engines", "last_seen_at"):
        for e in reports if isinstance(reports, list) else []:
            if isinstance(e, dict) and e.get("plan_id"):
                engines.setdefault(str(e["plan_id"]), []).append({**e, "node": node_id, "reported_at": iso(seen)})
    return engines


def serving(plan_ids: Iterable[str], engines: Mapping[str, list[dict[str, Any]]]) -> dict[str, Any] | None:
    """What the engines of these plans last reported (`engines`: engine_reports()), summed (rates,
    queues) or worst (latencies)."""
    reports = [r for p in plan_ids for r in engines.get(p, [])]
    if not reports:
        return None

    def total(key: str) -> float:
        return round(sum(float(r.get(key) or 0) for r in reports), 3)

    def worst(key: str) -> float | None:
        values = [float(r[key]) for r in reports if isinstance(r.get(key), int | float)]
        return round(max(values), 3) if values else None

    times = [r["reported_at"] for r in reports if r.get("reported_at")]
    return {"tokens_per_s": total("tokens_per_s"), "running": int(total("running")), "waiting": int(total("waiting")),
            "arrivals": int(total("arrivals")), "finished": int(total("finished")),
            "kv_usage": worst("kv_usage"), "ttft_p50_ms": worst("ttft_p50_ms"), "ttft_p95_ms": worst("ttft_p95_ms"),
            "tpot_p50_ms": worst("tpot_p50_ms"), "tpot_p95_ms": worst("tpot_p95_ms"),
            "reported_at": max(times) if times else None, "engines": len(reports)}


def gpu_holders(deployments: Iterable[Deployment], active: Mapping[int, Transition]) -> dict[str, list[dict[str, Any]]]:
    """uuid -> what runs there: [{deployment, plan shape, stage, role: serving | preparing}], and the
    jobs holding GPUs: [{job, role: job | yielding}]."""
    out: dict[str, list[dict[str, Any]]] = {}

    def mark(gear: Gear | None, name: str, role: str) -> None:
        for plan in gear.plans if gear is not None else ():
            for i, stage in enumerate(plan.all_stages):
                for u in stage.gpu_uuids:
                    out.setdefault(u, []).append({"deployment": name, "plan": plan.shape(), "stage": i,
                                                  "layers": [stage.layer_start, stage.layer_end], "role": role})

    for d in deployments:
        current = parse_gear(d.current_gear)
        mark(current, d.name, "serving")
        t = active.get(d.pk)
        target = parse_gear(t.to_gear) if t is not None else None
        if target is not None and (current is None or target.gear_id != current.gear_id):
            kept = set(current.plans) if current is not None else set()
            mark(Gear(target.model, tuple(p for p in target.plans if p not in kept),
                      tuple(w for p, w in zip(target.plans, target.weights, strict=True) if p not in kept))
                 if kept else target, d.name, "preparing")
    # fine-tune and batch jobs hold whole GPUs (scheduler/pool/jobs.py): the heatmap says whose
    for job in Job.objects.filter(state__in=Job.HOLDING).only("name", "state", "gpu_uuids"):
        for u in job.gpu_uuids:
            out.setdefault(str(u), []).append({"job": job.name, "role": "yielding" if job.state == Job.YIELDING
                                               else "job"})
    return out


# --- deployments -----------------------------------------------------------------------------------
def model_versions(deployments: Iterable[Deployment]) -> dict[int, dict[str, Any]]:
    """deployment pk -> the registry version it serves (its plans load it, the gateway tokenizes
    with it); only a rollout changes it (console/gearbox/rollout.py)."""
    from console.registry.models import ModelVersion

    ids = {d.model_version_id for d in deployments if d.model_version_id}
    rows = {r["id"]: r for r in ModelVersion.objects.filter(pk__in=ids).values(
        "id", "version", "sha256", "status", "engine", "tokenizer")}
    return {d.pk: rows[d.model_version_id] for d in deployments if d.model_version_id in rows}


def active_transitions(deployments: Sequence[Deployment]) -> dict[int, Transition]:
    rows = Transition.objects.filter(deployment__in=[d.pk for d in deployments], phase__in=ACTIVE_PHASES)
    return {t.deployment_id: t for t in rows}


def pending_decisions(deployments: Sequence[Deployment]) -> dict[int, int]:
    rows = Decision.objects.filter(deployment__in=[d.pk for d in deployments], approval=Decision.PENDING)
    return dict(rows.order_by("id").values_list("deployment_id", "id"))


def health(dep: Deployment, active: Transition | None, fleet: FleetView,
           served: Mapping[str, Any] | None) -> dict[str, Any]:
    reasons: list[str] = []
    degraded = False
    current = parse_gear(dep.current_gear)
    if dep.emergency_requested_at is not None:
        degraded = True
        reasons.append(f"emergency downshift requested by {dep.emergency_actor}: {dep.emergency_reason}")
    elif dep.mode == Deployment.EMERGENCY:
        reasons.append(f"emergency: holds its gear until an operator releases it ({dep.emergency_actor}: "
                       f"{dep.emergency_reason})")
    if current is not None and fleet.blocks is not None:
        lost = [f"GPU {fleet.names.get(u, u)} is out ({readable(fleet.excluded.get(u, 'not reported'), fleet.names)})"
                for u in current.gpu_uuids if u not in fleet.block_of]
        if lost:
            degraded = True
            reasons.extend(lost[:4] + ([f"... and {len(lost) - 4} more"] if len(lost) > 4 else []))
    if served is not None:
        for key, slo, what in (("ttft_p95_ms", dep.ttft_ms, "TTFT"), ("tpot_p95_ms", dep.tpot_ms, "TPOT")):
            value = served.get(key)
            if isinstance(value, int | float) and value > slo:
                degraded = True
                reasons.append(f"{what} P95 {value:.0f} ms is above the SLO of {slo:.0f} ms")
    if dep.deleting_since is not None:
        degraded = True
        reasons.append("being deleted: its plans drain, then it goes (no new request is routed to it)")
    if active is not None:
        reasons.append(f"transition #{active.seq} ({active.kind}) in {active.phase}"
                       + (f": {active.step}" if active.step else ""))
    if degraded:
        state = "degraded"
    elif active is not None:
        state = "switching"
    elif current is None and dep.zero_since is not None:
        state = "scaled to zero"
        reasons.append(f"scaled to zero at {iso(dep.zero_since)} after {dep.idle_to_zero_s or 0:g} s without "
                       "requests: its GPUs are back in the pool; the gateway holds its next request while the "
                       "baseline gear comes up")
        if dep.wake_requested_at is not None:
            reasons.append(f"a request is held since {iso(dep.wake_requested_at)}: waking up")
    elif current is None:
        state = "idle"
        reasons.append("nothing runs yet: the gearbox brings the baseline gear up")
    else:
        state = "ok"
    return {"state": state, "reasons": reasons}


def routing_payload(dep: Deployment) -> dict[str, Any]:
    routes = []
    for r in dep.routing if isinstance(dep.routing, list) else []:
        if not isinstance(r, dict):
            continue
        shape = None
        try:
            shape = Plan.from_dict(r.get("plan")).shape() if r.get("plan") else None
        except ValueError:
            shape = None
        routes.append({"plan_id": r.get("plan_id"), "shape": shape, "weight": r.get("weight"),
                       "frozen": bool(r.get("frozen")), "nodes": list(r.get("nodes") or [])})
    return {"version": dep.routing_version, "routes": routes}


def routed_plan_ids(dep: Deployment) -> list[str]:
    return [str(r["plan_id"]) for r in dep.routing if isinstance(r, dict) and r.get("plan_id")] \
        if isinstance(dep.routing, list) else []


@dataclass
class DeploymentContext:
    """What deployment payloads share, read once for many deployments."""

    fleet: FleetView
    active: dict[int, Transition]
    pending: dict[int, int]
    versions: dict[int, dict[str, Any]]  # deployment pk -> the version it serves
    twu: TwuView  # token-weighted utilisation of their plans and GPUs (present_twu.py)

    @classmethod
    def load(cls, deployments: Sequence[Deployment], fleet: FleetView | None = None) -> DeploymentContext:
        fleet = fleet or fleet_view()
        active = active_transitions(deployments)
        return cls(fleet, active, pending_decisions(deployments), model_versions(deployments),
                   twu_view(deployments, fleet.engines, fleet.snapshot, active))


def deployment_payload(dep: Deployment, ctx: DeploymentContext) -> dict[str, Any]:
    from console.gearbox.present_controls import emergency_payload

    active = ctx.active.get(dep.pk)
    served = serving(routed_plan_ids(dep), ctx.fleet.engines)
    names = ctx.fleet.names
    return {
        "name": dep.name, "model_name": dep.model_name, "model_version": ctx.versions.get(dep.pk),
        "slo": {"ttft_ms": dep.ttft_ms, "tpot_ms": dep.tpot_ms}, "priority": dep.priority, "mode": dep.mode,
        "latency_critical": dep.latency_critical,
        "replicas": {"min": dep.min_replicas, "max": dep.max_replicas}, "idle_to_zero_s": dep.idle_to_zero_s,
        "created_by": dep.created_by.get_username() if dep.created_by_id is not None else None,
        "baseline_gear": gear_summary(dep.baseline_gear, names), "current_gear": gear_summary(dep.current_gear, names),
        "pinned_gear": gear_summary(dep.pinned_gear, names), "on_baseline": bool(dep.current_gear)
        and dep.current_gear == dep.baseline_gear,
        "routing": routing_payload(dep),
        "active_transition": None if active is None else {
            "seq": active.seq, "kind": active.kind, "phase": active.phase, "step": active.step,
            "to_gear_id": gear_id_of(active.to_gear), "abort_reason": active.abort_reason,
            "model_version_id": active.model_version_id},
        "emergency": emergency_payload(dep, active, names),
        "pending_decision": ctx.pending.get(dep.pk), "last_transition_seq": dep.last_transition_seq,
        "deleting_since": iso(dep.deleting_since), "zero_since": iso(dep.zero_since),
        "health": health(dep, active, ctx.fleet, served), "serving": served, "twu": ctx.twu.payload(dep),
        "created_at": iso(dep.created_at), "updated_at": iso(dep.updated_at),
    }


def serving_history(dep: Deployment) -> list[dict[str, Any]]:
    """The last hour of the deployment's serving (ServingSample, one per engine report), oldest first:
    what its charts start from before live points arrive."""
    from console.gearbox.models import ServingSample

    since = timezone.now() - timedelta(hours=1)
    return [{"at": iso(s.at), "tokens_per_s": s.tokens_per_s, "ttft_p50_ms": s.ttft_p50_ms,
             "ttft_p95_ms": s.ttft_p95_ms, "tpot_p95_ms": s.tpot_p95_ms, "running": s.running}
            for s in ServingSample.objects.filter(deployment=dep, at__gte=since).order_by("at")]


def load_history(dep: Deployment) -> list[dict[str, Any]]:
    """The deployment's load window (the gearbox samples it each tick): offered load over time."""
    samples = dep.load_window.get("samples", []) if isinstance(dep.load_window, dict) else []
    out = []
    for s in samples if isinstance(samples, list) else []:
        if isinstance(s, list) and len(s) >= 4 and all(isinstance(x, int | float) for x in s[:4]):
            out.append({"at": iso(datetime.fromtimestamp(s[0], tz=UTC)), "rate_rps": s[1],
                        "prompt_tokens_mean": s[2], "output_tokens_mean": s[3]})
    return out


# --- what pages and their websockets send ------------------------------------------------------------
RECENT_SWITCHES = 12
PAGE_ROWS = 25
DECISION_ROWS = 100  # the deployment page folds runs of "stay" (one every tick): it can show more


def recent_switches(limit: int = RECENT_SWITCHES, deployment: Deployment | None = None) -> list[dict[str, Any]]:
    qs = transitions_with_steps().order_by("-id")
    if deployment is not None:
        qs = qs.filter(deployment=deployment)
    now = timezone.now()
    names = load_names()
    return [transition_payload(t, now=now, names=names) for t in qs[:limit]]


def recent_decisions(deployment: Deployment, limit: int = DECISION_ROWS) -> list[dict[str, Any]]:
    names = load_names()
    return [decision_payload(d, names=names)
            for d in decisions_with_links().filter(deployment=deployment).order_by("-id")[:limit]]


def fleet_payload(fleet: FleetView) -> dict[str, Any]:
    """The atomic blocks and why each left-out GPU is out (the Overview groups its heatmap by them)."""
    return {"blocks": fleet.blocks, "excluded": fleet.excluded, "fleet_error": fleet.error}


def overview_state() -> dict[str, Any]:
    """The Overview's and the Deployments list's gearbox part: deployments, holders, blocks, switches."""
    deps = list(Deployment.objects.order_by("-priority", "name"))
    ctx = DeploymentContext.load(deps)
    return {"deployments": [deployment_payload(d, ctx) for d in deps], "holders": gpu_holders(deps, ctx.active),
            "gpu_twu": ctx.twu.gpu_payload(), "switches": recent_switches(), **fleet_payload(ctx.fleet)}


def deployments_state(fleet: FleetView | None = None) -> dict[str, Any]:
    deps = list(Deployment.objects.order_by("-priority", "name"))
    ctx = DeploymentContext.load(deps, fleet)
    return {"deployments": [deployment_payload(d, ctx) for d in deps], "holders": gpu_holders(deps, ctx.active),
            "gpu_twu": ctx.twu.gpu_payload()}


def gears_state(dep: Deployment, fleet: FleetView, active: Transition | None) -> dict[str, Any]:
    """The gears a deployment page draws (stages on GPUs), and every GPU of the nodes they touch."""
    gears: dict[str, Any] = {}
    for key, raw in (("current", dep.current_gear), ("baseline", dep.baseline_gear),
                     ("target", active.to_gear if active is not None else None)):
        gear = parse_gear(raw)
        gears[key] = gear_detail(gear, fleet) if gear is not None else None
    nodes = {g["node"] for gear in gears.values() if gear for p in gear["plans"] for s in p["stages"]
             for g in s["gpus"] if g["node"]}
    gpus = [{"uuid": u, **info, "in_block": u in fleet.block_of if fleet.blocks is not None else None,
             "out_reason": fleet.excluded.get(u)} for u, info in fleet.gpus.items() if info["node"] in nodes]
    return {"gears": gears, "gpus": gpus}


def deployment_state(dep: Deployment) -> dict[str, Any]:
    """Everything the Deployment page shows, as its websocket sends it on connect."""
    ctx = DeploymentContext.load([dep])
    return {"deployment": deployment_payload(dep, ctx), "transitions": recent_switches(PAGE_ROWS, dep),
            "decisions": recent_decisions(dep), "load": load_history(dep), "serving_history": serving_history(dep),
            "route_samples": route_samples(dep), "router_rollout": router_rollout(dep),
            **gears_state(dep, ctx.fleet, ctx.active.get(dep.pk))}


def deployment_update(dep: Deployment, fleet: FleetView | None = None) -> dict[str, Any]:
    """What changes with an event: the deployment, the gears it draws, its load window."""
    ctx = DeploymentContext.load([dep], fleet)
    return {"deployment": deployment_payload(dep, ctx), "load": load_history(dep), "route_samples": route_samples(dep),
            "router_rollout": router_rollout(dep), **gears_state(dep, ctx.fleet, ctx.active.get(dep.pk))}


ROUTE_SAMPLES = 5  # routing decisions the page shows


def route_samples(dep: Deployment) -> list[dict[str, Any]]:
    """The newest routing decisions the gateways sampled for this deployment (scores per plugin)."""
    from console.gateway import decisions

    return decisions.recent(dep.name, ROUTE_SAMPLES)


def router_rollout(dep: Deployment) -> list[dict[str, Any]]:
    """The newest stage changes of the deployment's learned routing weights (console/gateway/learned.py)."""
    from console.gateway import learned

    return learned.recent(dep.name, ROUTE_SAMPLES)


def transition_detail(deployment: str, seq: int, fleet: FleetView | None = None) -> dict[str, Any] | None:
    t = transitions_with_steps().filter(deployment__name=deployment, seq=seq).first()
    return transition_payload(t, detail=True, fleet=fleet or fleet_view()) if t is not None else None


def decision_detail(pk: int, fleet: FleetView | None = None) -> dict[str, Any] | None:
    d = decisions_with_links().filter(pk=pk).first()
    return decision_payload(d, detail=True, fleet=fleet or fleet_view()) if d is not None else None


# the decisions', gears', transitions' and TWU's shapes live in their own modules, re-exported here
# (imported last: they build on the helpers above)
from console.gearbox.present_decisions import decision_payload, decisions_with_links  # noqa: E402
from console.gearbox.present_gears import (  # noqa: E402, F401 - re-exported
    GEAR_ROLES,
    KnownGear,
    KnownPlan,
    gear_detail,
    gear_id_of,
    gear_summary,
    known_gear_payload,
    known_gears,
    known_plan_payload,
    known_plans,
    parse_gear,
    plan_detail,
    routes_by_plan,
)
from console.gearbox.present_transitions import (  # noqa: E402, F401 - re-exported
    MIGRATE_STEPS,
    SHADOW_STATUSES,
    migration_queue,
    moved_payload,
    phase_spans,
    shadow_status,
    step_payload,
    transition_payload,
    transitions_with_steps,
)
from console.gearbox.present_twu import TwuView, twu_view  # noqa: E402
