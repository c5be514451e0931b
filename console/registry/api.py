"""REST API of the registry: viewers list and read versions; admins register and retire them."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_field,
    extend_schema_view,
)
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from agents.protocol import MAX_CONTEXT_TOKENS, MAX_WARMUP_TOKENS  # prepare_plan carries both: one bound each
from console.accounts.auth import ReadViewerWriteAdmin
from console.api.params import QueryParams
from console.api.serializers import StrictSerializer, refused_response
from console.audit.chain import actor_of
from console.fleet.models import AgentCommand, Node
from console.registry import actions
from console.registry.architecture import HF_REQUIRED_KEYS, MAX_NAME_LEN, validate_architecture
from console.registry.models import ModelVersion
from console.registry.weights import parse_weights_uri

MAX_GPU_MEM_BYTES = 4 * 1024**4  # the agent protocol's bound: catches GiB-for-bytes mistakes


@extend_schema_field({
    "oneOf": [
        {"type": "string", "minLength": 1, "maxLength": MAX_NAME_LEN, "description": "a model catalog name"},
        {"type": "object", "description": "a Hugging Face config.json", "required": list(HF_REQUIRED_KEYS),
         "properties": {k: {"type": "integer", "minimum": 1} for k in HF_REQUIRED_KEYS},
         "additionalProperties": True},
    ]
})
class ArchitectureField(serializers.JSONField):
    pass


class ModelVersionSerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    architecture = ArchitectureField(read_only=True)
    serving = serializers.SerializerMethodField(help_text="deployments that serve this version now")
    deployments = serializers.SerializerMethodField(help_text=(
        "deployments of this model: where it can be rolled out (POST /api/v1/deployments/{name}/rollout)"))

    class Meta:
        model = ModelVersion
        fields = ["id", "name", "version", "engine", "architecture", "weights_uri", "sha256", "tokenizer",
                  "max_context", "min_gpu_mem_bytes", "warmup_tokens", "status", "status_detail", "weights_bytes",
                  "registered_at", "registered_by", "verified_at", "verified_by", "observed_sha256",
                  "quarantined_at", "quarantined_by", "retired_at", "retired_by", "serving", "deployments"]
        read_only_fields = fields

    @extend_schema_field(serializers.ListField(child=serializers.CharField()))
    def get_serving(self, obj: ModelVersion) -> list[str]:
        return sorted(obj.deployments.values_list("name", flat=True))

    @extend_schema_field(serializers.ListField(child=serializers.CharField()))
    def get_deployments(self, obj: ModelVersion) -> list[str]:
        from console.gearbox.models import Deployment

        return sorted(Deployment.objects.filter(model_name=obj.name).values_list("name", flat=True))


class RegisterSerializer(StrictSerializer):
    name = serializers.RegexField(r"^[A-Za-z0-9][A-Za-z0-9._/:+-]{0,127}$", max_length=128, error_messages={
        "invalid": "1-128 letters, digits or . _ / : + -, starting with a letter or digit"})
    version = serializers.RegexField(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$", max_length=64, error_messages={
        "invalid": "1-64 letters, digits or . _ + -, starting with a letter or digit"})
    engine = serializers.ChoiceField(choices=ModelVersion.ENGINES)
    architecture = ArchitectureField(help_text="a name of the scheduler's model catalog, or the model's "
                                               "Hugging Face config.json as an object")
    weights_uri = serializers.CharField(max_length=1024, help_text=(
        "file:///abs/path or /abs/path under a model root (FLEXPIPE_MODEL_ROOTS; hashed by the console), or "
        "http(s)://, s3://, hf:// (hashed by the agent that downloads it)"))
    sha256 = serializers.RegexField(r"^[0-9a-f]{64}$", error_messages={
        "invalid": "must be 64 lowercase hexadecimal digits (the SHA256 of the weights file)"})
    tokenizer = serializers.CharField(max_length=1024, help_text=(
        "this model's own tokenizer: the absolute path of its tokenizer.json (or of the model folder holding one) "
        "under a model root; loaded and tried at registration - the gateway tokenizes with it"))
    max_context = serializers.IntegerField(min_value=1, max_value=MAX_CONTEXT_TOKENS)
    min_gpu_mem_bytes = serializers.IntegerField(min_value=1, max_value=MAX_GPU_MEM_BYTES)
    warmup_tokens = serializers.IntegerField(min_value=0, max_value=MAX_WARMUP_TOKENS)

    def validate_architecture(self, value: Any) -> Any:
        try:
            return validate_architecture(value).value
        except ValueError as exc:
            raise ValidationError(str(exc)) from None

    def validate_weights_uri(self, value: str) -> str:
        try:
            parse_weights_uri(value)
        except ValueError as exc:
            raise ValidationError(str(exc)) from None
        return value


class CheckSerializer(StrictSerializer):
    node = serializers.CharField(max_length=64, help_text="the node_id of the agent that hashes its copy of the "
                                                          "weights (it must hold the model folder)")


class CheckCommandSerializer(serializers.Serializer):  # type: ignore[type-arg]
    command = serializers.IntegerField(help_text="the verify_weights command's id (the agent acks it)")
    state = serializers.ChoiceField(choices=AgentCommand.STATES,
                                    help_text="pending until the agent pulls it; ok or failed once it acked")
    node = serializers.CharField()
    version = serializers.IntegerField(help_text="the model version's id")
    detail = serializers.CharField(help_text="the agent's ack detail (empty until it acked)")
    result = serializers.JSONField(help_text="the agent's ack result: {sha256} on ok")


class RetireSerializer(StrictSerializer):
    reason = serializers.CharField(max_length=300, required=False, allow_blank=True, default="")


@extend_schema_view(
    list=extend_schema(summary="Model versions", parameters=[
        OpenApiParameter("status", str, enum=list(ModelVersion.STATUSES)),
        OpenApiParameter("name", str), OpenApiParameter("engine", str, enum=list(ModelVersion.ENGINES)),
        OpenApiParameter("sha256", str, description="registered digest")]),
    retrieve=extend_schema(summary="One model version"),
)
class ModelVersionViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):  # type: ignore[type-arg]
    serializer_class = ModelVersionSerializer
    permission_classes = [ReadViewerWriteAdmin]
    lookup_value_regex = r"[0-9]{1,18}"

    def get_queryset(self) -> QuerySet[ModelVersion]:
        qs = ModelVersion.objects.order_by("name", "-registered_at", "-id")
        if self.action != "list":
            return qs
        q = QueryParams(self.request.query_params)
        wanted = {"status": q.choice("status", ModelVersion.STATUSES), "name": q.text("name", max_len=128),
                  "engine": q.choice("engine", ModelVersion.ENGINES), "sha256": q.text("sha256", max_len=64)}
        q.raise_if_any()
        return qs.filter(**{k: v for k, v in wanted.items() if v is not None})

    @extend_schema(
        summary="Register a model version (admin)",
        request=RegisterSerializer,
        responses={201: ModelVersionSerializer,
                   200: OpenApiResponse(ModelVersionSerializer, description="the identical version was registered "
                                        "before: returned unchanged"),
                   400: OpenApiResponse(description="a field is invalid: the body names it"),
                   409: OpenApiResponse(description="conflicts with a registered version: the body names the field")},
        description=(
            "A local weights file is streamed through SHA256 now (small files; the answer says verified or "
            "quarantined) or by the Celery task registry.verify_weights (status verifying). Remote weights wait "
            "for the agent that loads them (status awaiting_agent). A digest mismatch quarantines the version. "
            "The same name with other weights is another version."),
    )
    def create(self, request: Request) -> Response:
        body = RegisterSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        try:
            reg = actions.do_register_model_version(actions.VersionSpec(**body.validated_data),
                                                    actor=actor_of(request.user), user=request.user)
        except actions.Refused as exc:
            return refused_response(exc.status, exc.errors)
        return Response(ModelVersionSerializer(reg.version).data,
                        status=status.HTTP_201_CREATED if reg.created else status.HTTP_200_OK)

    @extend_schema(
        summary="Ask a node's agent to check the version's weights (admin; idempotent per node)",
        request=CheckSerializer,
        responses={200: CheckCommandSerializer,
                   400: OpenApiResponse(description="`node` is no registered node: the body names it"),
                   404: OpenApiResponse(description="no such model version"),
                   409: OpenApiResponse(description="the version is retired: the body names `status`")},
        description=(
            "Issues a `verify_weights` command to the node: its agent hashes its copy of the weights (the "
            "model folder named like the version) and acks with the digest. A match verifies the version, "
            "another digest quarantines it (both audited); an agent without the weights acks failed and "
            "registry.weights_check_failed is audited, the status stays. Asking again about the same node "
            "returns the same command and its state, so this is how to poll for the answer."),
    )
    @action(detail=True, methods=["post"])
    def check(self, request: Request, pk: str | None = None) -> Response:
        version = self.get_object()
        body = CheckSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        node = Node.objects.filter(node_id=body.validated_data["node"]).first()
        if node is None:
            return refused_response(400, {"node": f"no registered node {body.validated_data['node']!r}"})
        try:
            cmd = actions.do_request_weights_check(version, node, actor=actor_of(request.user))
        except actions.Refused as exc:
            return refused_response(exc.status, exc.errors)
        return Response(CheckCommandSerializer({
            "command": cmd.pk, "state": cmd.state, "node": node.node_id, "version": version.pk,
            "detail": cmd.detail, "result": cmd.result if isinstance(cmd.result, dict) else {}}).data)

    @extend_schema(summary="Retire a model version (admin; idempotent)", request=RetireSerializer,
                   responses={200: ModelVersionSerializer,
                              409: OpenApiResponse(description="a deployment serves it (or is rolling it out): "
                                                               "the body names `status` and who")})
    @action(detail=True, methods=["post"])
    def retire(self, request: Request, pk: str | None = None) -> Response:
        version = self.get_object()
        body = RetireSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        try:
            actions.do_retire_model_version(version, actor=actor_of(request.user), user=request.user,
                                            reason=body.validated_data["reason"])
        except actions.Refused as exc:
            return refused_response(exc.status, exc.errors)
        version.refresh_from_db()
        return Response(ModelVersionSerializer(version).data)
