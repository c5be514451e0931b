"""Appending to the audit chain and verifying it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models import F

from console.audit.models import GENESIS_HASH, AuditEntry, AuditHead

# Columns that repeat a body field, for filtering; verify_chain checks they still agree.
_MIRRORED = ("seq", "at", "event_type", "actor", "deployment", "transition_seq", "decision_id", "summary")


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def entry_hash(prev_hash: str, body: str) -> str:
    return hashlib.sha256((prev_hash + body).encode()).hexdigest()


def actor_of(user: Any | None = None, *, agent: str | None = None, system: str | None = None) -> str:
    if user is not None:
        return f"user:{user.get_username()}"
    if agent:
        return f"agent:{agent}"
    return f"system:{system or 'console'}"


def record(event_type: str, *, actor: str, summary: str, at: datetime, data: dict[str, Any] | None = None,
           before: Any = None, after: Any = None, deployment: str = "", transition_seq: int | None = None,
           decision_id: int | None = None, user: Any | None = None) -> AuditEntry:
    """Append one entry. Call it inside the transaction of the write it records: both commit or neither."""
    with transaction.atomic():
        # Taking the head row's write lock first serialises appends (PostgreSQL row lock,
        # SQLite's write lock): two writers can never both extend the same tail.
        AuditHead.objects.get_or_create(pk=1)
        AuditHead.objects.filter(pk=1).update(seq=F("seq") + 1)
        head = AuditHead.objects.get(pk=1)
        content = {
            "seq": head.seq,
            "at": at.isoformat(),
            "event_type": event_type,
            "actor": actor,
            "deployment": deployment,
            "transition_seq": transition_seq,
            "decision_id": decision_id,
            "summary": summary[:300],
            "data": data or {},
            "before": before,
            "after": after,
        }
        body = canonical_json(content)
        digest = entry_hash(head.hash, body)
        entry = AuditEntry.objects.create(
            seq=head.seq, at=at, event_type=event_type, actor=actor, user=user, deployment=deployment,
            transition_seq=transition_seq, decision_id=decision_id, summary=summary[:300], body=body,
            prev_hash=head.hash, hash=digest,
        )
        AuditHead.objects.filter(pk=1).update(hash=digest)
    transaction.on_commit(lambda: _push(entry))
    return entry


def _push(entry: AuditEntry) -> None:
    from console.audit import live

    live.push_entry(entry)


@dataclass(frozen=True)
class ChainStatus:
    ok: bool
    checked: int  # entries verified
    first_bad_seq: int | None = None
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "checked": self.checked, "first_bad_seq": self.first_bad_seq, "reason": self.reason}


def verify_chain(batch: int = 2000) -> ChainStatus:
    """Walk the whole chain: hashes link, bodies hash to their hash, columns agree with bodies."""
    prev = GENESIS_HASH
    expected_seq = 1
    checked = 0
    last_seq = 0
    while True:
        rows = list(AuditEntry.objects.filter(seq__gt=last_seq).order_by("seq")[:batch])
        if not rows:
            break
        for e in rows:
            if e.seq != expected_seq:
                return ChainStatus(False, checked, expected_seq, f"entry {expected_seq} is missing")
            if e.prev_hash != prev:
                return ChainStatus(False, checked, e.seq, "prev_hash does not match the entry before it")
            if entry_hash(e.prev_hash, e.body) != e.hash:
                return ChainStatus(False, checked, e.seq, "the body does not hash to the stored hash")
            body = json.loads(e.body)
            for col in _MIRRORED:
                stored = getattr(e, col)
                hashed = datetime.fromisoformat(body["at"]) if col == "at" else body.get(col)
                if stored != hashed:
                    return ChainStatus(False, checked, e.seq, f"column {col} disagrees with the hashed body")
            prev = e.hash
            expected_seq += 1
            checked += 1
            last_seq = e.seq
    head = AuditHead.objects.filter(pk=1).first()
    if head is not None and (head.seq != checked or (checked and head.hash != prev)):
        return ChainStatus(False, checked, checked + 1, "the newest entries are missing (head is ahead)")
    return ChainStatus(True, checked)
