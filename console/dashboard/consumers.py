"""The base of every live page's websocket: who may connect, which group it joins, and the count of
connected clients for /metrics.

A page's consumer names its `group` (where `transaction.on_commit` pushes land), its `page` (the
metrics label) and the `required_role`; it sends its first message in `on_accepted` and adds one
handler per event type (`"type": "audit.entry"` -> `async def audit_entry(self, event)`).

Close codes: 4401 not logged in (or deactivated since), 4403 logged in without the role (or it was
taken away since). static/js/live.js stops reconnecting on both. A socket joins its user's group too
(console.accounts.live): when an admin deactivates the user or changes their role, every socket of
theirs checks again at once and closes if the user may no longer watch.
"""

from __future__ import annotations

from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from console.accounts import live as account_live
from console.accounts.roles import VIEWER, has_role
from console.metrics import websockets as ws_metrics


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
        await self.on_accepted()

    async def on_accepted(self) -> None:
        """Send what the page needs first (a snapshot, the head of a log)."""

    async def disconnect(self, code: int) -> None:
        if self._counted:
            self._counted = False
            ws_metrics.disconnected(self.page)
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
