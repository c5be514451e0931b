"""The gateway's URLs: the OpenAI API, and the URLconf of the gateway's own process.

`api` is mounted by the console's URLconf too (console/urls.py), where FLEXPIPE_PROCESS says
whether the console serves it (`all`) or answers it with 421 (`console`: the gateway runs apart,
console.gateway.asgi). `urlpatterns` is ROOT_URLCONF in the gateway's process (settings.py): the
API, and /healthz and /metrics for that process itself; nothing of the console (the agent API, the
pages, the REST API) is reachable there.
"""

from __future__ import annotations

from django.urls import path, re_path

from console.dashboard.views import healthz
from console.gateway import views
from console.metrics.views import ProcessMetricsView

api = [
    path("v1/completions", views.completions, name="gateway-completions"),
    path("v1/chat/completions", views.chat_completions, name="gateway-chat"),
    path("v1/models", views.models, name="gateway-models"),
]

# the console's process when the gateway runs apart: every /v1 path says where the API is
elsewhere = [re_path(r"^v1(?:/|$)", views.elsewhere, name="gateway-elsewhere")]

urlpatterns = [
    *api,
    path("healthz", healthz, name="healthz"),
    path("metrics", ProcessMetricsView.as_view(), name="metrics"),
]
