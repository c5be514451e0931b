"""Gearbox metrics: the gear as a first-class monitored object (seed 000, section 6.2).

State read from the gearbox's rows at scrape time (like collectors.py): every web process answers
the same, and a restart loses nothing. One or two queries per family; a scrape stays cheap.

    flexpipe_deployment_plan_info{deployment, plan_id, gear}   1 per plan of a deployment's current gear
                                                               (gear: its gear id)
    flexpipe_deployment_gear{deployment}                       the gear number: the seq of the transition
                                                               that brought the current gear up (0: none
                                                               yet) - it steps at every gear change
    flexpipe_deployment_pinned{deployment}                     1 while pinned or holding an emergency downshift
    flexpipe_deployment_routing_version{deployment}            the routing table's version
    flexpipe_transition_phase{deployment, phase}               1 for the phase of the running transition
                                                               (prepare | switch | cleanup | rollback),
                                                               or for idle; 0 for the others
    flexpipe_switch_duration_seconds{deployment}               histogram of finished switches (phase done:
                                                               from creation to the end of CLEANUP)
    flexpipe_migration_queue_length{deployment}                KV migrations waiting: sequences the running
                                                               move step migrates whose command the agent
                                                               has not acknowledged yet
    flexpipe_shadow_plan_status{deployment, status}            1 for the status of the shadow plan (the new
                                                               plans of the running transition): none |
                                                               preparing | ready | canary | promoted |
                                                               rolling_back; 0 for the others
    flexpipe_decisions_total{deployment, outcome, reason}      decisions counted from their rows; reason is
                                                               what triggered the decision (periodic |
                                                               topology | load | emergency | manual)
    flexpipe_decisions_pending_approval{deployment}            advised decisions waiting for an operator
    flexpipe_transition_kv_migrated_bytes_total{deployment}    what moved: KV bytes migrated ...
    flexpipe_transition_tokens_replayed_total{deployment}      ... against tokens replayed (all transitions)

Inputs of the alert rules (deploy/prometheus/alerts.yml; AlertInputsCollector, apart so the rules'
evaluation collects only them): gauges over a window the exporter fixes, so that the console's own
evaluation of the rules (console/metrics/alerts.py) needs no history:
    flexpipe_transition_overdue_seconds{deployment}            how far the running transition's current
                                                               step is past its deadline (its start, or
                                                               retry time, plus its timeout); 0 when idle
                                                               or within the deadline
    flexpipe_deployment_transitions_recent{deployment}         transitions started within the gearbox's
                                                               flap window (scheduler.gearbox
                                                               DEFAULT_CONFIG.flap_window_s, 30 min)
    flexpipe_deployment_slo_violation_ratio{deployment}        share of the serving samples of the last
                                                               SLO_WINDOW_S (5 min) whose worst P95 TTFT
                                                               or TPOT was above the deployment's SLO;
                                                               no series without samples in the window
    flexpipe_spillover_timeouts_recent{deployment, plan_id}    spilled requests (KV spillover, scheduler/
                                                               router/spillover.py) that timed out waiting
                                                               at that plan in the last SPILL_WINDOW_S
                                                               (5 min), stamped in Redis by every gateway
                                                               process (console/gateway/routing.py)
    flexpipe_kv_pool_free_ratio{deployment, plan_id, node}     free share of a plan's KV cache on a node:
                                                               1 - the kv_usage its engine last reported
                                                               (agents/protocol/ EngineReport), for the
                                                               plans of the deployment's current gear

Token-weighted utilisation (scheduler/pool/twu.py; console/gearbox/present_twu.py reads it from the
engines' latest reports, the same figures the Overview's heatmap and the deployment page show):
    flexpipe_gpu_twu{gpu, node}                                TWU of each GPU a reporting plan runs on
                                                               (plans sharing a GPU summed)
    flexpipe_deployment_twu{deployment}                        GPU-weighted TWU of the deployment's plans;
                                                               no series while none of them has reported
    flexpipe_pool_twu                                          mean TWU over the pool's GPUs (twu.pool_gpus:
                                                               a free GPU counts 0); the soft limits' input
    flexpipe_pool_admission_share{model}                       each served model's admission share under the
                                                               soft limits (FLEXPIPE_POOL_MODEL_WEIGHTS;
                                                               autoscale.admission_shares, the loop's rule 14)
    flexpipe_pool_weight_factor{model}                         ... and the factor its weight is scaled by now
                                                               (1 at or under the soft limit)
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from django.db.models import Count, DurationField, ExpressionWrapper, F, Max, Q, Sum
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from console.metrics.collectors import Described

SWITCH_DURATION_BUCKETS_S = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)
SLO_WINDOW_S = 300.0  # the SLO violation ratio's window
SPILL_WINDOW_S = 300.0  # the spillover timeouts' window (the alert's "last 5 min")
PHASE_VALUES = ("prepare", "switch", "cleanup", "rollback", "idle")


def _deployments() -> tuple[list[Any], dict[int, Any]]:
    """The deployments (the columns the families read) and their running transitions."""
    from console.gearbox.models import ACTIVE_PHASES, Deployment, Transition

    deps = list(Deployment.objects.order_by("name").only(
        "name", "mode", "current_gear", "routing_version", "last_transition_seq", "load_window", "model_name",
        "model_version"))
    return deps, {t.deployment_id: t for t in Transition.objects.filter(phase__in=ACTIVE_PHASES)}


class GearboxCollector(Described):
    """The gears, transitions, decisions and TWU (module docstring)."""

    families = (("flexpipe_deployment_plan_info", "gauge"), ("flexpipe_deployment_gear", "gauge"),
                ("flexpipe_deployment_pinned", "gauge"), ("flexpipe_deployment_routing_version", "gauge"),
                ("flexpipe_transition_phase", "gauge"), ("flexpipe_migration_queue_length", "gauge"),
                ("flexpipe_shadow_plan_status", "gauge"), ("flexpipe_router_rollout_share", "gauge"),
                ("flexpipe_gpu_twu", "gauge"), ("flexpipe_deployment_twu", "gauge"), ("flexpipe_pool_twu", "gauge"),
                ("flexpipe_pool_admission_share", "gauge"), ("flexpipe_pool_weight_factor", "gauge"),
                ("flexpipe_switch_duration_seconds", "histogram"), ("flexpipe_decisions", "counter"),
                ("flexpipe_decisions_pending_approval", "gauge"), ("flexpipe_transition_kv_migrated_bytes", "counter"),
                ("flexpipe_transition_tokens_replayed", "counter"))

    def collect(self) -> Iterator[Metric]:
        from console.gearbox import present
        from console.gearbox.models import Deployment, Transition

        deps, active = _deployments()
        latest_done = dict(Transition.objects.filter(phase="done").values("deployment_id")
                           .annotate(seq=Max("seq")).values_list("deployment_id", "seq"))

        info = GaugeMetricFamily("flexpipe_deployment_plan_info",
                                 "1 per plan of the deployment's current gear", labels=["deployment", "plan_id", "gear"])
        gear = GaugeMetricFamily("flexpipe_deployment_gear", "Gear number: the seq of the transition that brought "
                                 "the current gear up (0: nothing runs yet)", labels=["deployment"])
        pinned = GaugeMetricFamily("flexpipe_deployment_pinned", "1 while the deployment is pinned (or holds an "
                                   "emergency downshift: never switched automatically)",
                                   labels=["deployment"])
        routing = GaugeMetricFamily("flexpipe_deployment_routing_version", "Version of the deployment's routing table",
                                    labels=["deployment"])
        phase = GaugeMetricFamily("flexpipe_transition_phase", "1 for the phase of the running transition (or idle)",
                                  labels=["deployment", "phase"])
        queue = GaugeMetricFamily("flexpipe_migration_queue_length", "KV migrations waiting in the running move step",
                                  labels=["deployment"])
        shadow = GaugeMetricFamily("flexpipe_shadow_plan_status", "1 for the status of the shadow plan "
                                   "(the running transition's new plans)", labels=["deployment", "status"])
        for d in deps:
            current = present.parse_gear(d.current_gear)
            for plan in current.plans if current is not None else ():
                info.add_metric([d.name, plan.plan_id, current.gear_id], 1.0)  # type: ignore[union-attr]
            gear.add_metric([d.name], float(latest_done.get(d.pk, 0) if current is not None else 0))
            pinned.add_metric([d.name], 1.0 if d.mode in (Deployment.PINNED, Deployment.EMERGENCY) else 0.0)
            routing.add_metric([d.name], float(d.routing_version))
            t = active.get(d.pk)
            now_phase = t.phase if t is not None else "idle"
            for p in PHASE_VALUES:
                phase.add_metric([d.name, p], 1.0 if p == now_phase else 0.0)
            queue.add_metric([d.name], float(present.migration_queue(t)))
            status = present.shadow_status(t)
            for s in present.SHADOW_STATUSES:
                shadow.add_metric([d.name, s], 1.0 if s == status else 0.0)
        yield from (info, gear, pinned, routing, phase, queue, shadow)
        yield _rollout_share(deps)
        yield from self._twu(deps, active)
        yield self._durations()
        yield from self._decisions(deps)
        yield from self._moved()

    def _twu(self, deps: list[Any], active: dict[int, Any]) -> Iterator[Metric]:
        from console.gearbox import present
        from console.gearbox.present_twu import twu_view

        fleet = present.fleet_view()
        view = twu_view(deps, fleet.engines, fleet.snapshot, active)
        gpus = GaugeMetricFamily("flexpipe_gpu_twu", "Token-weighted utilisation of the GPU: cost-weighted tokens its "
                                 "plans served over their modelled capacity (plans sharing it summed)",
                                 labels=["gpu", "node"])
        for uuid, share in sorted(view.gpus.items()):
            gpus.add_metric([uuid, str(fleet.gpus.get(uuid, {}).get("node", ""))], share)
        yield gpus
        family = GaugeMetricFamily("flexpipe_deployment_twu", "Token-weighted utilisation of the deployment: its "
                                   "plans' TWU weighted by their GPUs", labels=["deployment"])
        for d in deps:
            value = view.deployments.get(d.pk)
            if value is not None:
                family.add_metric([d.name], value)
        yield family
        yield from self._pool(deps, view, fleet)

    @staticmethod
    def _pool(deps: list[Any], view: Any, fleet: Any) -> Iterator[Metric]:
        """The pool's TWU and the soft limits' shares, as the control loop's rule 14 prices them."""
        from django.conf import settings

        from scheduler.pool.autoscale import ScaleConfig, admission_shares, model_weights
        from scheduler.pool.twu import pool_gpus, pool_twu

        # no valid snapshot (the fleet view says why): no pool to average over, and no TWU either
        twu = pool_twu(view.gpus, pool_gpus(fleet.snapshot, view.gpus)) if fleet.snapshot is not None else None
        pool = GaugeMetricFamily("flexpipe_pool_twu", "Token-weighted utilisation of the pool: the mean over its GPUs "
                                 "(healthy, schedulable or ours; a free one counts 0)")
        if twu is not None:
            pool.add_metric([], twu)
        yield pool
        share = GaugeMetricFamily("flexpipe_pool_admission_share", "The model's share of the pool's admission under "
                                  "the soft limits (FLEXPIPE_POOL_MODEL_WEIGHTS)", labels=["model"])
        factor = GaugeMetricFamily("flexpipe_pool_weight_factor", "The factor the model's soft-limit weight is scaled "
                                   "by at the pool's TWU (1 at or under the soft limit)", labels=["model"])
        weights = settings.FLEXPIPE_POOL_MODEL_WEIGHTS
        models = sorted({d.model_name for d in deps if view.plans_of.get(d.pk)})
        if weights and models:
            got = admission_shares(model_weights(weights, models), twu,
                                   config=ScaleConfig.from_dict(settings.FLEXPIPE_POOL_SCALE, "FLEXPIPE_POOL_SCALE"))
            for m in models:
                share.add_metric([m], got.shares[m])
                factor.add_metric([m], got.factors[m])
        yield share
        yield factor

    def _durations(self) -> Metric:
        from console.gearbox.models import Transition

        took = ExpressionWrapper(F("finished_at") - F("created_at"), output_field=DurationField())
        buckets = {f"le{i}": Count("id", filter=Q(took__lte=timedelta(seconds=b)))
                   for i, b in enumerate(SWITCH_DURATION_BUCKETS_S)}
        rows = (Transition.objects.filter(phase="done", finished_at__isnull=False).annotate(took=took)
                .values("deployment__name").annotate(n=Count("id"), total=Sum("took"), **buckets)
                .order_by("deployment__name"))
        family = HistogramMetricFamily("flexpipe_switch_duration_seconds",
                                       "Duration of finished switches, from creation to the end of CLEANUP",
                                       labels=["deployment"])
        for row in rows:
            cumulative = [(_le(b), float(row[f"le{i}"])) for i, b in enumerate(SWITCH_DURATION_BUCKETS_S)]
            total = row["total"].total_seconds() if row["total"] is not None else 0.0
            family.add_metric([row["deployment__name"]], cumulative + [("+Inf", float(row["n"]))], sum_value=total)
        return family

    def _decisions(self, deps: list[Any]) -> Iterator[Metric]:
        from console.gearbox.models import Decision

        family = CounterMetricFamily("flexpipe_decisions", "Gearbox decisions by outcome and by what triggered them",
                                     labels=["deployment", "outcome", "reason"])
        for name, outcome, trigger, n in (Decision.objects.values("deployment__name", "outcome", "trigger")
                                          # a repeated "stay" is one row counting its ticks (gearbox.repeats)
                                          .annotate(n=Sum("repeats")).order_by("deployment__name", "outcome", "trigger")
                                          .values_list("deployment__name", "outcome", "trigger", "n")):
            family.add_metric([name, outcome, trigger], float(n))
        yield family
        pending = dict(Decision.objects.filter(approval=Decision.PENDING).values("deployment__name")
                       .annotate(n=Count("id")).values_list("deployment__name", "n"))
        waiting = GaugeMetricFamily("flexpipe_decisions_pending_approval",
                                    "Advised decisions waiting for an operator's approval", labels=["deployment"])
        for d in deps:
            waiting.add_metric([d.name], float(pending.get(d.name, 0)))
        yield waiting

    def _moved(self) -> Iterator[Metric]:
        from console.gearbox.models import Transition

        rows = (Transition.objects.values("deployment__name").annotate(kv=Sum("kv_bytes_migrated"),
                                                                       tokens=Sum("tokens_replayed"))
                .order_by("deployment__name"))
        kv = CounterMetricFamily("flexpipe_transition_kv_migrated_bytes",
                                 "KV cache bytes handed over by migration, over all transitions", labels=["deployment"])
        tokens = CounterMetricFamily("flexpipe_transition_tokens_replayed",
                                     "Tokens re-prefilled on a target instead of migrating their KV",
                                     labels=["deployment"])
        for row in rows:
            kv.add_metric([row["deployment__name"]], float(row["kv"] or 0))
            tokens.add_metric([row["deployment__name"]], float(row["tokens"] or 0))
        yield kv
        yield tokens


