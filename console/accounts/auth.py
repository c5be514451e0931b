"""API authentication and role permissions for DRF views."""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

from django.utils import timezone
from rest_framework import authentication, exceptions, permissions

from console.accounts.models import ApiToken
from console.accounts.roles import ADMIN, OPERATOR, VIEWER, has_role

TOKEN_PREFIX = "fpu_"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_api_token(user: Any, name: str) -> tuple[ApiToken, str]:
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    row = ApiToken.objects.create(user=user, name=name, prefix=token[:10], token_hash=hash_token(token),
                                  created_at=timezone.now())
    return row, token


class ApiTokenAuthentication(authentication.BaseAuthentication):
    """`Authorization: Bearer fpu_...` — a user's API token. Agent tokens are not valid here."""

    keyword = "bearer"

    def authenticate(self, request: Any) -> tuple[Any, ApiToken] | None:
        header = request.META.get("HTTP_AUTHORIZATION", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != self.keyword:
            return None
        token = token.strip()
        if not token:
            raise exceptions.AuthenticationFailed("Authorization: missing token after 'Bearer'")
        row = ApiToken.objects.select_related("user").filter(token_hash=hash_token(token), revoked_at=None).first()
        if row is None or not row.user.is_active:
            raise exceptions.AuthenticationFailed("Authorization: unknown or revoked API token")
        ApiToken.objects.filter(pk=row.pk).update(last_used_at=timezone.now())
        return row.user, row

    def authenticate_header(self, request: Any) -> str:
        return 'Bearer realm="api"'


class _RolePermission(permissions.BasePermission):
    role = VIEWER
    message = "requires the viewer role"

    def has_permission(self, request: Any, view: Any) -> bool:
        return has_role(request.user, self.role)


class IsViewer(_RolePermission):
    role = VIEWER
    message = "requires the viewer role (or operator, admin)"


class IsOperator(_RolePermission):
    role = OPERATOR
    message = "requires the operator role (or admin)"


class IsAdmin(_RolePermission):
    role = ADMIN
    message = "requires the admin role"


class ReadViewerWriteAdmin(permissions.BasePermission):
    """Viewers read; only admins write (the registry, users)."""

    message = "reading requires the viewer role; changing requires the admin role"

    def has_permission(self, request: Any, view: Any) -> bool:
        if request.method in permissions.SAFE_METHODS:
            return has_role(request.user, VIEWER)
        return has_role(request.user, ADMIN)
