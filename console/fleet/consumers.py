"""Websocket: the live cluster view (the heatmap). A full snapshot on connect, then deltas as reports
commit.

The snapshot goes in pages of FLEXPIPE_SNAPSHOT_PAGE_NODES nodes with their GPUs: a whole fleet in
one message passed daphne's 1 MiB websocket message limit at ~350 nodes, the socket closed, and the
heatmap never loaded (issue 19). The first page is {"type": "snapshot", "page": 1, "pages": N}
(the page starts over), the others {"type": "delta", "page": i, "pages": N} (merged in). Deltas are
merged per node and GPU and sent at most every FLEXPIPE_PUSH_MIN_INTERVAL_S
(console/dashboard/coalesce.py), never between the pages of a snapshot.
"""

from __future__ import annotations

import asyncio
from typing import Any

from channels.db import database_sync_to_async
from django.conf import settings

from console.dashboard.coalesce import Coalescer, Merged
from console.dashboard.consumers import LiveConsumer
from console.fleet import live


def snapshot_pages(state: dict[str, Any], nodes_per_page: int) -> list[dict[str, Any]]:
    """The cluster state cut into messages of at most `nodes_per_page` nodes, each with its GPUs."""
    nodes = state["nodes"]
    by_node: dict[str, list[dict[str, Any]]] = {}
    for g in state["gpus"]:
        by_node.setdefault(g["node_id"], []).append(g)
    chunks = [nodes[i:i + nodes_per_page] for i in range(0, len(nodes), nodes_per_page)] or [[]]
    out = []
    for i, chunk in enumerate(chunks, start=1):
        gpus = [g for n in chunk for g in by_node.get(n["node_id"], ())]
        out.append({"type": "snapshot" if i == 1 else "delta", "page": i, "pages": len(chunks),
                    "nodes": chunk, "gpus": gpus})
    return out


class ClusterConsumer(LiveConsumer):
    group = live.CLUSTER_GROUP
    page = "cluster"
    _push: Coalescer | None = None
    _sending: asyncio.Lock | None = None

    def _lock(self) -> asyncio.Lock:
        if self._sending is None:
            self._sending = asyncio.Lock()
        return self._sending

    async def on_accepted(self) -> None:
        # Also the answer to {"type": "resync"} (after a reconnect, say).
        state = await database_sync_to_async(live.cluster_state)()
        async with self._lock():
            for page in snapshot_pages(state, int(settings.FLEXPIPE_SNAPSHOT_PAGE_NODES)):
                await self.send_json(page)

    async def cluster_delta(self, event: dict[str, Any]) -> None:
        if self._push is None:
            self._merged = Merged()
            self._push = self.coalesced(self._send_merged)
        self._merged.add(event["delta"])
        self._push.poke()

    async def _send_merged(self) -> None:
        async with self._lock():
            await self.send_json({"type": "delta", **self._merged.take()})
