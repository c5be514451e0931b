"""How deployments, gears, plans, transitions and decisions look to operators: one shape for all.

The REST API (api.py), the pages (views.py), their websockets (consumers.py) and the metrics
(console/metrics/gearbox.py) all read through these functions, so a page and the API never
disagree on a field. Read-only: nothing here writes.

* Gears and plans are values inside rows (a deployment's baseline / current / pinned gear, a
  transition's from / to gear, a decision's target), not rows of their own. `known_gears()`
  gathers them, keyed by their content id (scheduler.plan: equal content, equal id), with the
  roles each deployment gives them.
* `FleetView` is the fleet as these payloads need it, read once per request or push: each GPU's
  node and index, the atomic blocks (scheduler.topology.partition over the gearbox's own
  fleet -> Snapshot conversion) and why each left-out GPU is out, and the engines' latest reports
  by plan.
* A deployment's `health` is one of idle (nothing runs yet), ok, switching (a transition runs) or
  degraded (its gear lost GPUs, its engines report P95 latencies above the SLO, or an emergency
  downshift is pending), with the reasons in words.
* A transition's `phases` are spans on the wall clock built from its step rows: a phase starts
  with its first step (PREPARE with the transition itself) and ends where the next one starts,
  or when the transition finished; the running phase has no end yet.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db.models import Prefetch
from django.utils import timezone

from console.gearbox.models import ACTIVE_PHASES, Decision, Deployment, Job, Transition, TransitionStep
from console.gearbox.names import GpuNames, distinct, gear_name, load_names, names_from, plan_name, readable
from scheduler.plan import Gear, Plan
from scheduler.topology import Snapshot
from scheduler.transition import STEP_DEFS, Step

SHADOW_STATUSES = ("none", "preparing", "ready", "canary", "promoted", "rolling_back")
HEALTH_STATES = ("idle", "scaled to zero", "ok", "switching", "degraded")
MIGRATE_STEPS = ("move", "rb_move")


# --- times -----------------------------------------------------------------------------------------
def iso(at: datetime | None) -> str | None:
    return at.astimezone(UTC).isoformat().replace("+00:00", "Z") if at is not None else None


def seconds_between(start: datetime | None, end: datetime | None) -> float | None:
    if start is None or end is None:
        return None
    return round(max(0.0, (end - start).total_seconds()), 3)


# --- gears and plans -------------------------------------------------------------------------------
def parse_gear(raw: object) -> Gear | None:
    """The gear a row stores, or None (null, or a value that no longer parses: shown as missing)."""
    if not raw:
        return None
    try:
        return Gear.from_dict(raw)
    except ValueError:
        return None


def gear_id_of(raw: object) -> str | None:
    gear = parse_gear(raw)
    return gear.gear_id if gear is not None else None


def gear_summary(raw: object, names: GpuNames | None = None) -> dict[str, Any] | None:
    """Id, shape, name (shape and placement: console/gearbox/names.py) and plans (id, shape, weight)
    of a stored gear: what lists show."""
    gear = parse_gear(raw)
    if gear is None:
        return None
    names = load_names() if names is None else names
    return {"gear_id": gear.gear_id, "shape": gear.shape(), "name": gear_name(gear, names),
            "gpu_count": len(gear.gpu_uuids),
            "plans": [{"plan_id": p.plan_id, "shape": p.shape(), "name": plan_name(p, names), "weight": w}
                      for p, w in zip(gear.plans, gear.weights, strict=True)]}


def plan_detail(plan: Plan, fleet: FleetView | None = None) -> dict[str, Any]:
    """A plan with its stages on GPUs (node, index, model, and whether the GPU is in a block now)."""
    stages = []
    for pipeline, chain in (("main" if plan.mode == "colocated" else "prefill", plan.stages),
                            ("decode", plan.decode_stages)):
        for i, stage in enumerate(chain):
            stages.append({"pipeline": pipeline, "index": i, "layers": [stage.layer_start, stage.layer_end],
                           "tp": stage.tp, "gpus": [_gpu(u, fleet) for u in stage.gpu_uuids]})
    return {"plan_id": plan.plan_id, "model": plan.model, "mode": plan.mode, "shape": plan.shape(), "pp": plan.pp,
            "kv_reserve_tokens": plan.kv_reserve_tokens, "kv_partition": plan.kv_partition,
            "gpu_count": len(plan.gpu_uuids), "stages": stages}


def gear_detail(gear: Gear, fleet: FleetView | None = None) -> dict[str, Any]:
    return {"gear_id": gear.gear_id, "model": gear.model, "shape": gear.shape(), "gpu_count": len(gear.gpu_uuids),
            "weights": list(gear.weights), "plans": [{**plan_detail(p, fleet), "weight": w}
                                                     for p, w in zip(gear.plans, gear.weights, strict=True)]}


def _gpu(uuid: str, fleet: FleetView | None) -> dict[str, Any]:
    info = fleet.gpus.get(uuid) if fleet is not None else None
    if info is None:
        return {"uuid": uuid, "node": None, "index": None, "model": None, "in_block": None, "out_reason": None}
    known = fleet is not None and fleet.blocks is not None  # blocks unknown: say so, not "out"
    return {"uuid": uuid, "node": info["node"], "index": info["index"], "model": info["model"],
            "in_block": uuid in fleet.block_of if known and fleet is not None else None,
            "out_reason": fleet.excluded.get(uuid) if fleet is not None else None}


@dataclass
class KnownGear:
    """One gear as the gearbox's rows know it, and what each deployment uses it for."""

    gear: Gear
    roles: dict[str, set[str]] = field(default_factory=dict)  # deployment -> GEAR_ROLES
    transitions: dict[str, list[int]] = field(default_factory=dict)  # deployment -> seqs that came from / went to it
    last_at: datetime | None = None  # the newest row that names it

    def note(self, deployment: str, role: str, at: datetime | None, seq: int | None = None) -> None:
        self.roles.setdefault(deployment, set()).add(role)
        if seq is not None and seq not in self.transitions.setdefault(deployment, []):
            self.transitions[deployment].append(seq)
        if at is not None and (self.last_at is None or at > self.last_at):
            self.last_at = at


