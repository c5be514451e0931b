"""POST /api/v1/models/{id}/check: an admin asks one node's agent to hash its copy of a version's
weights before any deployment loads them (a `verify_weights` command, agents/protocol/).

The round trips drive a real NodeAgent (agents/node/daemon.py, torch backend, its own model store)
through the console's agent endpoints, as in production: issued by the API, pulled, handled, acked.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from agents.engines.torch.weights import make_tiny_llama
from agents.node.daemon import NodeAgent
from console.audit.chain import verify_chain
from console.audit.models import AuditEntry
from console.fleet.models import AgentCommand
from console.registry.models import ModelVersion
from tests.console.conftest import AgentHTTP
from tests.console.people import Person
from tests.console.registry.conftest import (
    OTHER_SHA256,
    TinyWeights,
    assert_quarantined_by_agent,
    model_body,
    run_and_ack,
)

pytestmark = pytest.mark.django_db

MODELS = "/api/v1/models"


def post(client: Client, path: str, body: Any) -> Any:
    return client.post(path, json.dumps(body), content_type="application/json")


def register(admin: Person, **overrides: Any) -> ModelVersion:
    resp = post(admin.api(), MODELS, model_body(**overrides))
    assert resp.status_code == 201, resp.content
    version = ModelVersion.objects.get(pk=resp.json()["id"])
    assert version.status == "awaiting_agent"
    return version


def ask(admin: Person, version: ModelVersion, node: str = "a1") -> Any:
    return post(admin.api(), f"{MODELS}/{version.pk}/check", {"node": node})


def check_through_the_console(admin: Person, agent: AgentHTTP, node_agent: NodeAgent, version: ModelVersion,
                              on_commit: Any) -> Any:
    """The admin asks; the node agent pulls the command, runs and acks it; returns the agent's ack."""
    asked = ask(admin, version)
    assert asked.status_code == 200, asked.content
    assert asked.json()["state"] == "pending" and asked.json()["node"] == "a1"
    (pulled,) = agent.get("/agent/v1/commands", after=0).json()["commands"]
    assert pulled["id"] == asked.json()["command"] and pulled["kind"] == "verify_weights"
    assert pulled["deployment"] is None and pulled["transition_seq"] is None
    ack = run_and_ack(agent, node_agent, pulled, on_commit)
    version.refresh_from_db()
    return ack


# -- a real agent answers ------------------------------------------------------------------------------


def test_a_node_holding_the_registered_weights_verifies_the_version(
        admin: Person, agent: AgentHTTP, node_agent: NodeAgent, models_root: Path, tiny_weights: TinyWeights,
        django_capture_on_commit_callbacks: Any) -> None:
    make_tiny_llama(models_root / "tiny-llama")  # the node's copy: the same bytes as the registry's
    version = register(admin, sha256=tiny_weights.sha256)
    ack = check_through_the_console(admin, agent, node_agent, version, django_capture_on_commit_callbacks)
    assert ack.status == "ok" and ack.result == {"sha256": tiny_weights.sha256}, ack.detail
    assert version.status == "verified" and version.verified_by == "agent:a1"
    entry = AuditEntry.objects.get(event_type="registry.weights_verified")
    assert entry.actor == "agent:a1" and json.loads(entry.body)["before"] == {"status": "awaiting_agent"}
    requested = AuditEntry.objects.get(event_type="registry.weights_check_requested")
    assert requested.actor == "user:alice" and json.loads(requested.body)["data"]["node_id"] == "a1"
    assert not node_agent.plans and node_agent.booked() == {}  # a check loads nothing
    again = ask(admin, version).json()  # the same command, now answered: how a client polls
    assert again["command"] == json.loads(requested.body)["data"]["command_id"]
    assert again["state"] == "ok" and again["result"] == {"sha256": tiny_weights.sha256}
    assert verify_chain().ok


def test_a_node_holding_other_weights_quarantines_the_version(
        admin: Person, agent: AgentHTTP, node_agent: NodeAgent, models_root: Path, tiny_weights: TinyWeights,
        django_capture_on_commit_callbacks: Any) -> None:
    make_tiny_llama(models_root / "tiny-llama")
    version = register(admin, sha256=OTHER_SHA256)  # the registry says another digest
    ack = check_through_the_console(admin, agent, node_agent, version, django_capture_on_commit_callbacks)
    assert ack.status == "ok" and ack.result == {"sha256": tiny_weights.sha256}
    assert_quarantined_by_agent(version, OTHER_SHA256, tiny_weights.sha256)


