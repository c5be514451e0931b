from __future__ import annotations

from typing import Any

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.test import Client

from console.asgi import application
from tests.builders import GIB, report_body
from tests.console.conftest import enroll
from tests.console.people import make_person

pytestmark = pytest.mark.django_db(transaction=True)


async def _connect(user: Any | None) -> WebsocketCommunicator:
    comm = WebsocketCommunicator(application, "/ws/cluster/", headers=[(b"origin", b"http://testserver"),
                                                                     (b"host", b"testserver")])
    if user is not None:
        comm.scope["user"] = user
    return comm


async def test_an_anonymous_browser_is_turned_away() -> None:
    comm = await _connect(None)
    connected, code = await comm.connect()
    try:
        assert not connected and code == 4401
    finally:
        await comm.disconnect()


async def test_a_logged_in_operator_gets_a_snapshot_then_a_delta_for_each_report(django_user_model: Any) -> None:
    user = (await sync_to_async(make_person)("ops", "viewer")).user
    client = Client()
    agent = await sync_to_async(enroll)(client, "a1", gpus=2)
    comm = await _connect(user)
    connected, _ = await comm.connect()
    assert connected
    try:
        snap = await comm.receive_json_from(timeout=5)
        assert snap["type"] == "snapshot"
        assert sorted(g["uuid"] for g in snap["gpus"]) == ["GPU-a1-0", "GPU-a1-1"]

        resp = await sync_to_async(agent.post)("/agent/v1/report", report_body(gpus=2, used_gib=33))
        assert resp.status_code == 200
        delta = await comm.receive_json_from(timeout=5)
        assert delta["type"] == "delta"
        assert [n["node_id"] for n in delta["nodes"]] == ["a1"]
        assert {g["mem_used_bytes"] for g in delta["gpus"]} == {33 * GIB}
    finally:
        await comm.disconnect()


async def test_a_refused_report_pushes_nothing(django_user_model: Any) -> None:
    user = (await sync_to_async(make_person)("ops", "viewer")).user
    agent = await sync_to_async(enroll)(Client(), "a1", gpus=2)
    comm = await _connect(user)
    await comm.connect()
    try:
        await comm.receive_json_from(timeout=5)  # the snapshot
        bad = report_body(gpus=2)
        bad["gpus"][0]["sm_util"] = 7
        assert (await sync_to_async(agent.post)("/agent/v1/report", bad)).status_code == 400
        assert await comm.receive_nothing(timeout=0.5)
    finally:
        await comm.disconnect()


async def test_a_burst_of_reports_is_coalesced_and_the_last_state_arrives(django_user_model: Any, settings: Any) -> None:
    """Issue 19: thirty reports in a row reach the heatmap as a few merged deltas - never more than one
    per FLEXPIPE_PUSH_MIN_INTERVAL_S (+ the first, at once) - and the last one carries the last state."""
    import time

    settings.FLEXPIPE_PUSH_MIN_INTERVAL_S = 0.5
    user = (await sync_to_async(make_person)("ops", "viewer")).user
    agent = await sync_to_async(enroll)(Client(), "a1", gpus=2)
    comm = await _connect(user)
    await comm.connect()
    try:
        await comm.receive_json_from(timeout=5)  # the snapshot
        t0 = time.monotonic()
        for seq in range(1, 31):
            body = report_body(seq=seq, gpus=2, used_gib=seq)
            assert (await sync_to_async(agent.post)("/agent/v1/report", body)).status_code == 200
        deltas = []
        while True:  # until the last state arrives (the wait is on a condition; the timeout only guards a hang)
            deltas.append(await comm.receive_json_from(timeout=30))
            used = {g["uuid"]: g["mem_used_bytes"] for d in deltas for g in d["gpus"]}
            if used.get("GPU-a1-0") == 30 * GIB:
                break
        elapsed = time.monotonic() - t0
        assert all(d["type"] == "delta" for d in deltas)
        assert len(deltas) <= elapsed / 0.5 + 2
        assert used == {"GPU-a1-0": 30 * GIB, "GPU-a1-1": 30 * GIB}
    finally:
        await comm.disconnect()


def _fleet_state(nodes: int, gpus: int) -> dict[str, Any]:
    """The heatmap's state of a fleet, as console.fleet.live builds it (rows not saved: no database)."""
    from django.utils import timezone

    from console.fleet import live
    from console.fleet.models import Gpu, Node

    now = timezone.now()
    out: dict[str, Any] = {"nodes": [], "gpus": []}
    for i in range(nodes):
        node = Node(node_id=f"node-{i:05d}", hostname=f"gpu-host-{i:05d}.example", rack=f"rack-{i // 32}",
                    last_seen_at=now, registered_at=now, engines=[])
        out["nodes"].append(live.node_payload(node))
        for g in range(gpus):
            out["gpus"].append(live.gpu_payload(Gpu(node=node, uuid=f"GPU-{i:05d}-{g}-0123456789abcdef", index=g,
                                                    model="H100-SXM", mem_total_bytes=80 * GIB,
                                                    mem_used_bytes=12 * GIB, sm_util=0.5, temperature_c=50.0,
                                                    nvlink_group="nv0", updated_at=now)))
    return out


def test_the_snapshot_of_a_thousand_nodes_goes_in_pages_under_daphnes_message_limit() -> None:
    import json

    from console.fleet.consumers import snapshot_pages

    state = _fleet_state(1000, 8)
    assert len(json.dumps(state)) > 1024 * 1024  # one message would not pass
    pages = snapshot_pages(state, 100)
    assert [p["type"] for p in pages] == ["snapshot"] + ["delta"] * 9
    assert max(len(json.dumps(p)) for p in pages) < 1024 * 1024
    assert [n for p in pages for n in p["nodes"]] == state["nodes"]
    assert sorted(g["uuid"] for p in pages for g in p["gpus"]) == sorted(g["uuid"] for g in state["gpus"])
    assert snapshot_pages({"nodes": [], "gpus": []}, 100) == [
        {"type": "snapshot", "page": 1, "pages": 1, "nodes": [], "gpus": []}]


async def test_a_browser_gets_the_snapshot_in_pages(django_user_model: Any, settings: Any) -> None:
    settings.FLEXPIPE_SNAPSHOT_PAGE_NODES = 2
    user = (await sync_to_async(make_person)("ops", "viewer")).user
    client = Client()
    for node_id in ("a1", "a2", "a3"):
        await sync_to_async(enroll)(client, node_id, gpus=2)
    comm = await _connect(user)
    await comm.connect()
    try:
        first, second = await comm.receive_json_from(timeout=5), await comm.receive_json_from(timeout=5)
        assert (first["type"], first["page"], first["pages"], second["type"], second["page"]) == (
            "snapshot", 1, 2, "delta", 2)
        assert [n["node_id"] for n in first["nodes"] + second["nodes"]] == ["a1", "a2", "a3"]
        assert len(first["gpus"]) == 4 and len(second["gpus"]) == 2
    finally:
        await comm.disconnect()
