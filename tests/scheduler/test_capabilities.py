"""Engine capabilities (scheduler.capabilities) in the planner, the cost model and the agents' check."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from scheduler.capabilities import TORCH_CAPS, VLLM_CAPS, EngineCaps, engine_refusals, plan_refusals
from scheduler.costmodel import kv_route
from scheduler.modelspec import model_spec
from scheduler.plan import Plan, Stage
from scheduler.planner import PlannerOptions, plan_candidates
from scheduler.topology import Snapshot
from tests.scheduler.builders import CHAT_SLO, NodeSpec, chat_workload, make_fleet, tp_plan

M8 = model_spec("Llama-3-8B")


def engines(snap: Snapshot, **caps: EngineCaps) -> Snapshot:
    return replace(snap, nodes=tuple(replace(n, engine=caps.get(n.id)) for n in snap.nodes))


def two_nodes(**caps: EngineCaps) -> Snapshot:
    return engines(make_fleet([NodeSpec("a1", gpus=4), NodeSpec("b1", "A100-80G", gpus=4)], intra_rack_gbps=400),
                   **caps)


def test_a_vllm_node_gets_no_prefill_decode_split_and_the_candidates_say_why() -> None:
    def fleet(**caps: EngineCaps) -> Snapshot:
        return engines(make_fleet([NodeSpec("a1", gpus=4), NodeSpec("a2", gpus=4)], intra_rack_gbps=400), **caps)

    free = plan_candidates(M8, fleet(), chat_workload(30.0), slo=CHAT_SLO)
    assert free.excluded == ()
    held = plan_candidates(M8, fleet(a2=VLLM_CAPS), chat_workload(30.0), slo=CHAT_SLO)
    for c in held.feasible:
        for p in c.gear.plans:
            assert not plan_refusals(p, fleet(a2=VLLM_CAPS)), p.shape()
    assert any("node a2 (vllm) cannot run disaggregated plans" in x for x in held.excluded), held.excluded


def test_tp_sizes_an_engine_does_not_run_are_never_proposed() -> None:
    only_tp1 = EngineCaps(backend="custom", tp_sizes=(1,))
    cands = plan_candidates(M8, two_nodes(a1=only_tp1, b1=only_tp1), chat_workload(8.0), slo=CHAT_SLO,
                            options=PlannerOptions(allow_pp=False, allow_disaggregated=False))
    assert cands.feasible and all(st.tp == 1 for c in cands.feasible for p in c.gear.plans for st in p.all_stages)
    assert any("cannot run TP 2" in x for x in cands.excluded)


def test_a_fixed_memory_share_leaves_the_plan_that_much_less_kv() -> None:
    def tp1_kv(snap: Snapshot) -> int:
        cands = plan_candidates(M8, snap, chat_workload(1.0), slo=CHAT_SLO)
        return max(p.kv_reserve_tokens for c in cands.feasible for p in c.gear.plans if p.stages[0].tp == 1)

    share = replace(VLLM_CAPS, mem_fraction=0.3)
    assert tp1_kv(two_nodes(a1=share, b1=share)) < tp1_kv(two_nodes())


def test_an_engine_that_cannot_move_kv_gets_every_sequence_replayed() -> None:
    src = Plan(M8.name, "colocated", (Stage(0, 32, ("a1-g0",)),), kv_reserve_tokens=1000)
    dst = Plan(M8.name, "colocated", (Stage(0, 32, ("b1-g0",)),), kv_reserve_tokens=1000)
    assert math.isfinite(kv_route(src.stages, dst.stages, M8, two_nodes()).time_s(100))
    assert math.isinf(kv_route(src.stages, dst.stages, M8, two_nodes(b1=VLLM_CAPS)).time_s(100))


def test_the_agents_refusal_and_the_planners_filter_say_the_same() -> None:
    pd = Plan(M8.name, "disaggregated", (Stage(0, 32, ("a1-g0",)),), (Stage(0, 32, ("b1-g0",)),), 1000)
    why = plan_refusals(pd, two_nodes(b1=VLLM_CAPS))
    assert why == engine_refusals(pd, ["a1", "b1"], {"b1": VLLM_CAPS})
    assert any("cannot run disaggregated plans" in w for w in why)
    assert plan_refusals(tp_plan(M8, ["a1-g0"]), two_nodes(a1=TORCH_CAPS)) == []


@pytest.mark.parametrize("raw,field", [
    ({"backend": "vllm", "modes": ["warp"]}, "engine.modes"),
    ({"backend": "vllm", "tp_sizes": [0]}, "engine.tp_sizes"),
    ({"backend": "vllm", "mem_fraction": 1.5}, "engine.mem_fraction"),
    ({"backend": "vllm", "version": 99}, "engine.version"),
    ({"backend": "vllm", "kv_migration": "no"}, "engine.kv_migration"),
    ({"backend": "vllm", "colour": "red"}, "engine.colour"),
    ({"modes": ["colocated"]}, "engine.backend"),
])
def test_bad_capabilities_name_the_field(raw: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        EngineCaps.from_dict(raw)


def test_capabilities_round_trip_and_travel_in_the_snapshot() -> None:
    assert EngineCaps.from_dict(VLLM_CAPS.to_dict()) == VLLM_CAPS
    snap = two_nodes(b1=VLLM_CAPS)
    back = Snapshot.from_dict(snap.to_dict())
    assert back.node_by_id["b1"].engine == VLLM_CAPS and back.node_by_id["a1"].engine is None
