"""Deleting a deployment (admin): at once when nothing of it runs on an agent that answers, else drained
first - routing emptied, its plans released, the row gone once they are (console/gearbox/lifecycle.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from console.audit.models import AuditEntry
from console.fleet.models import AgentCommand, Node
from console.gearbox import ticks
from console.gearbox.models import Decision, Deployment, Transition
from tests.console.gearbox.harness import enroll_fleet, make_deployment
from tests.console.gearbox.ops import running_deployment
from tests.console.people import Person

pytestmark = pytest.mark.django_db


def delete(client: Client, name: str = "chat") -> Any:
    return client.delete(f"/api/v1/deployments/{name}")


def test_a_deployment_that_runs_nothing_is_deleted_at_once_and_its_audit_stays(admin: Person) -> None:
    enroll_fleet()
    make_deployment()
    resp = delete(admin.api())
    assert resp.status_code == 204
    assert not Deployment.objects.exists()
    entry = AuditEntry.objects.get(event_type="gearbox.deployment_deleted")
    assert entry.actor == "user:alice" and entry.deployment == "chat" and "nothing of it runs" in entry.summary
    assert AuditEntry.objects.filter(event_type="gearbox.deployment_created", deployment="chat").exists()


def test_a_deployment_whose_agents_are_gone_is_deleted_at_once(admin: Person) -> None:
    running_deployment(moved=False)
    Node.objects.update(schedulable=False, unschedulable_reason="heartbeat timeout")  # the old simulator died
    assert delete(admin.api()).status_code == 204
    assert not Deployment.objects.exists() and not Transition.objects.exists() and not Decision.objects.exists()


def test_a_running_deployment_is_drained_then_deleted(admin: Person) -> None:
    world = running_deployment(moved=False)
    for _ in range(3):
        world.agents.fleet.submit("chat", 200, 50)
    before = Deployment.objects.get(name="chat")
    resp = delete(admin.api())
    assert resp.status_code == 202 and resp.json() == {"state": "draining"}
    dep = Deployment.objects.get(name="chat")
    assert dep.routing == [] and dep.routing_version == before.routing_version + 1 and dep.deleting_since
    releases = AgentCommand.objects.filter(kind="release_plan", key__startswith="gearbox.delete/")
    assert [c.node.node_id for c in releases] == ["a1"] and releases[0].payload["drain_timeout_s"] > 0
    assert delete(admin.api()).status_code == 202  # again: nothing new
    assert AgentCommand.objects.filter(kind="release_plan", key__startswith="gearbox.delete/").count() == 1
    assert ticks.tick()["started"] == [] and Deployment.objects.filter(name="chat").exists()  # not decided on
    world.agents.run(15.0)  # the agent releases the plan (its requests finish or end explicitly) and acks
    out = ticks.tick()
    assert out.get("deleted") == ["chat"] and not Deployment.objects.exists()
    assert "its plans are released" in AuditEntry.objects.get(event_type="gearbox.deployment_deleted").summary
    assert AuditEntry.objects.get(event_type="gearbox.deployment_draining").actor == "user:alice"


def test_a_release_nobody_answers_ends_the_wait_and_says_so(admin: Person, settings: Any) -> None:
    settings.FLEXPIPE_DRAIN_BUDGET_S, settings.FLEXPIPE_STEP_TIMEOUT_S = 0.0, 0.0
    running_deployment(moved=False)
    assert delete(admin.api()).status_code == 202
    Deployment.objects.filter(name="chat").update(deleting_since=timezone.now() - timezone.timedelta(seconds=1))
    assert ticks.tick().get("deleted") == ["chat"]
    assert "1 release(s) unanswered" in AuditEntry.objects.get(event_type="gearbox.deployment_deleted").summary


def test_deleting_needs_the_admin_role_and_waits_for_a_running_transition(admin: Person, operator: Person,
                                                                         viewer: Person) -> None:
    world = running_deployment(moved=False)
    for person in (operator, viewer):
        assert delete(person.api()).status_code == 403
    assert delete(Client()).status_code == 401
    assert delete(admin.api(), "nope").status_code == 404
    resp = admin.api().post("/api/v1/deployments/chat/override",
                            json.dumps({"spec": {"plans": [{"stages": [{"gpus": ["b1/0", "b1/1"]}]}]}}),
                            content_type="application/json")
    assert resp.status_code == 201
    busy = delete(admin.api())
    assert busy.status_code == 409 and "transition #2" in busy.json()["deployment"][0]
    assert Deployment.objects.get(name="chat").deleting_since is None
    world.agents.run()
