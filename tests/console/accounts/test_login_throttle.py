"""Login throttling: after a few wrong passwords for a user (or many from one address) every attempt is
refused for a while, the right password included, with 429 and Retry-After."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
from django.conf import settings as django_settings
from django.test import Client

from tests.console.people import PASSWORD, Person

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def clean_counters() -> Iterator[None]:
    def wipe() -> None:
        client = redis.Redis.from_url(django_settings.REDIS_URL)
        prefix = django_settings.CHANNEL_LAYERS["default"]["CONFIG"]["prefix"]
        for key in client.scan_iter(f"{prefix}:login-fail:*"):
            client.delete(key)
    wipe()
    yield
    wipe()


def login(client: Client, username: str, password: str, addr: str = "10.1.1.1") -> Any:
    return client.post("/login/", {"username": username, "password": password}, REMOTE_ADDR=addr)


def test_after_five_wrong_passwords_even_the_right_one_is_refused(viewer: Person) -> None:
    client = Client()
    for _ in range(5):
        assert login(client, "vera", "wrong").status_code == 200  # the form again, with the error
    resp = login(client, "vera", PASSWORD)
    assert resp.status_code == 429 and int(resp["Retry-After"]) > 0
    assert b"Too many failed logins" in resp.content
    assert "_auth_user_id" not in client.session
    # another user from another address is not affected
    assert login(Client(), "oscar", "wrong", addr="10.2.2.2").status_code == 200


def test_many_usernames_from_one_address_are_throttled_too(viewer: Person, settings: Any) -> None:
    settings.FLEXPIPE_LOGIN_FAILURES_ADDR = 6
    for i in range(6):
        login(Client(), f"guess{i}", "wrong")
    assert login(Client(), "vera", PASSWORD).status_code == 429
    assert login(Client(), "vera", PASSWORD, addr="10.9.9.9").status_code == 302  # elsewhere: logged in


def test_a_success_clears_the_count(viewer: Person) -> None:
    for _ in range(4):
        login(Client(), "vera", "wrong")
    assert login(Client(), "vera", PASSWORD).status_code == 302
    for _ in range(4):
        login(Client(), "vera", "wrong")
    assert login(Client(), "vera", PASSWORD).status_code == 302


def test_the_admin_login_is_throttled_the_same_way(admin: Person) -> None:
    admin.user.is_staff = True
    admin.user.save()
    for _ in range(5):
        Client().post("/admin/login/", {"username": "alice", "password": "wrong"}, REMOTE_ADDR="10.3.3.3")
    resp = Client().post("/admin/login/", {"username": "alice", "password": PASSWORD}, REMOTE_ADDR="10.3.3.3")
    assert resp.status_code == 200 and b"Too many failed logins" in resp.content
