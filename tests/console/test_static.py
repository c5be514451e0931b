"""console.static.WhiteNoise: static files served as WhiteNoise serves them, in both of Django's modes.

It is async-capable so that the middleware chain stays async under ASGI (a pending long poll then
holds no thread: tests/console/fleet/test_long_poll_scale.py); the static paths must not change.
"""

from __future__ import annotations

from typing import Any

import httpx
from django.http import HttpRequest, HttpResponse
from django.test import RequestFactory

from console.asgi import application
from console.static import WhiteNoise


def _body(resp: Any) -> bytes:
    return b"".join(resp.streaming_content) if resp.streaming else resp.content


async def test_the_asgi_application_serves_a_static_file_and_the_views_behind_it() -> None:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=application), base_url="http://testserver") as c:
        js = await c.get("/static/js/live.js")
        health = await c.get("/healthz")
    assert js.status_code == 200 and "javascript" in js.headers["content-type"] and len(js.content) > 0
    assert health.status_code == 200


async def test_async_mode_looks_on_disk_with_autorefresh(settings: Any) -> None:
    settings.WHITENOISE_AUTOREFRESH = True

    async def app(request: HttpRequest) -> HttpResponse:
        return HttpResponse(b"app")

    middleware = WhiteNoise(app)
    static = await middleware(RequestFactory().get("/static/js/live.js"))
    other = await middleware(RequestFactory().get("/agent/v1/commands"))
    assert static.status_code == 200 and b"function" in _body(static)
    assert other.content == b"app"


def test_sync_mode_is_whitenoise_unchanged() -> None:
    middleware = WhiteNoise(lambda request: HttpResponse(b"app"))
    static = middleware(RequestFactory().get("/static/js/live.js"))
    other = middleware(RequestFactory().get("/healthz"))
    assert static.status_code == 200 and b"function" in _body(static)
    assert other.content == b"app"
