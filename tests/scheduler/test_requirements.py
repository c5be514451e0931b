"""A registered model version's placement requirements (scheduler.requirements) keep plans off the GPUs
and nodes that do not meet them, with a reason in the candidates and in the decision."""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduler import gearbox
from scheduler.capabilities import SIM_CAPS, TORCH_CAPS, VLLM_CAPS, EngineCaps
from scheduler.gearbox import Deployment, LoadWindow, Trigger
from scheduler.modelspec import model_spec
from scheduler.planner import PlannerOptions, plan_candidates
from scheduler.requirements import Requirements
from scheduler.topology import Snapshot
from tests.scheduler.builders import CHAT_SLO, NodeSpec, chat_workload, make_fleet, one_plan_gear, tp_plan

M8 = model_spec("Llama-3-8B")
GIB = 2**30


def fleet(**caps: EngineCaps) -> Snapshot:
    """a1: 4 A100-40G; b1: 4 H100-SXM (80 GB); engines as given (none: unrestricted)."""
    snap = make_fleet([NodeSpec("a1", "A100-40G", gpus=4), NodeSpec("b1", gpus=4)], intra_rack_gbps=400)
    return replace(snap, nodes=tuple(replace(n, engine=caps.get(n.id)) for n in snap.nodes))


def nodes_used(snap: Snapshot, req: Requirements) -> set[str]:
    found = plan_candidates(M8, snap, chat_workload(2.0), slo=CHAT_SLO, options=PlannerOptions(requires=req))
    assert found.feasible, found.infeasible
    return {snap.gpu_by_uuid[u].node_id for c in found.feasible for u in c.gear.gpu_uuids}


def test_without_requirements_both_nodes_are_used() -> None:
    assert nodes_used(fleet(), Requirements()) == {"a1", "b1"}


def test_a_gpu_below_min_gpu_mem_bytes_gets_no_plan_and_the_candidates_say_why() -> None:
    req = Requirements(min_gpu_mem_bytes=60 * GIB, source="llama v2")
    snap = fleet()
    assert nodes_used(snap, req) == {"b1"}
    found = plan_candidates(M8, snap, chat_workload(2.0), slo=CHAT_SLO, options=PlannerOptions(requires=req))
    why = [x for x in found.excluded if "a1" in x]
    assert why and "below the registered min_gpu_mem_bytes of llama v2 (60.0 GiB)" in why[0], found.excluded


def test_a_node_whose_engine_differs_gets_no_plan_and_a_node_that_reported_none_or_simulates_is_used() -> None:
    req = Requirements(engine="vllm", source="llama v1")
    assert nodes_used(fleet(a1=TORCH_CAPS, b1=VLLM_CAPS), req) == {"b1"}
    found = plan_candidates(M8, fleet(a1=TORCH_CAPS, b1=VLLM_CAPS), chat_workload(2.0), slo=CHAT_SLO,
                            options=PlannerOptions(requires=req))
    assert any("node a1 runs torch, the registered engine of llama v1 is vllm" in x for x in found.excluded)
    assert nodes_used(fleet(b1=VLLM_CAPS), req) == {"a1", "b1"}  # a1 reported no engine: unrestricted
    assert nodes_used(fleet(a1=SIM_CAPS, b1=VLLM_CAPS), req) == {"a1", "b1"}  # the simulator stands in for any


def test_when_no_gpu_meets_them_the_planner_says_so_instead_of_placing() -> None:
    req = Requirements(min_gpu_mem_bytes=100 * GIB)
    found = plan_candidates(M8, fleet(), chat_workload(2.0), slo=CHAT_SLO, options=PlannerOptions(requires=req))
    assert not found.feasible
    assert any("min_gpu_mem_bytes" in r for r in found.infeasible), found.infeasible


def test_the_decision_carries_the_reason_and_an_operators_gear_there_is_refused() -> None:
    snap = fleet(a1=TORCH_CAPS, b1=VLLM_CAPS)
    req = Requirements(min_gpu_mem_bytes=60 * GIB, engine="vllm", source="llama v1")
    base = one_plan_gear(tp_plan(M8, ["b1-g0"]))
    dep = Deployment("chat", M8.name, CHAT_SLO, base)
    d = gearbox.decide(dep, None, snap, LoadWindow(), snap.now_s, trigger=Trigger.MANUAL,
                       planner_options=PlannerOptions(requires=req))
    assert d.candidates and all(snap.gpu_by_uuid[u].node_id == "b1" for c in d.candidates for u in c.gear.gpu_uuids)
    assert any("a1" in x and "min_gpu_mem_bytes" in x for x in d.excluded), d.excluded
    on_a1 = one_plan_gear(tp_plan(M8, ["a1-g0"]))
    asked = gearbox.decide(dep, None, snap, LoadWindow(), snap.now_s, trigger=Trigger.MANUAL, requested_gear=on_a1,
                           planner_options=PlannerOptions(requires=req))
    assert asked.outcome is gearbox.Outcome.BLOCKED
    text = " ".join(asked.reasons)
    assert "GPU a1/0 (A100-40G) has 37.3 GiB, below the registered min_gpu_mem_bytes" in text
    assert "node a1 runs torch" in text


def test_a_negative_minimum_is_refused() -> None:
    with pytest.raises(ValueError, match="min_gpu_mem_bytes"):
        Requirements(min_gpu_mem_bytes=-1)
