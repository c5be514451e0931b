"""The emergency downshift holds like a pin until an operator releases it; a blocked one changes nothing,
says why and what to do, and offers the planner's best safe gear instead (console/gearbox/emergency.py)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from django.utils import timezone

from console.audit.models import AuditEntry
from console.fleet.actions import Rejected
from console.gearbox import present, ticks
from console.gearbox.actions import do_pin_gear, do_record_load, do_request_gear, do_set_mode, do_unpin_gear
from console.gearbox.emergency import OFFER_LABEL, do_emergency_downshift, do_release_emergency
from console.gearbox.executor import build_executor
from console.gearbox.models import Decision, Deployment, Transition
from scheduler.gearbox import LoadSample
from scheduler.invariants import assert_clean
from tests.console.gearbox.harness import (
    FleetReporter,
    SimAgents,
    django_log,
    enroll_fleet,
    gear,
    make_deployment,
)

pytestmark = pytest.mark.django_db


def drive(agents: SimAgents, name: str = "chat", *, max_s: float = 30.0) -> Transition:
    ex = build_executor()
    deadline = time.monotonic() + max_s
    while time.monotonic() < deadline:
        out = ex.advance(name)
        agents.run()
        if out.record is None or not out.record.active:
            break
        time.sleep(0.01)
    row = Transition.objects.filter(deployment__name=name).order_by("-seq").first()
    assert row is not None and not row.active, f"still {row.phase if row else None}/{row.step if row else None}"
    return row


def audits(event_type: str) -> int:
    return AuditEntry.objects.filter(event_type=event_type).count()


def moved_off_the_baseline(*, forced: bool = False) -> tuple[FleetReporter, SimAgents]:
    """chat's baseline (TP2 on a1/0-1) up, then an operator's move to TP4 on b1/0-3 - or (forced) a
    move the gearbox is pushed into when a tenant takes a1/1 for a while: no cooldown follows it."""
    rep = enroll_fleet()
    make_deployment()
    agents = SimAgents()
    assert ticks.tick()["started"] == ["chat#1"]
    drive(agents)
    if forced:
        rep.gone = {"GPU-a1-1"}
        rep.report("a1")
        assert ticks.tick(trigger="topology")["started"] == ["chat#2"]
        drive(agents)
        rep.gone = set()
    else:
        do_request_gear("chat", gear("b1", [0, 1, 2, 3]), actor="system:test")
        drive(agents)
    for node in ("a1", "b1"):
        rep.report(node)
    return rep, agents


def heavy_load(dep: str = "chat", rate_rps: float = 90.0) -> None:
    """Five minutes of a load far over what the baseline carries: an auto deployment shifts up."""
    now = time.time()
    for i in range(21):
        do_record_load(Deployment.objects.get(name=dep), LoadSample(now - 300 + 15 * i, rate_rps, 512, 200))


def test_an_emergency_reaches_the_baseline_and_holds_it_across_ticks_until_released() -> None:
    rep, agents = moved_off_the_baseline(forced=True)
    first = do_emergency_downshift("chat", reason="latency alarm", actor="system:oncall")
    again = do_emergency_downshift("chat", reason="latency alarm", actor="system:oncall")
    assert (first.state, again.state) == ("requested", "already_requested")
    dep = Deployment.objects.get(name="chat")
    assert dep.mode == "emergency" and dep.pinned_gear == dep.baseline_gear  # held at once, before it runs
    assert ticks.tick(trigger="emergency", deployment="chat")["started"] == ["chat#3"]
    row = drive(agents)
    assert row.kind == "emergency" and row.phase == "done"
    for node in ("a1", "b1"):
        rep.report(node)

    # what undid it before: the tick at the end of the downshift, with a load an auto gear shifts up for
    heavy_load()
    for trigger in ("ended", "periodic", "topology", "periodic"):
        assert ticks.tick(trigger=trigger)["started"] == [], trigger
    dep = Deployment.objects.get(name="chat")
    assert dep.current_gear == dep.baseline_gear and dep.mode == "emergency" and dep.emergency_requested_at is None
    held = Decision.objects.filter(deployment=dep, trigger__in=("periodic", "topology", "load")).first()
    assert held is not None and held.outcome == "stay"
    assert held.reasons == ["emergency: holds its gear until an operator releases it"]
    assert do_emergency_downshift("chat", reason="again", actor="system:oncall").state == "holding"
    assert audits("gearbox.emergency_requested") == 1 and audits("gearbox.emergency_repeated") == 2

    # released, the gearbox is free again: the same load now shifts the gear up
    do_release_emergency("chat", actor="system:oncall")
    dep = Deployment.objects.get(name="chat")
    assert (dep.mode, dep.pinned_gear) == ("auto", None) and audits("gearbox.emergency_released") == 1
    assert ticks.tick()["started"] == ["chat#4"]
    assert_clean(django_log("chat", agents.log), complete=False)


def test_a_blocked_emergency_changes_nothing_says_why_and_offers_the_best_safe_gear() -> None:
    rep, agents = moved_off_the_baseline()
    rep.gone = {"GPU-a1-0"}  # another tenant takes a GPU of the baseline
    rep.report("a1")
    out = do_emergency_downshift("chat", reason="latency alarm", actor="system:oncall")
    assert out.state == "blocked" and out.decision is not None
    assert out.reasons[0].startswith("emergency: the baseline gear cannot run on this snapshot: ")
    assert "set a new baseline, or downshift to the planner's best safe gear" in out.reasons[1]
    dep = Deployment.objects.get(name="chat")
    assert dep.mode == "auto" and dep.emergency_requested_at is None and dep.pinned_gear is None
    assert Transition.objects.filter(deployment=dep, kind="emergency").count() == 0
    assert out.decision.outcome == "blocked" and out.decision.trigger == "emergency"
    blocked = AuditEntry.objects.get(event_type="gearbox.emergency_blocked")
    assert blocked.actor == "system:oncall" and blocked.decision_id == out.decision.pk
    offer = out.offers[0]
    assert offer["label"] == OFFER_LABEL and offer["gear_id"] != present.gear_id_of(dep.baseline_gear)
    assert "GPU-a1-0" not in str(offer) and offer["name"].startswith("TP")

    with pytest.raises(Rejected) as exc:
        do_emergency_downshift("chat", reason="x", actor="system:oncall", gear_id="g-0000000000000000")
    assert exc.value.status == 409 and "gear_id" in exc.value.errors

    taken = do_emergency_downshift("chat", reason="latency alarm", actor="system:oncall", gear_id=offer["gear_id"])
    assert taken.state == "requested"
    assert ticks.tick(trigger="emergency", deployment="chat")["started"] == ["chat#3"]
    drive(agents)
    dep = Deployment.objects.get(name="chat")
    assert present.gear_id_of(dep.current_gear) == offer["gear_id"] == present.gear_id_of(dep.pinned_gear)
    assert dep.mode == "emergency"
    shown = present.deployment_payload(dep, present.DeploymentContext.load([dep]))["emergency"]
    assert shown["state"] == "holding" and shown["target"]["gear_id"] == offer["gear_id"]
    assert shown["on_baseline"] is False


def test_an_emergency_blocked_at_its_tick_stays_pending_and_shows_blocked() -> None:
    rep, agents = moved_off_the_baseline()
    assert do_emergency_downshift("chat", reason="latency alarm", actor="system:oncall").state == "requested"
    rep.gone = {"GPU-a1-1"}  # between the request and its tick, the baseline lost a GPU
    rep.report("a1")
    for _ in range(3):
        assert ticks.tick(trigger="emergency", deployment="chat")["started"] == []
    dep = Deployment.objects.get(name="chat")
    assert dep.emergency_requested_at is not None and dep.mode == "emergency"
    assert Decision.objects.filter(deployment=dep, outcome="blocked", trigger="emergency").count() == 1  # once
    shown = present.deployment_payload(dep, present.DeploymentContext.load([dep]))
    assert shown["emergency"]["state"] == "blocked"
    assert shown["emergency"]["blocked"][0].startswith("emergency: the baseline gear cannot run")
    assert "a1/1" in shown["emergency"]["blocked"][0]  # the GPU by node/index, not by uuid
    assert shown["emergency"]["offers"] and shown["health"]["state"] == "degraded"
    rep.gone = set()  # the tenant gives it back: the next tick starts the downshift
    rep.report("a1")
    assert ticks.tick(trigger="periodic")["started"] == ["chat#3"]


def test_an_emergency_during_a_running_transition_rolls_it_back_first() -> None:
    rep = enroll_fleet()
    make_deployment()
    agents = SimAgents()
    assert ticks.tick()["started"] == ["chat#1"]
    drive(agents)
    do_request_gear("chat", gear("b1", [0, 1, 2, 3]), actor="system:test")
    ex = build_executor()
    while Transition.objects.get(seq=2).step not in ("canary", "flip", "freeze"):
        ex.advance("chat")
        agents.run()
    assert do_emergency_downshift("chat", reason="bad canary", actor="system:oncall").state == "requested"
    assert ticks.tick(trigger="emergency", deployment="chat")["started"] == []  # it waits for the rollback
    rolled = drive(agents)
    assert rolled.seq == 2 and rolled.phase == "rolled_back" and "emergency" in rolled.error
    rep.report("a1")
    assert ticks.tick(trigger="ended", deployment="chat")["started"] == []  # already on the baseline
    dep = Deployment.objects.get(name="chat")
    assert dep.current_gear == dep.baseline_gear and dep.emergency_requested_at is None and dep.mode == "emergency"
    latest = Decision.objects.filter(deployment=dep, trigger="emergency").first()
    assert latest is not None and latest.outcome == "stay"
    assert_clean(django_log("chat", agents.log), complete=False)


def test_while_an_emergency_holds_only_its_release_hands_the_gear_back(operator: Any, viewer: Any) -> None:
    moved_off_the_baseline()
    with pytest.raises(Rejected) as exc:
        do_release_emergency("chat", actor=operator.user)
    assert exc.value.status == 409 and "holds no emergency" in exc.value.errors["mode"]
    do_pin_gear("chat", actor=operator.user)
    do_emergency_downshift("chat", reason="drill", actor=operator.user)  # a pin does not stop it
    for verb in (lambda: do_set_mode("chat", "auto", actor=operator.user),
                 lambda: do_unpin_gear("chat", actor=operator.user),
                 lambda: do_pin_gear("chat", actor=operator.user),
                 lambda: do_request_gear("chat", gear("b1", [4, 5]), actor=operator.user)):
        with pytest.raises(Rejected) as exc:
            verb()
        assert exc.value.status == 409 and "release it first" in exc.value.errors["mode"]
    with pytest.raises(Rejected) as exc:
        do_release_emergency("chat", actor=viewer.user)
    assert exc.value.status == 403
    with pytest.raises(Rejected) as exc:
        do_release_emergency("chat", actor=operator.user, mode="turbo")
    assert exc.value.status == 400 and "mode" in exc.value.errors
    dep = do_release_emergency("chat", actor=operator.user, mode="pinned")
    assert dep.mode == "pinned" and dep.pinned_gear == dep.current_gear and dep.emergency_requested_at is None
    entry = AuditEntry.objects.get(event_type="gearbox.emergency_released")
    assert entry.actor == "user:oscar" and entry.at <= timezone.now()
