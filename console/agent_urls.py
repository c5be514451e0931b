"""Agent protocol v1's URLs (agents/protocol/), and the URLconf of the agent API's own process.

`api` is mounted by the console's URLconf too (console/urls.py): an agent pointed at the console's
address is served there as before. `urlpatterns` is ROOT_URLCONF in the agent API's own process
(FLEXPIPE_PROCESS=agents, console.agent_asgi): the protocol, and /healthz and /metrics for that
process itself; no page, REST API or websocket of the console is reachable there.
"""

from __future__ import annotations

from django.urls import path

from console.dashboard.views import healthz
from console.fleet import agent_api
from console.gearbox import agent_api as gearbox_agent_api
from console.metrics.views import ProcessMetricsView

api = [
    path("agent/v1/register", agent_api.register, name="agent-register"),
    path("agent/v1/report", agent_api.report, name="agent-report"),
    path("agent/v1/commands", agent_api.commands, name="agent-commands"),
    path("agent/v1/commands/<int:command_id>/ack", agent_api.ack, name="agent-ack"),
    path("agent/v1/routing", gearbox_agent_api.routing, name="agent-routing"),
]

urlpatterns = [
    *api,
    path("healthz", healthz, name="healthz"),
    path("metrics", ProcessMetricsView.as_view(), name="metrics"),
]
