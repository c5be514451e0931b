"""REST API of the gearbox: deployments, gears, plans, transitions and decisions, and the operator verbs.

Reading needs the viewer role. The verbs - pin, unpin, mode, emergency on a deployment, approve on a
decision - need the operator role (admins have it too) and call console.gearbox.actions (each one
transaction, audited with the caller as actor). A body with an unknown or bad field is a 400 that
names it and changes nothing; a verb the deployment's state refuses is a 409 that says why.

The payloads come from console.gearbox.present (the pages and their websockets show the same
shapes); console/gearbox/serializers.py describes them for the OpenAPI schema, with the request bodies.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models import QuerySet
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
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

from console.accounts.auth import IsAdmin, IsOperator, IsViewer
from console.api.params import QueryParams
from console.api.serializers import StrictSerializer, refused_response
from console.celery import watching_broker
from console.fleet.actions import Rejected
from console.gearbox import actions, emergency, lifecycle, override, present, rollout
from console.gearbox.api_lifecycle import DeploymentWrites, request_data
from console.gearbox.api_lifecycle import deployment_body as _deployment
from console.gearbox.models import ACTIVE_PHASES, PHASES, Decision, Deployment, Transition
from console.gearbox.serializers import (
    APPROVALS,
    CURRENT,
    GEAR_ID_RE,
    NAME,
    NAME_RE,
    OPERATOR_VERBS,
    PLAN_ID_RE,
    REFUSALS,
    ApproveSerializer,
    DecisionDetailSerializer,
    DecisionSerializer,
    DeploymentSerializer,
    EmergencyBlocked,
    EmergencyResult,
    EmergencySerializer,
    GearChoiceSerializer,
    GearDetailSerializer,
    GearSerializer,
    LatencyCriticalSerializer,
    ModeSerializer,
    OverrideSerializer,
    PinSerializer,
    PlanSerializer,
    ReleaseSerializer,
    RolloutSerializer,
    TransitionDetailSerializer,
    TransitionSerializer,
    UnpinSerializer,
)
from scheduler.gearbox import Outcome, Trigger


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
class DeploymentViewSet(DeploymentWrites, mixins.ListModelMixin, mixins.RetrieveModelMixin,  # type: ignore[type-arg]
                        mixins.DestroyModelMixin, viewsets.GenericViewSet):
    serializer_class = DeploymentSerializer
    lookup_field = "name"
    lookup_value_regex = NAME_RE

    def get_permissions(self) -> list[Any]:
        if self.action == "destroy":
            return [IsAdmin()]
        return [IsOperator()] if self.action in OPERATOR_VERBS else [IsViewer()]

    def get_queryset(self) -> QuerySet[Deployment]:
        qs = Deployment.objects.select_related("created_by").order_by("-priority", "name")
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

    @extend_schema(summary="Delete a deployment (admin): at once when nothing of it runs, else drained first",
                   parameters=[NAME], request=None,
                   responses={204: OpenApiResponse(description="deleted"),
                              202: inline_serializer("DeploymentDraining", {
                                  "state": serializers.ChoiceField(choices=["draining"])}),
                              403: OpenApiResponse(description="needs the admin role"), 404: REFUSALS[404],
                              409: OpenApiResponse(description="a transition runs: the body names it")},
                   description=(
                       "Draining: the routing table is emptied (no new request), each live plan is released with "
                       "the drain budget (what cannot finish ends with an explicit error), and the row goes once "
                       "the releases are acknowledged. Its audit entries stay. Asking again while it drains "
                       "answers 202 again."))
    def destroy(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        dep = self.get_object()
        try:
            state = lifecycle.do_delete_deployment(dep.name, actor=request.user)
        except Rejected as exc:
            return _refused(exc)
        if state == "deleted":
            return Response(status=status.HTTP_204_NO_CONTENT)
        return Response({"state": state}, status=status.HTTP_202_ACCEPTED)

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
                                                   "already there (now held): nothing new (audited)"),
                              409: OpenApiResponse(EmergencyBlocked, description=(
                                  "blocked: the target cannot run on the fleet now. Nothing changed but the "
                                  "recorded decision; the body says why, what to do, and offers safe gears")),
                              **{k: v for k, v in REFUSALS.items() if k != 409}},
                   description=(
                       "Works in every mode, pinned included. The deployment enters mode emergency at once and "
                       "holds the target - the gearbox never switches it automatically - until an operator "
                       "releases it (release). A running transition is asked to roll back first; then the "
                       "gearbox starts the downshift as an emergency transition. Asking again changes nothing."))
    @action(detail=True, methods=["post"])
    def emergency(self, request: Request, name: str | None = None) -> Response:
        dep = self.get_object()
        body = self._body(EmergencySerializer)
        try:
            with watching_broker() as deferred:
                out = emergency.do_emergency_downshift(dep.name, reason=body["reason"], actor=request.user,
                                                       gear_id=body.get("gear_id"))
        except Rejected as exc:
            return _refused(exc)
        if out.state == "blocked":
            assert out.decision is not None
            return Response({"emergency": list(out.reasons), "decision": out.decision.pk, "offers": list(out.offers)},
                            status=status.HTTP_409_CONFLICT)
        dep.refresh_from_db()
        body = {"state": out.state, "transition": out.transition.seq if out.transition is not None else None,
                "deployment": _deployment(dep)}
        if deferred:
            body["queued"] = sorted(set(deferred))
        return Response(body, status=status.HTTP_202_ACCEPTED if out.state == "requested" else status.HTTP_200_OK)

    @extend_schema(summary="Release an emergency (operator): hand the gear back to auto, advisory or a pin",
                   request=ReleaseSerializer, responses={200: DeploymentSerializer, **REFUSALS}, parameters=[NAME],
                   description="409 when the deployment holds no emergency downshift.")
    @action(detail=True, methods=["post"])
    def release(self, request: Request, name: str | None = None) -> Response:
        dep = self.get_object()
        mode = self._body(ReleaseSerializer)["mode"]
        try:
            return Response(_deployment(emergency.do_release_emergency(dep.name, actor=request.user, mode=mode)))
        except Rejected as exc:
            return _refused(exc)


    @extend_schema(summary="The planner's candidate gears now, with their estimates (what an override chooses from)",
                   parameters=[NAME], responses={200: inline_serializer("Candidates", {
                       "deployment": serializers.CharField(), "current_gear_id": serializers.CharField(allow_null=True),
                       "workload": serializers.JSONField(allow_null=True, help_text="the offered load estimated on"),
                       "candidates": serializers.ListField(child=serializers.JSONField(), help_text=(
                           "best first: gear_id, name (shape and placement), gpu_count, meets_slo, gain_tokens, "
                           "threshold_tokens, estimate {goodput_tokens_s, capacity_rps, ttft_p99_s, tpot_p99_s, ...}"))})})
    @action(detail=True, methods=["get"])
    def candidates(self, request: Request, name: str | None = None) -> Response:
        dep = self.get_object()
        d = override.candidates_now(dep)
        return Response({"deployment": dep.name, "current_gear_id": d.current_gear_id,
                         "workload": d.workload.to_dict() if d.workload else None,
                         "candidates": override.candidate_payloads(d)})

    @extend_schema(summary="Gear override (operator): switch to a chosen gear as a transition, then pin it",
                   request=OverrideSerializer, parameters=[NAME],
                   responses={201: TransitionSerializer, **REFUSALS}, description=(
                       "Exactly one of gear_id (a current candidate) and spec. The gear is checked against "
                       "invariant 4 on the fleet now (400 naming the field, with the reasons); a candidate that "
                       "is no longer one, a running transition or an emergency is a 409. The deployment is "
                       "pinned to the target at once; the manual transition and the override are audited."))
    @action(detail=True, methods=["post"])
    def override(self, request: Request, name: str | None = None) -> Response:
        dep = self.get_object()
        body = self._body(OverrideSerializer)
        try:
            _, started = override.do_override_gear(dep.name, actor=request.user, gear_id=body.get("gear_id"),
                                                   spec=body.get("spec"), reason=body["reason"])
        except Rejected as exc:
            return _refused(exc)
        row = present.transitions_with_steps().get(pk=started.pk)
        return Response(present.transition_payload(row), status=status.HTTP_201_CREATED)

    @extend_schema(summary="Set the baseline gear (operator): the emergency target from now on; nothing switches",
                   request=GearChoiceSerializer, parameters=[NAME], responses={200: DeploymentSerializer, **REFUSALS},
                   description=("gear_id: \"current\" or a current candidate; or spec. Checked against invariant 4 "
                                "like an override. The scenario loader never overwrites a baseline an operator set."))
    @action(detail=True, methods=["post"])
    def baseline(self, request: Request, name: str | None = None) -> Response:
        dep = self.get_object()
        body = self._body(GearChoiceSerializer)
        try:
            dep = override.do_set_baseline(dep.name, actor=request.user, gear_id=body.get("gear_id"),
                                           spec=body.get("spec"))
        except Rejected as exc:
            return _refused(exc)
        return Response(_deployment(dep))


    @extend_schema(summary="Roll a registry version out (operator): a transition with the canary, or a binding "
                           "when nothing runs yet", request=RolloutSerializer, parameters=[NAME],
                   responses={201: TransitionSerializer,
                              200: OpenApiResponse(inline_serializer("RolloutBound", {
                                  "state": serializers.ChoiceField(choices=["bound", "already_serving"]),
                                  "deployment": DeploymentSerializer()}), description=(
                                  "nothing ran yet (bound: its first gear loads it), or it serves it already")),
                              **REFUSALS},
                   description=(
                       "Registering a version changes nothing that serves; this does. The new version comes up "
                       "as shadow plans beside the running gear (weights checked against its SHA-256, its "
                       "tokenizer and warm-up checked on the shadow plan), takes the canary share, then every "
                       "request; a failed check or step rolls back and the old version keeps serving. 400: a "
                       "version of another model; 404: no such version; 409: not loadable (quarantined, retired, "
                       "verifying), a running transition, an emergency, or no room beside the running gear."))
    @action(detail=True, methods=["post"])
    def rollout(self, request: Request, name: str | None = None) -> Response:
        dep = self.get_object()
        body = self._body(RolloutSerializer)
        try:
            state, started = rollout.do_rollout_version(dep.name, body["version"], actor=request.user,
                                                        gear_id=body.get("gear_id"), spec=body.get("spec"))
        except Rejected as exc:
            return _refused(exc)
        if started is not None:
            row = present.transitions_with_steps().get(pk=started.pk)
            return Response(present.transition_payload(row), status=status.HTTP_201_CREATED)
        dep.refresh_from_db()
        return Response({"state": state, "deployment": _deployment(dep)})


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
        OpenApiParameter("decision", {"type": "integer", "minimum": 1}, description="the decision that caused it"),
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
            with watching_broker() as deferred:
                started = actions.do_approve_decision(decision.pk, actor=request.user)
        except Rejected as exc:
            return _refused(exc)
        row = present.transitions_with_steps().get(pk=started.pk)
        resp = Response(present.transition_payload(row), status=status.HTTP_201_CREATED)
        if deferred:  # stored; its first step is taken when the broker is back (console.celery.enqueue)
            resp["X-FlexPipe-Queued"] = ",".join(sorted(set(deferred)))
        return resp
