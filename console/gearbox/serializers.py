"""The gearbox API's shapes: the payloads it answers (described for the OpenAPI schema; the data itself
comes from console.gearbox.present, which the pages and websockets read too) and the request bodies
of the operator verbs (StrictSerializer: an unknown key is a 400 naming it). console/gearbox/api.py
holds the views."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import OpenApiExample, OpenApiParameter, OpenApiResponse, inline_serializer
from rest_framework import serializers

from console.api.serializers import StrictSerializer
from console.gearbox import emergency, present
from console.gearbox.models import PHASES, Deployment, Transition
from scheduler.gearbox import Outcome, Trigger

NAME_RE = r"[^/]{1,64}"
GEAR_ID_RE = r"g-[0-9a-f]{16}"
PLAN_ID_RE = r"p-[0-9a-f]{16}"
CURRENT = "current"
APPROVALS = ("pending", "approved", "superseded", "none")
OPERATOR_VERBS = ("pin", "unpin", "mode", "emergency", "release", "override", "baseline", "rollout", "destroy",
                  "latency_critical", "create", "partial_update")


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


class GearValueSerializer(PayloadSerializer):
    """What a gear is (its content), whoever uses it."""

    gear_id = serializers.CharField()
    model = serializers.CharField()
    shape = serializers.CharField()
    gpu_count = serializers.IntegerField()
    weights = serializers.ListField(child=serializers.FloatField())


class GearSerializer(GearValueSerializer):
    plans = PlanRefSerializer(many=True)
    deployments = GearUseSerializer(many=True)
    last_seen_at = serializers.DateTimeField(allow_null=True)


class GearDetailSerializer(GearSerializer):
    plans = GearPlanSerializer(many=True)  # type: ignore[assignment]


class GearContentSerializer(GearValueSerializer):
    """A gear as a value with its plans in full (present.gear_detail): not who uses it."""

    plans = GearPlanSerializer(many=True)


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
    replicas = inline_serializer("Replicas", {"min": serializers.IntegerField(), "max": serializers.IntegerField()},
                                 help_text="the bounds the pool scales it within (min 0: it may scale to zero)")
    idle_to_zero_s = serializers.FloatField(allow_null=True, help_text=(
        "seconds without requests after which it releases its GPUs; null: never"))
    created_by = serializers.CharField(allow_null=True, help_text="who created it (null: a scenario file)")
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
    deleting_since = serializers.DateTimeField(allow_null=True, help_text="draining before it is deleted")
    zero_since = serializers.DateTimeField(allow_null=True, help_text=(
        "scaled to zero since (its gear released after idle_to_zero_s; its next request wakes it); null: not"))
    last_transition_seq = serializers.IntegerField()
    health = inline_serializer("Health", {"state": serializers.ChoiceField(choices=present.HEALTH_STATES),
                                          "reasons": serializers.ListField(child=serializers.CharField())})
    serving = serializers.JSONField(allow_null=True, help_text=(
        "the engines' latest reports for the routed plans: tokens_per_s, running, waiting (summed), "
        "ttft_p50_ms, ttft_p95_ms, tpot_p95_ms, kv_usage (worst), reported_at"))
    twu = serializers.JSONField(allow_null=True, help_text=(
        "token-weighted utilisation over the engines' latest report intervals (scheduler/pool/twu.py): value "
        "(GPU-weighted over its plans; null: none reported) and plans [{plan_id, twu, prefill, decode}]; null: it "
        "runs nothing"))
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
    at = serializers.DateTimeField(help_text="decided at (the first tick of a run of repeats)")
    repeats = serializers.IntegerField(help_text='ticks that decided this, the first included: a "stay" that '
                                                 "repeats the last decision is counted here, not stored again")
    last_at = serializers.DateTimeField(help_text="the last tick that decided this")
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
    target_gear = GearContentSerializer(allow_null=True)


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
    mode = serializers.ChoiceField(choices=[Deployment.AUTO, Deployment.ADVISORY, Deployment.PINNED], help_text=(
        "auto: the gearbox switches; advisory: it proposes, an operator approves; pinned: the current gear "
        "is pinned"))


class LatencyCriticalSerializer(StrictSerializer):
    latency_critical = serializers.BooleanField(help_text=(
        "true: the planner keeps this deployment's plans off blocks whose fragment history says they keep "
        "shrinking (stability below 0.5); false: any block"))


class EmergencySerializer(StrictSerializer):
    reason = serializers.CharField(max_length=500, help_text="why the deployment must go back to its baseline")
    gear_id = serializers.RegexField(f"^{GEAR_ID_RE}$", required=False, help_text=(
        "the emergency target when the baseline cannot run: the id of a gear a blocked request offered "
        "(the planner's best safe gear); omitted: the baseline"))


class GearChoiceSerializer(StrictSerializer):
    gear_id = serializers.CharField(max_length=40, required=False, help_text=(
        "one of the planner's current candidates (GET .../candidates); for the baseline also \"current\""))
    spec = serializers.JSONField(required=False, help_text=(
        "the gear written out: {plans: [{stages: [{gpus: [\"h100-a/0\", ...], tp, layers}], decode_stages, "
        "kv_reserve_tokens}], weights} (console/gearbox/override.py)"))


class FiniteFloatField(serializers.FloatField):
    """A JSON number as a float; one too large for a float is a 400 like any bad value, not a 500."""

    def to_internal_value(self, data: Any) -> float:
        if isinstance(data, bool) or not isinstance(data, int | float):
            self.fail("invalid")
        try:
            return float(super().to_internal_value(data))
        except OverflowError:
            self.fail("invalid")


class StrictIntegerField(serializers.IntegerField):
    """A JSON integer only: DRF's IntegerField also takes "5" and 5.0, which the schema calls invalid."""

    def to_internal_value(self, data: Any) -> int:
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("invalid")
        return int(super().to_internal_value(data))