GEAR_ROLES = ("baseline", "current", "pinned", "source", "target", "proposed")


def known_gears(deployment: str | None = None) -> dict[str, KnownGear]:
    """Every gear a deployment runs, ran, was asked to run or was advised, by gear id.

    Sources: deployments (baseline, current, pinned), transitions (source = from, target = to)
    and decisions that named a target (proposed: to switch to, or advised). Each stored value is parsed once.
    """
    out: dict[str, KnownGear] = {}
    parsed: dict[str, Gear | None] = {}

    def add(raw: object, name: str, role: str, at: datetime | None, seq: int | None = None) -> None:
        if not raw:
            return
        key = json.dumps(raw, sort_keys=True)
        if key not in parsed:
            parsed[key] = parse_gear(raw)
        gear = parsed[key]
        if gear is None:
            return
        entry = out.get(gear.gear_id)
        if entry is None:
            entry = out[gear.gear_id] = KnownGear(gear)
        entry.note(name, role, at, seq)

    deps = Deployment.objects.all()
    transitions = Transition.objects.select_related("deployment")
    decisions = Decision.objects.exclude(target_gear_id="").select_related("deployment")
    if deployment is not None:
        deps = deps.filter(name=deployment)
        transitions = transitions.filter(deployment__name=deployment)
        decisions = decisions.filter(deployment__name=deployment)
    for d in deps:
        add(d.baseline_gear, d.name, "baseline", d.updated_at)
        add(d.current_gear, d.name, "current", d.updated_at)
        add(d.pinned_gear, d.name, "pinned", d.updated_at)
    for t in transitions.only("deployment__name", "seq", "from_gear", "to_gear", "updated_at").order_by("id"):
        add(t.from_gear, t.deployment.name, "source", t.updated_at, t.seq)
        add(t.to_gear, t.deployment.name, "target", t.updated_at, t.seq)
    for dec in decisions.only("deployment__name", "decision", "at").order_by("id"):
        raw = dec.decision.get("target") if isinstance(dec.decision, dict) else None
        add(raw, dec.deployment.name, "proposed", dec.at)
    return out


def known_gear_payload(entry: KnownGear, fleet: FleetView | None = None, *, detail: bool = False) -> dict[str, Any]:
    body = gear_detail(entry.gear, fleet) if detail else {
        "gear_id": entry.gear.gear_id, "model": entry.gear.model, "shape": entry.gear.shape(),
        "gpu_count": len(entry.gear.gpu_uuids), "weights": list(entry.gear.weights),
        "plans": [{"plan_id": p.plan_id, "shape": p.shape(), "weight": w}
                  for p, w in zip(entry.gear.plans, entry.gear.weights, strict=True)]}
    body["deployments"] = [{"deployment": name, "roles": [r for r in GEAR_ROLES if r in roles],
                            "transitions": sorted(entry.transitions.get(name, []))}
                           for name, roles in sorted(entry.roles.items())]
    body["last_seen_at"] = iso(entry.last_at)
    return body


