from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import connection, connections
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from console.fleet import actions
from console.fleet.models import AgentCommand, Gpu, GpuSample, Node, NodeLink
from console.fleet.tasks import prune_history
from tests.builders import GIB, JOIN_TOKEN, register_body, report_body
from tests.console.conftest import AgentHTTP, enroll

pytestmark = pytest.mark.django_db


def stored_state() -> tuple[Any, ...]:
    """Everything a report may write, to prove a rejected one wrote nothing."""
    return (
        list(Node.objects.values_list("node_id", "epoch", "last_seq", "last_seen_at", "engines").order_by("id")),
        list(Gpu.objects.values_list("uuid", "mem_used_bytes", "sm_util", "healthy", "updated_at").order_by("id")),
        GpuSample.objects.count(),
        NodeLink.objects.count(),
    )


class TestRegister:
    def test_it_enrolls_with_the_join_token_and_hands_out_the_agents_own_token(self, client: Client) -> None:
        agent = enroll(client, "a1", gpus=8)
        assert agent.token.startswith("fpa_") and agent.token != JOIN_TOKEN
        node = Node.objects.get(node_id="a1")
        assert node.epoch == 1 and node.gpus.count() == 8
        assert node.token_hash == actions.hash_token(agent.token)  # only the hash is stored

    def test_re_registering_with_its_own_token_starts_a_new_epoch_without_a_new_token(self, agent: AgentHTTP) -> None:
        resp = agent.post("/agent/v1/register", register_body("a1"))
        assert resp.status_code == 200
        assert resp.json()["epoch"] == 2 and resp.json()["agent_token"] is None

    def test_it_refuses_an_unknown_token(self, client: Client) -> None:
        resp = client.post("/agent/v1/register", register_body("a1"), content_type="application/json",
                           headers={"Authorization": "Bearer nope"})
        assert resp.status_code == 401 and "Authorization" in resp.json()["errors"]
        assert not Node.objects.exists()

    def test_an_agent_cannot_register_another_node(self, agent: AgentHTTP) -> None:
        resp = agent.post("/agent/v1/register", register_body("b1"))
        assert resp.status_code == 403 and "node_id" in resp.json()["errors"]
        assert not Node.objects.filter(node_id="b1").exists()

    def test_a_gpu_missing_from_a_new_registration_leaves_the_node(self, agent: AgentHTTP) -> None:
        agent.post("/agent/v1/register", register_body("a1", gpus=2))
        assert list(Gpu.objects.filter(present=True).values_list("index", flat=True)) == [0, 1]

    @pytest.mark.parametrize("plans,field", [("p-1", "plans"), ([7], "plans[0]"), (["p-1", ""], "plans[1]"),
                                             (["x" * 65], "plans[0]")])
    def test_a_bad_plans_list_is_refused_naming_the_item(self, agent: AgentHTTP, plans: Any, field: str) -> None:
        before = Node.objects.values_list("epoch", "lost_plans").get()
        resp = agent.post("/agent/v1/register", {**register_body("a1"), "plans": plans})
        assert resp.status_code == 400 and field in resp.json()["errors"], resp.json()
        assert Node.objects.values_list("epoch", "lost_plans").get() == before

    def test_the_plans_it_does_not_list_are_noted_lost_and_a_silent_agent_loses_none(self, agent: AgentHTTP) -> None:
        from console.gearbox.models import Deployment
        from tests.console.gearbox.harness import gear, make_deployment

        placed = gear("a1", [0, 1]).plans[0]
        dep = make_deployment("chat", baseline=gear("a1", [0, 1]))
        Deployment.objects.filter(pk=dep.pk).update(routing=[
            {"plan_id": placed.plan_id, "plan": placed.to_dict(), "weight": 1.0, "frozen": False, "nodes": ["a1"]},
            {"plan_id": "p-elsewhere", "plan": placed.to_dict(), "weight": 0.0, "frozen": False, "nodes": ["b1"]}])
        resp = agent.post("/agent/v1/register", {**register_body("a1"), "plans": ["p-other"]})
        assert resp.status_code == 200
        assert Node.objects.get(node_id="a1").lost_plans == {placed.plan_id: resp.json()["epoch"]}
        # it lists what it runs: nothing lost
        agent.post("/agent/v1/register", {**register_body("a1"), "plans": [placed.plan_id]})
        assert Node.objects.get(node_id="a1").lost_plans == {}
        # an agent that does not say (older agents, the simulated fleet): nothing is assumed lost
        agent.post("/agent/v1/register", register_body("a1"))
        assert Node.objects.get(node_id="a1").lost_plans == {}

    def test_enrollment_is_closed_without_a_join_token(self, client: Client, settings: Any) -> None:
        settings.FLEXPIPE_ENROLL_TOKEN = ""
        resp = client.post("/agent/v1/register", register_body("a1"), content_type="application/json",
                           headers={"Authorization": "Bearer "})
        assert resp.status_code == 401


