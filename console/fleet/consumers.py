"""Websocket: the live cluster view. A full snapshot on connect, then deltas as reports commit."""

from __future__ import annotations

from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from console.fleet import live


class ClusterConsumer(AsyncJsonWebsocketConsumer):  # type: ignore[misc]
    groups: list[str] = []

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=4401)
            return
        await self.channel_layer.group_add(live.CLUSTER_GROUP, self.channel_name)
        await self.accept()
        state = await database_sync_to_async(live.cluster_state)()
        await self.send_json({"type": "snapshot", **state})

    async def disconnect(self, code: int) -> None:
        await self.channel_layer.group_discard(live.CLUSTER_GROUP, self.channel_name)

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        # The view is read-only; a client may ask for a fresh snapshot (after a reconnect, say).
        if isinstance(content, dict) and content.get("type") == "resync":
            state = await database_sync_to_async(live.cluster_state)()
            await self.send_json({"type": "snapshot", **state})

    async def cluster_delta(self, event: dict[str, Any]) -> None:
        await self.send_json({"type": "delta", **event["delta"]})
