"""/api/v1: every REST endpoint, one router. OpenAPI 3 at /api/schema/, Swagger UI at /api/docs/.

To add endpoints, write the viewset in `<app>/api.py` and register it here; the schema and Swagger UI
pick it up by themselves.
"""

from __future__ import annotations

from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.routers import SimpleRouter

from console.accounts import api as accounts_api
from console.audit.api import AuditEntryViewSet
from console.fleet.api import GpuViewSet, NodeViewSet
from console.gearbox.api import (
    DecisionViewSet,
    DeploymentViewSet,
    GearViewSet,
    PlanViewSet,
    TransitionViewSet,
)
from console.gearbox.api_jobs import JobViewSet
from console.metrics.api import alerts_view
from console.registry.api import ModelVersionViewSet

router = SimpleRouter(trailing_slash=False)
router.register("models", ModelVersionViewSet, basename="modelversion")
router.register("audit", AuditEntryViewSet, basename="audit")
router.register("nodes", NodeViewSet, basename="node")
router.register("gpus", GpuViewSet, basename="gpu")
router.register("deployments", DeploymentViewSet, basename="deployment")
router.register("gears", GearViewSet, basename="gear")
router.register("plans", PlanViewSet, basename="plan")
router.register("transitions", TransitionViewSet, basename="transition")
router.register("decisions", DecisionViewSet, basename="decision")
router.register("jobs", JobViewSet, basename="job")
router.register("users", accounts_api.UserViewSet, basename="user")

urlpatterns = [
    path("api/v1/me", accounts_api.me, name="api-me"),
    path("api/v1/alerts", alerts_view, name="api-alerts"),
    path("api/v1/", include(router.urls)),
    path("api/schema/", SpectacularAPIView.as_view(), name="api-schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="api-schema"), name="api-docs"),
]
