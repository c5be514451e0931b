"""Gear override and baseline: an operator chooses the gear (seed 000 section 6.3, DESIGN.md invariant 6).

    candidates_now(deployment)                                   the planner's candidates, with estimates
    do_override_gear(deployment, *, actor, gear_id | spec, reason)   switch to that gear, then hold it (pin)
    do_set_baseline(deployment, *, actor, gear_id | spec)            the emergency target from now on

A gear is named either by `gear_id` - one of the planner's current candidates (`candidates_now`;
"current" for the baseline: the gear running now) - or by a `spec`, the stages an operator writes:

    {"plans": [{"stages": [{"gpus": ["h100-a/0", "h100-a/1"], "tp": 2, "layers": [0, 32]}],
                "decode_stages": [...],          # optional: a disaggregated plan's decode pipeline
                "kv_reserve_tokens": 200000}],   # optional: as much as fits (95 %)
     "weights": [1.0]}                           # optional: equal shares

GPUs as `node/index` (or their uuids); `tp`, when given, must match the GPUs; `layers` for every
stage or for none (then split evenly). Either way the gear is checked against invariant 4 on the
fleet as it is now (TP inside one atomic block, 92 % of each GPU's memory with what others hold,
healthy schedulable GPUs): a gear that breaks it is a 400 naming `spec` (or `gear_id`) with the
reasons, and nothing changes. An override runs as a manual transition and pins the target at once
- the gearbox never moves it automatically - until an operator unpins it; both are audited.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from django.db import transaction
from django.utils import timezone

from console.audit.chain import record
from console.fleet.actions import Rejected
from console.gearbox.actions import (
    _active,
    _decide,
    _gear,
    _gear_id,
    _locked,
    _not_in_emergency,
    _who,
    do_request_gear,
    held_gpus,
)
from console.gearbox.models import Decision, Deployment, Transition
from console.gearbox.names import gear_name, load_names, readable
from console.gearbox.snapshot import decision_snapshot, fleet_snapshot
from console.registry.specs import requirements_for, spec_for
from scheduler import gearbox
from scheduler.costmodel import max_kv_tokens
from scheduler.gearbox import Trigger, gear_footprint
from scheduler.modelspec import ModelSpec
from scheduler.plan import Gear, Plan, Stage, validate_gear
from scheduler.topology import Snapshot

KV_FILL = 0.95  # of the KV room that fits: leaves slack for the memory the agents report around it
MAX_PLANS, MAX_STAGES = 8, 16


def candidates_now(deployment: Deployment | str) -> gearbox.Decision:
    """The planner's candidates for the deployment on the fleet now, weighed like a decision (gain,
    cost, estimate), best first - read-only: nothing is recorded."""
    dep = _deployment(deployment)
    now = timezone.now()
    return _decide(dep, fleet_snapshot(now), held_gpus(), now, Trigger.MANUAL)


def fill_kv(stages: Sequence[Stage], model: ModelSpec, snapshot: Snapshot,
            reclaimable_bytes: Mapping[str, int] | None = None) -> int:
    """The KV reserve a pipeline gets when none is asked for: most of what fits under invariant 4."""
    return int(KV_FILL * max_kv_tokens(stages, model, snapshot, reclaimable_bytes=reclaimable_bytes))


def _deployment(deployment: Deployment | str) -> Deployment:
    name = deployment if isinstance(deployment, str) else deployment.name
    dep = Deployment.objects.filter(name=name).first()
    if dep is None:
        raise Rejected(404, {"deployment": f"no deployment {name!r}"})
    return dep


# --- naming a gear -------------------------------------------------------------------------------
def _uuid_of(raw: object, where: str, by_name: Mapping[str, str], known: set[str]) -> str:
    if not isinstance(raw, str) or not raw:
        raise Rejected(400, {where: "must be a GPU as node/index (h100-a/0) or its uuid"})
    if raw in known:
        return raw
    uuid = by_name.get(raw)
    if uuid is None:
        raise Rejected(400, {where: f"no GPU {raw[:80]!r} in the fleet (name it node/index, e.g. h100-a/0)"})
    return uuid


def _list(raw: object, where: str, *, most: int) -> list[Any]:
    if not isinstance(raw, list) or not raw:
        raise Rejected(400, {where: "must be a non-empty list"})
    if len(raw) > most:
        raise Rejected(400, {where: f"at most {most} entries; got {len(raw)}"})
    return raw


def _stages(raw: object, where: str, model: ModelSpec, by_name: Mapping[str, str], known: set[str]) -> list[Stage]:
    items = _list(raw, where, most=MAX_STAGES)
    for i, st in enumerate(items):
        if not isinstance(st, dict):
            raise Rejected(400, {f"{where}[{i}]": "must be an object with gpus (and tp, layers)"})
        unknown = sorted(set(st) - {"gpus", "tp", "layers"})
        if unknown:
            raise Rejected(400, {f"{where}[{i}].{unknown[0]}"[:100]: "unknown field; expected gpus, tp, layers"})
    with_layers = [isinstance(st.get("layers"), list) for st in items]
    if any(with_layers) and not all(with_layers):
        raise Rejected(400, {where: "give layers for every stage or for none (then they are split evenly)"})
    n = model.num_layers
    even = [n // len(items) + (1 if i < n % len(items) else 0) for i in range(len(items))]
    out, start = [], 0
    for i, st in enumerate(items):
        gpus = [_uuid_of(g, f"{where}[{i}].gpus[{j}]", by_name, known)
                for j, g in enumerate(_list(st.get("gpus"), f"{where}[{i}].gpus", most=64))]
        tp = st.get("tp")
        if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or tp != len(gpus)):
            raise Rejected(400, {f"{where}[{i}].tp": f"must equal the number of GPUs ({len(gpus)}); got {tp!r}"})
        if all(with_layers):
            layers = st["layers"]
            if len(layers) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in layers):
                raise Rejected(400, {f"{where}[{i}].layers": "must be [start, end), two integers"})
            out.append(Stage(layers[0], layers[1], tuple(gpus)))
        else:
            out.append(Stage(start, start + even[i], tuple(gpus)))
            start += even[i]
    return out


def parse_spec(raw: object, dep: Deployment, snap: Snapshot, reclaim: Mapping[str, int]) -> Gear:
    """The gear an operator's spec describes (module docstring); Rejected(400) naming the field."""
    if not isinstance(raw, dict):
        raise Rejected(400, {"spec": "must be an object: {plans: [{stages: [{gpus, tp, layers}]}], weights}"})
    unknown = sorted(set(raw) - {"plans", "weights"})
    if unknown:
        raise Rejected(400, {f"spec.{unknown[0]}"[:100]: "unknown field; expected plans, weights"})
    model = spec_for(dep)
    by_name = {name: uuid for uuid, name in load_names().items()}
    known = set(snap.gpu_by_uuid)
    plans = []
    for i, p in enumerate(_list(raw.get("plans"), "spec.plans", most=MAX_PLANS)):
        where = f"spec.plans[{i}]"
        if not isinstance(p, dict):
            raise Rejected(400, {where: "must be an object with stages"})
        extra = sorted(set(p) - {"stages", "decode_stages", "kv_reserve_tokens"})
        if extra:
            raise Rejected(400, {f"{where}.{extra[0]}"[:100]: "unknown field; expected stages, decode_stages, "
                                                              "kv_reserve_tokens"})
        stages = _stages(p.get("stages"), f"{where}.stages", model, by_name, known)
        decode = (_stages(p["decode_stages"], f"{where}.decode_stages", model, by_name, known)
                  if p.get("decode_stages") is not None else [])
        kv = p.get("kv_reserve_tokens")
        if kv is None:
            missing = [u for st in stages + decode for u in st.gpu_uuids if u not in known]
            kv = min((fill_kv(chain, model, snap, reclaim) for chain in (stages, decode) if chain), default=0) \
                if not missing else 1
            if kv <= 0:
                raise Rejected(400, {f"{where}.stages": f"the weights of {model.name} do not fit these GPUs "
                                                        "(with what others hold there)"})
        elif isinstance(kv, bool) or not isinstance(kv, int) or kv < 1:
            raise Rejected(400, {f"{where}.kv_reserve_tokens": "must be an integer >= 1"})
        plans.append(Plan(model.name, "disaggregated" if decode else "colocated", tuple(stages), tuple(decode),
                          kv_reserve_tokens=kv))
    weights = raw.get("weights")
    if weights is None:
        weights = [1.0 / len(plans)] * len(plans)
    elif (not isinstance(weights, list) or len(weights) != len(plans)
          or not all(isinstance(w, int | float) and not isinstance(w, bool) and w >= 0 for w in weights)
          or abs(sum(weights) - 1.0) > 1e-6):
        raise Rejected(400, {"spec.weights": f"must be {len(plans)} numbers >= 0 that sum to 1, one per plan"})
    return Gear(model.name, tuple(plans), tuple(float(w) for w in weights))


