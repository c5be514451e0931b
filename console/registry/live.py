"""Live push of registry changes to the browsers on the Registry page (group "registry").

Called from `transaction.on_commit` only: what is pushed has been committed.
"""

from __future__ import annotations

import logging
from typing import Any

import redis
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

log = logging.getLogger(__name__)
REGISTRY_GROUP = "registry"


def version_payload(version: Any) -> dict[str, Any]:
    """One version exactly as the API shows it: the page and the API never disagree on a field."""
    from console.registry.api import ModelVersionSerializer

    return dict(ModelVersionSerializer(version).data)


def push_version(version_id: int) -> None:
    from console.registry.models import ModelVersion

    version = ModelVersion.objects.filter(pk=version_id).first()
    layer = get_channel_layer()
    if version is None or layer is None:
        return
    try:
        async_to_sync(layer.group_send)(REGISTRY_GROUP, {"type": "registry.version",
                                                         "version": version_payload(version)})
    except (OSError, redis.RedisError) as exc:
        # Best effort: the state is committed; a page reload or the next change shows it.
        log.warning("registry push failed: %s", exc)
