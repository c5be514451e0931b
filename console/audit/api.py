"""REST API of the audit log: viewers list, filter and read entries, and verify the hash chain."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_view, inline_serializer
from rest_framework import serializers, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from console.api.params import QueryParams
from console.audit.chain import verify_chain
from console.audit.live import entry_payload
from console.audit.models import AuditEntry, AuditHead


class AuditEntrySerializer(serializers.Serializer):  # type: ignore[type-arg]
    """An entry as the chain hashed it; the same shape is pushed live to the Audit page."""

    seq = serializers.IntegerField()
    at = serializers.DateTimeField()
    event_type = serializers.CharField()
    actor = serializers.CharField(help_text='who did it: "user:alice", "agent:a1", "system:registry"')
    deployment = serializers.CharField(allow_blank=True)
    transition_seq = serializers.IntegerField(allow_null=True)
    decision_id = serializers.IntegerField(allow_null=True)
    summary = serializers.CharField()
    data = serializers.JSONField()
    before = serializers.JSONField(allow_null=True)
    after = serializers.JSONField(allow_null=True)
    hash = serializers.CharField()
    prev_hash = serializers.CharField()

    def to_representation(self, instance: AuditEntry) -> dict[str, Any]:
        return entry_payload(instance)


ChainStatusSerializer = inline_serializer("ChainStatus", {
    "ok": serializers.BooleanField(),
    "checked": serializers.IntegerField(help_text="entries verified"),
    "first_bad_seq": serializers.IntegerField(allow_null=True),
    "reason": serializers.CharField(allow_blank=True),
    "head_seq": serializers.IntegerField(help_text="the chain's length as its head records it"),
})


def _prefix_or_exact(field: str, value: str) -> dict[str, str]:
    # "registry.*" selects every registry event; anything else must match exactly.
    if value.endswith("*"):
        return {f"{field}__startswith": value[:-1]}
    return {field: value}


FILTERS = ("type", "actor", "deployment", "since", "until", "after_seq", "before_seq")


def filter_entries(q: QueryParams) -> QuerySet[AuditEntry]:
    """Entries matching the filters, newest first. Bad values land in `q.errors` (the caller raises or shows)."""
    event_type = q.text("type", max_len=64)
    actor = q.text("actor", max_len=160)
    deployment = q.text("deployment", max_len=64)
    since = q.datetime("since")
    until = q.datetime("until")
    after_seq = q.integer("after_seq", low=0)
    before_seq = q.integer("before_seq", low=1)  # the next page, older: keyset paging on the seq index
    if since and until and since >= until:
        q.fail("until", "must be later than since")
    qs = AuditEntry.objects.order_by("-seq")
    if q.errors:
        return qs.none()
    if event_type is not None:
        qs = qs.filter(**_prefix_or_exact("event_type", event_type))
    if actor is not None:
        qs = qs.filter(**_prefix_or_exact("actor", actor))
    if deployment is not None:
        qs = qs.filter(deployment=deployment)
    if since is not None:
        qs = qs.filter(at__gte=since)
    if until is not None:
        qs = qs.filter(at__lt=until)
    if after_seq is not None:
        qs = qs.filter(seq__gt=after_seq)
    if before_seq is not None:
        qs = qs.filter(seq__lt=before_seq)
    return qs


@extend_schema_view(
    list=extend_schema(summary="Audit entries, newest first", parameters=[
        OpenApiParameter("type", str, description='event type, exact, or a prefix ending in "*" (registry.*)'),
        OpenApiParameter("actor", str, description='exact ("user:alice") or a prefix ending in "*" (agent:*)'),
        OpenApiParameter("deployment", str),
        OpenApiParameter("since", OpenApiTypes.DATETIME, description="ISO 8601 date-time; entries at or after it"),
        OpenApiParameter("until", OpenApiTypes.DATETIME, description="ISO 8601 date-time; entries before it"),
        OpenApiParameter("after_seq", int, description="entries with a larger seq (catching up after a reconnect)"),
        OpenApiParameter("before_seq", int, description="entries with a smaller seq: the page older than the "
                                                        "last one read (cheaper than a deep offset)"),
    ]),
    retrieve=extend_schema(summary="One audit entry by its sequence number"),
)
class AuditEntryViewSet(viewsets.ReadOnlyModelViewSet):  # type: ignore[type-arg]
    serializer_class = AuditEntrySerializer
    lookup_field = "seq"
    lookup_value_regex = r"[0-9]{1,18}"

    def get_queryset(self) -> QuerySet[AuditEntry]:
        qs = AuditEntry.objects.order_by("-seq")
        if self.action != "list":
            return qs
        q = QueryParams(self.request.query_params)
        filtered = filter_entries(q)
        q.raise_if_any()
        return filtered

    @extend_schema(summary="Verify the hash chain", responses={200: ChainStatusSerializer}, description=(
        "Walks the whole chain: each entry's body hashes to its hash, each links to the one before, the "
        "filterable columns agree with the hashed body, and nothing is missing at the end."))
    @action(detail=False, methods=["get"], pagination_class=None)
    def verify(self, request: Request) -> Response:
        status = verify_chain()
        head = AuditHead.objects.filter(pk=1).first()
        return Response({**status.to_dict(), "head_seq": head.seq if head else 0})
