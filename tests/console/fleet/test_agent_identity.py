"""DESIGN.md invariant 8: an agent is only itself. Its token acts for its own node and GPUs, never
another's; an enrolled node is re-enrolled only with its own token or an operator's approval."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from console.accounts.auth import hash_token
from console.audit.models import AuditEntry
from console.fleet.models import AgentCommand, Gpu, Node
from tests.builders import GIB, JOIN_TOKEN, gpu_info, register_body, report_body
from tests.console.conftest import AgentHTTP, enroll

pytestmark = pytest.mark.django_db


def join(client: Client, body: dict[str, Any]) -> Any:
    return client.post("/agent/v1/register", body, content_type="application/json",
                       headers={"Authorization": f"Bearer {JOIN_TOKEN}"})


@pytest.fixture
def victim(client: Client) -> AgentHTTP:
    return enroll(client, "b1", gpus=2)


def test_an_agent_cannot_register_another_nodes_gpu(agent: AgentHTTP, victim: AgentHTTP) -> None:
    body = register_body("a1", gpus=1)
    body["gpus"].append(gpu_info("b1", 0) | {"index": 1})  # b1's GPU, claimed by a1
    resp = agent.post("/agent/v1/register", body)
    assert resp.status_code == 403, resp.content
    assert "belongs to node 'b1'" in resp.json()["errors"]["gpus[1].uuid"]
    assert Gpu.objects.get(uuid="GPU-b1-0").node.node_id == "b1"  # nothing moved
    assert Node.objects.get(node_id="a1").epoch == 1  # nor was a1 re-registered
    # and the victim's reports still land
    assert victim.post("/agent/v1/report", report_body("b1", epoch=victim.epoch, gpus=2)).status_code == 200


def test_a_gpu_its_old_node_no_longer_lists_may_move(agent: AgentHTTP, victim: AgentHTTP) -> None:
    victim.post("/agent/v1/register", register_body("b1", gpus=1))  # GPU-b1-1 left b1 (re-racked)
    body = register_body("a1", gpus=1)
    body["gpus"].append(gpu_info("b1", 1) | {"index": 1})
    assert agent.post("/agent/v1/register", body).status_code == 200
    assert Gpu.objects.get(uuid="GPU-b1-1").node.node_id == "a1"


def test_the_join_token_does_not_re_enroll_an_enrolled_node(client: Client, victim: AgentHTTP) -> None:
    resp = join(client, register_body("b1", gpus=2))
    assert resp.status_code == 403
    assert "enrolled already" in resp.json()["errors"]["node_id"]
    assert "agent-token" in resp.json()["errors"]["node_id"]  # it says how to get approval
    # the real agent's token was not rotated out: it still reports
    assert victim.post("/agent/v1/report", report_body("b1", epoch=victim.epoch, gpus=2)).status_code == 200


def test_an_operator_approves_re_enrolment_with_a_new_token_and_the_audit_says_who(
        client: Client, victim: AgentHTTP, operator: Any, viewer: Any) -> None:
    assert viewer.api().post("/api/v1/nodes/b1/agent-token").status_code == 403
    resp = operator.api().post("/api/v1/nodes/b1/agent-token")
    assert resp.status_code == 201, resp.content
    token = resp.json()["agent_token"]
    entry = AuditEntry.objects.filter(event_type="fleet.agent_token_issued").get()
    assert entry.actor == f"user:{operator.username}"
    # the old token stops working; the node registers with the approved one
    assert victim.post("/agent/v1/report", report_body("b1", epoch=victim.epoch, seq=2, gpus=2)).status_code == 401
    again = victim.post("/agent/v1/register", register_body("b1", gpus=2), token=token)
    assert again.status_code == 200 and again.json()["epoch"] == 2
    registered = AuditEntry.objects.filter(event_type="fleet.node_registered").order_by("-seq").first()
    assert registered is not None and registered.actor == "agent:b1"
    assert operator.api().post("/api/v1/nodes/nope/agent-token").status_code == 404


def test_an_agent_cannot_report_another_nodes_gpus(agent: AgentHTTP, victim: AgentHTTP) -> None:
    body = report_body("a1", epoch=agent.epoch)
    body["gpus"][0]["uuid"] = "GPU-b1-0"
    resp = agent.post("/agent/v1/report", body)
    assert resp.status_code == 403 and "belongs to node 'b1'" in resp.json()["errors"]["gpus[0].uuid"]
    # nor report as the other node
    resp = agent.post("/agent/v1/report", report_body("b1", epoch=victim.epoch, gpus=2))
    assert resp.status_code == 403 and "node_id" in resp.json()["errors"]


def test_an_agent_cannot_ack_another_nodes_command(agent: AgentHTTP, victim: AgentHTTP) -> None:
    from django.utils import timezone

    from console.fleet.actions import do_issue_command

    cmd = do_issue_command(Node.objects.get(node_id="b1"), key="k", kind="abort_plan", payload={},
                           now=timezone.now())
    resp = agent.post(f"/agent/v1/commands/{cmd.pk}/ack", {"protocol": 1, "status": "failed"})
    assert resp.status_code == 403 and "id" in resp.json()["errors"]
    assert AgentCommand.objects.get(pk=cmd.pk).state == "pending"


def test_make_run_issues_a_token_to_an_enrolled_demo_node_whose_agent_kept_none(client: Client, tmp_path: Any) -> None:
    from pathlib import Path

    from django.core.management import call_command

    from agents.client import load_token

    enroll(client, "h100-a")  # a database from before agents kept their tokens: no token file
    scenario = Path(__file__).resolve().parents[3] / "scenarios" / "demo.yaml"
    call_command("ensure_agent_tokens", str(scenario), str(tmp_path))
    token = load_token(tmp_path / "h100-a.token")
    assert token is not None and not (tmp_path / "a100-b.token").exists()  # only enrolled nodes
    again = client.post("/agent/v1/register", register_body("h100-a"), content_type="application/json",
                        headers={"Authorization": f"Bearer {token}"})
    assert again.status_code == 200
    assert AuditEntry.objects.filter(event_type="fleet.agent_token_issued", actor="system:make run").count() == 1
    call_command("ensure_agent_tokens", str(scenario), str(tmp_path))  # kept: nothing issued again
    assert AuditEntry.objects.filter(event_type="fleet.agent_token_issued").count() == 1


class TestARememberedToken:
    """The agent API remembers which node a token is (actions.agent_for_token: a report skips that
    query); the database still has the last word, in the report's own locked read."""

    def test_stops_working_the_moment_it_is_rotated_and_the_report_changes_nothing(
            self, victim: AgentHTTP) -> None:
        assert victim.post("/agent/v1/report", report_body("b1", epoch=victim.epoch, seq=1, gpus=2)).status_code == 200
        # rotated as another process would (the operator's API runs in the console's process): only the row changes
        Node.objects.filter(node_id="b1").update(token_hash=hash_token("fpa_rotated"))
        body = report_body("b1", epoch=victim.epoch, seq=2, gpus=2, used_gib=70)
        resp = victim.post("/agent/v1/report", body)
        assert resp.status_code == 401 and resp.json()["errors"] == {"Authorization": "unknown agent token"}
        assert Node.objects.get(node_id="b1").last_seq == 1
        assert set(Gpu.objects.filter(node__node_id="b1").values_list("mem_used_bytes", flat=True)) != {70 * GIB}
        assert victim.post("/agent/v1/report", body, token="fpa_rotated").status_code == 200

    def test_that_moved_to_another_row_is_looked_up_again_not_refused(self, client: Client, victim: AgentHTTP) -> None:
        assert victim.post("/agent/v1/report", report_body("b1", epoch=victim.epoch, seq=1, gpus=2)).status_code == 200
        other = enroll(client, "c1", gpus=2)
        # the token is c1's now (as after a database restored under a running console): the row says so
        Node.objects.filter(node_id="b1").update(token_hash=hash_token("fpa_elsewhere"))
        Node.objects.filter(node_id="c1").update(token_hash=hash_token(victim.token))
        resp = victim.post("/agent/v1/report", report_body("c1", epoch=other.epoch, seq=1, gpus=2))
        assert resp.status_code == 200, resp.content
        assert Node.objects.get(node_id="c1").last_seq == 1 and Node.objects.get(node_id="b1").last_seq == 1
        # and it no longer speaks for b1
        resp = victim.post("/agent/v1/report", report_body("b1", epoch=victim.epoch, seq=2, gpus=2))
        assert resp.status_code == 403 and "belongs to node 'c1'" in resp.json()["errors"]["node_id"]
