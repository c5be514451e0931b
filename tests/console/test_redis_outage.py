"""Issue 18, finding 3: a Redis outage (broker, channel layer) is not an outage of the console.

Writes commit and answer without waiting on the broker (202 naming what is queued for later, never a
500 after the commit); what could not be sent is sent at the first report after Redis is back, not
at the next beat; a switch in flight when Redis goes away completes once it is back. Each test has
its own redis-server (tests/redis_outage.py), which it stops and starts again.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable
from typing import Any

import pytest
from celery.contrib.testing.worker import start_worker
from django.conf import settings
from django.test import Client
from django.utils import timezone

from console.celery import app, enqueue, owed
from console.fleet.actions import do_issue_agent_token
from console.fleet.models import Node
from console.gearbox import tasks
from console.gearbox.models import Deployment, Transition
from scheduler.invariants import assert_clean
from tests.builders import report_body
from tests.console.gearbox.harness import SimAgents, django_log, enroll_fleet, make_deployment
from tests.console.people import Person
from tests.redis_outage import PrivateRedis, needs_redis_server

pytestmark = [pytest.mark.django_db(transaction=True), needs_redis_server]


def queued_tasks(server: PrivateRedis) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for raw in server.client().lrange(app.conf.task_default_queue, 0, -1):
        msg = json.loads(raw)
        body = json.loads(base64.b64decode(msg["body"]))
        out.append((msg["headers"]["task"], body[1]))
    return out


def http_report(node_id: str, seq: int, **kw: Any) -> Any:
    """A report through the agent API, as the node's agent sends it (a token an operator issued)."""
    node = Node.objects.get(node_id=node_id)
    _, token = do_issue_agent_token(node_id, actor="system:test", now=timezone.now())
    body = report_body(node_id, epoch=node.epoch, seq=seq, gpus=8, used_gib=0.6, **kw)
    return Client().post("/agent/v1/report", body, content_type="application/json",
                         headers={"Authorization": f"Bearer {token}"})


def test_an_emergency_while_the_broker_is_down_is_stored_and_answered_202_queued(
        private_redis: PrivateRedis, operator: Person) -> None:
    enroll_fleet()
    make_deployment("chat")
    private_redis.stop()
    resp = operator.api().post("/api/v1/deployments/chat/emergency", {"reason": "broker test"},
                               content_type="application/json")
    assert resp.status_code == 202, resp.content  # was: a ~20 s hang, then 500 although committed
    assert resp.json()["state"] == "requested" and resp.json()["queued"] == ["gearbox.tick"]
    assert Deployment.objects.get(name="chat").emergency_requested_at is not None
    private_redis.start()
    assert http_report("a1", 2).status_code == 200
    assert ("gearbox.tick", {"trigger": "emergency", "deployment": "chat"}) in queued_tasks(private_redis)


def test_the_first_report_after_the_broker_is_back_sends_the_owed_topology_tick(private_redis: PrivateRedis) -> None:
    enroll_fleet()
    private_redis.stop()
    failed = http_report("a1", 2, healthy=False)  # a GPU fails during the outage
    assert failed.status_code == 200, failed.content  # stored and answered; its topology tick could not be sent
    private_redis.start()
    assert queued_tasks(private_redis) == []  # nothing sent it meanwhile; no beat runs in tests
    # the next report changes nothing (the GPU is still broken): before, nothing ticked until the beat
    assert http_report("a1", 3, healthy=False).status_code == 200
    assert ("gearbox.tick", {"trigger": "topology"}) in queued_tasks(private_redis)


def until(cond: Callable[[], bool], agents: SimAgents, what: str, max_s: float = 120.0,
          sweep_every_s: float | None = None) -> None:
    deadline = time.monotonic() + max_s
    next_sweep = time.monotonic() + (sweep_every_s or max_s)
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {max_s:g} s"
        if sweep_every_s is not None and time.monotonic() >= next_sweep:
            enqueue(tasks.sweep)  # as beat does
            next_sweep = time.monotonic() + sweep_every_s
        agents.run()
        time.sleep(0.02)


def test_a_switch_in_flight_when_redis_goes_away_completes_once_it_is_back(private_redis: PrivateRedis) -> None:
    rep = enroll_fleet()
    make_deployment()
    agents = SimAgents()
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10,
                      queues=[app.conf.task_default_queue]):
        assert tasks.tick.delay(trigger="periodic").get(timeout=60)["started"] in ([], ["chat#1"])
        until(lambda: Transition.objects.filter(seq=1).exists(), agents, "the first transition started")
        until(lambda: Transition.objects.get(seq=1).step != "", agents, "its first step running")
        private_redis.stop()  # mid-switch: the agents go on acking, nothing can reach a worker
        t_end = time.monotonic() + 1.0
        while time.monotonic() < t_end:
            agents.run()
            time.sleep(0.02)
        assert Transition.objects.get(seq=1).active
        private_redis.start()
        seq = rep.seq.get("a1", 0) + 1
        assert http_report("a1", seq).status_code == 200  # sends what the acks owed
        assert owed() == []
        # A task that was in the queue when Redis stopped is gone with it (a Redis that keeps nothing on
        # disk, as here): in production beat's sweep advances such a transition; so does this wait
        until(lambda: Transition.objects.get(seq=1).phase == "done", agents, "the transition done after the outage",
              sweep_every_s=settings.FLEXPIPE_TICK_S)
    assert_clean(django_log("chat", agents.log), complete=False)


async def test_a_live_socket_is_told_degraded_when_redis_goes_and_re_synced_on_reconnect(
        private_redis: PrivateRedis) -> None:
    from channels.db import database_sync_to_async
    from channels.testing import WebsocketCommunicator

    from console.asgi import application
    from tests.console.people import make_person

    vera = (await database_sync_to_async(make_person)("vera", "viewer")).user

    def socket() -> WebsocketCommunicator:
        comm = WebsocketCommunicator(application, "/ws/cluster/", headers=[(b"origin", b"http://testserver"),
                                                                         (b"host", b"testserver")])
        comm.scope["user"] = vera
        return comm

    comm = socket()
    try:
        connected, _ = await comm.connect(timeout=10)
        assert connected and (await comm.receive_json_from(timeout=10))["type"] == "snapshot"
        private_redis.stop()
        msg = await comm.receive_json_from(timeout=30)
        assert msg["type"] == "degraded", msg
        closed = await comm.receive_output(timeout=30)
        assert closed == {"type": "websocket.close", "code": 1013}
    finally:
        await comm.disconnect()
    private_redis.start()
    # as live.js does: reconnect until it is live again (a first try may meet a connection the layer
    # pooled before the restart: degraded once more); then the snapshot re-syncs the page
    for _ in range(10):
        again = socket()
        try:
            connected, _ = await again.connect(timeout=10)
            first = await again.receive_json_from(timeout=10)
        finally:
            await again.disconnect()
        if first["type"] != "degraded":
            break
    assert connected and first["type"] == "snapshot", first


def test_request_paths_send_tasks_without_subscribing_to_their_results(private_redis: PrivateRedis) -> None:
    # The Redis result backend's subscription is what reconnected 20 times, a second apart, and then raised
    # "Retry limit exceeded ... result store backend" inside apply_async: a request path never subscribes.
    consumer = app.backend.result_consumer  # a fresh backend (the fixture re-pointed the app): not listening yet
    assert consumer._pubsub is None
    tasks.enqueue(tasks.tick, trigger="periodic")
    assert consumer._pubsub is None  # apply_async without ignore_result starts listening for the result
    assert ("gearbox.tick", {"trigger": "periodic"}) in queued_tasks(private_redis)
