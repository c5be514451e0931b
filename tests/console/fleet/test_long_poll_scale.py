"""Issue 19: a pending long poll holds no PostgreSQL connection, no thread and no Redis client.

N polls wait at once in this process (httpx's ASGI transport into console.asgi.application, the
application daphne serves); while they wait, the test database's connections (pg_stat_activity)
and this process's Redis clients (CLIENT LIST, matched to this process's sockets) stay a small
constant, and a command issued for one node answers that node's poll and no other.
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import redis
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connection, connections
from django.utils import timezone

from console import asgi, db_pool
from console.asgi import application
from console.fleet import actions, agent_api, doorbell
from console.fleet.models import AgentCommand, Node

pytestmark = pytest.mark.django_db(transaction=True)
N = 200
DEADLINE_S = 120.0  # a hang guard only: every wait below is on a condition


@pytest.fixture(autouse=True)
async def _close_connections() -> AsyncIterator[None]:
    yield
    await sync_to_async(connections.close_all)()


def _nodes(n: int) -> dict[str, str]:
    tokens = {f"n{i:04d}": actions.new_agent_token() for i in range(n)}
    Node.objects.bulk_create([Node(node_id=node_id, hostname=node_id, agent_version="t", registered_at=timezone.now(),
                                   token_hash=actions.hash_token(token)) for node_id, token in tokens.items()])
    return tokens


def _pg_connections() -> int:
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()")
        return int(cur.fetchone()[0])


def _my_local_ports() -> set[int]:
    """Local TCP ports of this process's sockets (/proc: its fds' socket inodes in the net tables)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[9] in inodes:
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _my_redis_clients(probe: redis.Redis) -> int:
    """Clients the Redis server has from this process, less the probe itself."""
    probe.ping()  # connected before this process's ports are read
    ports = _my_local_ports()
    mine = [c for c in probe.client_list() if int(re.split(r"[:\]]", c["addr"])[-1]) in ports]
    return len(mine) - 1


def _issue(node_id: str) -> None:
    actions.do_issue_command(Node.objects.get(node_id=node_id), key=f"k:{node_id}", kind="prepare_plan",
                             payload={"plan": "p"}, now=timezone.now(), transition_seq=1, step="prepare")


async def _until(condition: Any) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + DEADLINE_S
    while not condition():
        assert loop.time() < end, "condition never held"
        await asyncio.sleep(0.02)


def _waiting() -> int:
    return sum(len(group) for group in doorbell.listener().waiters.values())


async def test_pending_polls_hold_no_connection_and_one_doorbell_wakes_exactly_its_poll() -> None:
    tokens = await sync_to_async(_nodes)(N)
    # what this process holds already (earlier tests' pools: the channel layer's, Celery's): not counted
    threads_before = threading.active_count()
    probe = redis.Redis.from_url(settings.REDIS_URL)
    clients_before = _my_redis_clients(probe)
    pg_before = await sync_to_async(_pg_connections)()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=application), base_url="http://testserver",
                                 timeout=DEADLINE_S) as client:
        polls = {node_id: asyncio.ensure_future(client.get(
            "/agent/v1/commands", params={"after": 0, "wait": 30}, headers={"Authorization": f"Bearer {token}"}))
            for node_id, token in tokens.items()}
        try:
            await _until(lambda: _waiting() == N and doorbell.listener().subscribed.is_set())
            pg = await sync_to_async(_pg_connections)() - pg_before
            clients = _my_redis_clients(probe) - clients_before
            threads = threading.active_count() - threads_before
            # at most one connection per pool thread; the listener's one client; the pool's threads
            assert pg <= db_pool.pool()._max_workers, pg
            assert clients <= 2, clients
            assert threads <= db_pool.pool()._max_workers + 2, threads

            target = "n0123"
            await sync_to_async(_issue)(target)
            resp = await asyncio.wait_for(polls[target], timeout=DEADLINE_S)
            assert [c["kind"] for c in resp.json()["commands"]] == ["prepare_plan"]
            assert not any(task.done() for node_id, task in polls.items() if node_id != target)
        finally:
            for stop in list(asgi._live):
                stop.set()  # as when the server stops: every pending poll answers with nothing at once
            answers = await asyncio.wait_for(asyncio.gather(*polls.values()), timeout=DEADLINE_S)
            probe.close()
    assert all(r.status_code == 200 for r in answers)
    assert sum(len(r.json()["commands"]) for r in answers) == 1
    assert await sync_to_async(AgentCommand.objects.filter(state=AgentCommand.DELIVERED).count)() == 1
    assert _waiting() == 0 and doorbell.listener().task is None  # the listener let go of its connection


