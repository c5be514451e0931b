"""Gearbox metrics — THE place for them. Empty until the gearbox app lands; it is already registered.

Fill `GearboxCollector.collect()` from the gearbox's models (state read at scrape time, like
collectors.py), keeping these names and labels (issue 6, point 4):

    flexpipe_deployment_plan_info{deployment, plan_id, gear}      gauge 1 per deployment's current plan
    flexpipe_deployment_gear{deployment}                          gauge: current gear number
    flexpipe_deployment_pinned{deployment}                        gauge 0/1
    flexpipe_transition_phase{deployment, phase}                  gauge 1 for the active phase
                                                                  (prepare|switch|cleanup|rollback|idle)
    flexpipe_switch_duration_seconds{deployment}                  histogram of finished transitions,
                                                                  built with HistogramMetricFamily from
                                                                  the transition rows (buckets below)
    flexpipe_migration_queue_length{deployment}                   gauge: KV migrations waiting
    flexpipe_shadow_plan_status{deployment, status}               gauge 1 for the shadow plan's status
    flexpipe_decisions{deployment, outcome, reason}               counter (CounterMetricFamily,
                                                                  counted from the decision rows)

Read everything in one or two queries per family; a scrape must stay cheap (every 15 s).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

SWITCH_DURATION_BUCKETS_S = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)


class GearboxCollector(Collector):
    def collect(self) -> Iterator[Metric]:
        # Nothing to report before the gearbox exists; yield the families listed above once it does.
        return iter(())
