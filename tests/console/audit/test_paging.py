"""The audit is kept whole and read a page at a time (issue 19): keyset pages by seq in the API and
the Audit page, and an index behind each filter."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection

from console.audit import views
from console.audit.chain import record
from console.audit.models import AuditEntry
from tests.console.people import Person

pytestmark = pytest.mark.django_db
T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


@pytest.fixture
def twelve(db: None) -> list[AuditEntry]:
    return [record("gearbox.decision" if n % 2 else "fleet.node_registered", actor="system:test",
                   summary=f"entry {n}", at=T0 + timedelta(seconds=n), deployment="chat" if n % 3 == 0 else "")
            for n in range(12)]


def page_seqs(html: str) -> list[int]:
    data = json.loads(re.search(r'<script id="audit-data" type="application/json">(.*?)</script>', html, re.S)[1])
    return [e["seq"] for e in data["entries"]]


def test_the_api_pages_older_entries_by_seq_with_the_filters_kept(viewer: Person, twelve: list[AuditEntry]) -> None:
    client = viewer.api()
    first = client.get("/api/v1/audit", {"limit": 5}).json()["results"]
    assert [e["seq"] for e in first] == [12, 11, 10, 9, 8]
    older = client.get("/api/v1/audit", {"limit": 5, "before_seq": first[-1]["seq"]}).json()["results"]
    assert [e["seq"] for e in older] == [7, 6, 5, 4, 3]
    typed = client.get("/api/v1/audit", {"type": "gearbox.decision", "before_seq": 8}).json()["results"]
    assert [e["seq"] for e in typed] == [6, 4, 2] and {e["event_type"] for e in typed} == {"gearbox.decision"}


@pytest.mark.parametrize("value", ["0", "-2", "x", ""])
def test_a_bad_before_seq_is_400_naming_it(viewer: Person, twelve: list[AuditEntry], value: str) -> None:
    resp = viewer.api().get("/api/v1/audit", {"before_seq": value})
    assert resp.status_code == 400 and list(resp.json()) == ["before_seq"], resp.content


def test_the_page_shows_a_page_and_links_the_older_one(viewer: Person, twelve: list[AuditEntry],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(views, "PAGE_ROWS", 5)
    html = viewer.browser().get("/audit/", {"deployment": "chat"}).content.decode()
    assert page_seqs(html) == [10, 7, 4, 1]  # four match: one page, no older link
    assert 'id="audit-older"' not in html
    html = viewer.browser().get("/audit/").content.decode()
    assert page_seqs(html) == [12, 11, 10, 9, 8]
    older = re.search(r'id="audit-older" href="([^"]+)"', html)[1].replace("&amp;", "&")
    assert older == "?before_seq=8"
    html = viewer.browser().get("/audit/" + older).content.decode()
    assert page_seqs(html) == [7, 6, 5, 4, 3] and 'id="audit-newest"' in html
    typed = viewer.browser().get("/audit/", {"type": "fleet.*"}).content.decode()
    link = re.search(r'id="audit-older" href="([^"]+)"', typed)[1].replace("&amp;", "&")
    assert page_seqs(typed) == [11, 9, 7, 5, 3]
    assert link == "?type=fleet.%2A&before_seq=3"  # the filters ride along


def test_each_filter_has_an_index_in_seq_order() -> None:
    with connection.cursor() as cur:
        found = connection.introspection.get_constraints(cur, AuditEntry._meta.db_table)
    columns = {tuple(c["columns"]) for c in found.values() if c["index"]}
    assert {("event_type", "seq"), ("actor", "seq"), ("deployment", "seq"), ("at",)} <= columns

