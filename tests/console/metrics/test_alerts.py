"""console/metrics/alerts.py: the shipped rules parse into the subset it evaluates, read metrics that
exist (or are declared planned), and fire over the console's real metric values - on the page and
in /api/v1/alerts."""

from __future__ import annotations

import time
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
import redis as redis_lib
import yaml
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from console.fleet.models import Node
from console.gearbox.actions import do_record_serving, do_request_gear
from console.gearbox.executor import build_executor
from console.gearbox.models import Deployment, Transition
from console.metrics import REGISTRY, alerts
from console.metrics.collectors import Described
from console.metrics.views import register_collectors
from tests.console.conftest import enroll
from tests.console.gearbox.conftest import _fast_transitions  # noqa: F401 - short dwells here too
from tests.console.gearbox.harness import gear
from tests.console.gearbox.ops import MOVED, engine_report, running_deployment
from tests.console.metrics.test_metrics import scrape
from tests.console.people import Person


@pytest.fixture(autouse=True)
def _no_remembered_alerts(redis_client: redis_lib.Redis) -> None:
    redis_client.delete(alerts.REDIS_KEY)


def rules_by_name() -> dict[str, alerts.Rule]:
    return {r.name: r for r in alerts.load_rules()}


def active(name: str, now_s: float | None = None) -> list[alerts.AlertState]:
    _, states = alerts.current(time.time() if now_s is None else now_s)
    return [s for s in states if s.active.rule.name == name]


# --- the file and the parser -----------------------------------------------------------------------
def test_every_rule_of_the_shipped_file_is_in_the_subset_the_console_evaluates() -> None:
    doc = yaml.safe_load(alerts.RULES_PATH.read_text())
    names = [r["alert"] for g in doc["groups"] for r in g["rules"]]
    rules = alerts.load_rules()  # raises Unsupported naming the rule otherwise
    assert [r.name for r in rules] == names and len(names) == 7
    assert {r.expr.metric for r in rules} == {
        "flexpipe_deployment_slo_violation_ratio", "flexpipe_deployment_transitions_recent",
        "flexpipe_transition_overdue_seconds", "flexpipe_agent_report_lag_seconds", "flexpipe_router_rollback_active",
        "flexpipe_kv_pool_free_ratio", "flexpipe_spillover_timeouts_recent"}


@pytest.mark.django_db
def test_every_metric_a_rule_reads_is_exported_or_declared_planned() -> None:
    running_deployment()
    register_collectors()
    exported = {f.name for f in REGISTRY.collect()} | {s.name for f in REGISTRY.collect() for s in f.samples}
    for rule in alerts.load_rules():
        m = rule.expr.metric
        if m in alerts.PLANNED_METRICS:
            assert m not in exported, f"{m} is exported now: drop it from alerts.PLANNED_METRICS"
        else:
            assert m in exported, f"alert {rule.name} reads {m}, which no collector exports"


@pytest.mark.django_db
def test_each_collector_names_exactly_the_families_it_yields() -> None:
    running_deployment()
    register_collectors()
    for collector in list(REGISTRY._collector_to_names):
        if not isinstance(collector, Described):
            continue
        assert [f.name for f in collector.describe()] == [f.name for f in collector.collect()], collector


@pytest.mark.django_db
def test_the_rules_are_evaluated_over_their_own_metrics_without_reading_the_whole_fleet() -> None:
    running_deployment()
    names = {r.expr.metric for r in alerts.load_rules()}
    everything = [s for s in alerts.registry_samples() if s.name in names]
    with CaptureQueriesContext(connection) as queries:
        restricted = alerts.registry_samples(names=names)
    def seen(samples: list[alerts.Sample]) -> list[tuple[Any, ...]]:  # (a report's lag grows with the clock)
        return sorted((s.name, sorted(s.labels.items()), None if "lag" in s.name else s.value) for s in samples)

    assert seen(restricted) == seen(everything) and restricted
    read = " ".join(q["sql"] for q in queries.captured_queries)
    # the GPUs by state, the decisions and the engines' TWU (the fleet view) are not the rules' inputs
    assert '"fleet_gpu"' not in read and '"gearbox_decision"' not in read, read


