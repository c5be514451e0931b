"""The audit log's REST API: filters, detail, and the chain verification — read-only, for viewers."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import connection
from django.test import Client

from console.audit.chain import record
from console.audit.live import entry_payload
from console.audit.models import AuditEntry
from tests.console.conftest import AgentHTTP
from tests.console.people import Person

pytestmark = pytest.mark.django_db

AUDIT = "/api/v1/audit"
T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


@pytest.fixture
def history(db: None) -> list[AuditEntry]:
    """Five entries a minute apart, by several actors, about two deployments."""
    rows = [
        ("registry.version_registered", "user:alice", "", 0),
        ("gearbox.pinned", "user:oscar", "chat", 1),
        ("fleet.node_registered", "agent:a1", "", 2),
        ("gearbox.decision", "system:gearbox", "chat", 3),
        ("gearbox.decision", "system:gearbox", "code", 4),
    ]
    return [record(t, actor=a, summary=f"{t} by {a}", at=T0 + timedelta(minutes=m), deployment=d,
                   data={"minute": m}) for t, a, d, m in rows]


def seqs(client: Client, **params: Any) -> list[int]:
    resp = client.get(AUDIT, params)
    assert resp.status_code == 200, resp.content
    return [e["seq"] for e in resp.json()["results"]]


def test_without_credentials_the_log_is_401(db: None) -> None:
    for path in (AUDIT, f"{AUDIT}/1", f"{AUDIT}/verify"):
        assert Client().get(path).status_code == 401


def test_an_agent_token_is_refused(agent: AgentHTTP) -> None:
    client = Client(headers={"Authorization": f"Bearer {agent.token}"})
    assert client.get(AUDIT).status_code == 401 and client.get(f"{AUDIT}/verify").status_code == 401


def test_an_outsider_is_forbidden(outsider: Person, history: list[AuditEntry]) -> None:
    for path in (AUDIT, f"{AUDIT}/1", f"{AUDIT}/verify"):
        assert outsider.api().get(path).status_code == 403


@pytest.mark.parametrize("who", ["viewer", "operator", "admin"])
def test_every_role_reads_the_log_newest_first(request: pytest.FixtureRequest, who: str,
                                               history: list[AuditEntry]) -> None:
    person: Person = request.getfixturevalue(who)
    assert seqs(person.api()) == [5, 4, 3, 2, 1]


def test_the_log_cannot_be_written_through_the_api(admin: Person, history: list[AuditEntry]) -> None:
    client = admin.api()
    assert client.post(AUDIT, "{}", content_type="application/json").status_code == 405
    assert client.delete(f"{AUDIT}/1").status_code == 405
    assert client.put(f"{AUDIT}/1", "{}", content_type="application/json").status_code == 405
    assert AuditEntry.objects.count() == 5


def test_it_filters_by_type_actor_deployment_and_time(viewer: Person, history: list[AuditEntry]) -> None:
    client = viewer.api()
    assert seqs(client, type="gearbox.decision") == [5, 4]
    assert seqs(client, type="gearbox.*") == [5, 4, 2]
    assert seqs(client, actor="user:oscar") == [2]
    assert seqs(client, actor="agent:*") == [3]
    assert seqs(client, deployment="chat") == [4, 2]
    assert seqs(client, since="2026-11-29T12:02:00Z") == [5, 4, 3]
    assert seqs(client, until="2026-11-29T12:02:00Z") == [2, 1]
    assert seqs(client, since="2026-11-29T12:01:00+00:00", until="2026-11-29T12:03:00Z") == [3, 2]
    assert seqs(client, since="2026-11-29T13:01:00+01:00") == [5, 4, 3, 2]  # 12:01 UTC: the offset counts
    assert seqs(client, type="gearbox.*", deployment="chat", actor="system:gearbox") == [4]
    assert seqs(client, after_seq="3") == [5, 4]
    assert seqs(client, type="nothing.like.this") == []


def test_the_list_pages_with_limit_and_offset(viewer: Person, history: list[AuditEntry]) -> None:
    resp = viewer.api().get(AUDIT, {"limit": 2, "offset": 1}).json()
    assert resp["count"] == 5 and [e["seq"] for e in resp["results"]] == [4, 3]
    assert "offset=3" in resp["next"] and resp["previous"] is not None


@pytest.mark.parametrize("params,field", [
    ({"since": "yesterday"}, "since"),
    ({"until": "2026-13-40T00:00:00Z"}, "until"),
    ({"since": "2026-11-29T12:03:00Z", "until": "2026-11-29T12:01:00Z"}, "until"),
    ({"after_seq": "-1"}, "after_seq"),
    ({"after_seq": "three"}, "after_seq"),
    ({"actor": "user:\x00"}, "actor"),
    ({"type": "t" * 65}, "type"),
    ({"limit": "1001"}, "limit"),
    ({"offset": "x"}, "offset"),
])
def test_a_bad_filter_is_a_400_naming_it(viewer: Person, history: list[AuditEntry], params: dict[str, str],
                                         field: str) -> None:
    resp = viewer.api().get(AUDIT, params)
    assert resp.status_code == 400 and list(resp.json()) == [field], resp.content


def test_several_bad_filters_are_named_together(viewer: Person) -> None:
    resp = viewer.api().get(AUDIT, {"since": "soon", "after_seq": "x"})
    assert resp.status_code == 400 and sorted(resp.json()) == ["after_seq", "since"]


def test_the_detail_shows_what_the_chain_hashed(viewer: Person, history: list[AuditEntry]) -> None:
    resp = viewer.api().get(f"{AUDIT}/2")
    assert resp.status_code == 200
    entry = resp.json()
    assert entry == entry_payload(history[1])
    assert entry["data"] == {"minute": 1} and entry["prev_hash"] == history[0].hash
    assert entry["actor"] == "user:oscar" and entry["deployment"] == "chat"


def test_an_unknown_seq_is_404(viewer: Person, history: list[AuditEntry]) -> None:
    assert viewer.api().get(f"{AUDIT}/99").status_code == 404
    assert viewer.api().get(f"{AUDIT}/123456789012345678901234").status_code == 404
    assert viewer.api().get(f"{AUDIT}/abc").status_code == 404


def test_verify_reports_an_intact_chain(viewer: Person, history: list[AuditEntry]) -> None:
    resp = viewer.api().get(f"{AUDIT}/verify")
    assert resp.status_code == 200
    assert resp.json() == {"ok": True, "checked": 5, "first_bad_seq": None, "reason": "", "head_seq": 5}


def test_verify_on_an_empty_log_is_ok(viewer: Person) -> None:
    assert viewer.api().get(f"{AUDIT}/verify").json() == {"ok": True, "checked": 0, "first_bad_seq": None,
                                                          "reason": "", "head_seq": 0}


def test_verify_finds_a_tampered_entry(viewer: Person, history: list[AuditEntry]) -> None:
    with connection.cursor() as cur:
        if connection.vendor == "postgresql":
            cur.execute("SET session_replication_role = replica")  # what an attacker with the DB would do
        cur.execute("UPDATE audit_auditentry SET body = replace(body, '\"minute\":2', '\"minute\":9') WHERE seq = 3")
        if connection.vendor == "postgresql":
            cur.execute("SET session_replication_role = DEFAULT")
    status = viewer.api().get(f"{AUDIT}/verify").json()
    assert status["ok"] is False and status["first_bad_seq"] == 3 and "hash" in status["reason"]
    assert json.loads(AuditEntry.objects.get(seq=3).body)["data"] == {"minute": 9}