class DeploymentChangeSerializer(StrictSerializer):
    """What PATCH may change (every field optional; the others stay)."""

    ttft_ms = FiniteFloatField(required=False, help_text="time-to-first-token objective, ms (> 0)")
    tpot_ms = FiniteFloatField(required=False, help_text="time-per-output-token objective, ms (> 0)")
    priority = StrictIntegerField(required=False, min_value=-1000, max_value=1000,
                                        help_text="higher is served first when deployments compete for GPUs")
    min_replicas = StrictIntegerField(required=False, min_value=0, max_value=256, help_text=(
        "fewest replicas the pool keeps (0: it may scale to zero)"))
    max_replicas = StrictIntegerField(required=False, min_value=1, max_value=256, help_text=(
        "most replicas the pool scales it to (>= min_replicas)"))
    idle_to_zero_s = FiniteFloatField(required=False, allow_null=True, help_text=(
        "seconds without requests after which it releases its GPUs (needs min_replicas 0); null: never"))


class DeploymentCreateSerializer(DeploymentChangeSerializer):
    name = serializers.CharField(max_length=64, help_text="its name: letters, digits, '.', '_', '-'")
    model_version = StrictIntegerField(min_value=1, max_value=2**62, help_text=(
        "the registry version (its id) it serves: verified, or awaiting its first agent's hash"))
    ttft_ms = FiniteFloatField(help_text="time-to-first-token objective, ms (> 0)")
    tpot_ms = FiniteFloatField(help_text="time-per-output-token objective, ms (> 0)")
    baseline_gear = serializers.JSONField(required=False, default="auto", help_text=(
        '"auto" (the default): the planner\'s best gear that fits the fleet now; or the gear written out as an '
        "override's spec: {plans: [{stages: [{gpus: [\"h100-a/0\", ...], tp, layers}], kv_reserve_tokens}], "
        "weights}. Either is checked against invariant 4 on the fleet now; it is the emergency target"))
    mode = serializers.ChoiceField(choices=[Deployment.AUTO, Deployment.ADVISORY], required=False,
                                   default=Deployment.AUTO, help_text="auto: the gearbox switches; advisory: it "
                                                                      "proposes, an operator approves")
    latency_critical = serializers.BooleanField(required=False, default=False, help_text=(
        "keep its plans off blocks that keep shrinking"))


class OverrideSerializer(GearChoiceSerializer):
    reason = serializers.CharField(max_length=500, required=False, allow_blank=True, default="",
                                   help_text="why (audited)")


class RolloutSerializer(GearChoiceSerializer):
    version = serializers.IntegerField(min_value=1, max_value=2**62, help_text=(
        "the registry version (its id) to roll out; a version of the deployment's model"))
    gear_id = serializers.CharField(max_length=40, required=False, help_text=(  # type: ignore[assignment]
        "where the new version's shadow plans run: a candidate's id (omitted: the planner's best safe gear on "
        "GPUs the running gear does not hold)"))


class ReleaseSerializer(StrictSerializer):
    mode = serializers.ChoiceField(choices=[Deployment.AUTO, Deployment.ADVISORY, Deployment.PINNED], required=False,
                                   default=Deployment.AUTO, help_text="the mode after the emergency (pinned: pin "
                                                                      "the gear running now)")


class ApproveSerializer(StrictSerializer):
    pass


EmergencyResult = inline_serializer("EmergencyResult", {
    "state": serializers.ChoiceField(choices=[s for s in emergency.STATES if s != "blocked"]),
    "transition": serializers.IntegerField(allow_null=True, help_text=(
        "the running transition it asked to roll back first, or the emergency transition already running")),
    "deployment": DeploymentSerializer(),
    "queued": serializers.ListField(child=serializers.CharField(), required=False, help_text=(
        "only when the task broker (Redis) did not answer: the request is stored and these tasks are "
        "queued when the broker is back (console.celery.enqueue)")),
})

NAME = OpenApiParameter("name", str, OpenApiParameter.PATH, description="the deployment's name",
                        examples=[OpenApiExample("the demo's chat deployment", value="chat-8b")])
EmergencyBlocked = inline_serializer("EmergencyBlocked", {
    "emergency": serializers.ListField(child=serializers.CharField(), help_text="why, then what to do"),
    "decision": serializers.IntegerField(help_text="the blocked decision, recorded and audited"),
    "offers": serializers.ListField(child=serializers.JSONField(), help_text=(
        "the planner's best safe gears, best first: gear_id, name, label, meets_slo, estimate - not the "
        "baseline; ask again with gear_id to take one")),
})
REFUSALS = {400: OpenApiResponse(description="a field is invalid: the body names it; nothing changed"),
            403: OpenApiResponse(description="needs the operator role"),
            404: OpenApiResponse(description="no such deployment"),
            409: OpenApiResponse(description="the deployment's state refuses it: the body names the field and why")}
