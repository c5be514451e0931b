from __future__ import annotations

from django.conf import settings
from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path

from console import agent_urls
from console.accounts import views as accounts_pages
from console.accounts.login import ThrottledAdminAuthenticationForm, ThrottledLoginView
from console.audit import views as audit_pages
from console.dashboard import views as dashboard
from console.gateway import urls as gateway
from console.gearbox import views as gearbox_pages
from console.metrics.views import MetricsView, alerts_page
from console.registry import views as registry_pages

# The admin's login page checks passwords too: the same throttle.
admin.site.login_form = ThrottledAdminAuthenticationForm

urlpatterns = [
    path("", dashboard.overview, name="overview"),
    path("cluster.json", dashboard.cluster_json, name="cluster-json"),
    # Pages (the navigation in console/dashboard/navigation.py lists them).
    path("deployments/", gearbox_pages.deployments_page, name="deployments"),
    path("deployments/<str:name>/", gearbox_pages.deployment_page, name="deployment-detail"),
    path("deployments/<str:name>/transitions/<int:seq>/", gearbox_pages.transition_page, name="transition-detail"),
    path("decisions/<int:pk>/", gearbox_pages.decision_page, name="decision-detail"),
    path("audit/", audit_pages.audit_page, name="audit-page"),
    path("registry/", registry_pages.registry_page, name="registry-page"),
    path("users/", accounts_pages.users_page, name="users-page"),
    path("alerts/", alerts_page, name="alerts-page"),
    path("metrics", MetricsView.as_view(), name="metrics"),
    path("healthz", dashboard.healthz, name="healthz"),
    path("login/", ThrottledLoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("admin/", admin.site.urls),
    path("", include("console.api.urls")),
    # agent protocol v1 (agents/protocol/): here, and in the agent API's own process (console.agent_asgi)
    *agent_urls.api,
    # the OpenAI-compatible gateway (docs/gateway.md): here only when this process serves it too;
    # its own process (console.gateway.asgi) serves it otherwise, and here every /v1 path says so
    *(gateway.api if settings.FLEXPIPE_PROCESS == "all" else gateway.elsewhere),
]
