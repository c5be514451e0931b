from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.decorators import api_view
from rest_framework.request import Request
from rest_framework.response import Response

from console.accounts.roles import role_of


@extend_schema(responses=inline_serializer("Me", {"username": serializers.CharField(),
                                                   "role": serializers.CharField(allow_null=True)}))
@api_view(["GET"])
def me(request: Request) -> Response:
    """Who the caller is and which role they hold."""
    user: Any = request.user
    return Response({"username": user.get_username(), "role": role_of(user)})
