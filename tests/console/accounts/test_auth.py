from __future__ import annotations

import pytest
from django.test import Client
from django.utils import timezone

from console.accounts.models import ApiToken
from tests.console.conftest import AgentHTTP
from tests.console.people import Person

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("who,role", [("admin", "admin"), ("operator", "operator"), ("viewer", "viewer")])
def test_an_api_token_authenticates_its_user_and_role(request: pytest.FixtureRequest, who: str, role: str) -> None:
    person: Person = request.getfixturevalue(who)
    resp = person.api().get("/api/v1/me")
    assert resp.status_code == 200 and resp.json() == {"username": person.username, "role": role}
    assert ApiToken.objects.get(user=person.user).last_used_at is not None


def test_an_outsider_is_authenticated_but_forbidden(outsider: Person) -> None:
    resp = outsider.api().get("/api/v1/me")
    assert resp.status_code == 403 and "viewer role" in resp.json()["detail"]


def test_no_credentials_is_401_with_a_challenge(db: None) -> None:
    resp = Client().get("/api/v1/me")
    assert resp.status_code == 401 and resp.headers["WWW-Authenticate"].startswith("Bearer")


def test_a_revoked_token_is_refused(viewer: Person) -> None:
    ApiToken.objects.filter(user=viewer.user).update(revoked_at=timezone.now())
    resp = viewer.api().get("/api/v1/me")
    assert resp.status_code == 401 and "revoked" in resp.json()["detail"]


def test_an_agent_token_is_not_a_user_token(agent: AgentHTTP) -> None:
    resp = Client(headers={"Authorization": f"Bearer {agent.token}"}).get("/api/v1/me")
    assert resp.status_code == 401


def test_the_browser_session_works_for_reads(viewer: Person) -> None:
    assert viewer.browser().get("/api/v1/me").json()["role"] == "viewer"


def test_a_superuser_is_an_admin(db: None, django_user_model) -> None:  # type: ignore[no-untyped-def]
    root = django_user_model.objects.create_superuser("root", password="x" * 12)
    client = Client()
    client.force_login(root)
    assert client.get("/api/v1/me").json()["role"] == "admin"