@dataclass
class KnownPlan:
    plan: Plan
    gears: set[str] = field(default_factory=set)
    deployments: set[str] = field(default_factory=set)


def known_plans(gears: Mapping[str, KnownGear]) -> dict[str, KnownPlan]:
    out: dict[str, KnownPlan] = {}
    for gear_id, entry in gears.items():
        for plan in entry.gear.plans:
            known = out.setdefault(plan.plan_id, KnownPlan(plan))
            known.gears.add(gear_id)
            known.deployments.update(entry.roles)
    return out


def known_plan_payload(entry: KnownPlan, routing: Mapping[str, list[dict[str, Any]]],
                       fleet: FleetView | None = None) -> dict[str, Any]:
    """A plan, the gears it belongs to, and where routing tables send requests to it now."""
    return {**plan_detail(entry.plan, fleet), "gears": sorted(entry.gears),
            "deployments": sorted(entry.deployments), "routes": routing.get(entry.plan.plan_id, [])}


def routes_by_plan() -> dict[str, list[dict[str, Any]]]:
    """plan id -> [{deployment, version, weight, frozen, nodes}] from every routing table."""
    out: dict[str, list[dict[str, Any]]] = {}
    for name, version, routes in Deployment.objects.values_list("name", "routing_version", "routing"):
        for r in routes if isinstance(routes, list) else []:
            if isinstance(r, dict) and r.get("plan_id"):
                out.setdefault(str(r["plan_id"]), []).append({
                    "deployment": name, "version": version, "weight": r.get("weight"), "frozen": bool(r.get("frozen")),
                    "nodes": list(r.get("nodes") or [])})
    return out


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
    from console.fleet.models import Gpu
    from console.gearbox.snapshot import fleet_snapshot
    from scheduler.topology import partition

    now = now or timezone.now()
    gpus = {g.uuid: {"node": g.node.node_id, "index": g.index, "model": g.model, "state": g.state}
            for g in Gpu.objects.filter(present=True).select_related("node").order_by("node__node_id", "index")}
    engines = engine_reports()
    blocks: list[dict[str, Any]] | None = None
    block_of: dict[str, str] = {}
    excluded: dict[str, str] = {}
    error = ""
    snapshot: Snapshot | None = None
    if with_blocks:
        try:
            part = partition(snap := fleet_snapshot(now))
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


# --- transitions -----------------------------------------------------------------------------------
def transitions_with_steps() -> Any:
    return Transition.objects.select_related("deployment", "decision").prefetch_related(
        Prefetch("steps", queryset=TransitionStep.objects.order_by("id")))


def phase_spans(t: Transition, steps: Sequence[TransitionStep], now: datetime | None = None) -> list[dict[str, Any]]:
    """The phases a transition went through, with start, end and duration (module docstring)."""
    starts: list[tuple[str, datetime]] = [("prepare", t.created_at)]
    for s in steps:
        if s.phase != starts[-1][0] and s.phase not in {p for p, _ in starts}:
            starts.append((s.phase, s.started_at))
    if t.active and t.phase not in {p for p, _ in starts}:
        starts.append((t.phase, max(t.updated_at, starts[-1][1])))
    now = now or timezone.now()
    spans = []
    for i, (phase, start) in enumerate(starts):
        end = starts[i + 1][1] if i + 1 < len(starts) else t.finished_at
        running = end is None
        spans.append({"phase": phase, "started_at": iso(start), "ended_at": iso(end), "running": running,
                      "duration_s": seconds_between(start, end if end is not None else now)})
    return spans


def moved_payload(t: Transition) -> dict[str, Any]:
    record = t.record if isinstance(t.record, dict) else {}
    forward = record.get("moved") if isinstance(record.get("moved"), dict) else {}
    back = record.get("moved_back") if isinstance(record.get("moved_back"), dict) else {}
    return {"kv_bytes_migrated": t.kv_bytes_migrated, "tokens_replayed": t.tokens_replayed,
            "seqs_migrated": t.seqs_migrated, "seqs_replayed": t.seqs_replayed, "seqs_finished": t.seqs_finished,
            "seqs_failed": t.seqs_failed, "stall_s_max": t.stall_s_max, "forward": forward, "back": back}


