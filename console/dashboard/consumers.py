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

Slow clients (issue 19): a browser that stops reading (a frozen tab, a saturated link) must not
make the server buffer its pushes without end, nor back up the channel layer. daphne hands every
send to Twisted at once (there is no backpressure through ASGI), so the server cannot see a
socket's buffer: the browser tells it instead. live.js acks every message with the count it has
handled ({"type": "ack", "count": n}); the consumer keeps the sizes of the messages not acked yet,
and when they pass FLEXPIPE_WS_MAX_UNACKED_BYTES it leaves its groups (the layer stops delivering to
it at once) and closes with 4409 (RESYNC_CLOSE). live.js reconnects and the page starts over from
the snapshot it gets on connect. The same happens when the consumer's own receive buffer in the
layer (channels_redis keeps `capacity` messages per channel, then drops the oldest without a word)
is half full: its handlers are slower than its events, and a page that silently lost one would
stay wrong; a resync makes it right.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
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
RESYNC_CLOSE = 4409  # the client fell behind: it reconnects and starts over from a snapshot (live.js)
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
    _in_groups = False
    _dropped = False  # closed for falling behind: nothing more is sent
    _sent_count = 0  # messages sent on this socket
    _unacked: deque[int] | None = None  # sizes of the messages sent and not acked yet, oldest first
    _unacked_bytes = 0

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
        self._in_groups = True
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
        self._uncount()
        await self.leave_groups()

    async def leave_groups(self) -> None:
        """Leave the groups joined on connect (a subclass that joins more extends this); idempotent."""
        if self._in_groups:
            self._in_groups = False
            await self.channel_layer.group_discard(self.group, self.channel_name)
            await self.channel_layer.group_discard(account_live.user_group(self.scope["user"].pk), self.channel_name)

    async def account_changed(self, event: dict[str, Any]) -> None:
        code = await database_sync_to_async(_refusal)(self.scope["user"].pk, self.required_role)
        if code is not None:
            await self.close(code=code)

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        # Live pages are read-only; writes go through the REST API (CSRF, roles, audit).
        if not isinstance(content, dict):
            return
        if content.get("type") == "ack":
            self._acked(content.get("count"))
        elif content.get("type") == "resync":
            await self.on_accepted()

    async def send_json(self, content: Any, close: bool = False) -> None:
        """Send one message, counted as not acked until the browser says it handled it; past
        FLEXPIPE_WS_MAX_UNACKED_BYTES of those the socket is dropped for a resync (module docstring)."""
        if self._dropped:
            return
        text = await self.encode_json(content)  # json.dumps escapes to ASCII: its length is its size
        if self._unacked is None:
            self._unacked = deque()
        self._unacked.append(len(text))
        self._unacked_bytes += len(text)
        self._sent_count += 1
        if self._unacked_bytes > int(settings.FLEXPIPE_WS_MAX_UNACKED_BYTES):
            await self.drop_for_resync(f"{self._unacked_bytes} bytes sent and not acknowledged")
            return
        await self.send(text_data=text, close=close)

    def _acked(self, count: Any) -> None:
        """The browser handled `count` messages of this socket: those are off its backlog."""
        if not isinstance(count, int) or isinstance(count, bool) or self._unacked is None:
            return
        # the oldest unacked message is number sent - len(unacked) + 1; an ack never goes past the last sent
        while self._unacked and self._sent_count - len(self._unacked) < min(count, self._sent_count):
            self._unacked_bytes -= self._unacked.popleft()

    async def drop_for_resync(self, why: str) -> None:
        """Leave every group (the layer stops queueing for this socket), stop the pushes and close
        with RESYNC_CLOSE: the browser reconnects and gets a fresh snapshot."""
        if self._dropped:
            return
        self._dropped = True
        log.warning("%s websocket fell behind (%s); closed for a resync", self.page, why)
        ws_metrics.resynced(self.page)
        self._stop_pinging()
        self._stop_coalescing()
        await self.leave_groups()
        await self.close(code=RESYNC_CLOSE)

    async def dispatch(self, message: dict[str, Any]) -> None:
        if self._dropped and message.get("type") != "websocket.disconnect":
            return
        buffer = getattr(self.channel_layer, "receive_buffer", {}).get(self.channel_name)
        capacity = int(getattr(self.channel_layer, "capacity", 0) or 0)
        if buffer is not None and capacity and buffer.qsize() * 2 >= capacity:
            # channels_redis drops a channel's oldest messages past `capacity`, silently
            await self.drop_for_resync(f"{buffer.qsize()} events waiting in the channel layer")
            return
        await super().dispatch(message)
