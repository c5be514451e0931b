"""Prometheus metrics of the console, served as text at /metrics (see views.py for who may scrape).

Two kinds, one registry (`REGISTRY`, ours rather than prometheus_client's global one):

  * state metrics, read from the database at scrape time by collectors — so every web process
    answers the same, and nothing is lost when a process restarts:
        collectors.py  fleet (agent report lag, GPUs by state), registry, audit chain
        gearbox.py     deployments, transitions, decisions — the gearbox task fills this module
  * process-local event metrics, counted where they happen:
        websockets.py  connected websocket clients, connects and disconnects per page

To add a metric family: yield it from a collector's `collect()` (state) or declare it with
`registry=REGISTRY` (events). Names start with `flexpipe_` and carry their unit.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

REGISTRY = CollectorRegistry()
