"""Tell a user's open websockets that their account changed (deactivated, another role).

Every live consumer (console.dashboard.consumers.LiveConsumer) joins its user's group; on the
message it checks the user again and closes at once when they may no longer watch. Called from
`transaction.on_commit` only, like every live push.
"""

from __future__ import annotations

import logging

import redis
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

log = logging.getLogger(__name__)


def user_group(user_pk: int) -> str:
    return f"user-{user_pk}"


def account_changed(user_pk: int) -> None:
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        async_to_sync(layer.group_send)(user_group(user_pk), {"type": "account.changed"})
    except (OSError, redis.RedisError) as exc:
        # The sockets then keep their user until they reconnect; HTTP refuses the user at once anyway.
        log.warning("could not tell user %s's websockets that their account changed: %s", user_pk, exc)
