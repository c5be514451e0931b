"""How the operator controls look: an emergency's state, what became of each candidate, the gears an
operator may override to. Read-only, like console/gearbox/present.py (which embeds these).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from console.gearbox.models import Decision, Deployment, Transition
from console.gearbox.names import GpuNames, gear_name, readable

EMERGENCY_STATES = ("pending", "blocked", "running", "holding", "failed")


def emergency_payload(dep: Deployment, active: Transition | None, names: GpuNames) -> dict[str, Any] | None:
    """None unless an emergency is pending or held. `state`:

    pending   requested, its transition not started yet (the next tick starts it)
    blocked   requested, but its target cannot run now: `blocked` says why, `offers` what could
    running   its transition runs
    holding   on its target, held until an operator releases it
    failed    held, but its transition rolled back (`error`): the gear is not the target; ask again
    """
    from console.gearbox.emergency import emergency_target, offers_of
    from console.gearbox.present import gear_id_of, gear_summary, iso

    if dep.mode != Deployment.EMERGENCY and dep.emergency_requested_at is None:
        return None
    target = emergency_target(dep)
    last = (Decision.objects.filter(deployment=dep, trigger="emergency").order_by("-id")
            .values("id", "at", "outcome", "reasons", "decision").first())
    body: dict[str, Any] = {
        "reason": dep.emergency_reason, "actor": dep.emergency_actor,
        "requested_at": iso(dep.emergency_requested_at),
        "target": gear_summary(target.to_dict(), names), "on_baseline": target.gear_id == gear_id_of(dep.baseline_gear),
        "blocked": [], "offers": [], "error": "", "decision": last["id"] if last else None,
    }
    if active is not None and active.kind == Transition.EMERGENCY:
        state = "running"
    elif dep.emergency_requested_at is not None:
        blocked = last is not None and last["outcome"] == "blocked" and last["at"] >= dep.emergency_requested_at
        state = "blocked" if blocked else "pending"
        if blocked and last is not None:
            body["blocked"] = [readable(str(r), names) for r in last["reasons"]]
            body["offers"] = offers_of(last["decision"])
    elif gear_id_of(dep.current_gear) == target.gear_id:
        state = "holding"
    else:
        state = "failed"
        failed = (Transition.objects.filter(deployment=dep, kind=Transition.EMERGENCY).order_by("-seq")
                  .values_list("error", flat=True).first())
        body["error"] = readable(failed or "its transition did not reach the target", names)
    body["state"] = state
    return body


def candidate_badge(c: Mapping[str, Any], d: Decision) -> str:
    """What became of one candidate of a decision, in a few words (never "does not pass · chosen")."""
    chosen = bool(d.target_gear_id) and c.get("gear_id") == d.target_gear_id
    if d.trigger == "emergency":
        if d.outcome == "blocked":
            return "offered instead of the baseline"
        return "emergency target" if chosen else "weighed"
    if d.trigger == "manual" and chosen:
        return "the operator's choice"
    if chosen:
        return {"switch": "chosen: switched to", "advise": "advised (waiting for approval)"}.get(d.outcome, "chosen")
    if c.get("passes"):
        return "beat its cost; another ranked first" if d.outcome in ("switch", "advise") else \
            "beat its cost; held back (" + d.outcome + ")"
    return "gain below cost × factor"


def candidate_row(c: Mapping[str, Any], names: GpuNames) -> dict[str, Any]:
    """One gear an operator may override to: id, name and the planner's estimate."""
    from console.gearbox.present import parse_gear

    gear = parse_gear(c.get("gear"))
    est = c.get("estimate") if isinstance(c.get("estimate"), dict) else {}
    return {"gear_id": c.get("gear_id"), "shape": c.get("shape"),
            "name": gear_name(gear, names) if gear is not None else c.get("shape"),
            "gpu_count": len(gear.gpu_uuids) if gear is not None else None,
            "meets_slo": bool(c.get("standing")), "note": c.get("note", ""),
            "gain_tokens": c.get("gain_tokens"), "threshold_tokens": c.get("threshold_tokens"),
            "estimate": {k: est.get(k) for k in ("goodput_tokens_s", "throughput_tokens_s", "capacity_rps",
                                                 "ttft_p99_s", "tpot_p99_s", "utilization")}}
