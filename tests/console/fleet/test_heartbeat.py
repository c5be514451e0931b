from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from console.fleet import actions
from console.fleet.models import Node
from tests.builders import report_body
from tests.console.conftest import AgentHTTP, enroll

pytestmark = pytest.mark.django_db


def test_a_node_silent_past_the_timeout_becomes_unschedulable(agent: AgentHTTP) -> None:
    later = timezone.now() + timedelta(seconds=46)
    assert actions.do_sweep_heartbeats(now=later, timeout_s=45) == ["a1"]
    node = Node.objects.get(node_id="a1")
    assert not node.schedulable and "45 s" in node.unschedulable_reason


def test_a_node_that_reported_recently_stays_schedulable(agent: AgentHTTP) -> None:
    assert actions.do_sweep_heartbeats(now=timezone.now() + timedelta(seconds=30), timeout_s=45) == []
    assert Node.objects.get(node_id="a1").schedulable


def test_only_the_silent_node_is_marked(agent: AgentHTTP, client) -> None:  # type: ignore[no-untyped-def]
    enroll(client, "b1")
    Node.objects.filter(node_id="a1").update(last_seen_at=timezone.now() - timedelta(minutes=5))
    assert actions.do_sweep_heartbeats(now=timezone.now(), timeout_s=45) == ["a1"]
    assert Node.objects.get(node_id="b1").schedulable


def test_a_report_after_the_timeout_brings_the_node_back(agent: AgentHTTP) -> None:
    actions.do_sweep_heartbeats(now=timezone.now() + timedelta(minutes=5), timeout_s=45)
    assert agent.post("/agent/v1/report", report_body()).status_code == 200
    node = Node.objects.get(node_id="a1")
    assert node.schedulable and node.unschedulable_reason == ""


def test_sweeping_twice_marks_nothing_more(agent: AgentHTTP) -> None:
    later = timezone.now() + timedelta(minutes=5)
    assert actions.do_sweep_heartbeats(now=later, timeout_s=45) == ["a1"]
    assert actions.do_sweep_heartbeats(now=later, timeout_s=45) == []


def test_losing_and_regaining_a_node_is_audited(agent: AgentHTTP) -> None:
    from console.audit.chain import verify_chain
    from console.audit.models import AuditEntry

    actions.do_sweep_heartbeats(now=timezone.now() + timedelta(minutes=5), timeout_s=45)
    agent.post("/agent/v1/report", report_body())
    assert list(AuditEntry.objects.values_list("event_type", "actor")) == [
        ("fleet.node_registered", "agent:a1"),
        ("fleet.node_unschedulable", "system:heartbeat"),
        ("fleet.node_schedulable", "agent:a1"),
    ]
    assert verify_chain().ok
