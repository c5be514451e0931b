"""ASGI entry point: HTTP through Django, websockets through Channels (served by daphne)."""

from __future__ import annotations

import asyncio
import functools
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
django.setup(set_prefix=False)  # what get_asgi_application does, before importing consumers: the app registry
from console.handler import Handler  # noqa: E402

django_asgi_app = Handler()  # Django's ASGIHandler without a garbage cycle per request (console/handler.py)

from console import gctune  # noqa: E402

gctune.apply()  # a web process's full collections were its report p99 at 1,000 agents (gctune.py)

from asgiref.sync import ThreadSensitiveContext  # noqa: E402
from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402

from console import db_pool  # noqa: E402
from console.agent_http import AgentApiHandler  # noqa: E402
from console.dashboard.origin import SameOriginValidator  # noqa: E402
from console.routing import websocket_urlpatterns  # noqa: E402

STOP_KEY = "flexpipe.stop"  # scope key: an asyncio.Event set when the server cancels the request
STOP_GRACE_S = 2.0


@functools.cache
def _long_poll_path() -> str:
    from django.urls import NoReverseMatch, reverse

    try:
        return reverse("agent-commands")
    except NoReverseMatch:  # the gateway's own process (console.gateway.urls) serves no long poll
        return ""


def is_long_poll(path: str) -> bool:
    return path == _long_poll_path()


def is_agent_api(path: str) -> bool:
    """Agent protocol v1's paths: their database calls run on console.db_pool's threads, so a fleet
    of agents reporting at once holds at most FLEXPIPE_POLL_DB_THREADS connections of this process
    (a thread and a connection per report in flight ran a default PostgreSQL out of its 100 at ~200
    agents: issue 19); requests past them wait their turn on the event loop, which costs nothing."""
    return path.startswith("/agent/v1/") or is_long_poll(path)


_live: dict[asyncio.Event, asyncio.Future[Any]] = {}  # requests in flight: stop event -> task
_server_stopping = False


async def _drain() -> None:
    """Let the requests in flight (and any that still come in) answer, for at most the grace."""
    deadline = time.monotonic() + STOP_GRACE_S
    while _live and time.monotonic() < deadline:
        await asyncio.wait(list(_live.values()), timeout=max(0.0, deadline - time.monotonic()))


def _on_server_stopping() -> Any:
    global _server_stopping
    _server_stopping = True
    for stop in list(_live):
        stop.set()
    from twisted.internet import defer

    # Twisted waits for this Deferred before it stops the loop the views run on.
    return defer.Deferred.fromFuture(asyncio.ensure_future(_drain()))


def _hook_server_shutdown() -> None:
    """Under daphne, learn that the server stops from Twisted's shutdown trigger (once), and start
    the garbage collector's freezer (console/gctune.py).

    Only when daphne has installed its reactor already and runs it: importing Twisted's reactor here
    first would install the wrong one, other servers (tests' communicators) have none, and a test
    process that imported daphne's server has one installed that serves nothing (a freezer there
    hid the garbage tests/console/test_agent_http.py counts).
    """
    if getattr(_hook_server_shutdown, "done", False) or "twisted.internet.reactor" not in sys.modules:
        return
    from twisted.internet import reactor

    if not reactor.running:  # type: ignore[attr-defined]
        return  # installed, not serving: a test process that imported daphne's server (it installs one)
    reactor.addSystemEventTrigger("before", "shutdown", _on_server_stopping)  # type: ignore[attr-defined]
    _hook_server_shutdown.done = True  # type: ignore[attr-defined]
    gctune.start_freezer()  # a server's process: freeze what survives (console/gctune.py)


class StopOnCancel:
    """Tell a long-waiting view that nobody will wait for its answer any more.

    When daphne stops (Ctrl-C) it cancels every pending request, but the cancellation never
    reaches an async view that runs behind Django's sync middleware (it runs in the middleware's
    thread, which waits for it), and daphne then waits for that thread: an agent's pending long
    poll held the web process until its wait ran out, longer than the process manager waits before a SIGKILL.
    An agent answered early polls again at once, in a request daphne takes in after it cancelled
    the others. So each request runs as its own task with an event in its scope, set when the
    request is cancelled, when the client disconnects, and (for every request, new ones included)
    once daphne's reactor starts shutting down; a view that watches it
    (console.fleet.agent_api.commands) answers at once. A request still running after a short
    grace is cancelled as before (asyncio.wait_for cancels it on the timeout). (The middleware chain
    is all async now, console/static.py; the event still carries disconnects and the server's stop.)

    The long poll's path also runs its sync calls on console.db_pool's shared threads, so that a
    waiting poll holds no thread and no database connection of its own (`pooled` says which paths
    do: the console pools every agent API path, is_agent_api; the gateway's process every request,
    console.gateway.asgi).
    """

    def __init__(self, app: Any, *, pooled: Callable[[str], bool] = is_long_poll) -> None:
        self.app = app
        self.pooled = pooled

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        _hook_server_shutdown()
        stop = asyncio.Event()
        if _server_stopping:  # a request that came in while the server stops waits for nothing
            stop.set()

        async def receive_watching_disconnect() -> dict[str, Any]:
            message: dict[str, Any] = await receive()
            if message.get("type") == "http.disconnect":
                stop.set()  # the client is gone: nobody waits for the answer
            return message

        async def run() -> None:
            if self.pooled(str(scope.get("path", ""))):
                # its short database calls borrow a pool thread each; it holds none while it waits
                async with ThreadSensitiveContext(executor=db_pool.Borrowed()):
                    await self.app({**scope, STOP_KEY: stop}, receive_watching_disconnect, send)
            else:
                await self.app({**scope, STOP_KEY: stop}, receive_watching_disconnect, send)

        task = asyncio.ensure_future(run())
        _live[stop] = task
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            stop.set()
            try:
                await asyncio.wait_for(task, timeout=STOP_GRACE_S)
            except (TimeoutError, asyncio.CancelledError):
                pass
            raise
        finally:
            _live.pop(stop, None)


agent_asgi_app = AgentApiHandler()


async def http_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Agent protocol v1 behind its short middleware chain (console/agent_http.py), the rest behind the whole one."""
    app = agent_asgi_app if is_agent_api(str(scope.get("path", ""))) else django_asgi_app
    await app(scope, receive, send)


application = ProtocolTypeRouter(
    {
        "http": StopOnCancel(http_app, pooled=is_agent_api),
        "websocket": SameOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
    }
)
