"""A plan over two nodes that one of them loses: the other is told to release its stage, and its GPUs
stay booked until it answers (console/gearbox/lost_release.py)."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from agents.protocol import GpuInfo, RegisterRequest, check_payload
from console.audit.models import AuditEntry
from console.fleet.actions import do_ack_command, do_issue_agent_token, do_register_node, do_sweep_heartbeats
from console.fleet.models import AgentCommand, Node
from console.gearbox import lost_release, tasks, ticks
from console.gearbox.actions import held_gpus
from console.gearbox.models import Deployment, GpuReservation, Transition
from scheduler.plan import Gear
from tests.console.gearbox.harness import FleetReporter, SimAgents, enroll_fleet, make_deployment, uuid
from tests.console.gearbox.ops import drive
from tests.console.gearbox.test_worker_crash import two_node_gear  # PP2 over b1 (GPUs 0-1) and a1 (4-5)

pytestmark = pytest.mark.django_db

STAGE_ON_A1 = {uuid("a1", 4), uuid("a1", 5)}  # the stage the node that keeps running holds


def restart_agent(node_id: str) -> None:
    """The agent of `node_id` comes back (a new process: a new epoch) running nothing. It registers
    with its own token (an operator-issued one stands in for the one it kept)."""
    req = RegisterRequest(node_id, f"{node_id}.test", "test", tuple(
        GpuInfo(uuid(node_id, i), i, "H100-SXM", 80 * 2**30, "nvl0") for i in range(8)),
        rack="A", data_addr=f"{node_id}.test:7070", plans=())
    _, token = do_issue_agent_token(node_id, actor="system:test", now=timezone.now())
    do_register_node(req, token=token, now=timezone.now())


def releases() -> list[AgentCommand]:
    return list(AgentCommand.objects.filter(kind="release_plan", key__startswith="gearbox.lost/")
                .select_related("node").order_by("id"))


def booked(plan_id: str) -> set[str]:
    return set(GpuReservation.objects.filter(plan_id=plan_id).values_list("gpu_uuid", flat=True))


def entries(event_type: str) -> list[dict[str, Any]]:
    return [json.loads(e.body) for e in AuditEntry.objects.filter(event_type=event_type).order_by("seq")]


def b1_loses_the_plan() -> tuple[str, FleetReporter]:
    """chat runs the two-node gear; b1's agent comes back without it and a topology tick follows.
    Returns the lost plan's id and the reporter."""
    rep = enroll_fleet({"a1": "A", "b1": "A"})
    make_deployment(baseline=two_node_gear())
    agents = SimAgents()
    assert ticks.tick()["started"] == ["chat#1"]
    assert drive(agents).phase == "done"
    lost = two_node_gear().plans[0].plan_id
    assert booked(lost) == STAGE_ON_A1 | {uuid("b1", 0), uuid("b1", 1)}
    rep.report("a1")  # what the bring-up left is reported: the gearbox decides on it (the loop's rule 6)
    restart_agent("b1")
    rep.report("b1")
    ticks.tick(trigger="topology")  # (the agents act no more: each answer below is the test's)
    assert not any(r.get("plan_id") == lost for r in Deployment.objects.get(name="chat").routing)
    return lost, rep


