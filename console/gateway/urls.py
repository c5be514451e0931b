"""The gateway's URLs: the OpenAI API, and the URLconf of the gateway's own process.

`api` is mounted by the console's URLconf too (console/urls.py), where FLEXPIPE_PROCESS says
whether the console serves it (`all`) or answers it with 421 (`console`: the gateway runs apart,
console.gateway.asgi). `urlpatterns` is ROOT_URLCONF in the gateway's process (settings.py): the
API, and /healthz and /metrics for that process itself; nothing of the console (the agent API, the
pages, the REST API) is reachable there.
"""

from __future__ import annotations

from django.urls import path, re_path
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from rest_framework.request import Request
from rest_framework.response import Response

from console.dashboard.views import healthz
from console.gateway import views
from console.metrics import REGISTRY
from console.metrics.views import MetricsView

api = [
    path("v1/completions", views.completions, name="gateway-completions"),
    path("v1/chat/completions", views.chat_completions, name="gateway-chat"),
    path("v1/models", views.models, name="gateway-models"),
]

# the console's process when the gateway runs apart: every /v1 path says where the API is
elsewhere = [re_path(r"^v1(?:/|$)", views.elsewhere, name="gateway-elsewhere")]


class GatewayMetricsView(MetricsView):
    """GET /metrics of the gateway's process: its own events only (console.gateway.metrics' families).

    The console's /metrics also collects the fleet, registry, audit and gearbox families from the
    database; the gateway's process leaves those to the console, or Prometheus, scraping both, would
    count the fleet once more per gateway process. The same auth: a viewer's API token.
    """

    def get(self, request: Request) -> Response:
        return Response(generate_latest(REGISTRY), content_type=CONTENT_TYPE_PLAIN_0_0_4)


urlpatterns = [
    *api,
    path("healthz", healthz, name="healthz"),
    path("metrics", GatewayMetricsView.as_view(), name="metrics"),
]
