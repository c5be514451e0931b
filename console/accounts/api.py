from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db.models import QuerySet
from drf_spectacular.utils import (
    OpenApiResponse,
    extend_schema,
    extend_schema_field,
    extend_schema_view,
    inline_serializer,
)
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action, api_view
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from console.accounts import actions
from console.accounts.auth import IsAdmin
from console.accounts.models import ApiToken
from console.accounts.roles import ROLES, role_of
from console.api.serializers import StrictSerializer, refused_response
from console.audit.chain import actor_of


@extend_schema(responses=inline_serializer("Me", {"username": serializers.CharField(),
                                                   "role": serializers.CharField(allow_null=True)}))
@api_view(["GET"])
def me(request: Request) -> Response:
    """Who the caller is and which role they hold."""
    user: Any = request.user
    return Response({"username": user.get_username(), "role": role_of(user)})


# -- users, roles and API tokens: admins only -------------------------------------------------------
USERNAME_RE = r"^[\w.@+-]{1,150}$"


class ApiTokenSerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    class Meta:
        model = ApiToken
        fields = ["id", "name", "prefix", "created_at", "last_used_at", "revoked_at"]
        read_only_fields = fields


class UserSerializer(serializers.Serializer):  # type: ignore[type-arg]
    username = serializers.CharField(read_only=True)
    role = serializers.SerializerMethodField()
    active = serializers.BooleanField(source="is_active", read_only=True)
    date_joined = serializers.DateTimeField(read_only=True)
    last_login = serializers.DateTimeField(read_only=True, allow_null=True)
    tokens = serializers.SerializerMethodField()

    @extend_schema_field(serializers.ChoiceField(choices=ROLES, allow_null=True))
    def get_role(self, obj: Any) -> str | None:
        return role_of(obj) if obj.is_active else _group_role(obj)

    @extend_schema_field(ApiTokenSerializer(many=True))
    def get_tokens(self, obj: Any) -> list[dict[str, Any]]:
        return list(ApiTokenSerializer(obj.api_tokens.all(), many=True).data)


def _group_role(user: Any) -> str | None:
    """The role a (possibly inactive) user's groups give: what they get back when activated."""
    names = set(user.groups.values_list("name", flat=True))
    held = [r for r in ROLES if r in names]
    return held[-1] if held else None


def _password_errors(value: str) -> list[str]:
    try:
        validate_password(value)
    except DjangoValidationError as exc:
        return list(exc.messages)
    return []


class CreateUserSerializer(StrictSerializer):
    username = serializers.RegexField(USERNAME_RE, max_length=150, error_messages={
        "invalid": "1-150 letters, digits or . @ + - _"})
    # min_length: Django's MinimumLengthValidator (settings.AUTH_PASSWORD_VALIDATORS), so the schema says it
    password = serializers.CharField(min_length=8, max_length=128, write_only=True, trim_whitespace=False)
    role = serializers.ChoiceField(choices=ROLES, allow_null=True)

    def validate_password(self, value: str) -> str:
        errors = _password_errors(value)
        if errors:
            raise ValidationError(errors)
        return value


class RoleSerializer(StrictSerializer):
    role = serializers.ChoiceField(choices=ROLES, allow_null=True, help_text="null: no role (an outsider)")


class ActiveSerializer(StrictSerializer):
    active = serializers.BooleanField()


class IssueTokenSerializer(StrictSerializer):
    name = serializers.CharField(max_length=100, help_text='what it is for, e.g. "grafana"')


class RevokeTokenSerializer(StrictSerializer):
    token_id = serializers.IntegerField(min_value=1, max_value=2**62)


