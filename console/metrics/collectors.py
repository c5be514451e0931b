"""State metrics, computed from the database at each scrape."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from django.utils import timezone
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class Described(Collector):
    """A collector that names its families up front (`families`: (name, type) of what `collect`
    yields). The registry maps each name to its collector, so a collection restricted to some names
    runs only the collectors that yield them: the alert rules' evaluation (console/metrics/alerts.py)
    reads the few families the rules reference, not the whole fleet's. A test checks that
    `families` and `collect` agree."""

    families: tuple[tuple[str, str], ...] = ()

    def describe(self) -> Iterator[Metric]:
        for name, kind in self.families:
            yield Metric(name, "", kind)


class FleetCollector(Described):
    families = (("flexpipe_agent_report_lag_seconds", "gauge"), ("flexpipe_node_schedulable", "gauge"))

    def collect(self) -> Iterator[Metric]:
        from console.fleet.models import Node

        now = timezone.now()
        lag = GaugeMetricFamily("flexpipe_agent_report_lag_seconds",
                                "Seconds since each node's agent last reported (now - last report)", labels=["node"])
        schedulable = GaugeMetricFamily("flexpipe_node_schedulable",
                                        "1 when the node reports within the heartbeat timeout, else 0",
                                        labels=["node"])
        for node_id, last_seen, ok in Node.objects.values_list("node_id", "last_seen_at", "schedulable"):
            if last_seen is not None:
                lag.add_metric([node_id], max(0.0, (now - last_seen).total_seconds()))
            schedulable.add_metric([node_id], 1.0 if ok else 0.0)
        yield lag
        yield schedulable


class GpuStateCollector(Described):
    families = (("flexpipe_gpus", "gauge"),)

    def collect(self) -> Iterator[Metric]:
        from console.fleet.models import GPU_STATES, Gpu, gpu_state

        counts: Counter[str] = Counter(
            gpu_state(healthy=h, allocatable=a, node_schedulable=s)
            for h, a, s in Gpu.objects.filter(present=True).values_list("healthy", "allocatable", "node__schedulable"))
        gpus = GaugeMetricFamily("flexpipe_gpus", "GPUs by state: ours (usable), tenant (lent to another tenant), "
                                 "unhealthy, unreachable (node missed the heartbeat)", labels=["state"])
        for state in GPU_STATES:
            gpus.add_metric([state], counts.get(state, 0))
        yield gpus


class ModelRegistryCollector(Described):
    families = (("flexpipe_registry_versions", "gauge"),)

    def collect(self) -> Iterator[Metric]:
        from django.db.models import Count

        from console.registry.models import ModelVersion

        counts = dict(ModelVersion.objects.values_list("status").annotate(n=Count("id")).values_list("status", "n"))
        family = GaugeMetricFamily("flexpipe_registry_versions", "Model versions in the registry by status",
                                   labels=["status"])
        for status in ModelVersion.STATUSES:
            family.add_metric([status], counts.get(status, 0))
        yield family


class AuditCollector(Described):
    families = (("flexpipe_audit_chain_length", "gauge"),)

    def collect(self) -> Iterator[Metric]:
        from console.audit.models import AuditHead

        head = AuditHead.objects.filter(pk=1).values_list("seq", flat=True).first()
        yield GaugeMetricFamily("flexpipe_audit_chain_length", "Entries in the hash-chained audit log",
                                value=head or 0)
