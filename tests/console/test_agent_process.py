"""The agent API as its own process (console/agent_asgi.py), beside the console's.

A real daphne serves console.agent_asgi:application against this test's PostgreSQL and Redis
(bench.gateway_flood.Proc, the way `make run` and the benches start it); the agent is the real
client (agents.client.AgentClient). What the test process does stands for the console's other
processes: it issues commands through the same actions a Celery worker runs and listens on the
channel layer as the console's sockets do. Every wait is on a condition.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import connection
from django.utils import timezone

from agents.client import AgentClient
from agents.protocol import GpuInfo, GpuReport, RegisterRequest, Report
from bench.gateway_flood import Proc
from console.fleet import actions, doorbell
from console.fleet.live import CLUSTER_GROUP
from console.fleet.models import AgentCommand, Gpu, Node
from tests.conftest import TEST_NAMESPACE, TEST_REDIS_URL, database_url_for_processes, purge_tasks

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]
ENROLL = "fpj_agent-process-test"
GIB = 2**30


@pytest.fixture(scope="module")
def agents_proc(django_db_setup: None, django_db_blocker: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    with django_db_blocker.unblock():
        if connection.vendor != "postgresql":
            pytest.skip("two processes writing one SQLite file serialise on its lock; needs PostgreSQL")
        url = database_url_for_processes()
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "console.settings", "DATABASE_URL": url,
           "REDIS_URL": TEST_REDIS_URL, "FLEXPIPE_CHANNEL_PREFIX": TEST_NAMESPACE, "FLEXPIPE_QUEUE": TEST_NAMESPACE,
           "FLEXPIPE_ENROLL_TOKEN": ENROLL, "SECRET_KEY": "agent-process-test-" + os.urandom(16).hex(),
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    env.pop("FLEXPIPE_PROCESS", None)  # the module sets it: it is what makes the process the agents'
    proc = Proc("agents", "console.agent_asgi:application", env, tmp_path_factory.mktemp("agentproc"))
    proc.start()
    yield proc
    proc.kill()
    purge_tasks()  # the ticks the registrations queued (no worker takes them here)


def enrolled(url: str, node_id: str) -> tuple[AgentClient, tuple[str, ...]]:
    uuids = tuple(f"GPU-{node_id}-{i}" for i in range(2))
    client = AgentClient(url, ENROLL, delta_reports=False)
    client.register(RegisterRequest(node_id, f"{node_id}.test", "t", tuple(
        GpuInfo(u, i, "H100-SXM", 80 * GIB, "nvl0") for i, u in enumerate(uuids)), rack="A"))
    return client, uuids


def report(node_id: str, uuids: tuple[str, ...], seq: int, used_gib: int) -> Report:
    node = Node.objects.get(node_id=node_id)
    return Report(node_id, node.epoch, seq, tuple(GpuReport(u, used_gib * GIB, 80 * GIB, 0.5, 50.0, True)
                                                  for u in uuids))


def until(cond: Any, what: str, max_s: float = 60.0) -> None:
    deadline = time.monotonic() + max_s  # a hang guard: the wait is on the condition
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_it_serves_agent_protocol_v1_and_nothing_of_the_console(agents_proc: Proc) -> None:
    client, uuids = enrolled(agents_proc.url, "ap-1")
    with client:
        assert client.report(report("ap-1", uuids, 1, used_gib=12)) == 1
    assert {g.uuid: g.mem_used_bytes for g in Gpu.objects.filter(node__node_id="ap-1")} == {u: 12 * GIB for u in uuids}
    assert httpx.get(f"{agents_proc.url}/healthz").status_code == 200
    for path in ("/", "/login/", "/deployments/", "/api/v1/nodes/", "/v1/models", "/admin/"):
        assert httpx.get(f"{agents_proc.url}{path}").status_code == 404, path
    # no websocket route: the browsers' sockets are the console's process's
    upgrade = httpx.get(f"{agents_proc.url}/ws/cluster/", headers={
        "Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
        "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="})
    assert upgrade.status_code != 101


def test_a_command_issued_elsewhere_wakes_the_agents_pending_poll_in_its_process(agents_proc: Proc) -> None:
    client, _ = enrolled(agents_proc.url, "ap-2")
    probe = redis.Redis.from_url(TEST_REDIS_URL)
    answer: dict[str, Any] = {}

    def poll() -> None:
        answer["commands"] = client.pull_commands(after=0, wait_s=25.0)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        # the poll waits when the agent process's doorbell listener has subscribed (Redis says so)
        until(lambda: probe.pubsub_numsub(doorbell.channel())[0][1] >= 1, "the poll never waited on the doorbell")
        actions.do_issue_command(Node.objects.get(node_id="ap-2"), key="ap-2:prepare", kind="prepare_plan",
                                 payload={"plan": "p"}, now=timezone.now(), transition_seq=1, step="prepare")
        poller.join(30)
    finally:
        poller.join()
        client.close()
    assert [c.kind for c in answer["commands"]] == ["prepare_plan"]
    assert AgentCommand.objects.get(key="ap-2:prepare").state == AgentCommand.DELIVERED


def test_a_report_to_the_agent_process_reaches_the_consoles_live_pages(agents_proc: Proc) -> None:
    client, uuids = enrolled(agents_proc.url, "ap-3")
    layer = get_channel_layer()
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(CLUSTER_GROUP, channel)
    try:
        with client:
            client.report(report("ap-3", uuids, 1, used_gib=31))
        gpus = async_to_sync(delta_for)(layer, channel, "ap-3")
    finally:
        async_to_sync(layer.group_discard)(CLUSTER_GROUP, channel)
    assert {g["uuid"]: g["mem_used_bytes"] for g in gpus} == {u: 31 * GIB for u in uuids}


async def delta_for(layer: Any, channel: str, node_id: str) -> list[dict[str, Any]]:
    """The GPUs of `node_id` in the first live delta that has them (an earlier test's may come first)."""
    while True:
        message = await asyncio.wait_for(layer.receive(channel), timeout=60)  # a hang guard
        gpus = [g for g in message.get("delta", {}).get("gpus", []) if g["node_id"] == node_id]
        if message["type"] == "cluster.delta" and gpus:
            return gpus


def test_an_unknown_process_kind_is_refused_naming_the_setting_and_the_kinds() -> None:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "console.settings", "FLEXPIPE_PROCESS": "agent"}
    done = subprocess.run([sys.executable, "-c", "import django; django.setup()"], env=env, capture_output=True,
                          text=True, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode != 0
    assert "FLEXPIPE_PROCESS: must be all, console, gateway or agents, got 'agent'" in done.stderr