@pytest.mark.parametrize("expr", [
    "rate(flexpipe_gateway_requests_total[5m]) > 1",
    "flexpipe_gpus offset 5m > 1",
    "flexpipe_gpus > bool 1",
    'flexpipe_gpus{state=~"ours|tenant"} > 1',
    "sum without (state) (flexpipe_gpus) > 1",
    "sum(flexpipe_gpus) > 1",
    "flexpipe_gpus > flexpipe_node_schedulable",
    "flexpipe_gpus > 1 and flexpipe_node_schedulable == 0",
    "-flexpipe_gpus < 1",
    "sum by (state) (flexpipe_gpus) > 1 unless flexpipe_gpus",
])
def test_it_refuses_expressions_it_cannot_evaluate_without_history_or_joins(expr: str) -> None:
    with pytest.raises(alerts.Unsupported, match="outside the subset|label matcher"):
        alerts.parse_expr(expr)


def test_it_refuses_templates_durations_and_recording_rules_it_does_not_handle() -> None:
    def doc(**rule: Any) -> dict[str, Any]:
        return {"groups": [{"name": "g", "rules": [{"alert": "A", "expr": "flexpipe_gpus > 1", **rule}]}]}

    with pytest.raises(alerts.Unsupported, match=r"alert A: annotation summary: template \{\{ \$value \}\}"):
        alerts.parse_rules(doc(annotations={"summary": "{{ $value }}"}))
    with pytest.raises(alerts.Unsupported, match="humanize"):
        alerts.parse_rules(doc(annotations={"summary": "{{ $value | humanize }}"}))
    with pytest.raises(alerts.Unsupported, match="not a duration"):
        alerts.parse_rules(doc(**{"for": "5 minutes"}))
    with pytest.raises(alerts.Unsupported, match="recording rule"):
        alerts.parse_rules({"groups": [{"name": "g", "rules": [{"record": "x", "expr": "flexpipe_gpus"}]}]})
    assert alerts.parse_rules(doc(**{"for": "1h30m"}))[0].for_s == 5400


def test_it_evaluates_the_subset_as_prometheus_does() -> None:
    S = alerts.Sample
    rules = alerts.parse_rules({"groups": [{"name": "g", "rules": [
        {"alert": "Low", "expr": 'min by (deployment, plan_id) (kv{node!="x"}) < 0.1', "labels": {"severity": "page"},
         "annotations": {"summary": '{{ $labels.plan_id }} at {{ printf "%.2f" $value }}{{ $labels.node }}'}},
        {"alert": "Hot", "expr": 'lag{node="a"} >= 60'},
    ]}]})
    samples = [S("kv", {"deployment": "d", "plan_id": "p", "node": "a"}, 0.05),
               S("kv", {"deployment": "d", "plan_id": "p", "node": "b"}, 0.5),
               S("kv", {"deployment": "d", "plan_id": "q", "node": "c"}, 0.1),  # at the edge: not below
               S("kv", {"deployment": "d", "plan_id": "r", "node": "x"}, 0.0),  # matched out
               S("lag", {"node": "a"}, 60.0), S("lag", {"node": "b"}, 600.0)]
    out = alerts.evaluate(rules, samples)
    assert [(a.rule.name, dict(a.labels), a.value) for a in out] == [
        ("Low", {"deployment": "d", "plan_id": "p", "severity": "page", "alertname": "Low"}, 0.05),
        ("Hot", {"node": "a", "alertname": "Hot"}, 60.0)]
    assert out[0].annotations == {"summary": "p at 0.05"}  # an aggregated-away label renders as nothing


# --- over the console's real metrics ---------------------------------------------------------------
@pytest.mark.django_db
def test_a_silent_agent_goes_pending_then_firing_once_its_for_has_passed(client: Any) -> None:
    enroll(client, "a1")
    enroll(client, "b1")
    Node.objects.filter(node_id="a1").update(last_seen_at=timezone.now() - timedelta(seconds=300))
    t0 = time.time()
    [lag] = active("FlexPipeAgentReportLag", t0)
    assert lag.active.labels == {"node": "a1", "severity": "warning", "alertname": "FlexPipeAgentReportLag"}
    assert lag.active.value >= 300 and lag.state == "pending" and lag.since_s == t0
    assert lag.active.annotations["summary"] == "node a1 stopped reporting"
    [lag] = active("FlexPipeAgentReportLag", t0 + 61)  # the rule's `for: 1m` has passed
    assert lag.state == "firing" and lag.since_s == t0
    Node.objects.filter(node_id="a1").update(last_seen_at=timezone.now())
    assert active("FlexPipeAgentReportLag", t0 + 62) == []
    Node.objects.filter(node_id="a1").update(last_seen_at=timezone.now() - timedelta(seconds=300))
    [lag] = active("FlexPipeAgentReportLag", t0 + 63)  # resolved in between: its clock starts over
    assert lag.state == "pending" and lag.since_s == t0 + 63


