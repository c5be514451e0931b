"""Websocket of the Registry page: every version on connect, then each version as it changes."""

from __future__ import annotations

from typing import Any

from channels.db import database_sync_to_async

from console.dashboard.consumers import LiveConsumer
from console.registry import live
from console.registry.models import ModelVersion


def _all_versions() -> list[dict[str, Any]]:
    return [live.version_payload(v) for v in ModelVersion.objects.order_by("name", "-registered_at", "-id")]


class RegistryConsumer(LiveConsumer):
    group = live.REGISTRY_GROUP
    page = "registry"

    async def on_accepted(self) -> None:
        await self.send_json({"type": "snapshot", "versions": await database_sync_to_async(_all_versions)()})

    async def registry_version(self, event: dict[str, Any]) -> None:
        await self.send_json({"type": "version", "version": event["version"]})