class TestReport:
    def test_it_stores_the_latest_state_a_sample_and_the_links(self, agent: AgentHTTP, client: Client) -> None:
        enroll(client, "b1")
        body = report_body(used_gib=20, sm_util=0.9)
        body["links"] = [{"peer": "b1", "bw_gbps": 100.0, "latency_us": 12.5, "measured_at": 1.7e9,
                          "method": "dataplane-bulk"}]
        body["engines"] = [{"plan_id": "p1", "running": 3, "waiting": 1, "tokens_per_s": 99.5, "kv_usage": 0.4}]
        resp = agent.post("/agent/v1/report", body)
        assert resp.status_code == 200 and resp.json() == {"accepted": 1}
        gpu = Gpu.objects.get(uuid="GPU-a1-0")
        assert gpu.mem_used_bytes == 20 * GIB and gpu.sm_util == 0.9 and gpu.updated_at is not None
        assert GpuSample.objects.count() == 4
        link = NodeLink.objects.get()
        assert (link.bw_gbps, link.latency_us, link.method) == (100.0, 12.5, "dataplane-bulk")
        assert link.measured_at.timestamp() == 1.7e9  # the agent's stamp (it is not in the future)
        assert Node.objects.get(node_id="a1").engines[0]["plan_id"] == "p1"

    @pytest.mark.parametrize("link,field", [
        ({"peer": "b1", "bw_gbps": -1.0}, "links[0].bw_gbps"),
        # NaN and Infinity are no JSON: the agent API's reader refuses the body itself (agents.schema.loads)
        ({"peer": "b1", "bw_gbps": float("nan")}, "(body)"),
        ({"peer": "b1", "bw_gbps": float("inf")}, "(body)"),
        ({"peer": "b1", "bw_gbps": 10.0, "latency_us": -3}, "links[0].latency_us"),
        ({"peer": "b1", "bw_gbps": 10.0, "measured_at": float("nan")}, "(body)"),
        ({"peer": "b1", "bw_gbps": 200_000.0}, "links[0].bw_gbps"),
        ({"peer": "x9", "bw_gbps": 10.0}, "links[0].peer"),
        ({"peer": "a1", "bw_gbps": 10.0}, "links[0].peer"),
    ])
    def test_a_bad_link_is_refused_naming_the_field_and_stores_nothing(self, agent: AgentHTTP, client: Client,
                                                                      link: dict[str, Any], field: str) -> None:
        enroll(client, "b1")
        before = stored_state()
        body = report_body()
        body["links"] = [link]
        import json

        resp = agent.client.post("/agent/v1/report", json.dumps(body), content_type="application/json",
                                 headers={"Authorization": f"Bearer {agent.token}"})
        assert resp.status_code == 400, resp.content
        assert field in resp.json()["errors"], resp.json()
        assert stored_state() == before

    def test_a_bad_collective_sweep_is_refused_naming_the_point(self, agent: AgentHTTP) -> None:
        before = stored_state()
        body = report_body()
        body["collectives"] = [{"op": "all_reduce", "scope": "intra", "ranks": 2,
                                "points": [[1024, 1e-5], [512, 2e-5]]}]
        resp = agent.post("/agent/v1/report", body)
        assert resp.status_code == 400 and "collectives[0].points[1]" in resp.json()["errors"], resp.json()
        assert stored_state() == before

    @pytest.mark.parametrize("mutate,status,field", [
        (lambda b: b.pop("seq"), 400, "seq"),
        (lambda b: b["gpus"][0].update(sm_util="high"), 400, "gpus[0].sm_util"),
        (lambda b: b["gpus"][3].update(temperature_c=None), 400, "gpus[3].temperature_c"),
        (lambda b: b.update(protocol=0), 400, "protocol"),
        (lambda b: b.update(colour="red"), 400, "colour"),
        (lambda b: b["gpus"][1].update(uuid="GPU-elsewhere"), 400, "gpus[1].uuid"),
        (lambda b: b.update(node_id="b1"), 403, "node_id"),
        (lambda b: b.update(epoch=7), 409, "epoch"),
        (lambda b: b.update(plans=["p-1", 7]), 400, "plans[1]"),
    ])
    def test_a_bad_report_is_refused_with_the_field_named_and_stores_nothing(
            self, agent: AgentHTTP, mutate: Any, status: int, field: str) -> None:
        before = stored_state()
        body = report_body()
        mutate(body)
        resp = agent.post("/agent/v1/report", body)
        assert resp.status_code == status, resp.content
        assert field in resp.json()["errors"]
        assert stored_state() == before

    def test_the_plans_a_running_agent_no_longer_lists_are_noted_lost_once_and_fresh_ones_are_not_judged(
            self, agent: AgentHTTP) -> None:
        from console.audit.models import AuditEntry
        from console.gearbox.models import Deployment
        from tests.console.gearbox.harness import gear, make_deployment

        placed = gear("a1", [0, 1]).plans[0]
        dep = make_deployment("chat", baseline=gear("a1", [0, 1]))
        Deployment.objects.filter(pk=dep.pk).update(routing=[
            {"plan_id": placed.plan_id, "plan": placed.to_dict(), "weight": 1.0, "frozen": False, "nodes": ["a1"]}])
        node = Node.objects.get(node_id="a1")
        seq = iter(range(1, 100))

        def report(plans: list[str] | None) -> dict[str, int]:
            body = report_body(seq=next(seq), epoch=agent.epoch)
            resp = agent.post("/agent/v1/report", body if plans is None else {**body, "plans": plans})
            assert resp.status_code == 200, resp.content
            return Node.objects.get(pk=node.pk).lost_plans  # type: ignore[no-any-return]

        def prepare(key: str) -> AgentCommand:
            return actions.do_issue_command(node, key=key, kind="prepare_plan", payload={"plan_id": placed.plan_id},
                                            now=timezone.now(), deployment="chat", transition_seq=1, step="prepare")

        def ack(cmd: AgentCommand) -> None:
            actions.do_ack_command(node, cmd.pk, status="ok", detail="", result={}, now=timezone.now())

        def noted() -> int:
            return AuditEntry.objects.filter(event_type="fleet.plans_lost").count()

        ack(prepare("t1:prepare:a1"))
        assert report([placed.plan_id]) == {}
        assert report([]) == {placed.plan_id: agent.epoch} and noted() == 1  # it died under the agent
        assert report([]) == {placed.plan_id: agent.epoch} and noted() == 1  # said again: noted once
        assert report(None) == {placed.plan_id: agent.epoch}  # a report that does not say changes nothing
        assert report([placed.plan_id]) == {}  # it runs it again
        again = prepare("t2:prepare:a1")
        assert report([]) == {}  # a prepare in flight: not lost
        ack(again)
        assert report([]) == {}  # acked after the last report: this one may have been built before it
        assert report([]) == {placed.plan_id: agent.epoch} and noted() == 2  # now it is judged

    def test_a_body_that_is_not_json_is_refused(self, agent: AgentHTTP) -> None:
        before = stored_state()
        resp = agent.client.post("/agent/v1/report", "{not json", content_type="application/json",
                                 headers={"Authorization": f"Bearer {agent.token}"})
        assert resp.status_code == 400 and "(body)" in resp.json()["errors"]
        assert stored_state() == before

    def test_a_stale_sequence_number_is_refused_and_stores_nothing(self, agent: AgentHTTP) -> None:
        assert agent.post("/agent/v1/report", report_body(seq=5, used_gib=5)).status_code == 200
        before = stored_state()
        for seq in (5, 4):
            resp = agent.post("/agent/v1/report", report_body(seq=seq, used_gib=70))
            assert resp.status_code == 409 and "stale seq" in resp.json()["errors"]["seq"]
        assert stored_state() == before

    def test_a_report_from_before_a_re_registration_is_stale(self, agent: AgentHTTP) -> None:
        agent.post("/agent/v1/register", register_body("a1"))  # epoch 2
        resp = agent.post("/agent/v1/report", report_body(epoch=1, seq=99))
        assert resp.status_code == 409 and "epoch" in resp.json()["errors"]

    @pytest.mark.parametrize("token", ["", "fpa_unknown", JOIN_TOKEN])
    def test_only_an_agent_token_may_report(self, agent: AgentHTTP, token: str) -> None:
        before = stored_state()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        resp = agent.client.post("/agent/v1/report", report_body(), content_type="application/json", headers=headers)
        assert resp.status_code == 401 and "Authorization" in resp.json()["errors"]
        assert stored_state() == before

    def test_a_user_session_is_not_an_agent(self, agent: AgentHTTP, django_user_model: Any) -> None:
        user = django_user_model.objects.create_user("ops", password="pw-long-enough")
        agent.client.force_login(user)
        resp = agent.client.post("/agent/v1/report", report_body(), content_type="application/json")
        assert resp.status_code == 401

    def test_a_user_api_token_is_not_an_agent_token(self, agent: AgentHTTP, admin: Any) -> None:
        """Even an admin's API token is refused on every agent endpoint: agents and people never share."""
        before = stored_state()
        headers = {"Authorization": f"Bearer {admin.token}"}
        resp = agent.client.post("/agent/v1/report", report_body(), content_type="application/json", headers=headers)
        assert resp.status_code == 401 and "Authorization" in resp.json()["errors"]
        assert agent.client.get("/agent/v1/commands", {"after": 0}, headers=headers).status_code == 401
        assert agent.client.get("/agent/v1/routing", headers=headers).status_code == 401
        assert stored_state() == before

    def test_the_history_stays_bounded(self, agent: AgentHTTP, settings: Any) -> None:
        settings.FLEXPIPE_GPU_HISTORY = 5
        for seq in range(1, 33):
            assert agent.post("/agent/v1/report", report_body(seq=seq, gpus=1, used_gib=seq)).status_code == 200
        # a report stores a sample of each GPU it changed and prunes nothing (issue 19): the beat's
        # retention task does
        assert GpuSample.objects.filter(gpu__uuid="GPU-a1-0").count() == 32
        assert prune_history.apply().get() == {"over_count": 27, "too_old": 0}
        kept = list(GpuSample.objects.filter(gpu__uuid="GPU-a1-0").order_by("id").values_list("id", flat=True))
        assert len(kept) == 5 and kept == sorted(kept)