def resolve_gear(dep: Deployment, *, gear_id: str | None, spec: object, allow_current: bool = False,
                 allow_auto: bool = False, snap: Snapshot | None = None,
                 requires: Any = None) -> tuple[Gear, str]:
    """The gear an operator named (one of `gear_id`, `spec`), checked against invariant 4 on the fleet
    now; (gear, how it was named). Rejected 400 naming the field, 409 when a candidate went stale.
    `allow_auto`: gear_id "auto" is the planner's best candidate now (a new deployment's baseline
    when the operator lets the planner choose; `dep` may be a row not stored yet). The gear must also
    meet the registry version's placement requirements: the deployment's, or those of `requires` (a
    ModelVersion: a rollout's)."""
    if (gear_id is None) == (spec is None):
        raise Rejected(400, {"gear_id": "give exactly one of gear_id (a candidate's id) and spec (stages, tp, GPUs)"})
    now = timezone.now()
    base = snap if snap is not None else fleet_snapshot(now)
    held = held_gpus()
    others = set().union(*[g for name, g in held.items() if name != dep.name]) if held else set()
    view = decision_snapshot(base, others)
    model = spec_for(dep)
    current = _gear(dep, "current_gear")
    reclaim = gear_footprint(current, model, base) if current is not None else {}
    field, how = "spec", "spec"
    if gear_id is not None:
        field = "gear_id"
        if allow_current and gear_id == "current":
            if current is None:
                raise Rejected(409, {"gear_id": "nothing runs yet: there is no current gear"})
            gear, how = current, "the gear running now"
        elif allow_auto and gear_id == "auto":
            listed = _decide(dep, base, held, now, Trigger.MANUAL)
            if not listed.candidates:
                why = [*listed.reasons[1:4], *listed.excluded[:3]] or ["the planner found none"]
                raise Rejected(400, {"gear_id": f"no gear of {dep.model_name} fits the fleet now: " + "; ".join(why)})
            gear, how = listed.candidates[0].gear, "the planner's best gear now"
        else:
            listed = _decide(dep, base, held, now, Trigger.MANUAL)
            gear = next((c.gear for c in listed.candidates if c.gear.gear_id == gear_id), None)  # type: ignore[assignment]
            if gear is None:
                raise Rejected(409, {"gear_id": f"{gear_id} is not one of the planner's candidates now (the fleet "
                                                "changed, or it never was): list them again"})
            how = "a planner candidate"
    else:
        gear = parse_spec(spec, dep, view, reclaim)
    problems = validate_gear(gear, view, model, reclaimable_bytes=reclaim)
    problems += requirements_for(requires if requires is not None else dep).gear_refusals(gear.plans, view)
    if problems:
        names = load_names()
        raise Rejected(400, {field: "breaks invariant 4 on the fleet now: "
                                    + "; ".join(readable(p, names) for p in problems[:6])})
    return gear, how


