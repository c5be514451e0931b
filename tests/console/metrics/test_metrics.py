"""GET /metrics: Prometheus text for viewers' tokens; the numbers follow the database and the sockets."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.test import Client
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from console.asgi import application
from console.audit.chain import record
from console.fleet.models import Node
from tests.builders import report_body
from tests.console.conftest import AgentHTTP, enroll
from tests.console.people import Person, make_person
from tests.console.registry.conftest import OTHER_SHA256, model_body, model_roots, tiny_weights  # noqa: F401 - fixtures


def scrape(client: Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    resp = client.get("/metrics")
    assert resp.status_code == 200, resp.content
    assert resp["Content-Type"].startswith("text/plain; version=0.0.4")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(resp.content.decode()) for s in family.samples}


@pytest.mark.django_db
def test_metrics_need_credentials(db: None) -> None:
    resp = Client().get("/metrics")
    assert resp.status_code == 401 and b"credentials were not provided" in resp.content


@pytest.mark.django_db
def test_an_agent_token_cannot_scrape(agent: AgentHTTP) -> None:
    assert Client(headers={"Authorization": f"Bearer {agent.token}"}).get("/metrics").status_code == 401


@pytest.mark.django_db
def test_a_user_without_a_role_cannot_scrape(outsider: Person) -> None:
    assert outsider.api().get("/metrics").status_code == 403


@pytest.mark.django_db
def test_prometheus_asking_for_openmetrics_still_gets_the_text_format(viewer: Person) -> None:
    resp = viewer.api().get("/metrics", headers={
        "Accept": "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"})
    assert resp.status_code == 200 and b"# TYPE flexpipe_gpus gauge" in resp.content


@pytest.mark.django_db
def test_fleet_registry_and_audit_numbers_follow_the_database(viewer: Person, admin: Person, client: Client) -> None:
    a1 = enroll(client, "a1")
    body = report_body("a1")
    body["gpus"][0]["allocatable"] = False
    body["gpus"][1]["healthy"] = False
    assert a1.post("/agent/v1/report", body).status_code == 200
    enroll(client, "b1", gpus=2)
    Node.objects.filter(node_id="a1").update(last_seen_at=timezone.now() - timedelta(seconds=30))
    Node.objects.filter(node_id="b1").update(schedulable=False, last_seen_at=timezone.now() - timedelta(seconds=300))
    api = admin.api()
    api.post("/api/v1/models", _json(model_body()), content_type="application/json")
    bad = api.post("/api/v1/models", _json(model_body(version="v2", sha256=OTHER_SHA256)),
                   content_type="application/json").json()
    from console.registry import actions
    from console.registry.models import ModelVersion

    actions.do_record_weights_check(ModelVersion.objects.get(pk=bad["id"]), observed_sha256="0" * 64, node_id="a1")
    record("test.event", actor="system:test", summary="one more", at=timezone.now())

    m = scrape(viewer.api())
    assert 30 <= m[("flexpipe_agent_report_lag_seconds", (("node", "a1"),))] < 90
    assert m[("flexpipe_agent_report_lag_seconds", (("node", "b1"),))] >= 300
    assert m[("flexpipe_node_schedulable", (("node", "a1"),))] == 1
    assert m[("flexpipe_node_schedulable", (("node", "b1"),))] == 0
    gpus = {state: m[("flexpipe_gpus", (("state", state),))] for state in ("ours", "tenant", "unhealthy", "unreachable")}
    assert gpus == {"ours": 2, "tenant": 1, "unhealthy": 1, "unreachable": 2}
    versions = {s: m[("flexpipe_registry_versions", (("status", s),))]
                for s in ("verifying", "awaiting_agent", "verified", "quarantined", "retired")}
    assert versions == {"verifying": 0, "awaiting_agent": 1, "verified": 0, "quarantined": 1, "retired": 0}
    from console.audit.models import AuditHead

    assert m[("flexpipe_audit_chain_length", ())] == AuditHead.objects.get().seq >= 6


def _json(body: Any) -> str:
    import json

    return json.dumps(body)


@pytest.mark.django_db(transaction=True)
async def test_websocket_clients_are_counted_as_they_connect_and_leave() -> None:
    vera = await database_sync_to_async(make_person)("vera", "viewer")
    otto = await database_sync_to_async(make_person)("otto", None)

    async def clients(page: str) -> tuple[float, float, float]:
        m = await database_sync_to_async(scrape)(vera.api())
        label = (("page", page),)
        return (m.get(("flexpipe_websocket_clients", label), 0.0),
                m.get(("flexpipe_websocket_connects_total", label), 0.0),
                m.get(("flexpipe_websocket_disconnects_total", label), 0.0))

    before = await clients("audit")
    comms = [WebsocketCommunicator(application, "/ws/audit/", headers=[(b"origin", b"http://testserver"),
                                                                       (b"host", b"testserver")])
             for _ in range(3)]
    for comm, user in zip(comms, (vera.user, vera.user, otto.user), strict=True):
        comm.scope["user"] = user
    try:
        results = [await comm.connect() for comm in comms]
        assert [ok for ok, _ in results] == [True, True, False]  # the outsider is refused, not counted
        now = await clients("audit")
        assert now == (before[0] + 2, before[1] + 2, before[2])
        await comms[0].disconnect()
        after_one = await clients("audit")
        assert after_one == (before[0] + 1, before[1] + 2, before[2] + 1)
    finally:
        for comm in comms[1:]:
            await comm.disconnect()
    assert (await clients("audit"))[0] == before[0]