class AlertInputsCollector(Described):
    """The inputs of the alert rules (module docstring): a collector of their own, so the console's
    evaluation of the rules (console/metrics/alerts.py) runs this one and the fleet's report lag,
    not the gears, decisions and TWU of the whole fleet."""

    families = (("flexpipe_transition_overdue_seconds", "gauge"), ("flexpipe_deployment_transitions_recent", "gauge"),
                ("flexpipe_kv_pool_free_ratio", "gauge"), ("flexpipe_deployment_slo_violation_ratio", "gauge"),
                ("flexpipe_router_rollback_active", "gauge"), ("flexpipe_spillover_timeouts_recent", "gauge"))

    def collect(self) -> Iterator[Metric]:
        deps, active = _deployments()
        yield from self._alert_inputs(deps, active)
        yield _rollback_active(deps)
        yield self._spill_timeouts(deps)

    def _spill_timeouts(self, deps: list[Any]) -> Metric:
        from console.gateway import routing

        g = GaugeMetricFamily("flexpipe_spillover_timeouts_recent", f"Spilled requests that timed out waiting at "
                              f"the plan in the last {SPILL_WINDOW_S:.0f} s", labels=["deployment", "plan_id"])
        for (name, plan_id), n in sorted(routing.spill_timeouts_recent([d.name for d in deps], SPILL_WINDOW_S).items()):
            g.add_metric([name, plan_id], float(n))
        return g

    def _alert_inputs(self, deps: list[Any], active: dict[int, Any]) -> Iterator[Metric]:
        from django.utils import timezone

        from console.gearbox.models import ServingSample, Transition
        from scheduler.gearbox import DEFAULT_CONFIG

        now = timezone.now()
        overdue = GaugeMetricFamily("flexpipe_transition_overdue_seconds",
                                    "Seconds the running transition's current step is past its deadline "
                                    "(0: idle or within it)", labels=["deployment"])
        for d in deps:
            t = active.get(d.pk)
            deadline_s = _deadline_s(t) if t is not None else None
            overdue.add_metric([d.name], max(0.0, now.timestamp() - deadline_s) if deadline_s is not None else 0.0)
        yield overdue

        window_s = DEFAULT_CONFIG.flap_window_s
        started = dict(Transition.objects.filter(created_at__gte=now - timedelta(seconds=window_s))
                       .values("deployment_id").annotate(n=Count("id")).values_list("deployment_id", "n"))
        recent = GaugeMetricFamily("flexpipe_deployment_transitions_recent",
                                   f"Transitions started in the last {window_s:.0f} s (the gearbox's flap window)",
                                   labels=["deployment"])
        for d in deps:
            recent.add_metric([d.name], float(started.get(d.pk, 0)))
        yield recent

        yield self._kv_free(deps)

        # Each serving sample holds the worst P95 over the deployment's routed plans (ticks.py).
        late = Q(ttft_p95_ms__gt=F("deployment__ttft_ms")) | Q(tpot_p95_ms__gt=F("deployment__tpot_ms"))
        rows = (ServingSample.objects.filter(at__gte=now - timedelta(seconds=SLO_WINDOW_S))
                .values("deployment__name").annotate(n=Count("id"), late=Count("id", filter=late))
                .order_by("deployment__name"))
        ratio = GaugeMetricFamily("flexpipe_deployment_slo_violation_ratio",
                                  f"Share of the serving samples of the last {SLO_WINDOW_S:.0f} s whose P95 TTFT or "
                                  "TPOT was above the deployment's SLO", labels=["deployment"])
        for row in rows:
            ratio.add_metric([row["deployment__name"]], row["late"] / row["n"])
        yield ratio

    def _kv_free(self, deps: list[Any]) -> Metric:
        from console.fleet.models import Node
        from console.gearbox import present

        owner: dict[str, str] = {}
        for d in deps:
            current = present.parse_gear(d.current_gear)
            for plan in current.plans if current is not None else ():
                owner[plan.plan_id] = d.name
        family = GaugeMetricFamily("flexpipe_kv_pool_free_ratio", "Free share of the plan's KV cache on the node, "
                                   "as its engine last reported (1 - kv_usage)", labels=["deployment", "plan_id", "node"])
        for node_id, reports in Node.objects.exclude(engines=[]).order_by("node_id").values_list("node_id", "engines"):
            for e in reports if isinstance(reports, list) else []:
                kv = e.get("kv_usage") if isinstance(e, dict) else None
                name = owner.get(str(e.get("plan_id"))) if isinstance(e, dict) else None
                if name is not None and isinstance(kv, int | float) and not isinstance(kv, bool):
                    family.add_metric([name, str(e["plan_id"]), node_id], 1.0 - min(1.0, max(0.0, float(kv))))
        return family


