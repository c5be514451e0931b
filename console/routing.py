from __future__ import annotations

from django.urls import path

from console.fleet.consumers import ClusterConsumer

websocket_urlpatterns = [
    path("ws/cluster/", ClusterConsumer.as_asgi()),
]
