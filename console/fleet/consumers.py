"""Websocket: the live cluster view. A full snapshot on connect, then deltas as reports commit (merged,
at most every FLEXPIPE_PUSH_MIN_INTERVAL_S: console/dashboard/coalesce.py)."""

from __future__ import annotations

from typing import Any

from channels.db import database_sync_to_async

from console.dashboard.coalesce import Coalescer, Merged
from console.dashboard.consumers import LiveConsumer
from console.fleet import live


class ClusterConsumer(LiveConsumer):
    group = live.CLUSTER_GROUP
    page = "cluster"

    async def on_accepted(self) -> None:
        # Also the answer to {"type": "resync"} (after a reconnect, say).
        state = await database_sync_to_async(live.cluster_state)()
        await self.send_json({"type": "snapshot", **state})

    _push: Coalescer | None = None

    async def cluster_delta(self, event: dict[str, Any]) -> None:
        # Deltas are merged per node and GPU and sent at most every FLEXPIPE_PUSH_MIN_INTERVAL_S.
        if self._push is None:
            self._merged = Merged()
            self._push = self.coalesced(self._send_merged)
        self._merged.add(event["delta"])
        self._push.poke()

    async def _send_merged(self) -> None:
        await self.send_json({"type": "delta", **self._merged.take()})
