"""Who may watch the live paths: the viewer role on every one of them (websockets, /cluster.json), only
from the console's own pages (Origin), and a user deactivated or demoted while watching is cut off at once."""

from __future__ import annotations

from typing import Any

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.test import Client

from console.accounts.actions import do_set_user_active, do_set_user_role
from console.asgi import application
from tests.console.people import Person, make_person

pytestmark = pytest.mark.django_db(transaction=True)

LIVE = ["/ws/cluster/", "/ws/audit/", "/ws/registry/", "/ws/gearbox/"]


def socket(path: str, user: Any | None, origin: bytes | None = b"http://testserver",
           host: bytes = b"testserver") -> WebsocketCommunicator:
    headers = [(b"host", host)] + ([(b"origin", origin)] if origin is not None else [])
    comm = WebsocketCommunicator(application, path, headers=headers)
    if user is not None:
        comm.scope["user"] = user
    return comm


@pytest.mark.parametrize("path", LIVE)
async def test_a_user_without_a_role_gets_no_live_socket(path: str) -> None:
    otto = (await database_sync_to_async(make_person)("otto", None)).user
    comm = socket(path, otto)
    try:
        connected, code = await comm.connect(timeout=10)
        assert not connected and code == 4403
    finally:
        await comm.disconnect()


def test_cluster_json_needs_the_viewer_role(db: None) -> None:
    assert Client().get("/cluster.json").status_code == 401
    otto, vera = make_person("otto", None), make_person("vera", "viewer")
    assert otto.browser().get("/cluster.json").status_code == 403
    assert otto.browser().get("/").status_code == 403  # the Overview draws from those paths
    assert vera.browser().get("/cluster.json").status_code == 200


@pytest.mark.parametrize("origin,host", [
    (b"http://evil.example", b"testserver"),            # another site, with the viewer's cookie
    (b"http://testserver.evil.example", b"testserver"),
    (b"null", b"testserver"),                           # a sandboxed iframe or a file
    (None, b"testserver"),                              # no Origin at all
])
async def test_a_socket_from_another_origin_is_refused_even_with_allowed_hosts_star(
        settings: Any, origin: bytes | None, host: bytes) -> None:
    settings.ALLOWED_HOSTS = ["*"]
    vera = (await database_sync_to_async(make_person)("vera", "viewer")).user
    comm = socket("/ws/audit/", vera, origin=origin, host=host)
    try:
        connected, _ = await comm.connect(timeout=10)
        assert not connected
    finally:
        await comm.disconnect()


async def test_the_consoles_own_origin_and_a_trusted_one_are_accepted(settings: Any) -> None:
    settings.ALLOWED_HOSTS = ["*"]
    settings.CSRF_TRUSTED_ORIGINS = ["https://console.example"]
    vera = (await database_sync_to_async(make_person)("vera", "viewer")).user
    for origin, host in ((b"http://127.0.0.1:8000", b"127.0.0.1:8000"), (b"https://console.example", b"web:8000")):
        comm = socket("/ws/audit/", vera, origin=origin, host=host)
        try:
            connected, _ = await comm.connect(timeout=10)
            assert connected, origin
        finally:
            await comm.disconnect()


@pytest.mark.parametrize("change,code", [("deactivate", 4401), ("demote", 4403)])
async def test_a_user_deactivated_or_demoted_while_watching_is_disconnected_at_once(change: str, code: int) -> None:
    alice: Person = await database_sync_to_async(make_person)("alice", "admin")
    vera: Person = await database_sync_to_async(make_person)("vera", "viewer")
    comm = socket("/ws/audit/", vera.user)
    try:
        connected, _ = await comm.connect(timeout=10)
        assert connected
        await comm.receive_json_from(timeout=10)  # the head of the log
        if change == "deactivate":
            await database_sync_to_async(do_set_user_active)(vera.user, active=False, actor="user:alice",
                                                             user=alice.user)
        else:
            await database_sync_to_async(do_set_user_role)(vera.user, role=None, actor="user:alice", user=alice.user)
        out = await comm.receive_output(timeout=10)
        while out["type"] != "websocket.close":  # the audit entry of the change may arrive first
            out = await comm.receive_output(timeout=10)
        assert out["code"] == code
    finally:
        await comm.disconnect()