@pytest.mark.django_db
def test_a_step_past_its_deadline_is_exported_and_stuck(viewer: Person) -> None:
    running_deployment(moved=False)
    do_request_gear("chat", gear("a1", [2, 3]), actor="system:test")
    build_executor().advance("chat")  # PREPARE sent; no agent answers
    row = Transition.objects.get(deployment__name="chat", seq=2)
    assert row.active and row.record["steps"][-1]["state"] == "running"
    chat = (("deployment", "chat"),)
    assert scrape(viewer.api())[("flexpipe_transition_overdue_seconds", chat)] == 0
    assert active("FlexPipeTransitionStuck") == []
    # the worker that should time it out is gone: its step started long before its timeout
    step = row.record["steps"][-1]
    step["started_s"] -= step["intent"]["timeout_s"] + 200
    Transition.objects.filter(pk=row.pk).update(record=row.record)
    overdue = scrape(viewer.api())[("flexpipe_transition_overdue_seconds", chat)]
    assert 200 <= overdue < 300
    [stuck] = active("FlexPipeTransitionStuck")
    assert stuck.active.labels["deployment"] == "chat" and stuck.active.value >= 200
    assert stuck.active.labels["severity"] == "critical"
    html = viewer.browser().get("/alerts/").content.decode()
    assert 'data-alert="FlexPipeTransitionStuck" data-state="pending"' in html
    assert 'the transition of chat is stuck (<a href="/deployments/chat/">its page</a>)' in html


@pytest.mark.django_db
def test_transitions_in_the_flap_window_are_counted(viewer: Person) -> None:
    running_deployment()
    chat = (("deployment", "chat"),)
    assert scrape(viewer.api())[("flexpipe_deployment_transitions_recent", chat)] == 2
    Transition.objects.filter(seq=1).update(created_at=timezone.now() - timedelta(minutes=31))
    assert scrape(viewer.api())[("flexpipe_deployment_transitions_recent", chat)] == 1
    assert active("FlexPipeGearFlapping") == []


@pytest.mark.django_db
def test_the_slo_violation_ratio_counts_samples_of_the_window_above_the_slo(viewer: Person) -> None:
    running_deployment(moved=False)
    dep = Deployment.objects.get(name="chat")  # SLO: TTFT 2000 ms, TPOT 100 ms
    now = timezone.now()

    def sample(ago_s: float, ttft_ms: float, tpot_ms: float) -> None:
        assert do_record_serving(dep, {"reported_at": (now - timedelta(seconds=ago_s)).isoformat(),
                                       "ttft_p95_ms": ttft_ms, "tpot_p95_ms": tpot_ms, "tokens_per_s": 10.0})

    sample(400, 9000, 900)  # before the 5 min window
    sample(200, 2500, 20)
    sample(150, 300, 150)
    sample(100, 300, 20)
    sample(50, 2000, 100)  # at the SLO is within it
    chat = (("deployment", "chat"),)
    assert scrape(viewer.api())[("flexpipe_deployment_slo_violation_ratio", chat)] == 0.5
    [sla] = active("FlexPipeSLAViolationRate")
    assert sla.active.value == 0.5 and sla.state == "pending"  # `for: 2m`
    assert sla.active.annotations["description"] == "P95 latency above the SLO in 0.50 of the samples of the last 5 min"


@pytest.mark.django_db
def test_a_full_kv_cache_reported_by_an_engine_saturates_its_plan(viewer: Person) -> None:
    world = running_deployment()
    plan_id = MOVED.plans[0].plan_id
    world.report_engines("b1", engine_report(plan_id))
    key = ("flexpipe_kv_pool_free_ratio", (("deployment", "chat"), ("node", "b1"), ("plan_id", plan_id)))
    assert scrape(viewer.api())[key] == pytest.approx(0.69)  # engine_report's kv_usage is 0.31
    assert active("FlexPipeKVPoolSaturated") == []
    world.report_engines("b1", replace(engine_report(plan_id), kv_usage=0.96))
    [full] = active("FlexPipeKVPoolSaturated")
    assert full.active.labels == {"deployment": "chat", "plan_id": plan_id, "severity": "warning",
                                  "alertname": "FlexPipeKVPoolSaturated"}
    assert full.active.value == pytest.approx(0.04)


