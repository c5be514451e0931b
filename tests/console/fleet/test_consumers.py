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
