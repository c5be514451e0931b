"""The Audit page's websocket: viewers only; each committed entry arrives once, as the API shows it."""

from __future__ import annotations

from typing import Any

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.db import transaction
from django.utils import timezone

from console.asgi import application
from console.audit.chain import record
from tests.console.people import make_person

pytestmark = pytest.mark.django_db(transaction=True)


def communicator(user: Any | None) -> WebsocketCommunicator:
    comm = WebsocketCommunicator(application, "/ws/audit/", headers=[(b"origin", b"http://testserver"),
                                                                   (b"host", b"testserver")])
    if user is not None:
        comm.scope["user"] = user
    return comm


def append(summary: str, **kw: Any) -> Any:
    return record("test.event", actor="user:vera", summary=summary, at=timezone.now(), data={"n": 1}, **kw)


async def test_an_anonymous_browser_is_turned_away_with_4401() -> None:
    comm = communicator(None)
    try:
        connected, code = await comm.connect()
        assert not connected and code == 4401
    finally:
        await comm.disconnect()


async def test_a_user_without_a_role_is_turned_away_with_4403() -> None:
    otto = await database_sync_to_async(make_person)("otto", None)
    comm = communicator(otto.user)
    try:
        connected, code = await comm.connect()
        assert not connected and code == 4403
    finally:
        await comm.disconnect()


async def test_a_viewer_hears_the_head_then_each_new_entry_as_the_api_shows_it() -> None:
    vera = await database_sync_to_async(make_person)("vera", "viewer")
    await database_sync_to_async(append)("before connecting")
    comm = communicator(vera.user)
    connected, _ = await comm.connect()
    assert connected
    try:
        assert await comm.receive_json_from(timeout=5) == {"type": "hello", "head_seq": 1}
        entry = await database_sync_to_async(append)("while watching", deployment="chat")
        msg = await comm.receive_json_from(timeout=5)
        assert msg["type"] == "entry" and msg["entry"]["seq"] == entry.seq == 2
        assert msg["entry"]["summary"] == "while watching" and msg["entry"]["deployment"] == "chat"
        api = await database_sync_to_async(vera.api().get)("/api/v1/audit/2")
        assert msg["entry"] == api.json()
        assert await comm.receive_nothing(timeout=0.2)  # once, not twice
    finally:
        await comm.disconnect()


async def test_an_entry_rolled_back_with_its_write_is_never_pushed() -> None:
    vera = await database_sync_to_async(make_person)("vera", "viewer")
    comm = communicator(vera.user)
    await comm.connect()
    try:
        await comm.receive_json_from(timeout=5)  # hello

        def write_then_fail() -> None:
            with transaction.atomic():
                append("this write fails after auditing")
                raise RuntimeError("the write it recorded failed")

        with pytest.raises(RuntimeError):
            await database_sync_to_async(write_then_fail)()
        assert await comm.receive_nothing(timeout=0.5)
        committed = await database_sync_to_async(append)("a later write that commits")
        msg = await comm.receive_json_from(timeout=5)
        assert msg["entry"]["seq"] == committed.seq == 1  # the rolled-back entry left no gap
    finally:
        await comm.disconnect()


async def test_a_resync_request_repeats_the_hello() -> None:
    vera = await database_sync_to_async(make_person)("vera", "viewer")
    comm = communicator(vera.user)
    await comm.connect()
    try:
        await comm.receive_json_from(timeout=5)
        await database_sync_to_async(append)("one")
        await comm.receive_json_from(timeout=5)
        await comm.send_json_to({"type": "resync"})
        assert await comm.receive_json_from(timeout=5) == {"type": "hello", "head_seq": 1}
    finally:
        await comm.disconnect()