@pytest.mark.django_db
def test_a_learned_routing_rolled_back_fires_the_rollback_alert_until_it_tries_again() -> None:
    from console.gateway import learned
    from tests.console.gearbox.test_pages_browser import ROLLED_BACK

    running_deployment()
    client = redis_lib.Redis.from_url(learned.settings.REDIS_URL)
    client.delete(learned.PREFIX + "chat")
    try:
        assert active("FlexPipeRouterRollback") == []  # static weights: no stage at all
        learned.keep("chat", [ROLLED_BACK])
        [back] = active("FlexPipeRouterRollback")
        assert back.active.labels["deployment"] == "chat"
        learned.keep("chat", [{**ROLLED_BACK, "before": "rolled_back", "after": "canary", "share": 0.1}])
        assert active("FlexPipeRouterRollback") == []
    finally:
        client.delete(learned.PREFIX + "chat")


# --- the page and the API --------------------------------------------------------------------------
@pytest.mark.django_db
def test_the_alerts_page_and_api_list_what_holds(viewer: Person, outsider: Person, client: Any) -> None:
    enroll(client, "a1")
    Node.objects.filter(node_id="a1").update(last_seen_at=timezone.now() - timedelta(seconds=300))
    page = viewer.browser().get("/alerts/")
    assert page.status_code == 200
    html = page.content.decode()
    assert 'data-alert="FlexPipeAgentReportLag" data-state="pending"' in html
    assert '<code>node="a1"</code>' in html and "node a1 stopped reporting" in html
    assert 'data-nav="alerts" class="active"' in html
    for name in rules_by_name():
        assert f'data-rule="{name}"' in html
    assert "its metric is not exported yet" not in html  # spillover timeouts are exported now (issue 16 d1)

    body = viewer.api().get("/api/v1/alerts").json()
    [lag] = body["alerts"]
    assert lag["name"] == "FlexPipeAgentReportLag" and lag["labels"]["node"] == "a1" and lag["value"] >= 300
    assert lag["state"] == "pending" and lag["active_since"] is not None and body["firing"] == 0
    assert {r["name"]: r["pending"] for r in body["rules"]}["FlexPipeAgentReportLag"] == 1
    assert outsider.browser().get("/alerts/").status_code == 403
    assert outsider.api().get("/api/v1/alerts").status_code == 403
    assert client.get("/api/v1/alerts").status_code == 401


@pytest.mark.django_db
def test_the_page_says_when_nothing_holds(viewer: Person) -> None:
    html = viewer.browser().get("/alerts/").content.decode()
    assert 'data-testid="alerts-empty"' in html and "none firing" in html


# --- on beat ---------------------------------------------------------------------------------------
def test_beat_evaluates_the_alert_rules_every_15_s_by_default() -> None:
    import os

    from django.conf import settings

    beat = {e["task"]: e for e in settings.CELERY_BEAT_SCHEDULE.values()}
    assert float(os.environ.get("FLEXPIPE_ALERTS_EVAL_S", "15")) == settings.FLEXPIPE_ALERTS_EVAL_S
    assert beat["metrics.evaluate_alerts"]["schedule"] == max(1.0, settings.FLEXPIPE_ALERTS_EVAL_S)


@pytest.mark.django_db(transaction=True)
def test_the_beat_task_stamps_an_alert_before_anyone_looks(worker: None, client: Any,
                                                           redis_client: redis_lib.Redis) -> None:
    from console.metrics.tasks import evaluate_alerts

    enroll(client, "a1")
    Node.objects.filter(node_id="a1").update(last_seen_at=timezone.now() - timedelta(seconds=300))
    before = time.time()
    assert evaluate_alerts.delay().get(timeout=60) == []  # held since now: pending for its `for: 1m`
    [stamp] = redis_client.hgetall(alerts.REDIS_KEY).items()
    assert b'"node", "a1"' in stamp[0] and float(stamp[1]) >= before
    [lag] = active("FlexPipeAgentReportLag", float(stamp[1]) + 60)  # later, a page: since the task's stamp
    assert lag.state == "firing" and lag.since_s == float(stamp[1])
    Node.objects.filter(node_id="a1").update(last_seen_at=timezone.now())
    assert evaluate_alerts.delay().get(timeout=60) == []
    assert redis_client.hgetall(alerts.REDIS_KEY) == {}  # resolved: cleared
