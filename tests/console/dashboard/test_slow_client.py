"""A slow client is dropped and re-synced, never buffered for without end nor let back up the channel
layer (issue 19): a socket whose unacknowledged messages pass FLEXPIPE_WS_MAX_UNACKED_BYTES, or whose
events pile up in the layer faster than its handlers take them, is closed with 4409 and its
reconnect starts over from a whole snapshot (console/dashboard/consumers.py)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import redis
from asgiref.sync import sync_to_async
from channels import DEFAULT_CHANNEL_LAYER
from channels.db import database_sync_to_async
from channels.layers import channel_layers, get_channel_layer
from channels.testing import WebsocketCommunicator
from django.test import Client, override_settings

from bench._ws import Websocket, WebsocketClosed
from console.asgi import application
from console.dashboard.consumers import RESYNC_CLOSE
from console.fleet.live import CLUSTER_GROUP
from console.gearbox import present
from console.gearbox.live import GEARBOX_GROUP
from tests.builders import JOIN_TOKEN
from tests.conftest import TEST_REDIS_URL
from tests.console.conftest import enroll
from tests.console.pagetools import LivePageTestCase
from tests.console.people import make_person

HEADERS = [(b"origin", b"http://testserver"), (b"host", b"testserver")]


def _delta(tag: str, gpus: int) -> dict[str, Any]:
    """A cluster delta of `gpus` made-up GPUs (~150 bytes each once sent)."""
    return {"nodes": [], "gpus": [{"uuid": f"GPU-{tag}-{i}", "node_id": f"n-{tag}", "index": i,
                                   "mem_used_bytes": 12345678 + i} for i in range(gpus)]}


def _members(group: str) -> int:
    """Channels in a channel-layer group, as Redis holds it (channels_redis: "<prefix>:group:<name>")."""
    layer = get_channel_layer()
    return int(redis.Redis.from_url(TEST_REDIS_URL).zcard(f"{layer.prefix}:group:{group}"))


async def _next_output(comm: WebsocketCommunicator) -> dict[str, Any]:
    return await comm.receive_output(timeout=10)  # type: ignore[no-any-return]


@pytest.mark.django_db(transaction=True)
async def test_a_socket_is_dropped_only_when_what_it_has_not_acked_passes_the_bound(settings: Any) -> None:
    settings.FLEXPIPE_WS_MAX_UNACKED_BYTES = 20_000
    settings.FLEXPIPE_PUSH_MIN_INTERVAL_S = 0
    vera = await database_sync_to_async(make_person)("vera", "viewer")
    layer = get_channel_layer()
    comm = WebsocketCommunicator(application, "/ws/cluster/", headers=HEADERS)
    comm.scope["user"] = vera.user
    assert (await comm.connect())[0]
    try:
        received = 0

        async def one() -> dict[str, Any]:
            nonlocal received
            out = await _next_output(comm)
            received += out["type"] == "websocket.send"
            return out

        assert '"snapshot"' in (await one())["text"]
        # a reading client: 30 deltas of ~5 KB (150 KB, 7x the bound), each acked - never dropped
        for i in range(30):
            await comm.send_json_to({"type": "ack", "count": received})
            await layer.group_send(CLUSTER_GROUP, {"type": "cluster.delta", "delta": _delta(f"r{i}", 30)})
            out = await one()
            assert out["type"] == "websocket.send" and f"GPU-r{i}-0" in out["text"]
        assert await sync_to_async(_members)(CLUSTER_GROUP) == 1

        # it stops acking: the deltas it holds unacked never pass the bound, then the socket closes
        unacked = 0
        for i in range(30):
            await layer.group_send(CLUSTER_GROUP, {"type": "cluster.delta", "delta": _delta(f"s{i}", 30)})
            out = await one()
            if out["type"] == "websocket.close":
                break
            unacked += len(out["text"])
        assert out == {"type": "websocket.close", "code": RESYNC_CLOSE}
        assert 10_000 < unacked <= 20_000
        # it left the layer's groups at once: nothing more is queued for it
        assert await sync_to_async(_members)(CLUSTER_GROUP) == 0
    finally:
        await comm.disconnect()


@pytest.mark.django_db(transaction=True)
async def test_a_socket_whose_events_pile_up_in_the_layer_is_dropped_for_a_resync(monkeypatch: Any) -> None:
    """channels_redis keeps `capacity` events per channel and then drops the oldest without a word:
    a page whose handler is stuck while another socket of the process drains the layer for it
    would silently lose events. Half full, it is dropped for a resync instead."""
    vera = await database_sync_to_async(make_person)("vera", "viewer")
    layer = get_channel_layer()
    stuck = WebsocketCommunicator(application, "/ws/gearbox/", headers=HEADERS)
    other = WebsocketCommunicator(application, "/ws/cluster/", headers=HEADERS)
    for comm in (stuck, other):
        comm.scope["user"] = vera.user
        assert (await comm.connect())[0]
    try:
        assert '"snapshot"' in (await _next_output(stuck))["text"]
        assert '"snapshot"' in (await _next_output(other))["text"]
        release, entered = threading.Event(), threading.Event()
        real = present.deployments_state

        def slow(*args: Any, **kwargs: Any) -> Any:
            entered.set()
            release.wait(30)
            return real(*args, **kwargs)

        monkeypatch.setattr(present, "deployments_state", slow)
        event = {"type": "gearbox.event", "event": {"kind": "routing", "deployment": "nowhere"}}
        await layer.group_send(GEARBOX_GROUP, event)
        while not entered.is_set():  # the stuck socket's handler holds the first event
            await asyncio.sleep(0.01)
        for _ in range(60):
            await layer.group_send(GEARBOX_GROUP, event)
        # the other socket's receive pulls the process's messages into each channel's buffer
        buffers = layer.receive_buffer
        deadline = time.monotonic() + 30
        while not any(q.qsize() >= layer.capacity // 2 for q in list(buffers.values())):
            assert time.monotonic() < deadline, "the layer never filled the stuck socket's buffer"
            await asyncio.sleep(0.01)
        release.set()
        while (out := await _next_output(stuck))["type"] == "websocket.send":
            pass
        assert out == {"type": "websocket.close", "code": RESYNC_CLOSE}
        assert await sync_to_async(_members)(GEARBOX_GROUP) == 0
    finally:
        release.set()
        for comm in (stuck, other):
            await comm.disconnect()


@override_settings(FLEXPIPE_WS_MAX_UNACKED_BYTES=200_000, FLEXPIPE_PUSH_MIN_INTERVAL_S=0,
                   FLEXPIPE_ENROLL_TOKEN=JOIN_TOKEN)
class ASlowClientOfALiveServer(LivePageTestCase):
    """daphne itself, a client that reads nothing after its snapshot, the real Redis layer."""

    def setUp(self) -> None:
        client = Client()
        for node in ("a1", "a2", "a3"):
            enroll(client, node, gpus=4)
        web = Client()
        web.force_login(make_person("watcher", "viewer").user)
        self.cookie = f"sessionid={web.cookies['sessionid'].value}"

    def test_it_is_dropped_the_layer_stays_bounded_and_its_reconnect_gets_the_whole_fleet(self) -> None:
        asyncio.run(self._scenario())

    async def _scenario(self) -> None:
        layer = channel_layers.make_backend(DEFAULT_CHANNEL_LAYER)  # this loop's own (closed with it)
        rd = redis.Redis.from_url(TEST_REDIS_URL)
        slow = await Websocket.connect("127.0.0.1", self._port, "/ws/cluster/", cookie=self.cookie)
        first = await slow.recv_json()
        assert first["type"] == "snapshot" and len(first["gpus"]) == 12
        # from here on `slow` reads nothing: what the server sends piles up in the sockets' buffers
        # 30 pushes of ~20 KB: three times the bound
        longest_queue = 0

        def sample() -> None:
            nonlocal longest_queue
            queued = [rd.zcard(k) for k in rd.scan_iter(match=f"{layer.prefix}specific*")]
            longest_queue = max([longest_queue, *queued])

        for i in range(30):
            await layer.group_send(CLUSTER_GROUP, {"type": "cluster.delta", "delta": _delta(f"p{i}", 130)})
            sample()
        deadline = time.monotonic() + 60
        while _members(CLUSTER_GROUP):  # the server drops it: it leaves the layer's group
            assert time.monotonic() < deadline, "the server kept a client that acked none of ~600 KB"
            sample()
            await asyncio.sleep(0.05)
        assert longest_queue < layer.capacity
        # it reads again: the server had stopped sending at the bound, then closed it - with 4409 when
        # the close frame got through, or by dropping the connection when it sat behind what the
        # client never read (autobahn aborts a close handshake unanswered for 1 s; the browser
        # reconnects on either)
        read_before = slow.bytes_received
        code: int | None = -1
        try:
            while True:
                await slow.recv_json()
        except WebsocketClosed as exc:
            code = exc.code
        assert code in (RESYNC_CLOSE, None)
        assert slow.bytes_received - read_before <= 200_000 + 32_000  # the bound, and the push that passed it
        # the reconnect starts over from the whole fleet, and keeps getting live deltas
        fresh = await Websocket.connect("127.0.0.1", self._port, "/ws/cluster/", cookie=self.cookie)
        try:
            snap = await fresh.recv_json()
            assert snap["type"] == "snapshot" and snap["pages"] == 1
            assert sorted(g["uuid"] for g in snap["gpus"]) == sorted(
                f"GPU-{n}-{i}" for n in ("a1", "a2", "a3") for i in range(4))
            await layer.group_send(CLUSTER_GROUP, {"type": "cluster.delta", "delta": _delta("after", 2)})
            delta = await fresh.recv_json()
            assert delta["type"] == "delta" and [g["uuid"] for g in delta["gpus"]] == ["GPU-after-0", "GPU-after-1"]
        finally:
            await fresh.close()
            await slow.close()
