"""The Users page (admins): who may use the console, with which role, and their API tokens.

Everything on it goes through the users API (console/accounts/api.py: create, role, active, tokens,
revoke-token), so the page, the API and the audit log agree; this view only embeds the first state.
"""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from console.accounts.api import UserSerializer
from console.accounts.decorators import role_required
from console.accounts.roles import ADMIN, ROLES


@role_required(ADMIN)
def users_page(request: HttpRequest) -> HttpResponse:
    from django.contrib.auth import get_user_model

    users = get_user_model().objects.order_by("username").prefetch_related("groups", "api_tokens")
    return render(request, "accounts/users.html", {"page_data": {
        "users": UserSerializer(users, many=True).data, "roles": list(ROLES), "me": request.user.get_username()}})
