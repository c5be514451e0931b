"""Websocket of the Audit page: each committed entry, as it is appended (group "audit")."""

from __future__ import annotations

from typing import Any

from channels.db import database_sync_to_async

from console.audit import live
from console.audit.models import AuditHead
from console.dashboard.consumers import LiveConsumer


def _head_seq() -> int:
    return AuditHead.objects.filter(pk=1).values_list("seq", flat=True).first() or 0


class AuditConsumer(LiveConsumer):
    group = live.AUDIT_GROUP
    page = "audit"

    async def on_accepted(self) -> None:
        # The page compares head_seq with the newest entry it shows and fetches what it missed
        # (GET /api/v1/audit?after_seq=N) — entries appended while it was reconnecting.
        await self.send_json({"type": "hello", "head_seq": await database_sync_to_async(_head_seq)()})

    async def audit_entry(self, event: dict[str, Any]) -> None:
        await self.send_json({"type": "entry", "entry": event["entry"]})
