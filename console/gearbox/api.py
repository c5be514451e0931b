"""REST API of the gearbox: deployments, gears, plans, transitions and decisions, and the operator verbs.

Reading needs the viewer role. The verbs - pin, unpin, mode, emergency on a deployment, approve on a
decision - need the operator role (admins have it too) and call console.gearbox.actions (each one
transaction, audited with the caller as actor). A body with an unknown or bad field is a 400 that
names it and changes nothing; a verb the deployment's state refuses is a 409 that says why.

The payloads come from console.gearbox.present (the pages and their websockets show the same
shapes); the serializers below describe them for the OpenAPI schema.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models import QuerySet
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiExample,
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_view,
    inline_serializer,
)
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import NotFound
from rest_framework.request import Request
from rest_framework.response import Response

from console.accounts.auth import IsOperator, IsViewer
from console.api.params import QueryParams
from console.api.serializers import StrictSerializer, refused_response
from console.fleet.actions import Rejected
from console.gearbox import actions, present
from console.gearbox.models import ACTIVE_PHASES, PHASES, Decision, Deployment, Transition
from scheduler.gearbox import Outcome, Trigger

NAME_RE = r"[^/]{1,64}"
GEAR_ID_RE = r"g-[0-9a-f]{16}"
PLAN_ID_RE = r"p-[0-9a-f]{16}"
CURRENT = "current"
APPROVALS = ("pending", "approved", "superseded", "none")


# --- payload shapes (for the schema; the data comes from console.gearbox.present) -------------------
class PayloadSerializer(serializers.Serializer):  # type: ignore[type-arg]
    """Describes a payload of console.gearbox.present for the schema; the views return the payloads
    themselves, so what the schema says and what the pages receive come from one place."""

    def to_representation(self, instance: Any) -> Any:
        return instance


class PlanRefSerializer(PayloadSerializer):
    plan_id = serializers.CharField()
    shape = serializers.CharField(help_text="TP4, PP2xTP4, P:TP2 / D:TP4")
    weight = serializers.FloatField(help_text="share of the gear's requests")


class GearSummarySerializer(PayloadSerializer):
    gear_id = serializers.CharField(help_text="content id: equal gears have equal ids")
    shape = serializers.CharField()
    gpu_count = serializers.IntegerField()
    plans = PlanRefSerializer(many=True)


class GpuPlaceSerializer(PayloadSerializer):
    uuid = serializers.CharField()
    node = serializers.CharField(allow_null=True)
    index = serializers.IntegerField(allow_null=True)
    model = serializers.CharField(allow_null=True)
    in_block = serializers.BooleanField(allow_null=True, help_text="usable now (in an atomic block)")
    out_reason = serializers.CharField(allow_null=True, help_text="why the GPU is in no block")


class StageSerializer(PayloadSerializer):
    pipeline = serializers.ChoiceField(choices=["main", "prefill", "decode"])
    index = serializers.IntegerField()
    layers = serializers.ListField(child=serializers.IntegerField(), help_text="[start, end)")
    tp = serializers.IntegerField()
    gpus = GpuPlaceSerializer(many=True)


class PlanDetailSerializer(PayloadSerializer):
    plan_id = serializers.CharField()
    model = serializers.CharField()
    mode = serializers.ChoiceField(choices=["colocated", "disaggregated"])
    shape = serializers.CharField()
    pp = serializers.IntegerField()
    kv_reserve_tokens = serializers.IntegerField()
    kv_partition = serializers.CharField()
    gpu_count = serializers.IntegerField()
    stages = StageSerializer(many=True)


class GearPlanSerializer(PlanDetailSerializer):
    weight = serializers.FloatField()


class GearUseSerializer(PayloadSerializer):
    deployment = serializers.CharField()
    roles = serializers.ListField(child=serializers.ChoiceField(choices=present.GEAR_ROLES))
    transitions = serializers.ListField(child=serializers.IntegerField(), help_text="seqs from or to this gear")


class GearSerializer(PayloadSerializer):
    gear_id = serializers.CharField()
    model = serializers.CharField()
    shape = serializers.CharField()
    gpu_count = serializers.IntegerField()
    weights = serializers.ListField(child=serializers.FloatField())
    plans = PlanRefSerializer(many=True)
    deployments = GearUseSerializer(many=True)
    last_seen_at = serializers.DateTimeField(allow_null=True)


class GearDetailSerializer(GearSerializer):
    plans = GearPlanSerializer(many=True)  # type: ignore[assignment]


class PlanRouteSerializer(PayloadSerializer):
    deployment = serializers.CharField()
    version = serializers.IntegerField(help_text="the routing table's version")
    weight = serializers.FloatField()
    frozen = serializers.BooleanField()
    nodes = serializers.ListField(child=serializers.CharField())


class PlanSerializer(PlanDetailSerializer):
    gears = serializers.ListField(child=serializers.CharField())
    deployments = serializers.ListField(child=serializers.CharField())
    routes = PlanRouteSerializer(many=True, help_text="where routing tables send requests to it now")


class RouteSerializer(PayloadSerializer):
    plan_id = serializers.CharField()
    shape = serializers.CharField(allow_null=True)
    weight = serializers.FloatField()
    frozen = serializers.BooleanField(help_text="admits nothing new: its sequences finish or move")
    nodes = serializers.ListField(child=serializers.CharField())


class DeploymentSerializer(PayloadSerializer):
    name = serializers.CharField()
    model_name = serializers.CharField()
    model_version = inline_serializer("DeploymentModelVersion", {
        "id": serializers.IntegerField(), "version": serializers.CharField(), "sha256": serializers.CharField(),
        "status": serializers.CharField(), "engine": serializers.CharField()}, allow_null=True,
        help_text="the registry version its transitions prepare: the newest verified (or awaiting-agent) one")
    slo = inline_serializer("Slo", {"ttft_ms": serializers.FloatField(), "tpot_ms": serializers.FloatField()})
    priority = serializers.IntegerField()
    mode = serializers.ChoiceField(choices=[m for m, _ in Deployment.MODES])
    latency_critical = serializers.BooleanField(help_text="its plans stay off blocks that keep shrinking")
    baseline_gear = GearSummarySerializer(help_text="the emergency target")
    current_gear = GearSummarySerializer(allow_null=True)
    pinned_gear = GearSummarySerializer(allow_null=True)
    on_baseline = serializers.BooleanField()
    routing = inline_serializer("Routing", {"version": serializers.IntegerField(),
                                            "routes": RouteSerializer(many=True)})
    active_transition = inline_serializer("ActiveTransition", {
        "seq": serializers.IntegerField(), "kind": serializers.CharField(), "phase": serializers.CharField(),
        "step": serializers.CharField(), "to_gear_id": serializers.CharField(allow_null=True),
        "abort_reason": serializers.CharField()}, allow_null=True)
    emergency = inline_serializer("PendingEmergency", {
        "requested_at": serializers.DateTimeField(), "reason": serializers.CharField(),
        "actor": serializers.CharField()}, allow_null=True, help_text="a downshift waiting to start")
    pending_decision = serializers.IntegerField(allow_null=True, help_text="advisory: the decision to approve")
    last_transition_seq = serializers.IntegerField()
    health = inline_serializer("Health", {"state": serializers.ChoiceField(choices=present.HEALTH_STATES),
                                          "reasons": serializers.ListField(child=serializers.CharField())})
    serving = serializers.JSONField(allow_null=True, help_text=(
        "the engines' latest reports for the routed plans: tokens_per_s, running, waiting (summed), "
        "ttft_p50_ms, ttft_p95_ms, tpot_p95_ms, kv_usage (worst), reported_at"))
    created_at = serializers.DateTimeField()
    updated_at = serializers.DateTimeField()


class PhaseSpanSerializer(PayloadSerializer):
    phase = serializers.ChoiceField(choices=list(PHASES))
    started_at = serializers.DateTimeField()
    ended_at = serializers.DateTimeField(allow_null=True)
    running = serializers.BooleanField()
    duration_s = serializers.FloatField(allow_null=True)


class MovedSerializer(PayloadSerializer):
    kv_bytes_migrated = serializers.IntegerField(help_text="KV cache bytes handed over by migration")
    tokens_replayed = serializers.IntegerField(help_text="tokens re-prefilled on the target instead")
    seqs_migrated = serializers.IntegerField()
    seqs_replayed = serializers.IntegerField()
    seqs_finished = serializers.IntegerField(help_text="left to finish on the old plan")
    seqs_failed = serializers.IntegerField(help_text="ended with an explicit error")
    stall_s_max = serializers.FloatField()
    forward = serializers.JSONField(help_text="the same, forward hand-overs (MoveStats)")
    back = serializers.JSONField(help_text="the same, rollback hand-overs (MoveStats)")


class TransitionSerializer(PayloadSerializer):
    id = serializers.IntegerField()
    deployment = serializers.CharField()
    seq = serializers.IntegerField(help_text="strictly increasing per deployment")
    kind = serializers.ChoiceField(choices=[k for k, _ in Transition.KINDS])
    phase = serializers.ChoiceField(choices=list(PHASES))
    active = serializers.BooleanField()
    step = serializers.CharField()
    attempt = serializers.IntegerField()
    actor = serializers.CharField()
    decision = serializers.IntegerField(allow_null=True)
    from_gear = GearSummarySerializer(allow_null=True)
    to_gear = GearSummarySerializer()
    created_at = serializers.DateTimeField()
    updated_at = serializers.DateTimeField()
    finished_at = serializers.DateTimeField(allow_null=True)
    duration_s = serializers.FloatField(help_text="to its end, or until now while it runs")
    error = serializers.CharField()
    abort_reason = serializers.CharField()
    phases = PhaseSpanSerializer(many=True)
    moved = MovedSerializer()


class StepSerializer(PayloadSerializer):
    step = serializers.CharField()
    phase = serializers.CharField()
    attempt = serializers.IntegerField()
    state = serializers.ChoiceField(choices=["running", "ok", "failed", "abandoned"])
    started_at = serializers.DateTimeField()
    finished_at = serializers.DateTimeField(allow_null=True)
    duration_s = serializers.FloatField(allow_null=True)
    note = serializers.CharField()
    error = serializers.CharField()
    reason = serializers.CharField()
    commands = serializers.IntegerField(help_text="agent commands it sent")
    result = serializers.JSONField()
    does = serializers.CharField(help_text="what the step does, from the transition table")


class BestCandidateSerializer(PayloadSerializer):
    gear_id = serializers.CharField()
    shape = serializers.CharField()
    gain_tokens = serializers.FloatField()
    cost_tokens = serializers.FloatField()
    threshold_tokens = serializers.FloatField(help_text="cost x hysteresis factor: what the gain must beat")
    passes = serializers.BooleanField()


class DecisionSerializer(PayloadSerializer):
    id = serializers.IntegerField()
    deployment = serializers.CharField()
    at = serializers.DateTimeField()
    trigger = serializers.ChoiceField(choices=[t.value for t in Trigger])
    outcome = serializers.ChoiceField(choices=[o.value for o in Outcome])
    factor = serializers.FloatField(help_text="the hysteresis factor applied")
    current_gear_id = serializers.CharField(allow_null=True)
    target_gear_id = serializers.CharField(allow_null=True)
    target_shape = serializers.CharField(allow_null=True)
    reasons = serializers.ListField(child=serializers.CharField())
    actor = serializers.CharField()
    note = serializers.CharField()
    approval = serializers.ChoiceField(choices=APPROVALS[:3], allow_null=True)
    approved_by = serializers.CharField(allow_null=True)
    approved_at = serializers.DateTimeField(allow_null=True)
    candidate_count = serializers.IntegerField()
    best = BestCandidateSerializer(allow_null=True)
    transitions = serializers.ListField(child=serializers.IntegerField(), help_text="seqs it started")


class CandidateSerializer(BestCandidateSerializer):
    factor = serializers.FloatField()
    value_tokens_s = serializers.FloatField(allow_null=True)
    note = serializers.CharField()
    cost = serializers.JSONField(help_text="the switch cost in parts: pause_s, prepare_s, kv_migrate_bytes, "
                                           "replay_tokens, weight_load_bytes, cold_start_s, ...")
    estimate = serializers.JSONField(help_text="steady state under the offered load: capacity_rps, "
                                               "goodput_tokens_s, ttft_p99_s, tpot_p99_s, ...")
    gpu_count = serializers.IntegerField(allow_null=True)


class DecisionDetailSerializer(DecisionSerializer):
    candidates = CandidateSerializer(many=True)
    current = serializers.JSONField(help_text="the gear it started from: id, valid, value, estimate")
    workload = serializers.JSONField(allow_null=True, help_text="the offered load it decided on")
    cooldown_until = serializers.DateTimeField(allow_null=True)
    target_gear = GearDetailSerializer(allow_null=True)


class TransitionDetailSerializer(TransitionSerializer):
    steps = StepSerializer(many=True)
    from_gear_detail = GearDetailSerializer(allow_null=True)
    to_gear_detail = GearDetailSerializer()
    decision_summary = DecisionSerializer(allow_null=True)


# --- request bodies ---------------------------------------------------------------------------------
class PinSerializer(StrictSerializer):
    gear_id = serializers.CharField(max_length=40, required=False, default=CURRENT, help_text=(
        'the gear to pin: "current" (the default) or its id, which must be the gear running now - '
        "a guard against pinning a gear the operator did not see"))


class UnpinSerializer(StrictSerializer):
    mode = serializers.ChoiceField(choices=[Deployment.AUTO, Deployment.ADVISORY], required=False,
                                   default=Deployment.AUTO, help_text="the mode after the pin")


class ModeSerializer(StrictSerializer):
    mode = serializers.ChoiceField(choices=[m for m, _ in Deployment.MODES], help_text=(
        "auto: the gearbox switches; advisory: it proposes, an operator approves; pinned: the current gear "
        "is pinned"))


class LatencyCriticalSerializer(StrictSerializer):
    latency_critical = serializers.BooleanField(help_text=(
        "true: the planner keeps this deployment's plans off blocks whose fragment history says they keep "
        "shrinking (stability below 0.5); false: any block"))


class EmergencySerializer(StrictSerializer):
    reason = serializers.CharField(max_length=500, help_text="why the deployment must go back to its baseline")


class ApproveSerializer(StrictSerializer):
    pass


EmergencyResult = inline_serializer("EmergencyResult", {
    "state": serializers.ChoiceField(choices=["requested", "already_requested", "already_running",
                                              "already_on_baseline"]),
    "transition": serializers.IntegerField(allow_null=True, help_text=(
        "the running transition it asked to roll back first, or the emergency transition already running")),
    "deployment": DeploymentSerializer(),
})

NAME = OpenApiParameter("name", str, OpenApiParameter.PATH, description="the deployment's name",
                        examples=[OpenApiExample("the demo's chat deployment", value="chat-8b")])
REFUSALS = {400: OpenApiResponse(description="a field is invalid: the body names it; nothing changed"),
            403: OpenApiResponse(description="needs the operator role"),
            404: OpenApiResponse(description="no such deployment"),
            409: OpenApiResponse(description="the deployment's state refuses it: the body names the field and why")}


def _refused(exc: Rejected) -> Response:
    return refused_response(exc.status, exc.errors)


def _boolean(q: QueryParams, name: str) -> bool | None:
    value = q.choice(name, ("true", "false"))
    return None if value is None else value == "true"


def _not_nul(value: str) -> str:
    if "\x00" in value:
        raise NotFound()
    return value


# --- deployments ------------------------------------------------------------------------------------
@extend_schema_view(
    list=extend_schema(summary="Deployments", responses=DeploymentSerializer(many=True), parameters=[
        OpenApiParameter("mode", str, enum=[m for m, _ in Deployment.MODES]),
        OpenApiParameter("model", str, description="model name"),
        OpenApiParameter("pinned", bool, description="only pinned (true) or unpinned (false) deployments")]),
    retrieve=extend_schema(summary="One deployment: SLO, mode, gears, routing table, health",
                           responses=DeploymentSerializer, parameters=[NAME]),
)
class DeploymentViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):  # type: ignore[type-arg]
    serializer_class = DeploymentSerializer
    lookup_field = "name"
    lookup_value_regex = NAME_RE

    def get_permissions(self) -> list[Any]:
        operator = ("pin", "unpin", "mode", "emergency", "latency_critical")
        return [IsOperator()] if self.action in operator else [IsViewer()]

    def get_queryset(self) -> QuerySet[Deployment]:
        qs = Deployment.objects.order_by("-priority", "name")
        if self.action != "list":
            return qs
        q = QueryParams(self.request.query_params)
        mode = q.choice("mode", [m for m, _ in Deployment.MODES])
        model = q.text("model", max_len=128)
        pinned = _boolean(q, "pinned")
        q.raise_if_any()
        if mode is not None:
            qs = qs.filter(mode=mode)
        if model is not None:
            qs = qs.filter(model_name=model)
        if pinned is not None:
            qs = qs.filter(mode=Deployment.PINNED) if pinned else qs.exclude(mode=Deployment.PINNED)
        return qs

    def get_object(self) -> Deployment:
        _not_nul(self.kwargs[self.lookup_field])
        return super().get_object()  # type: ignore[no-any-return]

    def list(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        page = self.paginate_queryset(self.get_queryset())
        rows = list(page if page is not None else self.get_queryset())
        ctx = present.DeploymentContext.load(rows)
        return self.get_paginated_response([present.deployment_payload(d, ctx) for d in rows])

    def retrieve(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return Response(_deployment(self.get_object()))

    def _body(self, serializer: type[StrictSerializer]) -> dict[str, Any]:
        body = serializer(data=request_data(self.request))
        body.is_valid(raise_exception=True)
        return dict(body.validated_data)

    @extend_schema(summary="Pin a gear (operator): the gearbox never switches the deployment automatically",
                   request=PinSerializer, responses={200: DeploymentSerializer, **REFUSALS}, parameters=[NAME], description=(
                       "Pins the gear running now. `gear_id` may name it (a known gear that is not the current "
                       "one is refused with 409: switch to it first). The emergency downshift still works on a "
                       "pinned deployment. Pinning the pinned gear again changes nothing."))
    @action(detail=True, methods=["post"])
    def pin(self, request: Request, name: str | None = None) -> Response:
        dep = self.get_object()
        wanted = self._body(PinSerializer)["gear_id"]
        if wanted != CURRENT and wanted not in present.known_gears(dep.name):
            return refused_response(400, {"gear_id": f"no gear {wanted!r} is known for deployment {dep.name}: "
                                                     f'give "current" or the id of the gear running now'})
        try:
            with transaction.atomic():
                pinned = actions.do_pin_gear(dep.name, actor=request.user)
                now = present.gear_id_of(pinned.pinned_gear)
                if wanted not in (CURRENT, now):
                    # the whole pin (and its audit entry) rolls back: nothing was pinned
                    raise Rejected(409, {"gear_id": f"{wanted} is not the gear running now ({now}); the pin holds "
                                                    "the running gear: switch to it first, then pin"})
        except Rejected as exc:
            return _refused(exc)
        return Response(_deployment(pinned))

    @extend_schema(summary="Unpin (operator): back to automatic (or advisory) mode", request=UnpinSerializer,
                   responses={200: DeploymentSerializer, **REFUSALS}, parameters=[NAME])
    @action(detail=True, methods=["post"])
    def unpin(self, request: Request, name: str | None = None) -> Response:
        dep = self.get_object()
        mode = self._body(UnpinSerializer)["mode"]
        try:
            return Response(_deployment(actions.do_unpin_gear(dep.name, actor=request.user, mode=mode)))
        except Rejected as exc:
            return _refused(exc)

    @extend_schema(summary="Set the mode (operator): auto | advisory | pinned", request=ModeSerializer,
                   responses={200: DeploymentSerializer, **REFUSALS}, parameters=[NAME], description=(
                       "pinned pins the current gear (as the pin verb does); auto or advisory on a pinned "
                       "deployment unpins it."))
    @action(detail=True, methods=["post"])
    def mode(self, request: Request, name: str | None = None) -> Response:
        dep = self.get_object()
        mode = self._body(ModeSerializer)["mode"]
        try:
            if mode == Deployment.PINNED:
                dep = actions.do_pin_gear(dep.name, actor=request.user)
            elif dep.mode == Deployment.PINNED:
                dep = actions.do_unpin_gear(dep.name, actor=request.user, mode=mode)
            else:
                dep = actions.do_set_mode(dep.name, mode, actor=request.user)
        except Rejected as exc:
            return _refused(exc)
        return Response(_deployment(dep))

    @extend_schema(summary="Mark latency-critical or not (operator): its plans stay off shrinking blocks",
                   request=LatencyCriticalSerializer, responses={200: DeploymentSerializer, **REFUSALS},
                   parameters=[NAME])
    @action(detail=True, methods=["post"], url_path="latency-critical")
    def latency_critical(self, request: Request, name: str | None = None) -> Response:
        dep = self.get_object()
        value = self._body(LatencyCriticalSerializer)["latency_critical"]
        try:
            return Response(_deployment(actions.do_set_latency_critical(dep.name, value, actor=request.user)))
        except Rejected as exc:
            return _refused(exc)

    @extend_schema(summary="Emergency downshift to the baseline gear (operator; reason required; idempotent)",
                   request=EmergencySerializer, parameters=[NAME],
                   responses={202: EmergencyResult,
                              200: OpenApiResponse(EmergencyResult, description="asked before, running, or "
                                                   "already on the baseline: nothing new (audited)"),
                              **REFUSALS},
                   description=(
                       "Works in every mode, pinned included. A running transition is asked to roll back "
                       "first; then the gearbox starts the downshift as an emergency transition. Asking again "
                       "changes nothing."))
    @action(detail=True, methods=["post"])
    def emergency(self, request: Request, name: str | None = None) -> Response:
        dep = self.get_object()
        reason = self._body(EmergencySerializer)["reason"]
        try:
            out = actions.do_emergency_downshift(dep.name, reason=reason, actor=request.user)
        except Rejected as exc:
            return _refused(exc)
        dep.refresh_from_db()
        body = {"state": out.state, "transition": out.transition.seq if out.transition is not None else None,
                "deployment": _deployment(dep)}
        return Response(body, status=status.HTTP_202_ACCEPTED if out.state == "requested" else status.HTTP_200_OK)


def request_data(request: Request) -> Any:
    """The JSON body; an empty body is an empty object (every field of these verbs has a default or is
    reported missing by name)."""
    return request.data if request.body else {}


def _deployment(dep: Deployment) -> dict[str, Any]:
    return present.deployment_payload(dep, present.DeploymentContext.load([dep]))


# --- gears and plans --------------------------------------------------------------------------------
@extend_schema_view(
    list=extend_schema(summary="Gears the deployments run, ran, were asked to run or were advised",
                       responses=GearSerializer(many=True), parameters=[
                           OpenApiParameter("deployment", str), OpenApiParameter("model", str),
                           OpenApiParameter("role", str, enum=list(present.GEAR_ROLES))]),
    retrieve=extend_schema(summary="One gear: its plans with their stages on GPUs", responses=GearDetailSerializer),
)
class GearViewSet(viewsets.GenericViewSet):  # type: ignore[type-arg]
    serializer_class = GearSerializer
    lookup_field = "gear_id"
    lookup_value_regex = GEAR_ID_RE

    def list(self, request: Request) -> Response:
        q = QueryParams(request.query_params)
        deployment = q.text("deployment", max_len=64)
        model = q.text("model", max_len=128)
        role = q.choice("role", present.GEAR_ROLES)
        q.raise_if_any()
        gears = [g for g in present.known_gears(deployment).values()
                 if (model is None or g.gear.model == model)
                 and (role is None or any(role in roles for roles in g.roles.values()))]
        gears.sort(key=lambda g: (g.last_at is None, -(g.last_at.timestamp() if g.last_at else 0), g.gear.gear_id))
        page = self.paginate_queryset(gears)
        return self.get_paginated_response([present.known_gear_payload(g) for g in page or []])

    def retrieve(self, request: Request, gear_id: str | None = None) -> Response:
        entry = present.known_gears().get(str(gear_id))
        if entry is None:
            raise NotFound(f"no gear {gear_id}")
        return Response(present.known_gear_payload(entry, present.fleet_view(with_blocks=True), detail=True))


@extend_schema_view(
    list=extend_schema(summary="Plans of the known gears, with their stages on GPUs and routes",
                       responses=PlanSerializer(many=True), parameters=[
                           OpenApiParameter("deployment", str), OpenApiParameter("gear", str),
                           OpenApiParameter("mode", str, enum=["colocated", "disaggregated"]),
                           OpenApiParameter("routed", bool, description="only plans a routing table sends "
                                                                        "requests to (true) or not (false)")]),
    retrieve=extend_schema(summary="One plan", responses=PlanSerializer),
)
class PlanViewSet(viewsets.GenericViewSet):  # type: ignore[type-arg]
    serializer_class = PlanSerializer
    lookup_field = "plan_id"
    lookup_value_regex = PLAN_ID_RE

    def list(self, request: Request) -> Response:
        q = QueryParams(request.query_params)
        deployment = q.text("deployment", max_len=64)
        gear = q.text("gear", max_len=40)
        mode = q.choice("mode", ("colocated", "disaggregated"))
        routed = _boolean(q, "routed")
        q.raise_if_any()
        routes = present.routes_by_plan()
        plans = [p for p in present.known_plans(present.known_gears(deployment)).values()
                 if (gear is None or gear in p.gears) and (mode is None or p.plan.mode == mode)
                 and (routed is None or routed == bool(routes.get(p.plan.plan_id)))]
        plans.sort(key=lambda p: p.plan.plan_id)
        page = self.paginate_queryset(plans) or []
        fleet = present.fleet_view(with_blocks=True) if page else None
        return self.get_paginated_response([present.known_plan_payload(p, routes, fleet) for p in page])

    def retrieve(self, request: Request, plan_id: str | None = None) -> Response:
        entry = present.known_plans(present.known_gears()).get(str(plan_id))
        if entry is None:
            raise NotFound(f"no plan {plan_id}")
        return Response(present.known_plan_payload(entry, present.routes_by_plan(), present.fleet_view()))


# --- transitions ------------------------------------------------------------------------------------
@extend_schema_view(
    list=extend_schema(summary="Transitions, newest first", responses=TransitionSerializer(many=True), parameters=[
        OpenApiParameter("deployment", str), OpenApiParameter("phase", str, enum=list(PHASES)),
        OpenApiParameter("active", bool, description="only running (true) or finished (false) transitions"),
        OpenApiParameter("kind", str, enum=[k for k, _ in Transition.KINDS]),
        OpenApiParameter("decision", int, description="the decision that caused it"),
        OpenApiParameter("since", OpenApiTypes.DATETIME, description="created at or after"),
        OpenApiParameter("until", OpenApiTypes.DATETIME, description="created before")]),
    retrieve=extend_schema(summary="One transition: phases, steps, timings and what moved",
                           responses=TransitionDetailSerializer),
)
class TransitionViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):  # type: ignore[type-arg]
    serializer_class = TransitionSerializer
    lookup_value_regex = r"[0-9]{1,18}"

    def get_queryset(self) -> QuerySet[Transition]:
        qs = present.transitions_with_steps().order_by("-id")
        if self.action != "list":
            return qs  # type: ignore[no-any-return]
        q = QueryParams(self.request.query_params)
        deployment = q.text("deployment", max_len=64)
        phase = q.choice("phase", PHASES)
        active = _boolean(q, "active")
        kind = q.choice("kind", [k for k, _ in Transition.KINDS])
        decision = q.integer("decision", low=1)
        since = q.datetime("since")
        until = q.datetime("until")
        if since and until and since >= until:
            q.fail("until", "must be later than since")
        q.raise_if_any()
        filters = {"deployment__name": deployment, "phase": phase, "kind": kind, "decision_id": decision,
                   "created_at__gte": since, "created_at__lt": until}
        qs = qs.filter(**{k: v for k, v in filters.items() if v is not None})
        if active is not None:
            qs = qs.filter(phase__in=ACTIVE_PHASES) if active else qs.exclude(phase__in=ACTIVE_PHASES)
        return qs  # type: ignore[no-any-return]

    def list(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        page = self.paginate_queryset(self.get_queryset()) or []
        return self.get_paginated_response([present.transition_payload(t) for t in page])

    def retrieve(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        t = self.get_object()
        return Response(present.transition_payload(t, detail=True, fleet=present.fleet_view()))


# --- decisions --------------------------------------------------------------------------------------
@extend_schema_view(
    list=extend_schema(summary="Every gearbox decision, switch or not, newest first",
                       responses=DecisionSerializer(many=True), parameters=[
                           OpenApiParameter("deployment", str),
                           OpenApiParameter("outcome", str, enum=[o.value for o in Outcome]),
                           OpenApiParameter("trigger", str, enum=[t.value for t in Trigger]),
                           OpenApiParameter("approval", str, enum=list(APPROVALS)),
                           OpenApiParameter("since", OpenApiTypes.DATETIME, description="decided at or after"),
                           OpenApiParameter("until", OpenApiTypes.DATETIME, description="decided before")]),
    retrieve=extend_schema(summary="One decision: trigger, candidates with gain, cost and factor, outcome, reasons",
                           responses=DecisionDetailSerializer),
)
class DecisionViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):  # type: ignore[type-arg]
    serializer_class = DecisionSerializer
    lookup_value_regex = r"[0-9]{1,18}"

    def get_permissions(self) -> list[Any]:
        return [IsOperator()] if self.action == "approve" else [IsViewer()]

    def get_queryset(self) -> QuerySet[Decision]:
        qs = present.decisions_with_links().order_by("-id")
        if self.action != "list":
            return qs  # type: ignore[no-any-return]
        q = QueryParams(self.request.query_params)
        deployment = q.text("deployment", max_len=64)
        outcome = q.choice("outcome", [o.value for o in Outcome])
        trigger = q.choice("trigger", [t.value for t in Trigger])
        approval = q.choice("approval", APPROVALS)
        since = q.datetime("since")
        until = q.datetime("until")
        if since and until and since >= until:
            q.fail("until", "must be later than since")
        q.raise_if_any()
        filters = {"deployment__name": deployment, "outcome": outcome, "trigger": trigger, "at__gte": since,
                   "at__lt": until, "approval": None if approval is None else ("" if approval == "none" else approval)}
        return qs.filter(**{k: v for k, v in filters.items() if v is not None})  # type: ignore[no-any-return]

    def list(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        page = self.paginate_queryset(self.get_queryset()) or []
        return self.get_paginated_response([present.decision_payload(d) for d in page])

    def retrieve(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return Response(present.decision_payload(self.get_object(), detail=True, fleet=present.fleet_view()))

    @extend_schema(summary="Approve an advised decision (operator): start the transition it proposes",
                   request=ApproveSerializer, responses={201: TransitionSerializer, **REFUSALS}, description=(
                       "Only a decision waiting for approval (advisory mode) can be approved, and only while it "
                       "still fits: the deployment has not changed gear since, no transition runs, and the "
                       "advised gear is still valid on the fleet. Otherwise 409 naming `decision` or "
                       "`deployment`."))
    @action(detail=True, methods=["post"])
    def approve(self, request: Request, pk: str | None = None) -> Response:
        decision = self.get_object()
        body = ApproveSerializer(data=request_data(request))
        body.is_valid(raise_exception=True)
        try:
            started = actions.do_approve_decision(decision.pk, actor=request.user)
        except Rejected as exc:
            return _refused(exc)
        row = present.transitions_with_steps().get(pk=started.pk)
        return Response(present.transition_payload(row), status=status.HTTP_201_CREATED)
