from __future__ import annotations

import threading

import pytest
from django.db import connection, connections, transaction
from django.utils import timezone

from console.audit.chain import record, verify_chain
from console.audit.models import AppendOnlyError, AuditEntry

pytestmark = pytest.mark.django_db


def add(n: int, **kw: object) -> list[AuditEntry]:
    return [record("test.event", actor="system:test", summary=f"entry {i}", at=timezone.now(),
                   data={"i": i, "x": 1.5}, **kw) for i in range(n)]  # type: ignore[arg-type]


def test_entries_chain_by_hash_and_verify() -> None:
    entries = add(5, deployment="chat")
    assert [e.seq for e in entries] == [1, 2, 3, 4, 5]
    assert all(b.prev_hash == a.hash for a, b in zip(entries, entries[1:], strict=False))
    status = verify_chain()
    assert status.ok and status.checked == 5


def test_the_model_refuses_updates_and_deletes() -> None:
    (entry,) = add(1)
    entry.summary = "rewritten"
    with pytest.raises(AppendOnlyError):
        entry.save()
    with pytest.raises(AppendOnlyError):
        entry.delete()
    with pytest.raises(AppendOnlyError):
        AuditEntry.objects.filter(pk=entry.pk).update(summary="x")
    with pytest.raises(AppendOnlyError):
        AuditEntry.objects.all().delete()


@pytest.mark.skipif(connection.vendor != "postgresql", reason="the trigger exists on PostgreSQL only")
def test_the_database_refuses_a_raw_update() -> None:
    add(2)
    with pytest.raises(Exception, match="append-only"), transaction.atomic(), connection.cursor() as cur:
        cur.execute("UPDATE audit_auditentry SET summary = 'forged' WHERE seq = 1")


def _tamper(sql: str) -> None:
    """What an attacker with database access would do: bypass the model (and drop the trigger)."""
    with connection.cursor() as cur:
        if connection.vendor == "postgresql":
            cur.execute("SET session_replication_role = replica")  # a superuser silencing triggers
        cur.execute(sql)
        if connection.vendor == "postgresql":
            cur.execute("SET session_replication_role = DEFAULT")


@pytest.mark.parametrize("sql,bad_seq,words", [
    ("UPDATE audit_auditentry SET body = replace(body, 'entry 2', 'entry X') WHERE seq = 3", 3, "hash"),
    ("UPDATE audit_auditentry SET summary = 'forged' WHERE seq = 2", 2, "summary"),
    ("UPDATE audit_auditentry SET actor = 'user:mallory' WHERE seq = 4", 4, "actor"),
    ("DELETE FROM audit_auditentry WHERE seq = 2", 2, "missing"),
    ("DELETE FROM audit_auditentry WHERE seq = 5", 5, "head is ahead"),
])
def test_tampering_is_detected_at_the_first_bad_entry(sql: str, bad_seq: int, words: str) -> None:
    add(5)
    _tamper(sql)
    status = verify_chain()
    assert not status.ok and status.first_bad_seq == bad_seq and words in status.reason


def test_an_entry_rolls_back_with_the_write_it_records() -> None:
    add(1)
    with pytest.raises(RuntimeError), transaction.atomic():
        add(1)
        raise RuntimeError("the action failed")
    assert AuditEntry.objects.count() == 1 and verify_chain().ok
    assert add(1)[0].seq == 2  # no gap left by the rolled-back entry


@pytest.mark.django_db(transaction=True)
def test_concurrent_appends_keep_one_unbroken_chain() -> None:
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            add(10)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=writer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    status = verify_chain()
    assert status.ok and status.checked == 40
