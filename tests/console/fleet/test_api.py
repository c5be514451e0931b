"""Read-only REST views of the fleet: nodes and GPUs as the agents last reported them."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from console.fleet.models import Node
from tests.builders import GIB, report_body
from tests.console.conftest import AgentHTTP, enroll
from tests.console.people import Person

pytestmark = pytest.mark.django_db


@pytest.fixture
def fleet(client: Client) -> dict[str, AgentHTTP]:
    """Node a1: 4 GPUs, one lent to a tenant, one broken. Node b1: 2 GPUs, silent past the heartbeat."""
    a1 = enroll(client, "a1")
    body = report_body("a1")
    body["gpus"][1]["allocatable"] = False
    body["gpus"][2]["healthy"] = False
    body["gpus"][0]["mem_used_bytes"] = 30 * GIB
    assert a1.post("/agent/v1/report", body).status_code == 200
    b1 = enroll(client, "b1", gpus=2, model="A100-SXM", mem_gib=40)
    Node.objects.filter(node_id="b1").update(schedulable=False, unschedulable_reason="no report for more than 45 s",
                                             last_seen_at=timezone.now() - timedelta(seconds=90))
    return {"a1": a1, "b1": b1}


def test_without_credentials_the_fleet_is_401(db: None) -> None:
    for path in ("/api/v1/nodes", "/api/v1/gpus", "/api/v1/nodes/a1", "/api/v1/gpus/GPU-a1-0"):
        assert Client().get(path).status_code == 401


def test_an_agent_token_cannot_read_the_fleet_api(fleet: dict[str, AgentHTTP]) -> None:
    client = Client(headers={"Authorization": f"Bearer {fleet['a1'].token}"})
    assert client.get("/api/v1/nodes").status_code == 401
    assert client.get("/api/v1/gpus").status_code == 401


def test_an_outsider_is_forbidden(outsider: Person, fleet: dict[str, AgentHTTP]) -> None:
    assert outsider.api().get("/api/v1/nodes").status_code == 403
    assert outsider.api().get("/api/v1/gpus/GPU-a1-0").status_code == 403


@pytest.mark.parametrize("who", ["viewer", "operator", "admin"])
def test_every_role_reads_the_fleet(request: pytest.FixtureRequest, who: str, fleet: dict[str, AgentHTTP]) -> None:
    person: Person = request.getfixturevalue(who)
    client = person.api()
    assert client.get("/api/v1/nodes").json()["count"] == 2
    assert client.get("/api/v1/nodes/b1").status_code == 200
    assert client.get("/api/v1/gpus").json()["count"] == 6
    assert client.get("/api/v1/gpus/GPU-a1-0").status_code == 200


def test_the_fleet_is_read_only(admin: Person, fleet: dict[str, AgentHTTP]) -> None:
    client = admin.api()
    assert client.post("/api/v1/nodes", "{}", content_type="application/json").status_code == 405
    assert client.delete("/api/v1/nodes/a1").status_code == 405
    assert client.patch("/api/v1/gpus/GPU-a1-0", "{}", content_type="application/json").status_code == 405


def test_a_viewer_lists_nodes_with_their_lag_and_gpu_count(viewer: Person, fleet: dict[str, AgentHTTP]) -> None:
    nodes = viewer.api().get("/api/v1/nodes").json()["results"]
    assert [(n["node_id"], n["gpu_count"], n["schedulable"]) for n in nodes] == [("a1", 4, True), ("b1", 2, False)]
    lag = {n["node_id"]: n["report_lag_s"] for n in nodes}
    assert lag["a1"] < 60 and lag["b1"] >= 90
    assert viewer.api().get("/api/v1/nodes", {"schedulable": "false"}).json()["count"] == 1


def test_a_node_detail_carries_its_gpus_and_engines(viewer: Person, fleet: dict[str, AgentHTTP]) -> None:
    node = viewer.api().get("/api/v1/nodes/a1").json()
    assert [g["uuid"] for g in node["gpus"]] == [f"GPU-a1-{i}" for i in range(4)]
    assert [g["state"] for g in node["gpus"]] == ["ours", "tenant", "unhealthy", "ours"]
    assert node["gpus"][0]["mem_used_bytes"] == 30 * GIB and node["engines"] == [] and node["links"] == []


@pytest.mark.parametrize("state,uuids", [
    ("ours", ["GPU-a1-0", "GPU-a1-3"]),
    ("tenant", ["GPU-a1-1"]),
    ("unhealthy", ["GPU-a1-2"]),
    ("unreachable", ["GPU-b1-0", "GPU-b1-1"]),
])
def test_gpus_filter_by_state(viewer: Person, fleet: dict[str, AgentHTTP], state: str, uuids: list[str]) -> None:
    got = viewer.api().get("/api/v1/gpus", {"state": state}).json()["results"]
    assert [g["uuid"] for g in got] == uuids and {g["state"] for g in got} == {state}


def test_gpus_filter_by_node_model_and_uuid(viewer: Person, fleet: dict[str, AgentHTTP]) -> None:
    def uuids(**params: Any) -> list[str]:
        return [g["uuid"] for g in viewer.api().get("/api/v1/gpus", params).json()["results"]]

    assert uuids(node="b1") == ["GPU-b1-0", "GPU-b1-1"]
    assert uuids(model="A100-SXM") == ["GPU-b1-0", "GPU-b1-1"]
    assert uuids(uuid="GPU-a1-3") == ["GPU-a1-3"]
    assert len(uuids()) == 6


def test_a_gpu_detail_by_uuid(viewer: Person, fleet: dict[str, AgentHTTP]) -> None:
    gpu = viewer.api().get("/api/v1/gpus/GPU-b1-1").json()
    assert gpu["node"] == "b1" and gpu["model"] == "A100-SXM" and gpu["state"] == "unreachable"


def test_unknown_nodes_and_gpus_are_404(viewer: Person, fleet: dict[str, AgentHTTP]) -> None:
    client = viewer.api()
    assert client.get("/api/v1/nodes/zz").status_code == 404
    assert client.get("/api/v1/gpus/GPU-zz-0").status_code == 404
    assert client.get("/api/v1/gpus/GPU-%00").status_code == 404


@pytest.mark.parametrize("path,params,field", [
    ("/api/v1/gpus", {"state": "sleepy"}, "state"),
    ("/api/v1/gpus", {"node": "a\x00"}, "node"),
    ("/api/v1/nodes", {"schedulable": "maybe"}, "schedulable"),
    ("/api/v1/nodes", {"limit": "-2"}, "limit"),
])
def test_bad_fleet_filters_are_named(viewer: Person, path: str, params: dict[str, str], field: str) -> None:
    resp = viewer.api().get(path, params)
    assert resp.status_code == 400 and list(resp.json()) == [field]
