"""How decisions look to operators: one decision, with its candidates (what became of each), as the
API, the pages and their websockets show it. Part of console/gearbox/present.py (which re-exports it)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from django.db.models import Prefetch

from console.gearbox.models import Decision, Transition
from console.gearbox.names import GpuNames, gear_name, load_names, readable
from console.gearbox.present import FleetView, iso
from console.gearbox.present_gears import gear_detail, parse_gear


def decision_payload(d: Decision, *, detail: bool = False, fleet: FleetView | None = None,
                     names: GpuNames | None = None) -> dict[str, Any]:
    cands = d.candidates if isinstance(d.candidates, list) else []
    best = cands[0] if cands and isinstance(cands[0], dict) else None
    names = (fleet.names if fleet is not None else load_names()) if names is None else names
    full = d.decision if isinstance(d.decision, dict) else {}
    target_gear = parse_gear(full.get("target"))
    body: dict[str, Any] = {
        "id": d.pk, "deployment": d.deployment.name, "at": iso(d.at), "repeats": d.repeats,
        "last_at": iso(d.last_at or d.at), "trigger": d.trigger, "outcome": d.outcome,
        "factor": d.factor, "current_gear_id": d.current_gear_id or None, "target_gear_id": d.target_gear_id or None,
        "target_shape": target_gear.shape() if target_gear is not None else None,
        "target_name": gear_name(target_gear, names) if target_gear is not None else None,
        "reasons": [readable(str(r), names) for r in d.reasons] if isinstance(d.reasons, list) else [],
        "actor": d.actor, "note": d.note, "approval": d.approval or None,
        "approved_by": d.approved_by.get_username() if d.approved_by_id and d.approved_by else None,
        "approved_at": iso(d.approved_at), "candidate_count": len(cands),
        "best": None if best is None else {k: best.get(k) for k in (
            "gear_id", "shape", "gain_tokens", "cost_tokens", "threshold_tokens", "passes")},
        "transitions": [t.seq for t in d.transitions.all()],
    }
    if detail:
        body["candidates"] = [_candidate(c, d.factor, names, d) for c in full.get("candidates", [])
                              if isinstance(c, dict)]
        body["current"] = {"gear_id": full.get("current_gear_id"), "valid": full.get("current_valid"),
                           "value_tokens_s": full.get("current_value_tokens_s"),
                           "estimate": full.get("current_estimate")}
        body["workload"] = full.get("workload")
        cooldown = full.get("cooldown_until_s")
        body["cooldown_until"] = iso(datetime.fromtimestamp(cooldown, tz=UTC)) \
            if isinstance(cooldown, int | float) else None
        body["target_gear"] = gear_detail(target_gear, fleet) if target_gear is not None else None
    return body


def _candidate(c: Mapping[str, Any], factor: float, names: GpuNames, d: Decision) -> dict[str, Any]:
    from console.gearbox.present_controls import candidate_badge

    cost = c.get("cost") if isinstance(c.get("cost"), dict) else {}
    gear = parse_gear(c.get("gear"))
    return {"gear_id": c.get("gear_id"), "shape": c.get("shape"),
            "name": gear_name(gear, names) if gear is not None else c.get("shape"),
            "gain_tokens": c.get("gain_tokens"),
            "cost_tokens": cost.get("tokens"), "threshold_tokens": c.get("threshold_tokens"), "factor": factor,
            "passes": c.get("passes"), "value_tokens_s": c.get("value_tokens_s"), "note": c.get("note", ""),
            "standing": c.get("standing"), "badge": candidate_badge(c, d),
            "cost": cost, "estimate": c.get("estimate"),
            "gpu_count": len(gear.gpu_uuids) if gear is not None else None}


def decisions_with_links() -> Any:
    return Decision.objects.select_related("deployment", "approved_by").prefetch_related(
        Prefetch("transitions", queryset=Transition.objects.only("id", "seq", "decision_id").order_by("seq")))
