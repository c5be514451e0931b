"""Operator actions and the gearbox tick: modes, pinning, approval, topology events (emergency: test_emergency.py)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from django.utils import timezone

from console.audit.models import AuditEntry
from console.fleet.actions import Rejected
from console.gearbox import ticks
from console.gearbox.actions import (
    do_approve_decision,
    do_pin_gear,
    do_request_gear,
    do_set_mode,
    do_unpin_gear,
    scheduler_deployment,
)
from console.gearbox.emergency import do_emergency_downshift
from console.gearbox.executor import build_executor
from console.gearbox.models import Decision, Deployment, Transition
from scheduler.invariants import assert_clean
from scheduler.plan import Gear
from tests.console.gearbox.harness import M8, SimAgents, django_log, enroll_fleet, gear, make_deployment

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


def bring_up(agents: SimAgents, name: str = "chat") -> Transition:
    out = ticks.tick()
    assert f"{name}#1" in out["started"], out  # type: ignore[operator]
    return drive(agents, name)


def audits(event_type: str) -> int:
    return AuditEntry.objects.filter(event_type=event_type).count()


# --- the first tick ----------------------------------------------------------------------------
def test_the_first_tick_brings_each_baseline_up_as_a_transition_with_its_decision() -> None:
    enroll_fleet()
    make_deployment("chat", baseline=gear("a1", [0, 1]))
    make_deployment("other", baseline=gear("b1", [0, 1]))
    agents = SimAgents()
    out = ticks.tick()
    assert sorted(out["started"]) == ["chat#1", "other#1"]  # type: ignore[arg-type]
    row = drive(agents, "chat")
    drive(agents, "other")
    assert row.phase == "done" and row.kind == "auto" and row.decision is not None
    assert row.decision.outcome == "switch" and "baseline" in row.decision.reasons[0]
    assert Deployment.objects.get(name="chat").current_gear == gear("a1", [0, 1]).to_dict()
    # nothing to decide while nothing changed: the next tick records decisions and starts nothing
    assert ticks.tick()["started"] == []


def test_nothing_is_placed_on_gpus_whose_agent_has_not_reported_yet() -> None:
    from agents.protocol import GpuInfo, RegisterRequest
    from console.fleet.actions import do_register_node
    from tests.builders import JOIN_TOKEN
    from tests.console.gearbox.harness import FleetReporter

    do_register_node(RegisterRequest("a1", "a1.test", "test", tuple(GpuInfo(f"GPU-a1-{i}", i, "H100-SXM", 80 * 2**30,
                                                                             "nvl0") for i in range(8)), rack="A"),
                     token=JOIN_TOKEN, now=timezone.now())
    make_deployment()
    assert ticks.tick()["started"] == [] and not Decision.objects.exists()
    FleetReporter().report("a1")
    assert ticks.tick()["started"] == ["chat#1"]
    assert Transition.objects.get().to_gear == gear("a1", [0, 1]).to_dict()


def test_a_lost_gpu_makes_the_next_topology_tick_move_the_gear_at_once() -> None:
    rep = enroll_fleet()
    make_deployment()
    agents = SimAgents()
    bring_up(agents)
    rep.gone = {"GPU-a1-1"}  # another tenant takes a GPU of the running plan
    rep.report("a1")
    agents.fleet.lose_gpus(["GPU-a1-1"])
    out = ticks.tick(trigger="topology")
    assert out["started"] == ["chat#2"], out
    row = drive(agents)
    assert row.phase == "done" and row.decision.trigger == "topology"  # type: ignore[union-attr]
    now = Deployment.objects.get(name="chat").current_gear
    assert "GPU-a1-1" not in str(now)
    # a forced move starts no cooldown: the next load change may move the gear at once
    assert scheduler_deployment(Deployment.objects.get(name="chat")).last_switch_times_s == ()
    assert_clean(django_log("chat", agents.log), complete=False)


def restart_agent(node_id: str, runs: tuple[str, ...] = ()) -> int:
    """The agent of `node_id` comes back (a new process: a new epoch), running `runs`. It registers with
    its own token (the harness keeps none: an operator-issued one stands in for the kept one)."""
    from agents.protocol import GpuInfo, RegisterRequest
    from console.fleet.actions import do_issue_agent_token, do_register_node

    req = RegisterRequest(node_id, f"{node_id}.test", "test", tuple(
        GpuInfo(f"GPU-{node_id}-{i}", i, "H100-SXM", 80 * 2**30, "nvl0") for i in range(8)),
        rack="A", data_addr=f"{node_id}.test:7070", plans=runs)
    _, token = do_issue_agent_token(node_id, actor="system:test", now=timezone.now())
    return do_register_node(req, token=token, now=timezone.now()).node.epoch


def test_a_plan_its_agent_came_back_without_leaves_the_gear_and_the_gearbox_brings_one_up() -> None:
    from console.fleet.models import Node
    from console.gearbox.models import GpuReservation

    rep = enroll_fleet()
    make_deployment()
    agents = SimAgents()
    bring_up(agents)
    dep = Deployment.objects.get(name="chat")
    lost = Gear.from_dict(dep.current_gear).plans[0].plan_id
    assert GpuReservation.objects.filter(plan_id=lost).count() == 2
    epoch = restart_agent("a1")
    assert Node.objects.get(node_id="a1").lost_plans == {lost: epoch} and audits("fleet.plans_lost") == 1
    rep.report("a1")

    out = ticks.tick(trigger="topology")

    # dropped (routing bumped, bookings freed), and with nothing left the baseline comes up again
    entry = json.loads(AuditEntry.objects.get(event_type="gearbox.plans_lost").body)
    assert entry["before"]["version"] == dep.routing_version and entry["after"] == {
        "version": dep.routing_version + 1, "current_gear_id": None}
    assert out["started"] == ["chat#2"], out
    row = drive(agents)
    assert row.phase == "done" and row.from_gear is None and row.decision.trigger == "topology"  # type: ignore[union-attr]
    assert Deployment.objects.get(name="chat").current_gear == dep.current_gear  # the same plan, prepared again
    # prepared again after the registration: alive, not lost a second time
    assert ticks.tick()["started"] == [] and audits("gearbox.plans_lost") == 1
    assert GpuReservation.objects.filter(plan_id=lost).count() == 2


def running_on(agents: SimAgents, node_id: str) -> set[str]:
    """The plans a running agent of `node_id` says it runs: those with an engine on its GPUs."""
    return agents.fleet.sim.plans_on(node_id)


def test_a_plan_that_dies_under_a_running_agent_leaves_the_gear_and_its_requests_are_served(
        monkeypatch: pytest.MonkeyPatch, django_capture_on_commit_callbacks: Any) -> None:
    from console.fleet import live
    from console.fleet.models import Node
    from console.gearbox.actions import lost_plans
    from console.gearbox.models import GpuReservation

    rep = enroll_fleet()
    make_deployment()
    agents = SimAgents()
    bring_up(agents)
    dep = Deployment.objects.get(name="chat")
    dead = Gear.from_dict(dep.current_gear).plans[0]
    for i in range(6):
        assert agents.fleet.submit("chat", 200 + 40 * i, 400) is not None
    agents.run(0.05)
    # its GPU fails and comes back while the agent keeps running: the plan is gone, the gear looks valid
    agents.fleet.lose_gpus([dead.gpu_uuids[0]], how="failed")
    agents.fleet.restore_gpus([dead.gpu_uuids[0]])
    assert dead.plan_id not in running_on(agents, "a1") and agents.fleet.open_sequences() == 6
    rep.report("a1")  # an agent that does not say what it runs: nothing is assumed lost
    assert Node.objects.get(node_id="a1").lost_plans == {}
    assert ticks.tick(trigger="topology")["started"] == []

    pushed: list[bool] = []
    monkeypatch.setattr(live, "push_report", lambda delta, *, node_id, topology_changed: pushed.append(
        topology_changed))
    with django_capture_on_commit_callbacks(execute=True):
        rep.report("a1", plans=running_on(agents, "a1"))  # the running agent's report says it
    node = Node.objects.get(node_id="a1")
    assert node.lost_plans == {dead.plan_id: node.epoch} and audits("fleet.plans_lost") == 1
    assert pushed == [True]  # a topology event: the gearbox ticks at once
    rep.report("a1", plans=running_on(agents, "a1"))  # said again: noted once
    assert audits("fleet.plans_lost") == 1

    out = ticks.tick(trigger="topology")

    assert audits("gearbox.plans_lost") == 1 and out["started"] == ["chat#2"], out
    row = drive(agents)
    assert row.phase == "done" and row.from_gear is None and row.decision.trigger == "topology"  # type: ignore[union-attr]
    assert GpuReservation.objects.filter(plan_id=dead.plan_id).count() == 2  # the same plan, prepared again
    assert lost_plans(Deployment.objects.get(name="chat")) == {}  # prepared after the loss: alive, before any report
    rep.report("a1", plans=running_on(agents, "a1"))
    assert Node.objects.get(node_id="a1").lost_plans == {}
    assert ticks.tick()["started"] == [] and audits("gearbox.plans_lost") == 1
    # the requests that were on it waited and are served by the new gear: none lost
    agents.run_out()
    assert agents.fleet.open_sequences() == 0 and not agents.fleet.sim.recorder.failed
    assert_clean(django_log("chat", agents.log))


def test_of_two_plans_the_one_left_takes_all_the_traffic_and_a_running_transition_goes_first() -> None:
    from console.gearbox.actions import drop_lost_plans

    rep = enroll_fleet()
    two = Gear(M8.name, gear("a1", [0, 1]).plans + gear("b1", [0, 1]).plans, (0.5, 0.5))
    make_deployment(baseline=two)
    agents = SimAgents()
    bring_up(agents)
    do_pin_gear("chat", actor="system:test")  # only the loss moves it
    restart_agent("b1")
    rep.report("b1")
    _, started = do_request_gear("chat", gear("a1", [2, 3]), actor="system:test", reason="busy")
    assert started is not None
    assert drop_lost_plans("chat", now=timezone.now()) == []  # not while a transition runs
    drive(agents)
    dep = Deployment.objects.get(name="chat")
    assert [r["nodes"] for r in dep.routing] == [["a1"]]  # it ended on a1's plan: nothing of b1 left to drop

    do_request_gear("chat", two, actor="system:test", reason="back to two")
    drive(agents)
    restart_agent("b1")
    rep.report("b1")
    b1_plan = two.plans[1].plan_id
    assert drop_lost_plans("chat", now=timezone.now()) == [b1_plan]
    dep = Deployment.objects.get(name="chat")
    assert [(r["nodes"], r["weight"]) for r in dep.routing] == [(["a1"], 1.0)]
    assert Gear.from_dict(dep.current_gear) == Gear(M8.name, two.plans[:1], (1.0,))
    assert drop_lost_plans("chat", now=timezone.now()) == []  # idempotent


def test_a_pinned_deployment_is_never_switched_automatically() -> None:
    rep = enroll_fleet()
    make_deployment()
    agents = SimAgents()
    bring_up(agents)
    do_pin_gear("chat", actor="system:test")
    rep.gone = {"GPU-a1-1"}
    rep.report("a1")
    out = ticks.tick(trigger="topology")
    assert out["started"] == []
    latest = Decision.objects.filter(deployment__name="chat").first()
    assert latest is not None and latest.outcome == "blocked" and any("pinned" in r for r in latest.reasons)


def test_advisory_mode_records_the_advice_and_starts_only_on_approval() -> None:
    rep = enroll_fleet()
    make_deployment()
    agents = SimAgents()
    bring_up(agents)
    do_set_mode("chat", "advisory", actor="system:test")
    rep.gone = {"GPU-a1-1"}
    rep.report("a1")
    assert ticks.tick(trigger="topology")["started"] == []
    advice = Decision.objects.filter(deployment__name="chat", approval=Decision.PENDING).get()
    assert advice.outcome == "advise" and advice.target_gear_id
    started = do_approve_decision(advice, actor="system:test")
    assert started.kind == "approved" and started.decision_id == advice.pk
    with pytest.raises(Rejected) as exc:
        do_approve_decision(advice, actor="system:test")
    assert "decision" in exc.value.errors
    row = drive(agents)
    assert row.phase == "done" and audits("gearbox.decision_approved") == 1


def test_an_approval_of_a_stale_decision_is_refused_and_changes_nothing() -> None:
    rep = enroll_fleet()
    make_deployment()
    agents = SimAgents()
    bring_up(agents)
    do_set_mode("chat", "advisory", actor="system:test")
    rep.gone = {"GPU-a1-1"}
    rep.report("a1")
    ticks.tick(trigger="topology")
    advice = Decision.objects.get(deployment__name="chat", approval=Decision.PENDING)
    # meanwhile an operator moved the deployment elsewhere by hand
    do_request_gear("chat", gear("b1", [4, 5]), actor="system:test")
    drive(agents)
    with pytest.raises(Rejected, match="stale"):
        do_approve_decision(advice, actor="system:test")
    assert Transition.objects.filter(kind="approved").count() == 0


def test_only_operators_steer_and_bad_input_names_the_field(viewer: Any, operator: Any) -> None:
    enroll_fleet()
    make_deployment()
    before = AuditEntry.objects.count()
    with pytest.raises(Rejected) as exc:
        do_set_mode("chat", "advisory", actor=viewer.user)
    assert exc.value.status == 403
    with pytest.raises(Rejected) as exc:
        do_set_mode("chat", "turbo", actor=operator.user)
    assert "mode" in exc.value.errors
    with pytest.raises(Rejected) as exc:
        do_emergency_downshift("chat", reason="  ", actor=operator.user)
    assert "reason" in exc.value.errors
    with pytest.raises(Rejected) as exc:
        do_request_gear("chat", {"model": "x"}, actor=operator.user)
    assert any(k.startswith("gear") for k in exc.value.errors)
    with pytest.raises(Rejected) as exc:
        do_pin_gear("chat", actor=operator.user)  # nothing runs yet
    assert "current_gear" in exc.value.errors
    assert AuditEntry.objects.count() == before
    assert Deployment.objects.get(name="chat").mode == "auto"
    do_set_mode("chat", "advisory", actor=operator.user)
    entry = AuditEntry.objects.get(event_type="gearbox.mode_set")
    assert entry.actor == "user:oscar" and entry.user_id == operator.user.pk


def test_pin_and_unpin_are_audited_and_unpin_restores_automatic_mode() -> None:
    enroll_fleet()
    make_deployment()
    agents = SimAgents()
    bring_up(agents)
    dep = do_pin_gear("chat", actor="system:test")
    assert dep.mode == "pinned" and dep.pinned_gear == dep.current_gear
    do_pin_gear("chat", actor="system:test")  # again: nothing new
    assert audits("gearbox.gear_pinned") == 1
    dep = do_unpin_gear("chat", actor="system:test")
    assert dep.mode == "auto" and dep.pinned_gear is None and audits("gearbox.gear_unpinned") == 1


def test_a_decision_row_keeps_every_candidate_with_gain_cost_and_factor() -> None:
    rep = enroll_fleet()
    make_deployment()
    agents = SimAgents()
    bring_up(agents)
    rep.gone = {"GPU-a1-0"}
    rep.report("a1")
    ticks.tick(trigger="topology")
    d = Decision.objects.filter(deployment__name="chat", outcome="switch").first()
    assert d is not None and d.candidates
    first = d.candidates[0]
    assert {"gear_id", "shape", "gain_tokens", "cost_tokens", "threshold_tokens", "factor", "passes"} <= set(first)
    assert d.decision["outcome"] == "switch" and d.at <= timezone.now()
    entry = AuditEntry.objects.filter(event_type="gearbox.decision", decision_id=d.pk).get()
    assert entry.deployment == "chat"


def test_the_gearbox_waits_for_reports_that_show_what_the_last_transition_left() -> None:
    rep = enroll_fleet()
    make_deployment()
    agents = SimAgents()
    bring_up(agents)
    do_request_gear("chat", gear("a1", [0]), actor="system:test")  # a narrower plan on one of its GPUs
    drive(agents)
    # the agents' last reports predate the end of the transition: the old plan's memory still shows
    rep.extra = {"GPU-a1-0": 70 * 2**30}
    Transition.objects.filter(seq=2).update(finished_at=timezone.now())
    before = Decision.objects.count()
    assert ticks.tick()["started"] == [] and Decision.objects.count() == before  # nothing decided on it
    rep.extra = {}
    rep.report("a1")  # the agent reports what it holds now
    ticks.tick()
    assert Decision.objects.count() == before + 1
    assert Transition.objects.count() == 2


def test_load_is_not_sampled_while_a_switch_runs_nor_right_after_it(settings: Any) -> None:
    from datetime import timedelta

    from console.fleet.models import Node

    settings.FLEXPIPE_REPORT_INTERVAL_S = 15
    enroll_fleet()
    make_deployment()
    agents = SimAgents()
    bring_up(agents)
    plan_id = Deployment.objects.get(name="chat").routing[0]["plan_id"]
    Node.objects.filter(node_id="a1").update(engines=[{"plan_id": plan_id, "running": 0, "waiting": 0,
                                                       "tokens_per_s": 0.0, "kv_usage": 0.0, "arrivals": 0}])
    ticks.tick()
    assert Deployment.objects.get(name="chat").load_window == {}  # the plan has just come up
    ticks.tick(now=timezone.now() + timedelta(seconds=16))
    assert len(Deployment.objects.get(name="chat").load_window["samples"]) == 1