def test_the_node_that_still_runs_the_plan_is_told_once_to_release_it_and_its_gpus_stay_booked() -> None:
    lost, _ = b1_loses_the_plan()

    [cmd] = releases()
    assert cmd.node.node_id == "a1" and cmd.deployment == "chat" and cmd.state == AgentCommand.PENDING
    assert cmd.payload == {"plan_id": lost, "deployment": "chat", "drain_timeout_s": 0.0}
    check_payload(cmd.kind, cmd.payload)  # what the agent accepts
    assert cmd.key.startswith(f"gearbox.lost/chat/{lost}/a1/")
    # b1 lost it: its GPUs are free; a1 still holds its stage: booked, for the others and for chat itself
    assert booked(lost) == STAGE_ON_A1
    assert STAGE_ON_A1 <= held_gpus()["chat"]
    assert lost_release.kept_booked(Deployment.objects.get(name="chat")) == STAGE_ON_A1
    # the gear that replaces it is planned elsewhere (the old stage's memory is still a1's)
    [replacing] = Transition.objects.filter(deployment__name="chat", seq__gt=1)
    assert not STAGE_ON_A1 & set(Gear.from_dict(replacing.to_gear).gpu_uuids)

    [entry] = entries("gearbox.lost_plan_released")
    assert entry["deployment"] == "chat" and entry["data"]["node_id"] == "a1" and entry["data"]["plan_id"] == lost
    assert entry["data"]["lost_on"] == ["b1"] and entry["data"]["gpus"] == sorted(STAGE_ON_A1)
    assert entry["data"]["command_id"] == cmd.pk
    [dropped] = entries("gearbox.plans_lost")
    assert dropped["data"]["released_on"] == {lost: ["a1"]}

    ticks.tick(trigger="topology")
    ticks.tick()
    assert releases() == [cmd] and len(entries("gearbox.lost_plan_released")) == 1  # nothing queued twice
    assert booked(lost) == STAGE_ON_A1  # nobody answered yet: still booked


def test_the_release_acked_frees_the_booking_and_asks_for_a_tick(
        monkeypatch: pytest.MonkeyPatch, django_capture_on_commit_callbacks: Any) -> None:
    lost, _ = b1_loses_the_plan()
    [cmd] = releases()
    asked: list[dict[str, Any]] = []
    monkeypatch.setattr(tasks, "enqueue", lambda task, **kw: asked.append({"task": task, **kw}))

    with django_capture_on_commit_callbacks(execute=True):
        do_ack_command(cmd.node, cmd.pk, status="ok", detail="", now=timezone.now(),
                       result={"plan_id": lost, "freed_bytes": 2 * 30 * 2**30, "failed": [], "handed_over": []})

    assert {"task": tasks.tick, "trigger": "periodic", "deployment": "chat"} in asked
    assert booked(lost) == STAGE_ON_A1  # freed by that tick, not before
    ticks.tick(deployment="chat")
    assert booked(lost) == set()
    assert lost_release.kept_booked(Deployment.objects.get(name="chat")) == frozenset()
    [freed] = entries("gearbox.lost_plan_freed")
    assert freed["data"] == {"plan_id": lost, "node_id": "a1", "why": "acked", "command_id": cmd.pk,
                             "gpus": sorted(STAGE_ON_A1)}
    ticks.tick()
    assert len(entries("gearbox.lost_plan_freed")) == 1


def test_a_failed_ack_of_the_release_frees_the_booking_too() -> None:
    lost, _ = b1_loses_the_plan()
    [cmd] = releases()

    do_ack_command(cmd.node, cmd.pk, status="failed", detail="engine gone", now=timezone.now(),
                   result={"reason": "failed"})
    ticks.tick(deployment="chat")

    assert booked(lost) == set()
    assert [e["data"]["why"] for e in entries("gearbox.lost_plan_freed")] == ["failed"]


def test_the_node_told_to_release_that_is_lost_itself_frees_the_booking() -> None:
    lost, _ = b1_loses_the_plan()
    [cmd] = releases()
    ticks.tick(trigger="topology")
    assert booked(lost) == STAGE_ON_A1

    # a1 falls silent past the heartbeat timeout; b1 keeps reporting
    Node.objects.filter(node_id="a1").update(last_seen_at=timezone.now() - timedelta(hours=1))
    assert do_sweep_heartbeats(now=timezone.now()) == ["a1"]
    ticks.tick(trigger="topology")

    assert booked(lost) == set()
    assert AgentCommand.objects.get(pk=cmd.pk).state in AgentCommand.OPEN_STATES  # never answered
    [freed] = entries("gearbox.lost_plan_freed")
    assert freed["data"]["why"] == "node_lost" and freed["data"]["node_id"] == "a1"