# --- the actions ---------------------------------------------------------------------------------
def do_override_gear(deployment: Deployment | str, *, actor: Any, gear_id: str | None = None, spec: object = None,
                     reason: str = "") -> tuple[Decision, Transition]:
    """Switch to the operator's gear as a manual transition, and pin it (module docstring)."""
    who, user = _who(actor)
    dep = _deployment(deployment)
    _not_in_emergency(dep)
    if _active(dep) is not None:
        raise Rejected(409, {"deployment": f"{dep.name} is in a transition; override once it ended"})
    gear, how = resolve_gear(dep, gear_id=gear_id, spec=spec)
    if _gear_id(dep.current_gear) == gear.gear_id:
        raise Rejected(409, {"gear_id" if gear_id else "spec": "it is the gear running now: pin it instead"})
    with transaction.atomic():
        dep = _locked(dep.name)
        _not_in_emergency(dep)
        row, started = do_request_gear(dep, gear, actor=actor, reason=reason or "gear override")
        if started is None:
            raise Rejected(409, {"deployment": "the gearbox refused it: " + "; ".join(row.reasons[:3])})
        now = timezone.now()
        before = {"mode": dep.mode, "pinned_gear_id": _gear_id(dep.pinned_gear)}
        dep.mode, dep.pinned_gear, dep.updated_at = Deployment.PINNED, gear.to_dict(), now
        dep.save(update_fields=["mode", "pinned_gear", "updated_at"])
        Decision.objects.filter(deployment=dep, approval=Decision.PENDING).update(approval=Decision.SUPERSEDED)
        name = gear_name(gear, load_names())
        record("gearbox.gear_overridden", actor=who, user=user, at=now, deployment=dep.name, decision_id=row.pk,
               transition_seq=started.seq,
               summary=f"{dep.name}: gear override to {name} ({how}), transition #{started.seq}, then pinned"
                       + (f": {reason[:120]}" if reason else ""),
               before=before, after={"mode": dep.mode, "pinned_gear_id": gear.gear_id},
               data={"how": how, "gear_id": gear.gear_id, "reason": reason})
    return row, started


