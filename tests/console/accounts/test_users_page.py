"""The Users page: admins only, in the navigation for them alone, embedding what the users API shows."""

from __future__ import annotations

import json
import re

import pytest

from tests.console.people import Person

pytestmark = pytest.mark.django_db


def embedded(html: str) -> dict[str, object]:
    found = re.search(r'<script id="users-data" type="application/json">(.*?)</script>', html, re.S)
    assert found is not None
    return json.loads(found.group(1))  # type: ignore[no-any-return]


def test_an_admin_sees_every_user_with_role_and_tokens_as_the_api_shows_them(admin: Person, operator: Person) -> None:
    browser = admin.browser()  # (logged in, and the token used, before the page reads them)
    api = admin.api().get("/api/v1/users").json()
    page = browser.get("/users/")
    assert page.status_code == 200
    data = embedded(page.content.decode())
    assert data["users"] == api and data["me"] == "alice"
    assert [u["username"] for u in api] == ["alice", "oscar"] and api[1]["role"] == "operator"
    assert 'data-nav="users"' in page.content.decode()


@pytest.mark.parametrize("who", ["operator", "viewer"])
def test_other_roles_get_no_users_page_nor_its_link(who: str, request: pytest.FixtureRequest) -> None:
    person: Person = request.getfixturevalue(who)
    resp = person.browser().get("/users/")
    assert resp.status_code == 403
    assert 'data-nav="users"' not in person.browser().get("/deployments/").content.decode()


def test_anonymous_visitors_are_sent_to_log_in(client: object) -> None:
    resp = client.get("/users/")  # type: ignore[attr-defined]
    assert resp.status_code == 302 and "/login/" in resp["Location"]
