"""Two real agent daemons on this machine (two data ports) measure the link between them, and the
console's gearbox builds cross-node gears from that measurement - priced by the measured figure.

Nothing is mocked: the agents enroll with a live console over HTTP, the console sends each a
probe_links command when the other registers, each times uploads to the other's data server (the
path KV takes) and reports the link; the snapshot, the planner and the cost model read it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.utils import timezone

from agents.node.daemon import NodeAgent
from agents.node.links import METHOD, LinkProber
from console.fleet.models import AgentCommand, NodeLink
from console.gearbox.snapshot import fleet_snapshot
from scheduler.costmodel import Slo, Workload, kv_route
from scheduler.gearbox import Deployment, LoadSample, LoadWindow, decide
from scheduler.modelspec import model_spec
from scheduler.plan import Gear, Plan, Stage
from scheduler.planner import PlannerOptions, plan_candidates
from scheduler.topology import GBPS_TO_BYTES_PER_S
from tests.agents.node import test_live
from tests.agents.node.conftest import gpus
from tests.agents.node.test_live import wait_for

console, running = test_live.console, test_live.running  # the live console and agent fixtures

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

LOW_BAR = PlannerOptions(min_pp_link_gbps=0.01, min_kv_link_gbps=0.01, max_candidates=40)


def cross_node(gear: Gear, snap: Any) -> bool:
    return any(len({snap.gpu_by_uuid[u].node_id for u in p.gpu_uuids}) > 1 for p in gear.plans)


def test_two_daemons_measure_their_link_and_the_gearbox_builds_cross_node_gears_from_it(
        running: Callable[..., NodeAgent], settings: Any) -> None:
    # no assumed path between nodes: whatever crosses them below stands on the measured link
    settings.FLEXPIPE_INTRA_RACK_GBPS = 0.0
    settings.FLEXPIPE_INTER_RACK_GBPS = 0.0
    model = model_spec("Llama-3-8B")
    a = running("n1", spec="2xA100-80G", links=LinkProber(bulk_bytes=4 << 20, rounds=2, pings=3))
    wait_for(lambda: NodeLink.objects.count() == 0 and AgentCommand.objects.filter(kind="probe_links").count() == 0,
             20, "n1 alone: nothing to probe")
    before = fleet_snapshot(timezone.now())
    b = running("n2", spec="2xA100-80G", links=LinkProber(bulk_bytes=4 << 20, rounds=2, pings=3))
    wait_for(lambda: NodeLink.objects.filter(method=METHOD).count() == 2, 60, "both directions measured",
             lambda: "; ".join(f"{c.node.node_id} {c.kind} {c.state} {c.detail[:80]}"
                               for c in AgentCommand.objects.select_related("node")))
    assert a.data_addr != b.data_addr
    link = NodeLink.objects.get(node__node_id="n1", peer="n2")
    assert link.bw_gbps > 0 and link.latency_us is not None and link.latency_us >= 0

    snap = fleet_snapshot(timezone.now())
    measured = snap.node_link_bytes_per_s("n1", "n2")
    assert measured == pytest.approx(min(link.bw_gbps, NodeLink.objects.get(node__node_id="n2").bw_gbps)
                                     * GBPS_TO_BYTES_PER_S)
    assert before.node_link_bytes_per_s("n1", "n2") == 0.0  # before: no path at all

    # the planner builds cross-node plans (prefill/decode splits, pipelines) over the measured link
    heavy = Workload(rate_rps=400.0, prompt_tokens_mean=512, output_tokens_mean=128)
    slo = Slo(ttft_ms=5000, tpot_ms=500)
    found = plan_candidates(model, snap, heavy, slo=slo, options=LOW_BAR)
    spanning = [c for c in found.feasible if cross_node(c.gear, snap)]
    assert {p.mode for c in spanning for p in c.gear.plans} >= {"disaggregated"} or any(
        p.pp > 1 for c in spanning for p in c.gear.plans), [c.gear.shape() for c in found.feasible]
    assert not [c for c in plan_candidates(model, before, heavy, slo=slo, options=LOW_BAR).feasible
                if cross_node(c.gear, before)]
    # ... and the gearbox weighs them on the measured figure
    on_n1 = Plan(model.name, "colocated", (Stage(0, model.num_layers, (gpus("n1", 1)[0],)),), kv_reserve_tokens=4096)
    current = Gear(model.name, (on_n1,), (1.0,))
    window = LoadWindow(tuple(LoadSample(snap.now_s - 60 + 15 * i, 400.0, 512, 128) for i in range(5)))
    d = decide(Deployment("d", model.name, slo, current), current, snap, window, snap.now_s, model=model,
               planner_options=LOW_BAR)
    assert any(cross_node(c.gear, snap) for c in d.candidates), [c.gear.shape() for c in d.candidates]

    # a move from n1 to n2 is priced by the measured link: KV bytes over the measured bandwidth
    route = kv_route(on_n1.stages, (Stage(0, model.num_layers, (gpus("n2", 1)[0],)),), model, snap)
    assert route.s_per_token == pytest.approx(model.kv_bytes_per_token / measured)
    latency = snap.node_link_latency_s("n1", "n2")
    assert latency is not None and route.latency_s > latency
