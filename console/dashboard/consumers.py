"""The base of every live page's websocket: who may connect, which group it joins, and the count of
connected clients for /metrics.

A page's consumer names its `group` (where `transaction.on_commit` pushes land), its `page` (the
metrics label) and the `required_role`; it sends its first message in `on_accepted` and adds one
handler per event type (`"type": "audit.entry"` -> `async def audit_entry(self, event)`).

Close codes: 4401 not logged in, 4403 logged in without the role. static/js/live.js stops
reconnecting on both.

Keep-alive: every FLEXPIPE_WS_PING_S the consumer sends {"type": "ping"} (live.js swallows it),
so an idle connection carries traffic through proxies that drop silent ones, and the page can
tell a dead connection from a quiet one (it reconnects after three silent periods). The client
gauge counts a connection from its accept to the end of the consumer, however it ends: a
disconnect, or the consumer failing under it (an exception skips disconnect()).
"""

from __future__ import annotations

import asyncio
from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings
from django.utils import timezone

from console.accounts.roles import VIEWER, has_role
from console.metrics import websockets as ws_metrics


class LiveConsumer(AsyncJsonWebsocketConsumer):  # type: ignore[misc]
    group: str = ""
    page: str = ""
    required_role: str | None = VIEWER  # None: any logged-in user
    # Channels joins `groups` before connect() runs, i.e. before the checks below: keep it empty.
    groups: list[str] = []
    _counted = False
    _pinger: asyncio.Task[None] | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stop_pinging()
            self._uncount()

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=4401)
            return
        if self.required_role is not None and not await database_sync_to_async(has_role)(user, self.required_role):
            await self.close(code=4403)
            return
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()
        self._counted = True
        ws_metrics.connected(self.page)
        self._pinger = asyncio.ensure_future(self._ping())
        await self.on_accepted()

    async def _ping(self) -> None:
        every_s = float(settings.FLEXPIPE_WS_PING_S)
        while True:
            await asyncio.sleep(every_s)
            await self.send_json({"type": "ping", "every_s": every_s, "at": timezone.now().isoformat()})

    def _stop_pinging(self) -> None:
        if self._pinger is not None:
            self._pinger.cancel()
            self._pinger = None

    def _uncount(self) -> None:
        if self._counted:
            self._counted = False
            ws_metrics.disconnected(self.page)

    async def on_accepted(self) -> None:
        """Send what the page needs first (a snapshot, the head of a log)."""

    async def disconnect(self, code: int) -> None:
        self._stop_pinging()
        if self._counted:
            self._uncount()
            await self.channel_layer.group_discard(self.group, self.channel_name)

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        # Live pages are read-only; writes go through the REST API (CSRF, roles, audit).
        if isinstance(content, dict) and content.get("type") == "resync":
            await self.on_accepted()
