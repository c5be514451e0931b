"""The pages and their shared navigation, as the server renders them (the browser tests run the scripts)."""

from __future__ import annotations

import json
import re

import pytest
from django.test import Client

from console.audit.chain import record
from console.registry.models import ModelVersion
from tests.console.people import Person
from tests.console.registry.conftest import model_body, model_roots, tiny_weights  # noqa: F401 - fixtures

pytestmark = pytest.mark.django_db

PAGES = ["/", "/deployments/", "/audit/", "/registry/", "/alerts/"]


def page_data(html: str, element_id: str) -> object:
    found = re.search(rf'<script id="{element_id}" type="application/json">(.*?)</script>', html, re.S)
    assert found, f"no {element_id} on the page"
    return json.loads(found.group(1))


@pytest.mark.parametrize("path", PAGES)
def test_an_anonymous_visitor_is_sent_to_the_login_page(db: None, path: str) -> None:
    resp = Client().get(path)
    assert resp.status_code == 302 and resp["Location"].startswith("/login/")


@pytest.mark.parametrize("path", ["/audit/", "/registry/", "/deployments/", "/alerts/"])
def test_a_user_without_a_role_gets_a_403_page_naming_the_role(outsider: Person, path: str) -> None:
    resp = outsider.browser().get(path)
    assert resp.status_code == 403 and b"needs the <b>viewer</b> role" in resp.content


@pytest.mark.parametrize("path,active", [("/", "overview"), ("/deployments/", "deployments"),
                                         ("/audit/", "audit"), ("/registry/", "registry"), ("/alerts/", "alerts")])
def test_every_page_shows_the_same_navigation_with_itself_highlighted(viewer: Person, path: str,
                                                                      active: str) -> None:
    html = viewer.browser().get(path).content.decode()
    items = re.findall(r'<a href="([^"]+)" data-nav="(\w+)"( class="active")?', html)
    assert [(href, key) for href, key, _ in items] == [
        ("/", "overview"), ("/deployments/", "deployments"), ("/audit/", "audit"), ("/registry/", "registry"),
        ("/alerts/", "alerts"), ("/api/docs/", "api")]
    assert [key for _, key, on in items if on] == [active]
    assert 'data-testid="who">vera <span class="role">viewer</span>' in html


def test_the_audit_page_embeds_the_filtered_entries_and_the_head(viewer: Person) -> None:
    from django.utils import timezone

    for kind in ("registry.version_registered", "fleet.node_registered", "registry.version_retired"):
        record(kind, actor="user:alice", summary=kind, at=timezone.now())
    resp = viewer.browser().get("/audit/", {"type": "registry.*"})
    assert resp.status_code == 200
    data = page_data(resp.content.decode(), "audit-data")
    assert [e["seq"] for e in data["entries"]] == [3, 1]
    assert data["head_seq"] == 3 and data["filters"] == {"type": "registry.*"}
    assert b'value="registry.*"' in resp.content


def test_a_bad_filter_on_the_audit_page_is_a_400_that_names_it(viewer: Person) -> None:
    resp = viewer.browser().get("/audit/", {"since": "last tuesday"})
    assert resp.status_code == 400
    html = resp.content.decode()
    assert "<b>since</b>: must be an ISO 8601 date-time" in html
    assert page_data(html, "audit-data")["entries"] == []  # type: ignore[index]


def test_a_viewer_gets_the_registry_without_any_control(admin: Person, viewer: Person) -> None:
    admin.api().post("/api/v1/models", json.dumps(model_body()), content_type="application/json")
    html = viewer.browser().get("/registry/").content.decode()
    data = page_data(html, "registry-data")
    assert data["can_admin"] is False  # type: ignore[index]
    assert [v["name"] for v in data["versions"]] == ["tiny-llama"]  # type: ignore[index]
    assert "register-form" not in html and "csrfmiddlewaretoken\" value" not in html.split("<main>")[1]


@pytest.mark.parametrize("who", ["operator", "viewer"])
def test_only_admins_get_the_register_form(request: pytest.FixtureRequest, who: str, admin: Person) -> None:
    person: Person = request.getfixturevalue(who)
    assert b"register-form" not in person.browser().get("/registry/").content
    html = admin.browser().get("/registry/").content.decode()
    assert 'id="register-form"' in html and page_data(html, "registry-data")["can_admin"] is True  # type: ignore[index]


def test_the_registry_page_lists_versions_as_the_api_does(admin: Person, viewer: Person) -> None:
    resp = admin.api().post("/api/v1/models", json.dumps(model_body()), content_type="application/json")
    data = page_data(viewer.browser().get("/registry/").content.decode(), "registry-data")
    assert data["versions"] == [resp.json()]  # type: ignore[index]
    assert ModelVersion.objects.count() == 1
