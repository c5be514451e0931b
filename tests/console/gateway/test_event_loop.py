"""Issue 18, finding 4: a huge prompt must not block daphne's event loop (it serves every agent's long
poll, websocket and API call of the process). Parsing and tokenizing run on console.gateway.cpu's
pool, and a prompt too long for the context is refused by its length before tokenizing.

The application runs in-process (httpx's ASGI transport, the asgi application daphne serves), so
the test sees both the pool and the loop: it asserts that /healthz answered while the 2.4 MB prompt
was still being tokenized - true however slow the machine, and never true if the tokenizing ran on
the loop. The latency itself is measured in bench/gateway_loop.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from asgiref.sync import sync_to_async
from django.db import connections

from console.asgi import application
from console.gateway import cpu
from tests.agents.dataplane.conftest import PLAN_TP1
from tests.console.gateway.world import make_deployment, make_node
from tests.console.people import make_person

pytestmark = pytest.mark.django_db(transaction=True)
HUGE = ("The quick brown fox jumps over the lazy dog. 12345 " * 50_000)[:2_400_000]


@pytest.fixture(autouse=True)
async def _tiny(settings: Any, tiny_model: Any) -> AsyncIterator[None]:
    settings.FLEXPIPE_GATEWAY_TOKENIZERS = {"tiny-llama": str(tiny_model.path)}
    settings.FLEXPIPE_GATEWAY_FROZEN_WAIT_S = 0.3
    yield
    # the connection sync_to_async's thread opened: closed, or the test database cannot be dropped
    await sync_to_async(connections.close_all)()


def _world() -> str:
    make_node("a1", "127.0.0.1:9")
    make_deployment("tiny", [{"plan_id": "p-x", "plan": PLAN_TP1, "weight": 1.0, "frozen": False, "nodes": ["a1"]}])
    return make_person("vera", "viewer").token


async def test_the_loop_answers_healthz_while_a_huge_prompt_is_tokenized(settings: Any) -> None:
    settings.FLEXPIPE_GATEWAY_MAX_PROMPT_CHARS = 3_000_000  # let it through to the tokenizer
    token = await sync_to_async(_world)()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=application), base_url="http://testserver",
                                 timeout=300) as client:
        big = asyncio.ensure_future(client.post("/v1/completions", headers={"Authorization": f"Bearer {token}"},
                                                json={"model": "tiny", "prompt": HUGE, "max_tokens": 1}))
        answered_while_tokenizing = 0
        while not big.done():
            if cpu.running():
                resp = await client.get("/healthz")
                assert resp.status_code == 200
                if cpu.running() and not big.done():
                    answered_while_tokenizing += 1
            await asyncio.sleep(0.005)
        resp = big.result()
    # ~1M tokens do not fit the tiny model's 2048: refused, after tokenizing
    assert resp.status_code == 400 and resp.json()["error"]["param"] in ("prompt", "max_tokens"), resp.text
    assert answered_while_tokenizing >= 1


async def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing() -> None:
    token = await sync_to_async(_world)()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=application), base_url="http://testserver",
                                 timeout=300) as client:
        for body in ({"model": "tiny", "prompt": HUGE},
                     {"model": "tiny", "messages": [{"role": "user", "content": HUGE}]}):
            path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
            resp = await client.post(path, headers={"Authorization": f"Bearer {token}"}, json=body)
            assert resp.status_code == 400, resp.text
            err = resp.json()["error"]
            assert err["param"] in ("prompt", "messages") and "cannot fit the model's context" in err["message"]


def test_a_forked_process_makes_its_own_pool() -> None:
    # daphne's live test servers (and preforking servers) are forked: a pool made before the fork has no
    # threads in the child, and a job given to it never ran - the gateway hung there
    import os
    import time

    assert asyncio.run(cpu.run(sum, [1, 2])) == 3  # the parent's pool exists now
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if its own job ran, and never return into pytest
        ok = False
        try:
            ok = asyncio.run(asyncio.wait_for(cpu.run(sum, [2, 3]), timeout=60)) == 5
        except BaseException:  # noqa: BLE001, S110 - the exit status says it
            pass
        os._exit(0 if ok else 1)
    deadline = time.monotonic() + 120
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        assert time.monotonic() < deadline, "the forked child's job never ran"
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0
