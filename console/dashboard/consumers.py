"""The base of every live page's websocket: who may connect, which group it joins, and the count of
connected clients for /metrics.

A page's consumer names its `group` (where `transaction.on_commit` pushes land), its `page` (the
metrics label) and the `required_role`; it sends its first message in `on_accepted` and adds one
handler per event type (`"type": "audit.entry"` -> `async def audit_entry(self, event)`).

Close codes: 1013 degraded (the channel layer failed: a {"type": "degraded"} message comes first;
the browser reconnects and re-syncs from the snapshot), 4401 not logged in (or deactivated since),
4403 logged in without the role (or it was taken away since). static/js/live.js stops reconnecting
on 4401 and 4403. A socket joins its user's group too (console.accounts.live): when an admin
deactivates the user or changes their role, every socket of theirs checks again at once and closes
if the user may no longer watch.

Keep-alive: every FLEXPIPE_WS_PING_S the consumer sends {"type": "ping"} (live.js swallows it),
so an idle connection carries traffic through proxies that drop silent ones, and the page can
tell a dead connection from a quiet one (it reconnects after three silent periods). The client
gauge counts a connection from its accept to the end of the consumer, however it ends: a
disconnect, the consumer failing under it (an exception skips disconnect()), or the channel
layer failing (degraded).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import redis
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings
from django.utils import timezone

from console.accounts import live as account_live
from console.accounts.roles import VIEWER, has_role
from console.dashboard.coalesce import Coalescer
from console.metrics import websockets as ws_metrics

log = logging.getLogger(__name__)
DEGRADED_CLOSE = 1013  # "try again later": the channel layer (Redis) does not answer
LAYER_ERRORS = (redis.RedisError, OSError)


def _refusal(user_pk: int, role: str | None) -> int | None:
    """The close code for this user now (fresh from the database), or None when they may watch."""
    from django.contrib.auth import get_user_model

    user = get_user_model().objects.filter(pk=user_pk).first()
    if user is None or not user.is_active:
        return 4401
    if role is not None and not has_role(user, role):
        return 4403
    return None


class LiveConsumer(AsyncJsonWebsocketConsumer):  # type: ignore[misc]
    group: str = ""
    page: str = ""
    required_role: str | None = VIEWER  # None: any logged-in user
    # Channels joins `groups` before connect() runs, i.e. before the checks below: keep it empty.
    groups: list[str] = []
    _counted = False
    _pinger: asyncio.Task[None] | None = None
    _coalescers: list[Coalescer] | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Run the consumer; when the channel layer (Redis) fails under it, tell the browser the page is
        degraded - it misses pushes from now on - and close with 1013: live.js shows "degraded" and
        reconnects, and the snapshot it gets on connect re-syncs the page once Redis is back. However
        it ends, the pinger stops and the client gauge comes down."""
        accepted = False

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal accepted
            accepted = accepted or message.get("type") == "websocket.accept"
            await send(message)

        try:
            await super().__call__(scope, receive, tracking_send)
        except LAYER_ERRORS as exc:
            log.warning("%s websocket: the channel layer failed (%s); told the browser it is degraded", self.page, exc)
            self._stop_pinging()
            self._uncount()
            try:
                if not accepted:
                    await send({"type": "websocket.accept"})
                await send({"type": "websocket.send", "text": json.dumps(
                    {"type": "degraded", "reason": "live updates are interrupted (the channel layer does not answer); "
                                                   "reconnecting"})})
                await send({"type": "websocket.close", "code": DEGRADED_CLOSE})
            except Exception:  # noqa: BLE001 - the browser may be gone already; nothing left to tell
                pass
        finally:
            self._stop_pinging()
            self._stop_coalescing()
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
        await self.channel_layer.group_add(account_live.user_group(user.pk), self.channel_name)
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

    def coalesced(self, flush: Any, *, busy_share: float | None = None) -> Coalescer:
        """A Coalescer for this socket's pushes (console/dashboard/coalesce.py), stopped with it."""
        c = Coalescer(float(settings.FLEXPIPE_PUSH_MIN_INTERVAL_S), flush, busy_share=busy_share)
        self._coalescers = [*(self._coalescers or ()), c]
        return c

    def _stop_coalescing(self) -> None:
        for c in self._coalescers or ():
            c.cancel()

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
        self._stop_coalescing()
        if self._counted:
            self._uncount()
            await self.channel_layer.group_discard(self.group, self.channel_name)
            await self.channel_layer.group_discard(account_live.user_group(self.scope["user"].pk), self.channel_name)

    async def account_changed(self, event: dict[str, Any]) -> None:
        code = await database_sync_to_async(_refusal)(self.scope["user"].pk, self.required_role)
        if code is not None:
            await self.close(code=code)

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        # Live pages are read-only; writes go through the REST API (CSRF, roles, audit).
        if isinstance(content, dict) and content.get("type") == "resync":
            await self.on_accepted()
