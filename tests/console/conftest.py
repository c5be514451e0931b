from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from tests.builders import JOIN_TOKEN, register_body


@pytest.fixture(autouse=True)
def _join_token(settings: Any) -> None:
    settings.FLEXPIPE_ENROLL_TOKEN = JOIN_TOKEN


@pytest.fixture(autouse=True)
def _no_remembered_tokens() -> None:
    """Each test starts with a process that knows no agent token (actions.agent_for_token)."""
    from console.fleet.actions import forget_agents

    forget_agents()


class AgentHTTP:
    """A registered agent talking to the console through Django's test client."""

    def __init__(self, client: Client, node_id: str, token: str, epoch: int) -> None:
        self.client, self.node_id, self.token, self.epoch = client, node_id, token, epoch

    def post(self, path: str, body: Any, token: str | None = None) -> Any:
        return self.client.post(path, body, content_type="application/json",
                                headers={"Authorization": f"Bearer {token or self.token}"})

    def get(self, path: str, token: str | None = None, **params: Any) -> Any:
        return self.client.get(path, params, headers={"Authorization": f"Bearer {token or self.token}"})


def enroll(client: Client, node_id: str = "a1", **kw: Any) -> AgentHTTP:
    resp = client.post("/agent/v1/register", register_body(node_id, **kw), content_type="application/json",
                       headers={"Authorization": f"Bearer {JOIN_TOKEN}"})
    assert resp.status_code == 201, resp.content
    body = resp.json()
    return AgentHTTP(client, node_id, body["agent_token"], body["epoch"])


@pytest.fixture
def agent(db: None, client: Client) -> AgentHTTP:
    """The agent of node a1: enrolled now, or - when a fixture enrolled a1 already (the join token
    re-enrolls no node) - holding a token an operator issued for it."""
    from django.utils import timezone

    from console.fleet.actions import do_issue_agent_token
    from console.fleet.models import Node

    node = Node.objects.filter(node_id="a1").first()
    if node is None:
        return enroll(client, "a1")
    _, token = do_issue_agent_token("a1", actor="system:test", now=timezone.now())
    return AgentHTTP(client, "a1", token, node.epoch)


from tests.console.people import admin, operator, outsider, viewer  # noqa: E402,F401 - fixtures
from tests.redis_outage import private_redis  # noqa: E402,F401 - a fixture
