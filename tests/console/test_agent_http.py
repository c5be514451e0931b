"""Agent protocol v1 behind its short middleware chain (console/agent_http.py), through the ASGI app."""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from asgiref.sync import sync_to_async
from django.db import connections
from django.test import Client

from console import asgi, db_pool
from console.asgi import application
from tests.builders import report_body
from tests.console.conftest import enroll

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
async def _close_connections() -> AsyncIterator[None]:
    yield
    await sync_to_async(connections.close_all)()


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=application), base_url="http://testserver") as c:
        yield c


@pytest.fixture
async def token() -> str:
    agent = await sync_to_async(enroll)(Client(), "h1", gpus=2)
    return agent.token


def _target(fn: Any) -> str:
    """What a pool thread was borrowed for: SyncToAsync hands the pool a partial over its own partial."""
    inner = fn.args[-1] if isinstance(fn, functools.partial) and fn.args else fn
    inner = inner.func if isinstance(inner, functools.partial) else inner
    return str(getattr(inner, "__qualname__", repr(inner)))


async def _hops(http: httpx.AsyncClient, token: str, seq: int, monkeypatch: Any) -> list[str]:
    borrowed: list[str] = []
    submit = db_pool.Borrowed.submit

    def counting(self: db_pool.Borrowed, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        borrowed.append(_target(fn))
        return submit(self, fn, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(db_pool.Borrowed, "submit", counting)
        resp = await http.post("/agent/v1/report", json=report_body("h1", seq=seq, gpus=2),
                               headers={"Authorization": f"Bearer {token}"})
    assert resp.status_code == 200, resp.text
    return borrowed


async def test_a_report_borrows_a_pool_thread_for_the_view_not_for_each_middleware(
        http: httpx.AsyncClient, token: str, monkeypatch: Any) -> None:
    hops = await _hops(http, token, 1, monkeypatch)
    # Django's handler itself: request_started's receivers, the view, the response's close.
    assert hops == ["Signal.asend.<locals>.sync_send", "report", "HttpResponseBase.close"], hops
    with monkeypatch.context() as patch:  # the same report through the browser chain, for contrast
        patch.setattr(asgi, "agent_asgi_app", asgi.django_asgi_app)
        whole = await _hops(http, token, 2, monkeypatch)
    assert len(whole) > len(hops) + 5, whole


async def test_an_agent_answer_carries_what_the_console_chain_gave_it(http: httpx.AsyncClient, token: str) -> None:
    resp = await http.post("/agent/v1/report", json=report_body("h1", seq=1, gpus=2),
                           headers={"Authorization": f"Bearer {token}"})
    assert int(resp.headers["content-length"]) == len(resp.content)
    assert resp.headers["x-content-type-options"] == "nosniff"
    assert "x-frame-options" not in resp.headers  # the browser chain did not run
    page = await http.get("/healthz")
    assert page.headers["x-frame-options"] == "DENY"  # a console path still runs the whole chain


async def test_refusals_on_the_agent_stack_are_json_naming_what_is_wrong(
        http: httpx.AsyncClient, token: str, settings: Any) -> None:
    settings.ALLOWED_HOSTS = ["testserver"]  # the default is "*", which lets any Host through
    unknown = await http.post("/agent/v1/report", json=report_body("h1", gpus=2),
                              headers={"Authorization": "Bearer nope"})
    assert unknown.status_code == 401 and unknown.json() == {"errors": {"Authorization": "unknown agent token"}}
    bad_host = await http.post("/agent/v1/report", json=report_body("h1", gpus=2),
                               headers={"Authorization": f"Bearer {token}", "Host": "evil.example"})
    assert bad_host.status_code == 400 and "application/json" in bad_host.headers["content-type"]
    assert "evil.example" in json.dumps(bad_host.json())
    missing = await http.get("/agent/v1/nothing-here")
    assert missing.status_code == 404 and "application/json" in missing.headers["content-type"]
    crashing = await http.post("/agent/v1/report", content=b"{", headers={"Authorization": f"Bearer {token}"})
    assert crashing.status_code == 400 and "application/json" in crashing.headers["content-type"]


async def _cyclic_garbage(app: Any, token: str, seqs: range) -> dict[str, int]:
    """What the cyclic collector finds after a report of each seq through `app` (nothing else
    collected meanwhile), by type name."""
    import collections
    import gc

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as c:
        await c.get("/healthz")  # imports, caches and connections made once, before counting
        gc.collect()
        gc.disable()
        try:
            for seq in seqs:
                resp = await c.post("/agent/v1/report", json=report_body("h1", seq=seq, gpus=2),
                                    headers={"Authorization": f"Bearer {token}"})
                assert resp.status_code == 200, resp.text
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            return dict(collections.Counter(type(o).__qualname__ for o in gc.garbage))
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()


async def test_a_request_leaves_no_garbage_cycle_behind(token: str) -> None:
    # Django's own ASGIHandler: its disconnect listener's RequestAborted keeps each request's frame,
    # and with it the request, in a cycle (console/handler.py) that only a collection frees
    from django.core.handlers.asgi import ASGIHandler

    from console.agent_http import AgentApiHandler
    from console.handler import Handler

    async def run(handler: Any, first: int) -> dict[str, int]:
        return await _cyclic_garbage(asgi.StopOnCancel(handler, pooled=asgi.is_agent_api), token, range(first, first + 10))

    theirs = await run(ASGIHandler(), 1)
    assert theirs.get("ASGIRequest") == 10 and theirs.get("frame", 0) >= 10, theirs  # the premise
    agents = await run(AgentApiHandler(), 11)
    assert not agents.get("ASGIRequest") and not agents.get("frame"), agents  # (what is left is the client's)
    # the pages' chain: no frame kept either; its requests stay in the cycle Django's authentication
    # middleware makes (request.user's lazy closure over the request), few next to the agents'
    pages = await run(Handler(), 21)
    assert not pages.get("frame"), pages
