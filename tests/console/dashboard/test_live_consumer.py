"""The base of every live page's websocket: the channel layer outwaits its blocking receive, the
server pings idle connections, and the client gauge comes back down however a connection ends."""

from __future__ import annotations

from typing import Any

import pytest
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator
from django.urls import path

from console.asgi import application
from console.dashboard.consumers import LiveConsumer
from console.metrics.websockets import CLIENTS
from tests.console.people import make_person

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_layers_redis_reads_outwait_its_blocking_receive() -> None:
    # redis 5+ times every read out after 5 s by default, channels_redis blocks 5 s in BZPOPMIN: an
    # idle consumer's read lost that race and the websocket closed with 1011 every 5-15 s
    layer = get_channel_layer()
    pool = layer.create_pool(0)
    assert pool.connection_kwargs["socket_timeout"] > layer.brpop_timeout + 5


def _gauge(page: str) -> float:
    return CLIENTS.labels(page=page)._value.get()  # type: ignore[no-any-return]


async def test_an_idle_connection_is_pinged_on_the_configured_period(settings: Any) -> None:
    settings.FLEXPIPE_WS_PING_S = 0.2
    vera = await database_sync_to_async(make_person)("vera", "viewer")
    comm = WebsocketCommunicator(application, "/ws/registry/", headers=[(b"origin", b"http://testserver"),
                                                                        (b"host", b"testserver")])
    comm.scope["user"] = vera.user
    connected, _ = await comm.connect()
    assert connected
    try:
        assert (await comm.receive_json_from(timeout=5))["type"] == "snapshot"
        for _ in range(2):
            ping = await comm.receive_json_from(timeout=5)
            assert ping["type"] == "ping" and ping["every_s"] == 0.2
    finally:
        await comm.disconnect()


class _Broken(LiveConsumer):
    group = "test-broken"
    page = "test-broken"

    async def on_accepted(self) -> None:
        raise RuntimeError("a bug in the page's first message")


async def test_the_client_gauge_comes_back_down_when_a_consumer_fails_under_its_connection() -> None:
    vera = await database_sync_to_async(make_person)("vera", "viewer")
    app = URLRouter([path("ws/broken/", _Broken.as_asgi())])
    before = _gauge("test-broken")
    comm = WebsocketCommunicator(app, "/ws/broken/")
    comm.scope["user"] = vera.user
    with pytest.raises(RuntimeError, match="a bug"):  # the application ended with it: nothing to disconnect
        await comm.connect()
        await comm.wait(timeout=5)
    assert _gauge("test-broken") == before
