"""Read-only REST views of the fleet: nodes and GPUs as the agents last reported them (viewers)."""

from __future__ import annotations

from typing import Any

from django.db.models import Count, Q, QuerySet
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_field,
    extend_schema_view,
)
from rest_framework import serializers, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import NotFound
from rest_framework.request import Request
from rest_framework.response import Response

from console.accounts.auth import IsOperator, IsViewer
from console.api.params import QueryParams
from console.audit.chain import actor_of
from console.fleet.actions import do_issue_agent_token
from console.fleet.models import GPU_STATE_Q, GPU_STATES, Gpu, Node, NodeLink


class GpuSerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    node = serializers.CharField(source="node.node_id")
    state = serializers.ChoiceField(choices=GPU_STATES, help_text=(
        "ours: healthy, allocatable, node reporting; tenant: lent to another tenant; "
        "unhealthy: broken per its last report; unreachable: its node missed the heartbeat"))

    class Meta:
        model = Gpu
        fields = ["uuid", "node", "index", "model", "nvlink_group", "state", "mem_total_bytes", "mem_used_bytes",
                  "sm_util", "temperature_c", "healthy", "allocatable", "xid_errors", "ecc_errors", "updated_at"]
        read_only_fields = fields


class LinkSerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    class Meta:
        model = NodeLink
        fields = ["peer", "bw_gbps", "measured_at"]
        read_only_fields = fields


class NodeSerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    gpu_count = serializers.IntegerField(read_only=True)
    report_lag_s = serializers.SerializerMethodField(help_text="seconds since the agent's last report")

    class Meta:
        model = Node
        fields = ["node_id", "hostname", "rack", "agent_version", "backends", "data_addr", "epoch", "schedulable",
                  "unschedulable_reason", "registered_at", "last_seen_at", "report_lag_s", "gpu_count"]
        read_only_fields = fields

    @extend_schema_field(OpenApiTypes.FLOAT)
    def get_report_lag_s(self, node: Node) -> float | None:
        if node.last_seen_at is None:
            return None
        return round(max(0.0, (timezone.now() - node.last_seen_at).total_seconds()), 3)


class NodeDetailSerializer(NodeSerializer):
    gpus = serializers.SerializerMethodField()
    links = LinkSerializer(many=True, read_only=True)
    engines = serializers.JSONField(read_only=True, help_text="latest engine reports, as the agent sent them")

    class Meta(NodeSerializer.Meta):
        fields = [*NodeSerializer.Meta.fields, "gpus", "links", "engines"]
        read_only_fields = fields

    @extend_schema_field(GpuSerializer(many=True))
    def get_gpus(self, node: Node) -> list[dict[str, Any]]:
        gpus = Gpu.objects.filter(node=node, present=True).select_related("node")
        return list(GpuSerializer(gpus, many=True).data)


class AgentTokenSerializer(serializers.Serializer):  # type: ignore[type-arg]
    node_id = serializers.CharField(read_only=True)
    agent_token = serializers.CharField(read_only=True, help_text="shown once: the agent registers with it")


def _not_nul(value: str) -> str:
    if "\x00" in value:
        raise NotFound()
    return value


@extend_schema_view(
    list=extend_schema(summary="Nodes", parameters=[
        OpenApiParameter("schedulable", bool, description="only nodes that are (true) or are not (false) schedulable"),
        OpenApiParameter("rack", str)]),
    retrieve=extend_schema(summary="One node with its GPUs, measured links and engine reports"),
)
class NodeViewSet(viewsets.ReadOnlyModelViewSet):  # type: ignore[type-arg]
    lookup_field = "node_id"
    lookup_value_regex = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"

    def get_serializer_class(self) -> type[serializers.Serializer]:  # type: ignore[type-arg]
        if self.action == "agent_token":
            return AgentTokenSerializer
        return NodeDetailSerializer if self.action == "retrieve" else NodeSerializer

    def get_permissions(self) -> list[Any]:
        return [IsOperator()] if self.action == "agent_token" else [IsViewer()]

    @extend_schema(summary="Approve re-enrolling a node (operator): a new agent token for it", request=None,
                   responses={201: AgentTokenSerializer,
                              403: OpenApiResponse(description="needs the operator role"),
                              404: OpenApiResponse(description="no such node")},
                   description=(
                       "The join token enrolls only node ids nobody holds; an enrolled node is re-enrolled "
                       "with its own agent token or with this one (DESIGN.md invariant 8). The old token stops "
                       "working; the new one is in this answer only. Audited as fleet.agent_token_issued."))
    @action(detail=True, methods=["post"], url_path="agent-token")
    def agent_token(self, request: Request, node_id: str | None = None) -> Response:
        node = self.get_object()
        _, token = do_issue_agent_token(node.node_id, actor=actor_of(request.user), user=request.user,
                                        now=timezone.now())
        return Response({"node_id": node.node_id, "agent_token": token}, status=201)

    def get_queryset(self) -> QuerySet[Node]:
        qs = Node.objects.annotate(gpu_count=Count("gpus", filter=Q(gpus__present=True))).order_by("node_id")
        if self.action != "list":
            return qs.prefetch_related("links")
        q = QueryParams(self.request.query_params)
        schedulable = q.choice("schedulable", ("true", "false"))
        rack = q.text("rack", max_len=64)
        q.raise_if_any()
        if schedulable is not None:
            qs = qs.filter(schedulable=schedulable == "true")
        if rack is not None:
            qs = qs.filter(rack=rack)
        return qs


@extend_schema_view(
    list=extend_schema(summary="GPUs", parameters=[
        OpenApiParameter("node", str, description="node_id"),
        OpenApiParameter("state", str, enum=list(GPU_STATES)),
        OpenApiParameter("model", str, description="GPU model name, e.g. H100-SXM"),
        OpenApiParameter("uuid", str, description="exact GPU UUID (for UUIDs that contain '/')")]),
    retrieve=extend_schema(summary="One GPU by UUID"),
)
class GpuViewSet(viewsets.ReadOnlyModelViewSet):  # type: ignore[type-arg]
    serializer_class = GpuSerializer
    lookup_field = "uuid"
    lookup_value_regex = r"[^/]{1,128}"

    def get_object(self) -> Gpu:
        _not_nul(self.kwargs[self.lookup_field])
        return super().get_object()  # type: ignore[no-any-return]

    def get_queryset(self) -> QuerySet[Gpu]:
        qs = Gpu.objects.filter(present=True).select_related("node").order_by("node__node_id", "index")
        if self.action != "list":
            return qs
        q = QueryParams(self.request.query_params)
        node = q.text("node", max_len=64)
        state = q.choice("state", GPU_STATES)
        model = q.text("model", max_len=64)
        uuid = q.text("uuid", max_len=128)
        q.raise_if_any()
        if node is not None:
            qs = qs.filter(node__node_id=node)
        if state is not None:
            qs = qs.filter(GPU_STATE_Q[state])
        if model is not None:
            qs = qs.filter(model=model)
        if uuid is not None:
            qs = qs.filter(uuid=uuid)
        return qs
