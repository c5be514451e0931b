"""The Registry page's websocket: every version on connect, then each change as it commits."""

from __future__ import annotations

import json
from typing import Any

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator

from console.asgi import application
from console.registry import actions
from console.registry.models import ModelVersion
from tests.console.people import make_person
from tests.console.registry.conftest import OTHER_SHA256, model_body

pytestmark = pytest.mark.django_db(transaction=True)


def communicator(user: Any | None) -> WebsocketCommunicator:
    comm = WebsocketCommunicator(application, "/ws/registry/", headers=[(b"origin", b"http://testserver"),
                                                                      (b"host", b"testserver")])
    if user is not None:
        comm.scope["user"] = user
    return comm


async def test_anonymous_and_roleless_users_are_turned_away() -> None:
    otto = await database_sync_to_async(make_person)("otto", None)
    for user, expected in ((None, 4401), (otto.user, 4403)):
        comm = communicator(user)
        try:
            connected, code = await comm.connect(timeout=10)
            assert not connected and code == expected
        finally:
            await comm.disconnect()


async def test_a_viewer_gets_the_versions_then_sees_a_registration_and_its_quarantine() -> None:
    alice = await database_sync_to_async(make_person)("alice", "admin")
    vera = await database_sync_to_async(make_person)("vera", "viewer")
    comm = communicator(vera.user)
    connected, _ = await comm.connect(timeout=10)
    assert connected
    try:
        assert await comm.receive_json_from(timeout=10) == {"type": "snapshot", "versions": []}
        resp = await database_sync_to_async(alice.api().post)("/api/v1/models", json.dumps(model_body()),
                                                     content_type="application/json")
        assert resp.status_code == 201
        msg = await comm.receive_json_from(timeout=10)
        assert msg == {"type": "version", "version": resp.json()}

        version = await database_sync_to_async(ModelVersion.objects.get)(pk=resp.json()["id"])
        await database_sync_to_async(actions.do_record_weights_check)(version, observed_sha256=OTHER_SHA256, node_id="a1")
        msg = await comm.receive_json_from(timeout=10)
        assert msg["version"]["status"] == "quarantined" and msg["version"]["observed_sha256"] == OTHER_SHA256
    finally:
        await comm.disconnect()


async def test_a_refused_registration_pushes_nothing() -> None:
    alice = await database_sync_to_async(make_person)("alice", "admin")
    vera = await database_sync_to_async(make_person)("vera", "viewer")
    comm = communicator(vera.user)
    await comm.connect(timeout=10)
    try:
        await comm.receive_json_from(timeout=10)
        resp = await database_sync_to_async(alice.api().post)("/api/v1/models", json.dumps(model_body(sha256="bad")),
                                                     content_type="application/json")
        assert resp.status_code == 400
        assert await comm.receive_nothing(timeout=0.5)
    finally:
        await comm.disconnect()
