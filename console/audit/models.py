"""The audit log: append-only and tamper-evident (DESIGN.md invariant 7).

Each entry's `body` is the canonical JSON of everything it says; `hash` is
sha256(prev_hash + body), so changing, removing or reordering any entry breaks every hash after
it. The other columns repeat parts of the body for filtering and are checked against it by
`verify_chain`. Rows are never updated or deleted: the model and its queryset refuse, and on
PostgreSQL a trigger refuses at the database too.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db import models

GENESIS_HASH = "0" * 64


class AppendOnlyError(RuntimeError):
    pass


class AppendOnlyQuerySet(models.QuerySet["AuditEntry"]):
    def update(self, **kwargs: Any) -> int:
        raise AppendOnlyError("audit entries are never updated")

    def delete(self) -> tuple[int, dict[str, int]]:
        raise AppendOnlyError("audit entries are never deleted")


class AuditEntry(models.Model):
    seq = models.PositiveBigIntegerField(unique=True)  # 1, 2, 3, ... without gaps
    at = models.DateTimeField(db_index=True)
    event_type = models.CharField(max_length=64)  # "<app>.<what happened>"
    actor = models.CharField(max_length=160)  # "user:alice", "agent:a1", "system:gearbox"
    user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                             related_name="+")
    deployment = models.CharField(max_length=64, blank=True, default="")
    transition_seq = models.PositiveBigIntegerField(null=True, blank=True, db_index=True)
    decision_id = models.PositiveBigIntegerField(null=True, blank=True, db_index=True)
    summary = models.CharField(max_length=300)
    body = models.TextField()  # canonical JSON of the entry: what the hash covers
    prev_hash = models.CharField(max_length=64)
    hash = models.CharField(max_length=64, unique=True)

    objects = AppendOnlyQuerySet.as_manager()

    class Meta:
        ordering = ["seq"]
        # the audit is kept whole and read newest first a page at a time, filtered by one of these
        # (console/audit/api.py filter_entries): each filter walks its index in seq order
        indexes = [models.Index(fields=["event_type", "-seq"], name="audit_type_newest"),
                   models.Index(fields=["actor", "-seq"], name="audit_actor_newest"),
                   models.Index(fields=["deployment", "-seq"], name="audit_deployment_newest")]

    def save(self, *args: Any, **kwargs: Any) -> None:
        if self.pk is not None:
            raise AppendOnlyError("audit entries are never updated")
        super().save(*args, **kwargs)

    def delete(self, *args: Any, **kwargs: Any) -> tuple[int, dict[str, int]]:
        raise AppendOnlyError("audit entries are never deleted")

    def __str__(self) -> str:
        return f"#{self.seq} {self.event_type} by {self.actor}"


class AuditHead(models.Model):
    """One row: the chain's last seq and hash. Appending locks it, so appends are serial."""

    seq = models.PositiveBigIntegerField(default=0)
    hash = models.CharField(max_length=64, default=GENESIS_HASH)
