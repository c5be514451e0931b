"""Connected websocket clients, counted by the consumers themselves (per process: Prometheus sums
the web processes). `page` is the consumer's page: cluster, audit, registry, ..."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from console.metrics import REGISTRY

CLIENTS = Gauge("flexpipe_websocket_clients", "Websocket clients connected now, per page (this process)",
                ["page"], registry=REGISTRY)
CONNECTS = Counter("flexpipe_websocket_connects", "Websocket connections accepted, per page", ["page"],
                   registry=REGISTRY)
DISCONNECTS = Counter("flexpipe_websocket_disconnects", "Accepted websocket connections that ended, per page",
                      ["page"], registry=REGISTRY)

RESYNCS = Counter("flexpipe_websocket_resyncs", "Websockets closed for falling behind (4409: the page reconnects "
                  "and starts over from a snapshot), per page", ["page"], registry=REGISTRY)


def connected(page: str) -> None:
    CLIENTS.labels(page=page).inc()
    CONNECTS.labels(page=page).inc()


def disconnected(page: str) -> None:
    CLIENTS.labels(page=page).dec()
    DISCONNECTS.labels(page=page).inc()


def resynced(page: str) -> None:
    RESYNCS.labels(page=page).inc()
