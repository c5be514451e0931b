"""The gateway as its own process (console/gateway/asgi.py), beside the console's (FLEXPIPE_PROCESS=console).

Real processes: both daphnes are started with subprocess against this test's database and Redis
(bench.gateway_flood.Stack, what the flood bench starts too), in front of the simulated fleet's
data plane (agents.sim.dataserver) stepped on a thread of the test process. Nothing is mocked;
nothing here depends on speed: the simulated time stands still while the test needs a stream to
stay open, and the flood's assertions are about who served what, never how fast (the latency
ratio is bench.gateway_flood's).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.db import connection

from bench.gateway_flood import DEPLOYMENT, PROMPT, Agent, Stack, flood, report_loop, route, seed
from console.gearbox.models import Deployment
from tests.conftest import TEST_NAMESPACE, TEST_REDIS_URL, database_url_for_processes, purge_tasks

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


@pytest.fixture(scope="module")
def stack(django_db_setup: None, django_db_blocker: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with django_db_blocker.unblock():
        if connection.vendor != "postgresql":
            pytest.skip("several processes writing one SQLite file serialise on its lock; needs PostgreSQL")
        url = database_url_for_processes()
    env = {"FLEXPIPE_CHANNEL_PREFIX": TEST_NAMESPACE, "FLEXPIPE_QUEUE": TEST_NAMESPACE,
           "FLEXPIPE_GATEWAY_FROZEN_WAIT_S": "0", "FLEXPIPE_GATEWAY_CPU_QUEUE": "128"}  # 100 arrive at once
    s = Stack(tmp_path_factory.mktemp("gwproc"), database_url=url, redis_url=TEST_REDIS_URL, extra_env=env,
              speed=4.0).start()
    yield s
    s.close()
    purge_tasks()  # the ticks the agents' registrations queued (no worker takes them here)


@pytest.fixture
def world(stack: Stack) -> Iterator[tuple[Stack, str, list[Agent]]]:
    stack.engine.running.set()
    token, agents = seed(stack, agents=2)
    yield stack, token, agents
    stack.engine.running.set()


def logged(cond: Any, max_s: float = 30.0) -> None:
    deadline = time.monotonic() + max_s
    while not cond():
        assert time.monotonic() < deadline, "the access log never showed it"
        time.sleep(0.05)


def completion(url: str, token: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {token}"}, timeout=60,
                      json={"model": DEPLOYMENT, "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, **body})


def test_the_gateway_streams_on_while_the_console_process_is_killed_and_restarted(
        world: tuple[Stack, str, list[Agent]], tmp_path: Path) -> None:
    stack, token, agents = world
    n = 16
    body = {"model": DEPLOYMENT, "prompt": PROMPT, "max_tokens": n, "stream": True, "ignore_eos": True,
            "return_token_ids": True}
    ids: list[int] = []
    finish = None
    with httpx.Client(timeout=60) as client, client.stream(
            "POST", f"{stack.gateway.url}/v1/completions", json=body,
            headers={"Authorization": f"Bearer {token}"}) as resp:
        assert resp.status_code == 200, resp.read()
        lines = resp.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                ids.extend(chunk["choices"][0].get("token_ids") or [])
                if ids:
                    break
        # the stream is open with tokens still to come: time stands still, the console dies and comes back
        stack.engine.running.clear()
        before = len(ids)
        assert 0 < before < n
        stack.console.kill()
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{stack.console.url}/healthz", timeout=5)
        stack.console.start()
        again = httpx.post(f"{stack.console.url}/agent/v1/report", json=agents[1].report_body(),
                           headers={"Authorization": f"Bearer {agents[1].token}"}, timeout=30)
        assert again.status_code == 200, again.text  # the restarted console takes reports again
        stack.engine.running.set()
        for line in lines:
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                ids.extend(choice.get("token_ids") or [])
                finish = choice.get("finish_reason") or finish
    assert len(ids) == n and finish == "length"  # the whole stream, once, through the console's crash
    assert stack.console.starts >= 2

    # a routing change made by another process reaches the gateway's process with the next request
    dep = Deployment.objects.get(name=DEPLOYMENT)
    Deployment.objects.filter(pk=dep.pk).update(routing=[route(stack, frozen=True)],
                                                routing_version=dep.routing_version + 1)
    frozen = completion(stack.gateway.url, token)
    assert frozen.status_code == 429 and "a switch is in progress" in frozen.json()["error"]["message"]
    Deployment.objects.filter(pk=dep.pk).update(routing=[route(stack)], routing_version=dep.routing_version + 2)
    assert completion(stack.gateway.url, token).status_code == 200


def test_a_flood_of_streams_goes_through_the_gateway_process_never_the_consoles(
        world: tuple[Stack, str, list[Agent]]) -> None:
    stack, token, agents = world
    served_before = len(stack.console.paths_served())
    stop = threading.Event()
    box: dict[str, Any] = {}
    reporter = threading.Thread(target=lambda: box.setdefault("reports", report_loop(agents, 20.0, stop)))
    reporter.start()
    try:
        result = flood(stack.gateway.url, token, 100, stop, max_tokens=4, once=True)
    finally:
        stop.set()
        reporter.join(60)
    latencies, statuses = box["reports"]
    assert result.statuses == {200: 100} and result.incomplete == 0, result  # every stream whole
    assert latencies and set(statuses) <= {200, 202}, statuses  # every report answered 2xx
    # daphne logs a request as its answer goes out: wait for every line, then look at what each served
    logged(lambda: len(stack.console.paths_served()) - served_before >= len(latencies))
    logged(lambda: sum(p == "/v1/completions" for p in stack.gateway.paths_served()) >= 100)
    console_paths = stack.console.paths_served()[served_before:]
    assert [p for p in console_paths if p.startswith("/v1")] == []
    assert sum(p == "/agent/v1/report" for p in console_paths) == len(latencies)

    # and the console's process does not serve the API: it says where it is
    misdirected = completion(stack.console.url, token)
    assert misdirected.status_code == 421
    assert f"{stack.gateway.url}/v1" in misdirected.json()["error"]["message"]
    # nor does the gateway's process serve the console
    assert httpx.post(f"{stack.gateway.url}/agent/v1/report", json={}, timeout=10).status_code == 404
