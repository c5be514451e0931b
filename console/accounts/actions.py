"""Every write to users, roles and API tokens goes through one of these actions (STYLE.md).

Each takes its actor, changes state in one transaction and appends the audit entry inside it (both
commit or neither). Refusals raise `Refused` naming the field, before anything is written.
Roles are the groups of console/accounts/roles.py: a user holds at most one of them.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.db import IntegrityError, transaction
from django.utils import timezone

from console.accounts import live
from console.accounts.auth import new_api_token
from console.accounts.models import ApiToken
from console.accounts.roles import ADMIN, ROLES, role_of
from console.audit.chain import record


class Refused(Exception):
    """A write refused. `errors` names each offending field; nothing was written."""

    def __init__(self, status: int, errors: dict[str, str]) -> None:
        self.status = status
        self.errors = errors
        super().__init__("; ".join(f"{k}: {v}" for k, v in errors.items()))


def _grant(target: Any, role: str | None) -> None:
    target.groups.remove(*Group.objects.filter(name__in=ROLES))
    if role is not None:
        target.groups.add(Group.objects.get_or_create(name=role)[0])


@transaction.atomic
def do_create_user(*, username: str, password: str, role: str | None, actor: str, user: Any | None = None,
                   now: datetime | None = None) -> Any:
    """A new console user holding `role` (None: no role yet, an outsider)."""
    now = now or timezone.now()
    model = get_user_model()
    if model.objects.filter(username=username).exists():
        raise Refused(409, {"username": f"a user {username!r} exists already"})
    try:
        with transaction.atomic():  # a savepoint: a concurrent twin loses cleanly
            target = model.objects.create_user(username, password=password)
    except IntegrityError:
        raise Refused(409, {"username": f"a user {username!r} exists already"}) from None
    _grant(target, role)
    record("accounts.user_created", actor=actor, user=user, at=now,
           summary=f"user {username} created with role {role or 'none'}",
           data={"username": username}, after={"role": role, "active": True})
    return target


@transaction.atomic
def do_set_user_role(target: Any, *, role: str | None, actor: str, user: Any | None = None,
                     now: datetime | None = None) -> bool:
    """Give `target` exactly `role` (None: no role). True when it changed. An admin cannot drop
    their own admin role: someone must be left to manage users. A superuser (an admin by that flag,
    whatever their groups) who is given another role loses the flag too: the audit says what holds."""
    if role is not None and role not in ROLES:
        raise Refused(400, {"role": f"must be one of {', '.join(ROLES)} or null"})
    before = role_of(target)
    if before == role:
        return False
    if user is not None and target.pk == user.pk and before == ADMIN:
        raise Refused(409, {"role": "you cannot take the admin role from yourself; ask another admin"})
    _grant(target, role)
    if role != ADMIN and (target.is_superuser or target.is_staff):
        target.is_superuser = target.is_staff = False
        target.save(update_fields=["is_superuser", "is_staff"])
    transaction.on_commit(lambda: live.account_changed(target.pk))
    record("accounts.role_changed", actor=actor, user=user, at=now or timezone.now(),
           summary=f"user {target.get_username()}: role {before or 'none'} -> {role or 'none'}",
           data={"username": target.get_username()}, before={"role": before}, after={"role": role})
    return True


@transaction.atomic
def do_set_user_active(target: Any, *, active: bool, actor: str, user: Any | None = None,
                       now: datetime | None = None) -> bool:
    """Let a user in again, or lock them out (session and API tokens stop working). True when changed."""
    if target.is_active == active:
        return False
    if user is not None and target.pk == user.pk and not active:
        raise Refused(409, {"active": "you cannot deactivate yourself; ask another admin"})
    target.is_active = active
    target.save(update_fields=["is_active"])
    transaction.on_commit(lambda: live.account_changed(target.pk))
    record("accounts.user_activated" if active else "accounts.user_deactivated", actor=actor, user=user,
           at=now or timezone.now(),
           summary=f"user {target.get_username()} {'activated' if active else 'deactivated'}",
           data={"username": target.get_username()}, before={"active": not active}, after={"active": active})
    return True


@transaction.atomic
def do_issue_api_token(target: Any, *, name: str, actor: str, user: Any | None = None,
                       now: datetime | None = None) -> tuple[ApiToken, str]:
    """A new API token for `target`: the row and the token itself (shown once; only its hash is kept)."""
    row, token = new_api_token(target, name)
    record("accounts.api_token_issued", actor=actor, user=user, at=now or timezone.now(),
           summary=f"API token {row.prefix}… ({name}) issued for {target.get_username()}",
           data={"username": target.get_username(), "token_id": row.pk, "prefix": row.prefix, "name": name})
    return row, token


@transaction.atomic
def do_revoke_api_token(row: ApiToken, *, actor: str, user: Any | None = None,
                        now: datetime | None = None) -> bool:
    """Revoke a token; idempotent (False when it was revoked before)."""
    now = now or timezone.now()
    if ApiToken.objects.filter(pk=row.pk, revoked_at=None).update(revoked_at=now) != 1:
        return False
    record("accounts.api_token_revoked", actor=actor, user=user, at=now,
           summary=f"API token {row.prefix}… ({row.name}) of {row.user.get_username()} revoked",
           data={"username": row.user.get_username(), "token_id": row.pk, "prefix": row.prefix})
    return True