@extend_schema_view(
    list=extend_schema(summary="Users, their role and their API tokens (admin)"),
    retrieve=extend_schema(summary="One user (admin)"),
)
class UserViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):  # type: ignore[type-arg]
    """Admins manage the console's users: create them, give or take a role, lock them out, issue and
    revoke their API tokens. Every write is audited with the admin as actor."""

    serializer_class = UserSerializer
    permission_classes = [IsAdmin]
    lookup_field = "username"
    lookup_value_regex = r"[\w.@+-]{1,150}"
    pagination_class = None

    def get_queryset(self) -> QuerySet[Any]:
        return get_user_model().objects.order_by("username").prefetch_related("groups", "api_tokens")

    def _refused(self, exc: actions.Refused) -> Response:
        return refused_response(exc.status, exc.errors)

    @extend_schema(summary="Create a user with a role (admin)", request=CreateUserSerializer,
                   responses={201: UserSerializer, 400: OpenApiResponse(description="the body names the field"),
                              409: OpenApiResponse(description="the username is taken")})
    def create(self, request: Request) -> Response:
        body = CreateUserSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        try:
            target = actions.do_create_user(**body.validated_data, actor=actor_of(request.user), user=request.user)
        except actions.Refused as exc:
            return self._refused(exc)
        return Response(UserSerializer(target).data, status=status.HTTP_201_CREATED)

    @extend_schema(summary="Give a user exactly this role, or none (admin)", request=RoleSerializer,
                   responses={200: UserSerializer, 409: OpenApiResponse(description="an admin's own admin role")})
    @action(detail=True, methods=["post"])
    def role(self, request: Request, username: str | None = None) -> Response:
        return self._change(request, RoleSerializer, lambda target, data, **who: actions.do_set_user_role(
            target, role=data["role"], **who))

    @extend_schema(summary="Activate or deactivate a user (admin)", request=ActiveSerializer,
                   responses={200: UserSerializer, 409: OpenApiResponse(description="deactivating yourself")})
    @action(detail=True, methods=["post"])
    def active(self, request: Request, username: str | None = None) -> Response:
        return self._change(request, ActiveSerializer, lambda target, data, **who: actions.do_set_user_active(
            target, active=data["active"], **who))

    def _change(self, request: Request, serializer: type[serializers.Serializer], do: Any) -> Response:
        """Validate the body, run the action on the user named in the URL, answer the user as it is now."""
        target = self.get_object()
        body = serializer(data=request.data)
        body.is_valid(raise_exception=True)
        try:
            do(target, body.validated_data, actor=actor_of(request.user), user=request.user)
        except actions.Refused as exc:
            return self._refused(exc)
        return Response(UserSerializer(self.get_object()).data)

    @extend_schema(summary="Issue an API token for a user (admin); the token is in this answer only",
                   request=IssueTokenSerializer,
                   responses={201: inline_serializer("IssuedApiToken", {
                       "token": serializers.CharField(help_text="send as Authorization: Bearer <token>"),
                       "id": serializers.IntegerField(), "name": serializers.CharField(),
                       "prefix": serializers.CharField()})})
    @action(detail=True, methods=["post"])
    def tokens(self, request: Request, username: str | None = None) -> Response:
        target = self.get_object()
        body = IssueTokenSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        row, token = actions.do_issue_api_token(target, name=body.validated_data["name"],
                                                actor=actor_of(request.user), user=request.user)
        return Response({"token": token, "id": row.pk, "name": row.name, "prefix": row.prefix},
                        status=status.HTTP_201_CREATED)

    @extend_schema(summary="Revoke one of a user's API tokens (admin; idempotent)", request=RevokeTokenSerializer,
                   responses={200: UserSerializer, 400: OpenApiResponse(description="token_id names no token "
                                                                                    "of this user")})
    @action(detail=True, methods=["post"], url_path="revoke-token")
    def revoke_token(self, request: Request, username: str | None = None) -> Response:
        target = self.get_object()
        body = RevokeTokenSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        row = ApiToken.objects.filter(pk=body.validated_data["token_id"], user=target).first()
        if row is None:
            return refused_response(400, {"token_id": f"{target.get_username()} has no token with this id"})
        actions.do_revoke_api_token(row, actor=actor_of(request.user), user=request.user)
        return Response(UserSerializer(self.get_object()).data)
