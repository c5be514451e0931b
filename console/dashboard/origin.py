"""The websockets' Origin check: a browser's socket is accepted only from the console's own pages.

Channels' AllowedHostsOriginValidator compares the Origin with ALLOWED_HOSTS, so with the default
`ALLOWED_HOSTS=*` any site could open a socket with an operator's session cookie and read the live
pages (the audit log streamed to `Origin: http://evil.example`). This one accepts an Origin that is
either the host the browser connected to (same origin: the Origin's host[:port] is the Host header,
and that host is allowed by ALLOWED_HOSTS) or one of CSRF_TRUSTED_ORIGINS (the console behind a
proxy that rewrites Host). A socket without an Origin is refused: every browser sends one.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from channels.security.websocket import WebsocketDenier
from django.conf import settings
from django.http.request import split_domain_port, validate_host


def _header(scope: dict[str, Any], name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key == name:
            return bytes(value).decode("latin1")
    return None


def origin_allowed(origin: str | None, host: str | None) -> bool:
    if not origin:
        return False
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return False
    trusted = {o.rstrip("/").lower() for o in settings.CSRF_TRUSTED_ORIGINS}
    if origin.rstrip("/").lower() in trusted:
        return True
    if not host or parts.netloc.lower() != host.lower():
        return False
    domain, _ = split_domain_port(host)
    return bool(domain) and validate_host(domain, settings.ALLOWED_HOSTS)


class SameOriginValidator:
    def __init__(self, application: Any) -> None:
        self.application = application

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> Any:
        if scope["type"] != "websocket":
            raise ValueError("SameOriginValidator guards websockets only")
        if origin_allowed(_header(scope, b"origin"), _header(scope, b"host")):
            return await self.application(scope, receive, send)
        return await WebsocketDenier()(scope, receive, send)
