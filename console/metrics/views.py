"""GET /metrics: Prometheus text format; and the Alerts page (the alert rules over the same metrics).

Protected: it names nodes, models and deployments, which the console shows only to its users.
Scrape with a viewer's API token — Prometheus sends it natively:

    scrape_configs:
      - job_name: flexpipe
        metrics_path: /metrics
        authorization: {type: Bearer, credentials_file: /etc/prometheus/flexpipe-token}

(`manage.py create_api_token prometheus` for a user in the viewer group; revocable like any token.)
"""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from drf_spectacular.utils import extend_schema
from prometheus_client import ProcessCollector, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from rest_framework import renderers
from rest_framework.negotiation import BaseContentNegotiation
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from console.accounts.auth import IsViewer
from console.accounts.decorators import role_required
from console.accounts.roles import VIEWER
from console.metrics import REGISTRY
from console.metrics import websockets as _websockets  # noqa: F401 - registers the websocket metrics
from console.metrics.collectors import (
    AuditCollector,
    FleetCollector,
    GpuStateCollector,
    ModelRegistryCollector,
)
from console.metrics.gearbox import AlertInputsCollector, GearboxCollector

_registered = False


def register_collectors() -> None:
    global _registered
    if _registered:
        return
    for collector in (FleetCollector(), GpuStateCollector(), ModelRegistryCollector(), AuditCollector(),
                      GearboxCollector(), AlertInputsCollector()):
        REGISTRY.register(collector)
    ProcessCollector(registry=REGISTRY)
    _registered = True


class PrometheusTextRenderer(renderers.BaseRenderer):
    media_type = "text/plain"
    format = "prometheus"
    charset = "utf-8"

    def render(self, data: Any, accepted_media_type: str | None = None, renderer_context: Any = None) -> bytes:
        if isinstance(data, bytes):
            return data
        # An error (401/403): DRF's {"detail": ...} as one plain line.
        detail = data.get("detail", data) if isinstance(data, dict) else data
        return f"{detail}\n".encode()


class AlwaysText(BaseContentNegotiation):
    """Prometheus asks for OpenMetrics first and text second; we always answer the classic text format."""

    def select_parser(self, request: Any, parsers: Any) -> Any:
        return parsers[0] if parsers else None

    def select_renderer(self, request: Any, renderers: Any, format_suffix: Any = None) -> Any:
        return renderers[0], renderers[0].media_type


@extend_schema(exclude=True)
class MetricsView(APIView):
    renderer_classes = [PrometheusTextRenderer]
    content_negotiation_class = AlwaysText
    permission_classes = [IsViewer]

    def get(self, request: Request) -> Response:
        register_collectors()
        return Response(generate_latest(REGISTRY), content_type=CONTENT_TYPE_PLAIN_0_0_4)


class ProcessMetricsView(MetricsView):
    """GET /metrics of a process apart from the console's (the gateway's, the agent API's): its own events only.

    The console's /metrics also collects the fleet, registry, audit and gearbox families from the
    database; the other processes leave those to the console, or Prometheus, scraping all of them,
    would count the fleet once more per process. The same auth: a viewer's API token.
    """

    def get(self, request: Request) -> Response:
        return Response(generate_latest(REGISTRY), content_type=CONTENT_TYPE_PLAIN_0_0_4)


ALERTS_REFRESH_S = 15  # the page reloads itself: Prometheus' default evaluation interval


@role_required(VIEWER)
def alerts_page(request: HttpRequest) -> HttpResponse:
    """What the rules of deploy/prometheus/alerts.yml find now (the payload of /api/v1/alerts)."""
    from console.metrics.api import alerts_payload

    return render(request, "metrics/alerts.html", {"data": alerts_payload(), "refresh_s": ALERTS_REFRESH_S})
