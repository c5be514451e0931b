"""Remote weights: the agent that loads them hashes them and acks a `verify_weights` command with the
digest; a mismatch quarantines the version (audited, before/after), a match verifies it."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from console.audit.models import AuditEntry
from console.fleet.models import Node
from console.registry import actions
from console.registry.models import ModelVersion
from tests.console.conftest import AgentHTTP, enroll
from tests.console.people import Person
from tests.console.registry.conftest import OTHER_SHA256, model_body

pytestmark = pytest.mark.django_db


@pytest.fixture
def remote_version(admin: Person) -> ModelVersion:
    resp = admin.api().post("/api/v1/models", json.dumps(model_body()), content_type="application/json")
    assert resp.status_code == 201, resp.content
    return ModelVersion.objects.get(pk=resp.json()["id"])


def ask_and_ack(agent: AgentHTTP, version: ModelVersion, on_commit: Callable[..., Any],
                ack: dict[str, Any]) -> Any:
    """The console asks the agent; the agent pulls the command and acks it, the way node.py does."""
    node = Node.objects.get(node_id=agent.node_id)
    actions.do_request_weights_check(version, node, actor="system:gearbox")
    pulled = agent.get("/agent/v1/commands", after=0).json()["commands"]
    (cmd,) = [c for c in pulled if c["kind"] == "verify_weights"]
    assert cmd["payload"]["sha256"] == version.sha256 and cmd["payload"]["weights_uri"] == version.weights_uri
    assert cmd["payload"]["model_version_id"] == version.pk
    with on_commit(execute=True):
        resp = agent.post(f"/agent/v1/commands/{cmd['id']}/ack", {"protocol": 1, **ack})
    assert resp.status_code == 200, resp.content
    version.refresh_from_db()
    return version


def test_an_agent_that_observes_another_digest_quarantines_the_version(
        remote_version: ModelVersion, agent: AgentHTTP, django_capture_on_commit_callbacks: Any) -> None:
    version = ask_and_ack(agent, remote_version, django_capture_on_commit_callbacks,
                          {"status": "ok", "result": {"sha256": OTHER_SHA256}})
    assert version.status == "quarantined"
    assert version.observed_sha256 == OTHER_SHA256 and version.quarantined_by == "agent:a1"
    assert "agent a1" in version.status_detail
    entry = AuditEntry.objects.get(event_type="registry.version_quarantined")
    body = json.loads(entry.body)
    assert entry.actor == "agent:a1"
    assert body["before"] == {"status": "awaiting_agent", "observed_sha256": ""}
    assert body["after"] == {"status": "quarantined", "observed_sha256": OTHER_SHA256}
    assert body["data"]["node_id"] == "a1" and body["data"]["expected_sha256"] == remote_version.sha256


def test_an_agent_that_observes_the_registered_digest_verifies_the_version(
        remote_version: ModelVersion, agent: AgentHTTP, django_capture_on_commit_callbacks: Any) -> None:
    version = ask_and_ack(agent, remote_version, django_capture_on_commit_callbacks,
                          {"status": "ok", "result": {"sha256": remote_version.sha256}})
    assert version.status == "verified" and version.verified_by == "agent:a1"
    entry = AuditEntry.objects.get(event_type="registry.weights_verified")
    assert json.loads(entry.body)["before"] == {"status": "awaiting_agent"}


def test_an_uppercase_digest_from_an_agent_is_the_same_digest(
        remote_version: ModelVersion, agent: AgentHTTP, django_capture_on_commit_callbacks: Any) -> None:
    version = ask_and_ack(agent, remote_version, django_capture_on_commit_callbacks,
                          {"status": "ok", "result": {"sha256": remote_version.sha256.upper()}})
    assert version.status == "verified"


def test_an_agent_that_could_not_hash_the_weights_changes_nothing_but_is_recorded(
        remote_version: ModelVersion, agent: AgentHTTP, django_capture_on_commit_callbacks: Any) -> None:
    version = ask_and_ack(agent, remote_version, django_capture_on_commit_callbacks,
                          {"status": "failed", "detail": "403 from the object store"})
    assert version.status == "awaiting_agent"
    entry = AuditEntry.objects.get(event_type="registry.weights_check_failed")
    assert entry.actor == "agent:a1" and "403 from the object store" in entry.summary


def test_an_unusable_digest_in_an_ack_is_recorded_and_changes_nothing(
        remote_version: ModelVersion, agent: AgentHTTP, django_capture_on_commit_callbacks: Any) -> None:
    version = ask_and_ack(agent, remote_version, django_capture_on_commit_callbacks,
                          {"status": "ok", "result": {"sha256": "not-a-digest"}})
    assert version.status == "awaiting_agent"
    entry = AuditEntry.objects.get(event_type="registry.weights_check_invalid")
    assert "sha256" in json.loads(entry.body)["data"]["error"]


def test_asking_the_same_agent_twice_issues_one_command_and_one_audit_entry(
        remote_version: ModelVersion, agent: AgentHTTP) -> None:
    node = Node.objects.get(node_id="a1")
    first = actions.do_request_weights_check(remote_version, node, actor="system:gearbox")
    second = actions.do_request_weights_check(remote_version, node, actor="system:gearbox")
    assert first.pk == second.pk
    assert AuditEntry.objects.filter(event_type="registry.weights_check_requested").count() == 1


def test_a_later_mismatch_on_another_node_quarantines_a_verified_version(
        remote_version: ModelVersion, agent: AgentHTTP, client: Any,
        django_capture_on_commit_callbacks: Any) -> None:
    ask_and_ack(agent, remote_version, django_capture_on_commit_callbacks,
                {"status": "ok", "result": {"sha256": remote_version.sha256}})
    second = enroll(client, "a2")
    version = ask_and_ack(second, remote_version, django_capture_on_commit_callbacks,
                          {"status": "ok", "result": {"sha256": OTHER_SHA256}})
    assert version.status == "quarantined" and version.quarantined_by == "agent:a2"
    body = json.loads(AuditEntry.objects.get(event_type="registry.version_quarantined").body)
    assert body["before"]["status"] == "verified"


def test_a_quarantined_version_stays_quarantined_when_an_agent_later_matches(
        remote_version: ModelVersion) -> None:
    actions.do_record_weights_check(remote_version, observed_sha256=OTHER_SHA256, node_id="a1")
    result = actions.do_record_weights_check(remote_version, observed_sha256=remote_version.sha256, node_id="a2")
    assert result.matched and not result.changed
    remote_version.refresh_from_db()
    assert remote_version.status == "quarantined"
    entry = AuditEntry.objects.get(event_type="registry.weights_checked")
    assert entry.actor == "agent:a2" and "stays quarantined" in entry.summary


def test_a_repeated_match_changes_nothing_and_writes_nothing(remote_version: ModelVersion) -> None:
    actions.do_record_weights_check(remote_version, observed_sha256=remote_version.sha256, node_id="a1")
    count = AuditEntry.objects.count()
    result = actions.do_record_weights_check(remote_version, observed_sha256=remote_version.sha256, node_id="a1")
    assert result.matched and not result.changed and AuditEntry.objects.count() == count


def test_reports_about_a_retired_version_are_ignored(remote_version: ModelVersion) -> None:
    actions.do_retire_model_version(remote_version, actor="user:alice")
    result = actions.do_record_weights_check(remote_version, observed_sha256=OTHER_SHA256, node_id="a1")
    assert not result.changed
    remote_version.refresh_from_db()
    assert remote_version.status == "retired"


def test_the_action_refuses_a_malformed_digest_naming_sha256(remote_version: ModelVersion) -> None:
    with pytest.raises(actions.Refused) as refused:
        actions.do_record_weights_check(remote_version, observed_sha256="abc", node_id="a1")
    assert list(refused.value.errors) == ["sha256"]
    remote_version.refresh_from_db()
    assert remote_version.status == "awaiting_agent"


def test_acks_of_other_commands_leave_the_registry_alone(
        remote_version: ModelVersion, agent: AgentHTTP, django_capture_on_commit_callbacks: Any) -> None:
    from django.utils import timezone

    from console.fleet.actions import do_issue_command

    node = Node.objects.get(node_id="a1")
    cmd = do_issue_command(node, key="other", kind="prepare_plan", payload={"model_version_id": remote_version.pk},
                           now=timezone.now())
    with django_capture_on_commit_callbacks(execute=True):
        agent.post(f"/agent/v1/commands/{cmd.pk}/ack",
                   {"protocol": 1, "status": "ok", "result": {"sha256": OTHER_SHA256}})
    remote_version.refresh_from_db()
    assert remote_version.status == "awaiting_agent"