class TestCommands:
    def issue(self, node_id: str = "a1", key: str = "t1:prepare:a1") -> AgentCommand:
        return actions.do_issue_command(Node.objects.get(node_id=node_id), key=key, kind="prepare_plan",
                                        payload={"plan": "p"}, now=timezone.now(), transition_seq=1,
                                        step="prepare")

    def test_the_queue_is_empty_until_transitions_exist(self, agent: AgentHTTP) -> None:
        resp = agent.get("/agent/v1/commands", after=0, wait=0)
        assert resp.status_code == 200 and resp.json() == {"commands": []}

    def test_an_issued_command_is_delivered_once_by_id_and_issuing_is_idempotent(self, agent: AgentHTTP) -> None:
        first = self.issue()
        assert self.issue().pk == first.pk
        cmds = agent.get("/agent/v1/commands", after=0, wait=0).json()["commands"]
        assert [c["id"] for c in cmds] == [first.pk] and cmds[0]["step"] == "prepare"
        assert agent.get("/agent/v1/commands", after=first.pk, wait=0).json()["commands"] == []
        first.refresh_from_db()
        assert first.state == AgentCommand.DELIVERED

    def test_an_agent_only_sees_its_own_commands(self, agent: AgentHTTP, client: Client) -> None:
        other = enroll(client, "b1")
        self.issue("b1", key="t1:prepare:b1")
        assert agent.get("/agent/v1/commands", after=0, wait=0).json()["commands"] == []
        assert len(other.get("/agent/v1/commands", after=0, wait=0).json()["commands"]) == 1

    def test_a_poll_starts_with_one_query_for_its_node_and_its_open_commands_oldest_first(
            self, agent: AgentHTTP, client: Client) -> None:
        enroll(client, "b1")
        self.issue("b1", key="t1:prepare:b1")  # another node's
        first, second, done = (self.issue(key=f"t1:prepare:a1:{i}") for i in range(3))
        AgentCommand.objects.filter(pk=done.pk).update(state=AgentCommand.OK)
        with CaptureQueriesContext(connection) as queries:
            node, cmds = actions.node_and_open_commands(agent.token, 0)
        assert len(queries) == 1
        assert node is not None and node.node_id == "a1" and [c.pk for c in cmds] == [first.pk, second.pk]
        assert cmds[1].payload == {"plan": "p"} and cmds[1].node.node_id == "a1"
        assert [c.pk for c in actions.node_and_open_commands(agent.token, first.pk)[1]] == [second.pk]
        with CaptureQueriesContext(connection) as queries:
            node, cmds = actions.node_and_open_commands(agent.token, second.pk)
        assert len(queries) == 1 and node is not None and node.node_id == "a1" and cmds == []
        assert actions.node_and_open_commands("not-a-token", 0) == (None, [])
        resp = agent.get("/agent/v1/commands", token="not-a-token", after=0, wait=0)
        assert resp.status_code == 401
        got = agent.get("/agent/v1/commands", after=0, wait=0).json()["commands"]
        assert [c["id"] for c in got] == [first.pk, second.pk]
        assert set(AgentCommand.objects.filter(pk__in=[first.pk, second.pk]).values_list("state", flat=True)) == {
            AgentCommand.DELIVERED}

    def test_the_long_poll_wakes_when_a_command_arrives(self, agent: AgentHTTP, transactional_db: None) -> None:
        def issue_from_another_thread() -> None:
            try:
                self.issue()
            finally:
                connections.close_all()

        timer = threading.Timer(0.3, issue_from_another_thread)
        timer.start()
        try:
            resp = agent.get("/agent/v1/commands", after=0, wait=20)
        finally:
            timer.join()
        assert [c["kind"] for c in resp.json()["commands"]] == ["prepare_plan"]

    @pytest.mark.parametrize("params,field", [({"after": "x"}, "after"), ({"wait": "99"}, "wait"),
                                              ({"after": "-1"}, "after")])
    def test_bad_poll_parameters_are_named(self, agent: AgentHTTP, params: dict[str, str], field: str) -> None:
        resp = agent.get("/agent/v1/commands", **params)
        assert resp.status_code == 400 and field in resp.json()["errors"]

    def test_an_ack_is_recorded_repeating_it_is_harmless_and_contradicting_it_is_refused(
            self, agent: AgentHTTP) -> None:
        cmd = self.issue()
        ok = {"protocol": 1, "status": "ok", "detail": "loaded", "result": {"load_s": 1.5}}
        assert agent.post(f"/agent/v1/commands/{cmd.pk}/ack", ok).json() == {"command": cmd.pk, "status": "ok"}
        assert agent.post(f"/agent/v1/commands/{cmd.pk}/ack", ok).status_code == 200
        resp = agent.post(f"/agent/v1/commands/{cmd.pk}/ack", {**ok, "status": "failed"})
        assert resp.status_code == 409 and "status" in resp.json()["errors"]
        cmd.refresh_from_db()
        assert cmd.state == "ok" and cmd.result == {"load_s": 1.5}

    def test_a_nul_character_anywhere_in_a_body_is_refused_not_a_server_error(self, agent: AgentHTTP) -> None:
        # PostgreSQL's jsonb cannot store U+0000; the ack would otherwise fail with a 500 on save.
        cmd = self.issue()
        resp = agent.post(f"/agent/v1/commands/{cmd.pk}/ack",
                          {"protocol": 1, "status": "ok", "result": {"sha256": "abc\x00"}})
        assert resp.status_code == 400 and "NUL" in resp.json()["errors"]["(body)"]
        cmd.refresh_from_db()
        assert cmd.state == "pending"

    def test_the_text_of_an_escape_is_not_a_nul_and_is_kept(self, agent: AgentHTTP) -> None:
        # a backslash then "u0000": the body holds the six characters escaped, which the refusal's
        # quick look (agent_api._json_body) sees; the walk over the values finds no NUL, so it is kept
        cmd = self.issue()
        resp = agent.post(f"/agent/v1/commands/{cmd.pk}/ack",
                          {"protocol": 1, "status": "ok", "detail": "path C:\\u0000x", "result": {}})
        assert resp.status_code == 200, resp.content
        cmd.refresh_from_db()
        assert cmd.detail == "path C:\\u0000x"

    def test_an_agent_cannot_ack_another_nodes_command(self, agent: AgentHTTP, client: Client) -> None:
        enroll(client, "b1")
        cmd = self.issue("b1", key="k-b1")
        resp = agent.post(f"/agent/v1/commands/{cmd.pk}/ack", {"protocol": 1, "status": "ok"})
        assert resp.status_code == 403 and "another node's" in resp.json()["errors"]["id"]
        cmd.refresh_from_db()
        assert cmd.state == "pending"
