"""Websocket: the live cluster view. A full snapshot on connect, then deltas as reports commit."""

from __future__ import annotations

from typing import Any

from channels.db import database_sync_to_async

from console.dashboard.consumers import LiveConsumer
from console.fleet import live


class ClusterConsumer(LiveConsumer):
    group = live.CLUSTER_GROUP
    page = "cluster"

    async def on_accepted(self) -> None:
        # Also the answer to {"type": "resync"} (after a reconnect, say).
        state = await database_sync_to_async(live.cluster_state)()
        await self.send_json({"type": "snapshot", **state})

    async def cluster_delta(self, event: dict[str, Any]) -> None:
        await self.send_json({"type": "delta", **event["delta"]})
