"""Named people for console tests: an admin, an operator, a viewer and an outsider (no role)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.test import Client

from console.accounts.auth import new_api_token

PASSWORD = "correct-horse-battery"


@dataclass
class Person:
    user: Any
    token: str

    @property
    def username(self) -> str:
        return str(self.user.username)

    def api(self) -> Client:
        """A client that authenticates with this person's API token."""
        return Client(headers={"Authorization": f"Bearer {self.token}"})

    def browser(self) -> Client:
        """A client logged in with a session, CSRF checks on, like a browser."""
        client = Client(enforce_csrf_checks=True)
        client.force_login(self.user)
        return client


def make_person(username: str, role: str | None) -> Person:
    user = get_user_model().objects.create_user(username, password=PASSWORD)
    if role:
        user.groups.add(Group.objects.get_or_create(name=role)[0])
    _, token = new_api_token(user, "tests")
    return Person(user, token)


@pytest.fixture
def admin(db: None) -> Person:
    return make_person("alice", "admin")


@pytest.fixture
def operator(db: None) -> Person:
    return make_person("oscar", "operator")


@pytest.fixture
def viewer(db: None) -> Person:
    return make_person("vera", "viewer")


@pytest.fixture
def outsider(db: None) -> Person:
    return make_person("otto", None)
