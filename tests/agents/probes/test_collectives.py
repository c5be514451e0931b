"""Collective sweeps (agents/probes/collectives.py) on this machine: gloo across two CPU processes,
the same code a GPU node runs with nccl across its GPUs."""

from __future__ import annotations

import pytest

from agents.probes.collectives import bus_gbps, copy_sweep, node_collectives
from scheduler.collectives import CollectiveCurve

pytestmark = pytest.mark.slow  # two spawned processes that import torch: several seconds


def test_a_two_process_sweep_gives_curves_the_cost_model_reads() -> None:
    # spawn, as on a GPU node: a forked pytest worker (threads, sockets) can deadlock its children
    reports = node_collectives(["cpu", "cpu"], sizes=(4096, 1 << 16, 1 << 18), repeats=2, wall=lambda: 1.7e9)
    assert {r.op for r in reports} == {"all_reduce", "send_recv"}
    for r in reports:
        assert r.backend == "gloo" and r.scope == "intra" and r.measured_at == 1.7e9
        assert [b for b, _ in r.points] == [4096, 1 << 16, 1 << 18] and all(t > 0 for _, t in r.points)
        curve = CollectiveCurve(r.op, "intra", "n1", r.ranks, r.points)  # type: ignore[arg-type]
        assert curve.time_s(1 << 17) > 0


def test_copies_and_bus_bandwidth() -> None:
    pts = copy_sweep("cpu", "cpu", sizes=(1 << 10, 1 << 20), repeats=2)
    assert [b for b, _ in pts] == [1 << 10, 1 << 20] and all(t > 0 for _, t in pts)
    # nccl-tests' bus bandwidth: an all-reduce over n ranks moves 2(n-1)/n of the message per rank
    assert bus_gbps("all_reduce", 8, 10**9, 1.0) == pytest.approx(8 * 2 * 7 / 8)
    assert bus_gbps("send_recv", 2, 10**9, 1.0) == pytest.approx(8.0)
