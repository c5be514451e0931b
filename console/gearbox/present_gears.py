"""How gears and plans look to operators: a stored gear parsed, summed up or in full (stages on GPUs),
and every gear and plan the gearbox's rows know, with what each deployment uses it for.

Gears and plans are values inside rows (a deployment's baseline / current / pinned gear, a
transition's from / to gear, a decision's target), not rows of their own. `known_gears()` gathers
them, keyed by their content id (scheduler.plan: equal content, equal id), with the roles each
deployment gives them. Part of console/gearbox/present.py (which re-exports it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from console.gearbox.models import Decision, Deployment, Transition
from console.gearbox.names import GpuNames, gear_name, load_names, plan_name
from console.gearbox.present import FleetView, iso
from scheduler.plan import Gear, Plan


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
