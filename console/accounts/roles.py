"""Roles are Django groups: viewer (read), operator (steer the gears), admin (registry, users).

Each role includes the ones before it. A superuser is an admin.
"""

from __future__ import annotations

from typing import Any

VIEWER, OPERATOR, ADMIN = "viewer", "operator", "admin"
ROLES = (VIEWER, OPERATOR, ADMIN)
_RANK = {VIEWER: 1, OPERATOR: 2, ADMIN: 3}


def role_of(user: Any) -> str | None:
    """The highest role a user holds, or None for an outsider."""
    if user is None or not user.is_authenticated or not user.is_active:
        return None
    if user.is_superuser:
        return ADMIN
    names = set(user.groups.values_list("name", flat=True)) if user.pk else set()
    held = [r for r in ROLES if r in names]
    return max(held, key=_RANK.__getitem__) if held else None


def has_role(user: Any, role: str) -> bool:
    held = role_of(user)
    return held is not None and _RANK[held] >= _RANK[role]
