"""GET /api/v1/alerts: what the alert rules of deploy/prometheus/alerts.yml find over the console's
metrics now (console/metrics/alerts.py evaluates them), and the rules themselves. The Alerts page
shows the same payload."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.decorators import api_view
from rest_framework.request import Request
from rest_framework.response import Response

from console.gearbox.present import iso
from console.metrics import alerts


def alerts_payload(now_s: float | None = None) -> dict[str, Any]:
    """Rules and active alerts, in the shape the API answers and the page renders."""
    now_s = time.time() if now_s is None else now_s
    rules, states = alerts.current(now_s)
    held: dict[str, list[str]] = {}
    for s in states:
        held.setdefault(s.active.rule.name, []).append(s.state)
    return {
        "evaluated_at": _iso(now_s),
        "firing": sum(1 for s in states if s.state == "firing"),
        "alerts": [{"name": s.active.rule.name, "state": s.state, "severity": s.active.rule.labels.get("severity"),
                    "labels": dict(s.active.labels), "value": s.active.value,
                    "active_since": None if s.since_s is None else _iso(s.since_s),
                    "summary": s.active.annotations.get("summary", ""),
                    "description": s.active.annotations.get("description", "")} for s in states],
        "rules": [{"name": r.name, "expr": r.expr_text, "for_s": r.for_s, "severity": r.labels.get("severity"),
                   "planned_metric": alerts.PLANNED_METRICS.get(r.expr.metric),
                   "firing": held.get(r.name, []).count("firing"), "pending": held.get(r.name, []).count("pending")}
                  for r in rules],
    }


def _iso(t_s: float) -> str:
    return str(iso(datetime.fromtimestamp(t_s, tz=UTC)))


_ALERT_FIELDS = {
    "name": serializers.CharField(help_text="the rule's alert name"),
    "state": serializers.ChoiceField(["pending", "firing"], help_text="pending until the rule's `for` has passed"),
    "severity": serializers.CharField(allow_null=True),
    "labels": serializers.DictField(child=serializers.CharField(), help_text="the series' labels, the rule's, alertname"),
    "value": serializers.FloatField(help_text="the expression's value for this series"),
    "active_since": serializers.DateTimeField(allow_null=True,
                                              help_text="when the console first saw it hold (null: unknown)"),
    "summary": serializers.CharField(),
    "description": serializers.CharField(),
}
_RULE_FIELDS = {
    "name": serializers.CharField(),
    "expr": serializers.CharField(help_text="PromQL, as in deploy/prometheus/alerts.yml"),
    "for_s": serializers.FloatField(),
    "severity": serializers.CharField(allow_null=True),
    "planned_metric": serializers.CharField(allow_null=True,
                                            help_text="the part that will export its metric, while none does"),
    "firing": serializers.IntegerField(),
    "pending": serializers.IntegerField(),
}


@extend_schema(summary="Alerts: the rules of deploy/prometheus/alerts.yml evaluated over the console's metrics",
               responses=inline_serializer("Alerts", {
                   "evaluated_at": serializers.DateTimeField(),
                   "firing": serializers.IntegerField(),
                   "alerts": inline_serializer("Alert", _ALERT_FIELDS, many=True),
                   "rules": inline_serializer("AlertRule", _RULE_FIELDS, many=True),
               }))
@api_view(["GET"])
def alerts_view(request: Request) -> Response:
    """Firing first, then pending; each with its labels, value and since when it holds."""
    return Response(alerts_payload())