def test_a_node_without_the_model_acks_failed_and_the_version_stays_as_it_was(
        admin: Person, agent: AgentHTTP, node_agent: NodeAgent, models_root: Path,
        django_capture_on_commit_callbacks: Any) -> None:
    version = register(admin)  # tiny-llama, but this node's model store is empty
    ack = check_through_the_console(admin, agent, node_agent, version, django_capture_on_commit_callbacks)
    assert ack.status == "failed" and str(models_root / "tiny-llama") in ack.detail and "'tiny-llama'" in ack.detail
    assert version.status == "awaiting_agent" and version.verified_at is None and version.observed_sha256 == ""
    entry = AuditEntry.objects.get(event_type="registry.weights_check_failed")
    assert entry.actor == "agent:a1" and "'tiny-llama'" in json.loads(entry.body)["data"]["detail"]
    assert not AuditEntry.objects.filter(event_type__in=["registry.weights_verified",
                                                         "registry.version_quarantined"]).exists()
    assert AgentCommand.objects.get(kind="verify_weights").state == "failed"


# -- who may ask, and what is refused ----------------------------------------------------------------


@pytest.mark.parametrize("who", ["outsider", "viewer", "operator"])
def test_only_an_admin_may_ask_for_a_check(request: pytest.FixtureRequest, admin: Person, agent: AgentHTTP,
                                           who: str) -> None:
    version = register(admin)
    person: Person = request.getfixturevalue(who)
    assert post(person.api(), f"{MODELS}/{version.pk}/check", {"node": "a1"}).status_code == 403
    assert not AgentCommand.objects.exists()


def test_asking_without_credentials_or_with_an_agent_token_is_401(admin: Person, agent: AgentHTTP) -> None:
    version = register(admin)
    assert post(Client(), f"{MODELS}/{version.pk}/check", {"node": "a1"}).status_code == 401
    as_agent = Client(headers={"Authorization": f"Bearer {agent.token}"})
    assert post(as_agent, f"{MODELS}/{version.pk}/check", {"node": "a1"}).status_code == 401
    assert not AgentCommand.objects.exists()


def test_an_unknown_node_is_refused_naming_node(admin: Person, agent: AgentHTTP) -> None:
    version = register(admin)
    resp = ask(admin, version, node="nowhere")
    assert resp.status_code == 400 and list(resp.json()) == ["node"] and "nowhere" in resp.json()["node"][0]
    for body in ({}, {"node": ""}, {"node": 7 * "x" * 10}, {"node": "a1", "nodes": ["a2"]}):
        bad = post(admin.api(), f"{MODELS}/{version.pk}/check", body)
        assert bad.status_code == 400, body
        assert set(bad.json()) <= {"node", "nodes"} and bad.json(), bad.json()
    assert not AgentCommand.objects.exists()
    assert not AuditEntry.objects.filter(event_type="registry.weights_check_requested").exists()


def test_a_retired_version_is_refused_with_409(admin: Person, agent: AgentHTTP) -> None:
    version = register(admin)
    assert post(admin.api(), f"{MODELS}/{version.pk}/retire", {}).status_code == 200
    resp = ask(admin, version)
    assert resp.status_code == 409 and list(resp.json()) == ["status"] and "retired" in resp.json()["status"][0]
    assert not AgentCommand.objects.exists()


def test_an_unknown_version_is_404(admin: Person, agent: AgentHTTP) -> None:
    assert post(admin.api(), f"{MODELS}/999999/check", {"node": "a1"}).status_code == 404


def test_asking_twice_about_one_node_is_one_command_and_one_audit_entry_and_another_node_is_another(
        admin: Person, agent: AgentHTTP, client: Client) -> None:
    from tests.console.conftest import enroll

    version = register(admin)
    first, second = ask(admin, version).json(), ask(admin, version).json()
    assert first == second and first["state"] == "pending"
    enroll(client, "a2")
    other = ask(admin, version, node="a2").json()
    assert other["command"] != first["command"] and other["node"] == "a2"
    assert AgentCommand.objects.filter(kind="verify_weights").count() == 2
    assert AuditEntry.objects.filter(event_type="registry.weights_check_requested").count() == 2