def transition_payload(t: Transition, *, detail: bool = False, fleet: FleetView | None = None,
                       now: datetime | None = None, names: GpuNames | None = None) -> dict[str, Any]:
    steps = list(t.steps.all())
    now = now or timezone.now()
    names = (fleet.names if fleet is not None else load_names()) if names is None else names
    source, target = gear_summary(t.from_gear, names), gear_summary(t.to_gear, names)
    if source is not None and target is not None:  # two distinct gears never read the same
        source["name"], target["name"] = distinct((source["name"], source["gear_id"]),
                                                  (target["name"], target["gear_id"]))
    body: dict[str, Any] = {
        "id": t.pk, "deployment": t.deployment.name, "seq": t.seq, "kind": t.kind, "phase": t.phase,
        "active": t.active, "step": t.step, "attempt": t.attempt, "actor": t.actor, "decision": t.decision_id,
        "from_gear": source, "to_gear": target,
        "created_at": iso(t.created_at), "updated_at": iso(t.updated_at), "finished_at": iso(t.finished_at),
        "duration_s": seconds_between(t.created_at, t.finished_at or now), "error": readable(t.error, names),
        "abort_reason": t.abort_reason, "phases": phase_spans(t, steps, now), "moved": moved_payload(t),
    }
    if detail:
        body["steps"] = [step_payload(s, now) for s in steps]
        target = parse_gear(t.to_gear)
        source = parse_gear(t.from_gear)
        body["to_gear_detail"] = gear_detail(target, fleet) if target is not None else None
        body["from_gear_detail"] = gear_detail(source, fleet) if source is not None else None
        body["decision_summary"] = decision_payload(t.decision, names=names) if t.decision is not None else None
    return body


def step_payload(s: TransitionStep, now: datetime) -> dict[str, Any]:
    try:
        does = STEP_DEFS[Step(s.step)].does
    except ValueError:
        does = ""
    return {"step": s.step, "phase": s.phase, "attempt": s.attempt, "state": s.state,
            "started_at": iso(s.started_at), "finished_at": iso(s.finished_at),
            "duration_s": seconds_between(s.started_at, s.finished_at or now), "note": s.note, "error": s.error,
            "reason": s.reason, "commands": len(s.commands) if isinstance(s.commands, list) else 0,
            "result": s.result if isinstance(s.result, dict) else {}, "does": does}


def shadow_status(t: Transition | None) -> str:
    """The shadow plan (the new plans PREPARE brings up before any request reaches them), by the
    running transition: none, preparing, ready (prepared, not routed yet), canary (a share of new
    requests), promoted (the flip gave it all new requests), rolling_back."""
    if t is None or not t.active:
        return "none"
    if t.phase == "rollback":
        return "rolling_back"
    if t.phase == "prepare":
        return "ready" if _step_ok(t, "prepare") else "preparing"
    if t.phase == "switch" and t.step == "canary":
        return "canary"
    return "promoted"


def _step_ok(t: Transition, step: str) -> bool:
    return TransitionStep.objects.filter(transition=t, step=step, state="ok").exists()


def migration_queue(t: Transition | None) -> int:
    """KV migrations waiting: sequences the running move step hands over by migration whose
    command the leaving plan's agent has not acknowledged yet (0 outside a move step)."""
    from console.fleet.models import AgentCommand

    if t is None or not t.active or t.step not in MIGRATE_STEPS:
        return 0
    step = TransitionStep.objects.filter(transition=t, step=t.step, attempt=t.attempt).first()
    keys = step.commands if step is not None and isinstance(step.commands, list) else []
    waiting = 0
    for payload in AgentCommand.objects.filter(key__in=keys, kind="move_sequences",
                                               state__in=AgentCommand.OPEN_STATES).values_list("payload", flat=True):
        moves = payload.get("moves", []) if isinstance(payload, dict) else []
        waiting += sum(1 for m in moves if isinstance(m, dict) and m.get("action") == "migrate")
    return waiting


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


# the decisions' shapes live in present_decisions.py (imported last: it builds on the helpers above)
from console.gearbox.present_decisions import decision_payload, decisions_with_links  # noqa: E402
from console.gearbox.present_twu import TwuView, twu_view  # noqa: E402
