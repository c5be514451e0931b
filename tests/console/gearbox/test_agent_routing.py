"""GET /agent/v1/routing: the routing tables, for agents and gateways with an agent token."""

from __future__ import annotations

import pytest
from django.test import Client

from console.gearbox.executor import build_executor
from tests.console.conftest import enroll
from tests.console.gearbox.harness import SimAgents, enroll_fleet, gear, make_deployment

pytestmark = pytest.mark.django_db


def test_an_agent_reads_every_deployments_routing_table(client: Client) -> None:
    enroll_fleet()
    make_deployment()
    agents = SimAgents()
    ex = build_executor()
    ex.start("chat", gear("a1", [0, 1]))
    for _ in range(400):
        if not ex.advance("chat").record.active:  # type: ignore[union-attr]
            break
        agents.run(0.05)
    agent = enroll(client, "z9")
    body = agent.get("/agent/v1/routing").json()
    (chat,) = body["deployments"]
    assert chat["name"] == "chat" and chat["version"] == 1
    route = chat["routes"][0]
    assert route["weight"] == 1.0 and route["frozen"] is False and route["nodes"] == ["a1"]
    assert route["plan_id"] == gear("a1", [0, 1]).plans[0].plan_id


def test_without_an_agent_token_it_says_what_to_send(client: Client) -> None:
    resp = client.get("/agent/v1/routing")
    assert resp.status_code == 401 and "Authorization" in resp.json()["errors"]
    resp = client.get("/agent/v1/routing", headers={"Authorization": "Bearer fpa_nope"})
    assert resp.status_code == 401
