"""The decision snapshot built incrementally (issue 19): only the nodes whose rows changed since the
process's last snapshot are read again, and what it builds equals a rebuild from every row; the
Overview's fleet view takes its GPUs from the same parts."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.db.models import F
from django.utils import timezone

from agents.protocol import GpuInfo, RegisterRequest
from console.fleet.actions import do_register_node, do_sweep_heartbeats
from console.fleet.models import GPU_UNHEALTHY, GPU_UNREACHABLE, Gpu, Node, gpu_state
from console.gearbox import present, snapshot
from console.gearbox.snapshot import fleet_snapshot
from tests.builders import JOIN_TOKEN
from tests.console.gearbox.harness import GIB, enroll_fleet, uuid

# real commits: inside a transaction (a TestCase) nothing is cached
pytestmark = pytest.mark.django_db(transaction=True)


def _reads_for(now: Any) -> int:
    """Nodes read by one snapshot at `now`, which must equal the rebuild from every row."""
    before = snapshot.nodes_read()
    snap = fleet_snapshot(now)
    assert snap == fleet_snapshot(now, cached=False)
    return snapshot.nodes_read() - before


def test_only_changed_nodes_are_read_again_and_the_snapshot_equals_a_full_rebuild(settings: Any) -> None:
    settings.FLEXPIPE_SNAPSHOT_CACHE_MAX_AGE_S = 3600
    fleet = enroll_fleet({"a1": "A", "b1": "A", "c1": "B", "d1": "B"}, gpus=4)
    now = timezone.now()
    assert _reads_for(now) == 4  # the first one reads every node
    assert _reads_for(now) == 0  # nothing changed: nothing read

    # one node reports a GPU's memory moving: that node only
    fleet.extra[uuid("b1", 2)] = 30 * GIB
    fleet.report("b1", 4)
    assert _reads_for(now) == 1
    gpu = next(g for g in fleet_snapshot(now).gpus if g.uuid == uuid("b1", 2))
    assert gpu.mem_used_bytes > 30 * GIB

    # a report that repeats everything still moves its node's reported_at (the GPUs' last_seen_s)
    fleet.report("c1", 4)
    assert _reads_for(now) == 1

    # a heartbeat sweep takes a silent node out: that node only
    Node.objects.filter(node_id="d1").update(last_seen_at=now - timedelta(minutes=10))
    assert _reads_for(now) == 1
    assert do_sweep_heartbeats(now=now, timeout_s=60) == ["d1"]
    assert _reads_for(now) == 1
    assert [n.schedulable for n in fleet_snapshot(now).nodes if n.id == "d1"] == [False]

    # a node joins (as a registration - a new epoch - may move GPUs between nodes): everything is read again
    gpu = GpuInfo(uuid("e1", 0), 0, "H100-SXM", 80 * GIB, "nvl0")
    do_register_node(RegisterRequest("e1", "e1.test", "test", (gpu,), rack="C", data_addr="e1.test:7070"),
                     token=JOIN_TOKEN, now=now)
    assert _reads_for(now) == 5
    assert uuid("e1", 0) in {g.uuid for g in fleet_snapshot(now).gpus}


def test_the_cache_is_rebuilt_whole_once_it_is_older_than_its_max_age(settings: Any) -> None:
    settings.FLEXPIPE_SNAPSHOT_CACHE_MAX_AGE_S = 3600
    enroll_fleet({"a1": "A", "b1": "A"}, gpus=2)
    now = timezone.now()
    _reads_for(now)
    assert _reads_for(now) == 0
    settings.FLEXPIPE_SNAPSHOT_CACHE_MAX_AGE_S = 0  # off: every row, every time (and nothing counted)
    assert _reads_for(now) == 0
    settings.FLEXPIPE_SNAPSHOT_CACHE_MAX_AGE_S = 1e-9  # older than that already
    assert _reads_for(now) == 2


def _gpus_from_rows() -> dict[str, dict[str, Any]]:
    """The Overview's GPUs as read from every GPU row (what present.fleet_view read before the cache)."""
    rows = Gpu.objects.filter(present=True).values_list("uuid", "node__node_id", "index", "model", "healthy",
                                                        "allocatable", "node__schedulable")
    return {u: {"node": n, "index": i, "model": m, "state": gpu_state(healthy=h, allocatable=a, node_schedulable=s)}
            for u, n, i, m, h, a, s in rows}


def test_the_overview_s_gpus_come_from_the_cache_and_equal_the_rows(settings: Any) -> None:
    settings.FLEXPIPE_SNAPSHOT_CACHE_MAX_AGE_S = 3600
    enroll_fleet({"a1": "A", "b1": "A"}, gpus=2)
    now = timezone.now()
    view = present.fleet_view(now)
    assert view.gpus == _gpus_from_rows() and len(view.gpus) == 4
    before = snapshot.nodes_read()
    assert present.fleet_view(now).gpus == view.gpus
    assert snapshot.nodes_read() == before  # the GPUs and the blocks from one read of nothing new

    Gpu.objects.filter(uuid=uuid("a1", 1)).update(healthy=False)
    Node.objects.filter(node_id="a1").update(last_seq=F("last_seq") + 1)  # as a report moves it
    Node.objects.filter(node_id="b1").update(last_seen_at=now - timedelta(minutes=10))
    assert do_sweep_heartbeats(now=now, timeout_s=60) == ["b1"]
    view = present.fleet_view(now)
    assert view.gpus == _gpus_from_rows()
    assert view.gpus[uuid("a1", 1)]["state"] == GPU_UNHEALTHY
    assert {view.gpus[uuid("b1", i)]["state"] for i in range(2)} == {GPU_UNREACHABLE}
