"""/api/v1/users: admins manage users, their role and their API tokens; everyone else is refused.
Every write is audited with the admin as actor; a refused request writes nothing."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from console.accounts.models import ApiToken
from console.audit.models import AuditEntry
from tests.console.conftest import AgentHTTP
from tests.console.people import Person

pytestmark = pytest.mark.django_db


def post(client: Client, path: str, body: Any) -> Any:
    return client.post(path, json.dumps(body), content_type="application/json")


NEW_USER = {"username": "nina", "password": "a-long-enough-password", "role": "viewer"}


def test_an_admin_creates_a_user_with_a_role_and_the_user_can_log_in(admin: Person) -> None:
    resp = post(admin.api(), "/api/v1/users", NEW_USER)
    assert resp.status_code == 201, resp.content
    assert resp.json()["username"] == "nina" and resp.json()["role"] == "viewer" and resp.json()["active"]
    assert "password" not in resp.json()
    client = Client()
    assert client.login(username="nina", password=NEW_USER["password"])
    assert client.get("/api/v1/me").json() == {"username": "nina", "role": "viewer"}
    entry = AuditEntry.objects.get(event_type="accounts.user_created")
    assert entry.actor == "user:alice" and json.loads(entry.body)["after"] == {"role": "viewer", "active": True}


@pytest.mark.parametrize("who,code", [("operator", 403), ("viewer", 403), ("outsider", 403)])
def test_only_admins_see_or_change_users(request: pytest.FixtureRequest, who: str, code: int) -> None:
    person: Person = request.getfixturevalue(who)
    assert person.api().get("/api/v1/users").status_code == code
    assert post(person.api(), "/api/v1/users", NEW_USER).status_code == code
    assert post(person.api(), f"/api/v1/users/{person.username}/role", {"role": "admin"}).status_code == code
    assert post(person.api(), f"/api/v1/users/{person.username}/tokens", {"name": "x"}).status_code == code
    assert not get_user_model().objects.filter(username="nina").exists()
    assert not AuditEntry.objects.filter(event_type__startswith="accounts.").exists()


def test_no_credentials_and_agent_tokens_are_401(agent: AgentHTTP) -> None:
    assert Client().get("/api/v1/users").status_code == 401
    agent_client = Client(headers={"Authorization": f"Bearer {agent.token}"})
    assert post(agent_client, "/api/v1/users", NEW_USER).status_code == 401


@pytest.mark.parametrize("body,field", [
    ({**NEW_USER, "username": "no spaces"}, "username"),
    ({**NEW_USER, "password": "short"}, "password"),
    ({**NEW_USER, "role": "root"}, "role"),
    ({k: v for k, v in NEW_USER.items() if k != "role"}, "role"),
    ({**NEW_USER, "is_superuser": True}, "is_superuser"),
])
def test_an_invalid_user_is_refused_naming_the_field(admin: Person, body: dict[str, Any], field: str) -> None:
    resp = post(admin.api(), "/api/v1/users", body)
    assert resp.status_code == 400 and list(resp.json()) == [field], resp.content
    assert not get_user_model().objects.filter(username__in=["nina", "no spaces"]).exists()


def test_a_taken_username_is_a_409_naming_it(admin: Person, viewer: Person) -> None:
    resp = post(admin.api(), "/api/v1/users", {**NEW_USER, "username": viewer.username})
    assert resp.status_code == 409 and list(resp.json()) == ["username"]


def test_an_admin_changes_a_role_and_the_api_follows_at_once(admin: Person, viewer: Person) -> None:
    emergency = "/api/v1/deployments/nowhere/emergency"
    assert post(viewer.api(), emergency, {"reason": "x"}).status_code == 403
    resp = post(admin.api(), f"/api/v1/users/{viewer.username}/role", {"role": "operator"})
    assert resp.status_code == 200 and resp.json()["role"] == "operator"
    assert post(viewer.api(), emergency, {"reason": "x"}).status_code == 404  # allowed now; no such deployment
    entry = AuditEntry.objects.get(event_type="accounts.role_changed")
    body = json.loads(entry.body)
    assert entry.actor == "user:alice" and body["before"] == {"role": "viewer"} and body["after"] == {"role": "operator"}
    # the same role again changes nothing and writes nothing
    assert post(admin.api(), f"/api/v1/users/{viewer.username}/role", {"role": "operator"}).status_code == 200
    assert AuditEntry.objects.filter(event_type="accounts.role_changed").count() == 1


def test_taking_every_role_makes_an_outsider(admin: Person, operator: Person) -> None:
    assert post(admin.api(), f"/api/v1/users/{operator.username}/role", {"role": None}).json()["role"] is None
    assert operator.api().get("/api/v1/me").status_code == 403


def test_an_admin_cannot_drop_their_own_admin_role_nor_deactivate_themselves(admin: Person) -> None:
    resp = post(admin.api(), f"/api/v1/users/{admin.username}/role", {"role": "viewer"})
    assert resp.status_code == 409 and list(resp.json()) == ["role"]
    resp = post(admin.api(), f"/api/v1/users/{admin.username}/active", {"active": False})
    assert resp.status_code == 409 and list(resp.json()) == ["active"]
    assert admin.api().get("/api/v1/me").json()["role"] == "admin"


def test_a_deactivated_user_is_locked_out_of_the_api_and_back_when_activated(admin: Person, viewer: Person) -> None:
    resp = post(admin.api(), f"/api/v1/users/{viewer.username}/active", {"active": False})
    assert resp.status_code == 200 and resp.json()["active"] is False and resp.json()["role"] == "viewer"
    assert viewer.api().get("/api/v1/me").status_code == 401
    assert post(admin.api(), f"/api/v1/users/{viewer.username}/active", {"active": True}).status_code == 200
    assert viewer.api().get("/api/v1/me").status_code == 200
    assert [e.event_type for e in AuditEntry.objects.order_by("seq")] == [
        "accounts.user_deactivated", "accounts.user_activated"]


def test_an_admin_issues_a_token_shown_once_and_revokes_it(admin: Person, viewer: Person) -> None:
    resp = post(admin.api(), f"/api/v1/users/{viewer.username}/tokens", {"name": "grafana"})
    assert resp.status_code == 201, resp.content
    issued = resp.json()
    assert issued["token"].startswith("fpu_") and issued["name"] == "grafana"
    grafana = Client(headers={"Authorization": f"Bearer {issued['token']}"})
    assert grafana.get("/api/v1/me").json() == {"username": viewer.username, "role": "viewer"}
    listed = admin.api().get(f"/api/v1/users/{viewer.username}").json()["tokens"]
    assert {t["name"] for t in listed} == {"tests", "grafana"} and all("token" not in t for t in listed)
    assert ApiToken.objects.get(pk=issued["id"]).token_hash != issued["token"]  # only the hash is kept

    resp = post(admin.api(), f"/api/v1/users/{viewer.username}/revoke-token", {"token_id": issued["id"]})
    assert resp.status_code == 200
    assert grafana.get("/api/v1/me").status_code == 401
    assert viewer.api().get("/api/v1/me").status_code == 200  # the user's other token still works
    # idempotent: revoking again writes nothing more
    assert post(admin.api(), f"/api/v1/users/{viewer.username}/revoke-token",
                {"token_id": issued["id"]}).status_code == 200
    assert [e.event_type for e in AuditEntry.objects.order_by("seq")] == [
        "accounts.api_token_issued", "accounts.api_token_revoked"]
    assert issued["token"] not in "".join(AuditEntry.objects.values_list("body", flat=True))


def test_a_token_of_another_user_cannot_be_revoked_through_this_one(admin: Person, viewer: Person,
                                                                      operator: Person) -> None:
    theirs = ApiToken.objects.get(user=operator.user)
    resp = post(admin.api(), f"/api/v1/users/{viewer.username}/revoke-token", {"token_id": theirs.pk})
    assert resp.status_code == 400 and list(resp.json()) == ["token_id"]
    assert operator.api().get("/api/v1/me").status_code == 200


def test_an_unknown_user_is_404(admin: Person) -> None:
    assert admin.api().get("/api/v1/users/nobody").status_code == 404
    assert post(admin.api(), "/api/v1/users/nobody/role", {"role": "viewer"}).status_code == 404


def test_a_browser_write_needs_the_csrf_token(admin: Person) -> None:
    resp = post(admin.browser(), "/api/v1/users", NEW_USER)
    assert resp.status_code == 403 and "CSRF" in resp.json()["detail"]
    assert not get_user_model().objects.filter(username="nina").exists()


def test_demoting_a_superuser_takes_the_admin_power_for_real(admin: Person) -> None:
    root = get_user_model().objects.create_superuser("root", password="a-long-enough-password")
    resp = post(admin.api(), "/api/v1/users/root/role", {"role": "viewer"})
    assert resp.status_code == 200 and resp.json()["role"] == "viewer"
    root.refresh_from_db()
    assert not root.is_superuser and not root.is_staff
    client = Client()
    client.force_login(root)
    assert client.get("/api/v1/users").status_code == 403  # the audit said admin -> viewer: so it is
    assert client.get("/api/v1/me").json() == {"username": "root", "role": "viewer"}
    entry = AuditEntry.objects.get(event_type="accounts.role_changed")
    assert json.loads(entry.body)["before"] == {"role": "admin"} and json.loads(entry.body)["after"] == {"role": "viewer"}
