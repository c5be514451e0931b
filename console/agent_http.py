"""Agent protocol v1's HTTP stack: Django with a short middleware chain (issue 19).

An agent's request is small and comes every few seconds from each of a thousand nodes; what it
needs of the middleware is little: JSON errors (console.api.errors.JsonErrors), the Host checked
against ALLOWED_HOSTS, a Content-Length, and nosniff. The console's chain (settings.MIDDLEWARE)
serves browsers: sessions, CSRF, authentication, messages, clickjacking. Each of those is a sync
middleware, and under ASGI Django runs each of its hooks through sync_to_async: about a dozen thread
hops per request onto console.db_pool's few threads. With 1,000 agents reporting, py-spy (--gil)
put 54% of the web process's CPU there (MiddlewareMixin 31%, the SyncToAsync hops 23%), ahead of
the reports' own work. The agent views need none of it: they are csrf_exempt and authenticate by
bearer token (console/fleet/agent_api.py).

So the agent API's paths (console.asgi.is_agent_api) are served by AgentApiHandler, a Django
ASGIHandler built on settings.FLEXPIPE_AGENT_MIDDLEWARE; every other path keeps the whole chain.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings
from django.core.exceptions import DisallowedHost
from django.http import HttpRequest, HttpResponse

from console.api.errors import error_response
from console.handler import Handler

security_log = logging.getLogger("django.security.DisallowedHost")


class AgentApiHandler(Handler):
    """An ASGIHandler (console.handler's, no garbage cycle per request) whose middleware is settings.FLEXPIPE_AGENT_MIDDLEWARE, not MIDDLEWARE."""

    def load_middleware(self, is_async: bool = False) -> None:
        # BaseHandler.load_middleware reads settings.MIDDLEWARE; it runs once, when the handler is built.
        full = settings.MIDDLEWARE
        settings.MIDDLEWARE = settings.FLEXPIPE_AGENT_MIDDLEWARE
        try:
            super().load_middleware(is_async)
        finally:
            settings.MIDDLEWARE = full


class AgentWire:
    """What the console's chain gave an agent's request and answer, without a thread hop:

    - the Host checked against ALLOWED_HOSTS (CommonMiddleware did it): a bad one is a JSON 400
      that names it;
    - Content-Length on a whole answer (CommonMiddleware; without it daphne answers chunked);
    - X-Content-Type-Options: nosniff (SecurityMiddleware, SECURE_CONTENT_TYPE_NOSNIFF).
    """

    sync_capable = False
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        self.get_response = get_response
        markcoroutinefunction(self)
        if not iscoroutinefunction(get_response):
            raise TypeError("AgentWire is async only: serve it with console.agent_http.AgentApiHandler")

    async def __call__(self, request: HttpRequest) -> HttpResponse:
        try:
            request.get_host()
        except DisallowedHost as exc:
            security_log.warning("%s", exc)
            host = request.META.get("HTTP_HOST", "")
            return error_response(request.path, 400, f"Host: {host!r} is not in ALLOWED_HOSTS", code="disallowed_host")
        response: HttpResponse = await self.get_response(request)
        if not response.streaming and not response.has_header("Content-Length"):
            response.headers["Content-Length"] = str(len(response.content))
        if settings.SECURE_CONTENT_TYPE_NOSNIFF:
            response.headers.setdefault("X-Content-Type-Options", "nosniff")
        return response
