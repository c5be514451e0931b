"""How transitions look to operators: one transition with its phases, steps and what it moved, and
the shadow plan and KV migration queue of a running one.

A transition's `phases` are spans on the wall clock built from its step rows: a phase starts
with its first step (PREPARE with the transition itself) and ends where the next one starts,
or when the transition finished; the running phase has no end yet. Part of
console/gearbox/present.py (which re-exports it).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from django.db.models import Prefetch
from django.utils import timezone

from console.gearbox.models import Transition, TransitionStep
from console.gearbox.names import GpuNames, distinct, load_names, readable
from console.gearbox.present import FleetView, iso, seconds_between
from console.gearbox.present_decisions import decision_payload
from console.gearbox.present_gears import gear_detail, gear_summary, parse_gear
from scheduler.transition import STEP_DEFS, Step

SHADOW_STATUSES = ("none", "preparing", "ready", "canary", "promoted", "rolling_back")
MIGRATE_STEPS = ("move", "rb_move")


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