async def test_a_ring_while_nobody_waits_is_not_lost() -> None:
    tokens = await sync_to_async(_nodes)(1)
    await sync_to_async(_issue)("n0000")  # rung before any poll listens: the poll's first query finds it
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=application), base_url="http://testserver",
                                 timeout=DEADLINE_S) as client:
        resp = await client.get("/agent/v1/commands", params={"after": 0, "wait": 30},
                                headers={"Authorization": f"Bearer {tokens['n0000']}"})
    assert [c["kind"] for c in resp.json()["commands"]] == ["prepare_plan"]


async def test_without_redis_the_poll_falls_back_to_querying(settings: Any) -> None:
    settings.REDIS_URL = "redis://127.0.0.1:9/0"  # nothing listens there: no ring reaches anyone
    tokens = await sync_to_async(_nodes)(1)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=application), base_url="http://testserver",
                                 timeout=DEADLINE_S) as client:
        poll = asyncio.ensure_future(client.get("/agent/v1/commands", params={"after": 0, "wait": 30},
                                                headers={"Authorization": f"Bearer {tokens['n0000']}"}))
        await _until(lambda: _waiting() == 1)
        await sync_to_async(_issue)("n0000")
        resp = await asyncio.wait_for(poll, timeout=DEADLINE_S)
    assert [c["kind"] for c in resp.json()["commands"]] == ["prepare_plan"]


def test_the_listener_says_whether_a_node_may_have_rung_since_a_mark() -> None:
    bell = doorbell.Listener()
    assert bell.rang_since(bell.mark(), "a")  # hearing nothing, it cannot say no
    bell.subscribed.set()
    bell.generation = 1
    mark = bell.mark()
    bell._ring("b")
    assert not bell.rang_since(mark, "a")
    assert bell.rang_since(mark, "b")
    bell._ring("a")
    assert bell.rang_since(mark, "a")
    later = bell.mark()
    assert not bell.rang_since(later, "a")
    bell.generation += 1  # subscribed anew: what rang in the gap was not heard
    assert bell.rang_since(later, "a")
    bell.subscribed.clear()
    assert bell.rang_since(bell.mark(), "a")


def test_an_idle_poll_answers_in_the_last_fifth_of_its_wait_spread_out() -> None:
    answers = [agent_api._idle_answer_s(30.0) for _ in range(2000)]
    assert all(24.0 <= a <= 30.0 for a in answers)
    assert min(answers) < 24.5 and max(answers) > 29.5  # spread over the fifth, not bunched at one point


async def test_a_ring_between_the_polls_first_query_and_its_wait_wakes_it(monkeypatch: Any) -> None:
    tokens = await sync_to_async(_nodes)(2)
    first_query = agent_api._poll_start
    bell: list[doorbell.Listener] = []

    def query_then_ring(request: Any, after: int) -> Any:
        node, found = first_query(request, after)
        if node.node_id == "n0001":  # the query found nothing; the command comes before the waiter is registered
            heard = bell[0].last_ring.get("n0001", 0)
            _issue("n0001")
            end = time.monotonic() + DEADLINE_S
            while bell[0].last_ring.get("n0001", 0) == heard:  # the listener heard the ring
                assert time.monotonic() < end, "the ring never came"
                time.sleep(0.01)
        return node, found

    monkeypatch.setattr(agent_api, "_poll_start", query_then_ring)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=application), base_url="http://testserver",
                                 timeout=DEADLINE_S) as client:
        def poll(node_id: str) -> Any:
            return client.get("/agent/v1/commands", params={"after": 0, "wait": 30},
                              headers={"Authorization": f"Bearer {tokens[node_id]}"})

        keeper = asyncio.ensure_future(poll("n0000"))  # holds the listener's subscription
        await _until(lambda: _waiting() == 1 and doorbell.listener().subscribed.is_set())
        bell.append(doorbell.listener())
        try:
            resp = await asyncio.wait_for(poll("n0001"), timeout=DEADLINE_S)
        finally:
            for stop in list(asgi._live):
                stop.set()
            await asyncio.wait_for(keeper, timeout=DEADLINE_S)
    assert [c["kind"] for c in resp.json()["commands"]] == ["prepare_plan"]
