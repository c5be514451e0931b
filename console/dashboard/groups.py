"""Per-page subscriptions (issue 19): which channel-layer groups a push goes to besides its page's own.

Each live page joins the group of what it shows: the Overview and the heatmap the fleet's ("cluster",
"gearbox", "audit"), a deployment's page only `deployment_group(name)`. A push is sent to its own
group and to the groups the apps' routers name for it: a fleet delta to the deployments whose gears
or routed plans it touches (console.gearbox.receivers registers that), an audit entry to its
deployment's. So a deployment page's socket never even hears another deployment's change: before,
every page heard every report and each socket read the database to decide it did not care.

A router is called in the process that pushes (the fleet pusher's thread, an on-commit hook), with
the push's payload; it returns group names (`deployment_group` makes them). A router that fails is
logged and skipped: the push still reaches its own group.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger(__name__)

Router = Callable[[dict[str, Any]], Iterable[str]]
_routers: dict[str, list[Router]] = {}
_GROUP_SAFE = re.compile(r"[A-Za-z0-9_.-]{1,80}")  # Channels' group names: ASCII, under 100 characters


def deployment_group(name: str) -> str:
    """The group of one deployment's pages (a name outside the groups' alphabet is hashed)."""
    if _GROUP_SAFE.fullmatch(name):
        return f"deployment.{name}"
    return "deployment.h" + hashlib.sha256(name.encode()).hexdigest()[:40]


def add_router(kind: str, router: Router) -> None:
    """Have `router` name more groups for every push of `kind` ("cluster.delta", "audit.entry")."""
    if router not in _routers.setdefault(kind, []):
        _routers[kind].append(router)


def extra_groups(kind: str, payload: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for router in _routers.get(kind, ()):
        try:
            out.extend(g for g in router(payload) if g not in out)
        except Exception:  # noqa: BLE001 - a push is best effort; its own group still gets it
            log.exception("live push: the %s router %s failed", kind, getattr(router, "__name__", router))
    return out