def _rollout_share(deps: list[Any]) -> Metric:
    """The learned routing's share per deployment that has one (console/gateway/learned.py)."""
    from console.gateway import learned

    family = GaugeMetricFamily("flexpipe_router_rollout_share", "Share of the deployment's requests its learned "
                               "routing weights route (newest stage change)", labels=["deployment"])
    for name, row in learned.newest([d.name for d in deps]).items():
        family.add_metric([name], float(row.get("share") or 0.0))
    return family


def _rollback_active(deps: list[Any]) -> Metric:
    """1 while a deployment's learned routing is rolled back (the alert's input)."""
    from console.gateway import learned

    family = GaugeMetricFamily("flexpipe_router_rollback_active", "1 while the deployment's learned routing is "
                               "rolled back to round-robin", labels=["deployment"])
    for name, row in learned.newest([d.name for d in deps]).items():
        family.add_metric([name], 1.0 if row.get("after") == "rolled_back" else 0.0)
    return family


def _deadline_s(t: Any) -> float | None:
    """When the running transition's current step must be over: a running step's own deadline; between
    steps, when the executor meant to look again (the row's wake_at); None when neither is known."""
    from scheduler.transition import StepRecord, StepState

    steps = t.record.get("steps") if isinstance(t.record, dict) else None
    if steps:
        try:
            step = StepRecord.from_dict(steps[-1])
        except ValueError:
            step = None
        if step is not None and step.state is StepState.RUNNING:
            return step.deadline_s
    return t.wake_at.timestamp() if t.wake_at is not None else None


def _le(bound: float) -> str:
    return str(float(bound))