@transaction.atomic
def do_set_baseline(deployment: Deployment | str, *, actor: Any, gear_id: str | None = None,
                    spec: object = None) -> Deployment:
    """The baseline (the emergency target) becomes the operator's gear; nothing switches."""
    who, user = _who(actor)
    dep = _deployment(deployment)
    gear, how = resolve_gear(dep, gear_id=gear_id, spec=spec, allow_current=True)
    dep = _locked(dep.name)
    if _gear_id(dep.baseline_gear) == gear.gear_id:
        return dep
    now = timezone.now()
    before = {"baseline_gear_id": _gear_id(dep.baseline_gear), "baseline_by": dep.baseline_by}
    dep.baseline_gear, dep.baseline_by, dep.updated_at = gear.to_dict(), who, now
    dep.save(update_fields=["baseline_gear", "baseline_by", "updated_at"])
    record("gearbox.baseline_set", actor=who, user=user, at=now, deployment=dep.name,
           summary=f"{dep.name}: baseline is now {gear_name(gear, load_names())} ({how})",
           before=before, after={"baseline_gear_id": gear.gear_id, "baseline_by": who}, data={"how": how})
    return dep


def candidate_payloads(d: gearbox.Decision) -> list[dict[str, Any]]:
    """The candidates of `candidates_now` as the API and the page show them."""
    from console.gearbox.present_controls import candidate_row

    names = load_names()
    return [candidate_row(c.to_dict(), names) for c in d.candidates]


__all__ = ["candidate_payloads", "candidates_now", "do_override_gear", "do_set_baseline", "fill_kv", "parse_spec",
           "resolve_gear"]
