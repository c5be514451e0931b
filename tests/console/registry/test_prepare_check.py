"""Remote weights checked by the agent that loads them: the node agent (agents/node/daemon.py, a real
one with the torch backend) hashes the weights before loading them and its prepare_plan ack carries
the digest; the console verifies the version on a match and quarantines it (audited) on a mismatch.

The command goes through the console's agent endpoints as in production: issued, pulled, handled by
the agent, acked.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.utils import timezone

from agents.node.daemon import NodeAgent
from console.audit.models import AuditEntry
from console.fleet.actions import do_issue_command
from console.fleet.models import Node
from console.registry.models import ModelVersion
from tests.agents.node.conftest import gpus, prepare_payload, tiny_plan
from tests.console.conftest import AgentHTTP
from tests.console.people import Person
from tests.console.registry.conftest import TinyWeights, assert_quarantined_by_agent, model_body, run_and_ack

pytestmark = pytest.mark.django_db


def register(admin: Person, sha256: str) -> ModelVersion:
    resp = admin.api().post("/api/v1/models", json.dumps(model_body(sha256=sha256)), content_type="application/json")
    assert resp.status_code == 201, resp.content
    version = ModelVersion.objects.get(pk=resp.json()["id"])
    assert version.status == "awaiting_agent"
    return version


def prepare_through_the_console(agent: AgentHTTP, node_agent: NodeAgent, version: ModelVersion,
                                on_commit: Any) -> Any:
    """Issue prepare_plan with the registry's digest; the node agent pulls, runs and acks it."""
    plan = tiny_plan([gpus("a1", 1)])
    payload = prepare_payload(plan, "a1", weights_sha256=version.sha256)
    do_issue_command(Node.objects.get(node_id="a1"), key=f"prepare:{plan.plan_id}", kind="prepare_plan",
                     payload=payload, now=timezone.now(), deployment="tiny", transition_seq=1, step="prepare")
    (pulled,) = agent.get("/agent/v1/commands", after=0).json()["commands"]
    assert pulled["payload"]["weights_sha256"] == version.sha256
    ack = run_and_ack(agent, node_agent, pulled, on_commit)
    version.refresh_from_db()
    return ack


def test_an_agent_that_finds_other_weights_before_loading_quarantines_the_version(
        admin: Person, agent: AgentHTTP, node_agent: NodeAgent, tiny_weights: TinyWeights,
        django_capture_on_commit_callbacks: Any) -> None:
    version = register(admin, "ab" * 32)  # the registry says ab..., the node holds the tiny model's weights
    ack = prepare_through_the_console(agent, node_agent, version, django_capture_on_commit_callbacks)
    assert ack.status == "failed" and ack.result["weights_sha256"] == tiny_weights.sha256
    assert not node_agent.plans and node_agent.booked() == {}  # nothing loaded, nothing booked
    assert_quarantined_by_agent(version, "ab" * 32, tiny_weights.sha256)


def test_an_agent_that_loads_the_registered_weights_verifies_the_version(
        admin: Person, agent: AgentHTTP, node_agent: NodeAgent, tiny_weights: TinyWeights,
        django_capture_on_commit_callbacks: Any) -> None:
    version = register(admin, tiny_weights.sha256)
    ack = prepare_through_the_console(agent, node_agent, version, django_capture_on_commit_callbacks)
    assert ack.status == "ok", ack.detail
    assert ack.result["weights_sha256"] == tiny_weights.sha256
    assert version.status == "verified" and version.verified_by == "agent:a1"
    entry = AuditEntry.objects.get(event_type="registry.weights_verified")
    assert json.loads(entry.body)["before"] == {"status": "awaiting_agent"}


def test_a_prepare_ack_with_a_malformed_digest_breaks_the_protocol_naming_the_field() -> None:
    from agents.protocol import check_result
    from agents.schema import SchemaError

    with pytest.raises(SchemaError) as refused:
        check_result("prepare_plan", {"plan_id": "p-1", "weights_sha256": "not-hex"})
    assert "weights_sha256" in str(refused.value)
