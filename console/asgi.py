"""ASGI entry point: HTTP through Django, websockets through Channels (served by daphne)."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
django_asgi_app = get_asgi_application()  # before importing consumers: it sets up the app registry

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402

from console.routing import websocket_urlpatterns  # noqa: E402

STOP_KEY = "flexpipe.stop"  # scope key: an asyncio.Event set when the server cancels the request
STOP_GRACE_S = 2.0


class StopOnCancel:
    """Tell a long-waiting view that the server is letting go of its request.

    When daphne stops (Ctrl-C) it cancels every pending request, but the cancellation never
    reaches an async view that runs behind Django's sync middleware (it runs in the middleware's
    thread, which waits for it), and daphne then waits for that thread: an agent's pending long
    poll held the web process until its wait ran out, longer than honcho waits before a SIGKILL.
    Here the request runs as its own task; on cancellation the event in its scope is set, a view
    that watches it (console.fleet.agent_api.commands) answers at once. A request still running
    after a short grace is cancelled as before (asyncio.wait_for cancels it on the timeout).
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        stop = asyncio.Event()
        task = asyncio.ensure_future(self.app({**scope, STOP_KEY: stop}, receive, send))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            stop.set()
            try:
                await asyncio.wait_for(task, timeout=STOP_GRACE_S)
            except (TimeoutError, asyncio.CancelledError):
                pass
            raise


application = ProtocolTypeRouter(
    {
        "http": StopOnCancel(django_asgi_app),
        "websocket": AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
    }
)
