from __future__ import annotations

from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path

from console.dashboard import views as dashboard
from console.fleet import agent_api

urlpatterns = [
    path("", dashboard.overview, name="overview"),
    path("cluster.json", dashboard.cluster_json, name="cluster-json"),
    path("healthz", dashboard.healthz, name="healthz"),
    path("login/", auth_views.LoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("admin/", admin.site.urls),
    path("", include("console.api.urls")),
    # agent protocol v1 (agents/protocol.py)
    path("agent/v1/register", agent_api.register, name="agent-register"),
    path("agent/v1/report", agent_api.report, name="agent-report"),
    path("agent/v1/commands", agent_api.commands, name="agent-commands"),
    path("agent/v1/commands/<int:command_id>/ack", agent_api.ack, name="agent-ack"),
]
