from __future__ import annotations

from django.urls import path

from console.audit.consumers import AuditConsumer
from console.fleet.consumers import ClusterConsumer
from console.gearbox.consumers import DeploymentConsumer, GearboxConsumer
from console.registry.consumers import RegistryConsumer

# One path per live page; each consumer derives from console.dashboard.consumers.LiveConsumer.
websocket_urlpatterns = [
    path("ws/cluster/", ClusterConsumer.as_asgi()),
    path("ws/audit/", AuditConsumer.as_asgi()),
    path("ws/registry/", RegistryConsumer.as_asgi()),
    path("ws/gearbox/", GearboxConsumer.as_asgi()),
    path("ws/deployments/<str:name>/", DeploymentConsumer.as_asgi()),
]
