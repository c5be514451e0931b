"""One pool in the simulator (scheduler/pool/sharing.py and priority.py through FlexPipePolicy):
the simulated agents refuse a PREPARE over 92% summed across deployments exactly as a real one
does; a priority-10 deployment takes GPUs from a priority-1 one, which moves, both decisions
naming the other, nothing lost."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from agents.sim.fleet import FleetSim
from agents.sim.run import run_policy
from agents.sim.scenario import parse_scenario
from scheduler.booking import REFUSAL_REASON
from scheduler.invariants import check
from scheduler.refusal import Refused
from tests.agents.sim.worlds import LIVELY
from tests.scheduler.builders import tp_plan


def two_on_one_node() -> FleetSim:
    doc = copy.deepcopy(LIVELY)
    doc["events"] = []
    sim = FleetSim(parse_scenario(doc))
    sim.start_baselines()
    return sim


def test_a_simulated_agent_refuses_a_prepare_over_092_summed_across_deployments() -> None:
    sim = two_on_one_node()
    chat = next(e for e in sim.live.values() if e.deployment == "chat")
    # the other deployment asks for chat's GPUs: beside what chat books there it is over 92%
    with pytest.raises(Refused) as refused:
        sim.launch("sum", tp_plan("Llama-3-70B", chat.plan.gpu_uuids, kv_tokens=8192))
    assert refused.value.code == REFUSAL_REASON and "above the 92% limit" in refused.value.reason
    # plans of two deployments with small KV reserves share free GPUs under 92% together
    free = [g.uuid for g in sim.snapshot().gpus if g.uuid not in sim.booked_bytes() and g.model == "A100-80G"][:4]
    assert len(free) == 4
    sim.launch("sum", tp_plan("Llama-3-70B", free, kv_tokens=4096))
    free = free[:2]
    sim.launch("chat", tp_plan("Llama-3-8B", free, kv_tokens=4096))
    booked = sim.booked_bytes()
    assert all(booked[u] <= 0.92 * sim.gpu_mem_bytes(u) for u in free)
    assert check(sim.memory_log.events, complete=False) == []
    # the checker judges how many deployments hold a GPU by the limit the bookings carried
    sim.max_models_per_gpu = 1
    sim.launch("chat", tp_plan("Llama-3-8B", free, kv_tokens=2048))
    found = check(sim.memory_log.events, complete=False)
    assert found and "plans of 2 deployments" in str(found[0]) and "max_models_per_gpu=1" in str(found[0])


TAKE: dict[str, Any] = {
    "name": "take", "seed": 3, "duration_s": 560,
    "nodes": [{"id": "a1", "gpu": "H100-SXM", "gpus": 8, "nvlink": True, "rack": "A"},
              {"id": "c1", "gpu": "L40S", "gpus": 2, "nvlink": False, "rack": "C"}],
    "network": {"intra_rack_gbps": 400, "inter_rack_gbps": 100},
    "max_models_per_gpu": 1,  # a 70B would otherwise share the 7B's GPU by memory rather than take it
    "models": [
        {"deployment": "hi", "model": "Llama-3-70B", "slo": {"ttft_ms": 3000, "tpot_ms": 120}, "priority": 10,
         "baseline": {"tp": 4, "nodes": ["a1"]}},
        {"deployment": "lo", "model": "Llama-2-7B", "slo": {"ttft_ms": 3000, "tpot_ms": 150}, "priority": 1,
         "baseline": {"tp": 4, "nodes": ["a1"]}}],
    "workload": [
        # the 70B's load rises past what it serves on the GPUs the 7B leaves it
        {"deployment": "hi", "arrival": "poisson", "rate_rps": [[0, 3], [200, 30]],
         "prompt_tokens": {"dist": "fixed", "value": 500}, "output_tokens": {"dist": "fixed", "value": 100}},
        {"deployment": "lo", "arrival": "poisson", "rate_rps": 20,
         "prompt_tokens": {"dist": "fixed", "value": 300}, "output_tokens": {"dist": "fixed", "value": 80}}],
    "events": [],
}


def test_a_priority_10_deployment_takes_gpus_from_a_priority_1_one_which_moves_in_the_simulator() -> None:
    out = run_policy(parse_scenario(copy.deepcopy(TAKE)), "flexpipe")
    takes = [d for d in out["decisions"] if d.get("takes")]
    gives = [d for d in out["decisions"] if d.get("gives_to")]
    assert takes and gives, "the case under test: the 70B took GPUs from the 7B"
    t, g = takes[0], gives[0]
    assert t["deployment"] == "hi" and list(t["takes"]) == ["lo"] and "from deployment lo (priority 1)" in t["reason"]
    assert g["deployment"] == "lo" and g["gives_to"] == "hi" and g["t_s"] == t["t_s"]
    assert "to deployment hi (priority 10 > 1)" in g["reason"] and g["outcome"] == "switch"
    # it yielded through a transition of its own: nothing lost, every invariant held
    assert out["lost"] == 0 and out["transition_invariant_violations"] == []
    assert out["memory_violations"] == [] and out["sequence_violations"] == []


def test_a_giver_with_nowhere_to_go_unloads_its_requests_wait_and_it_comes_back_when_the_taker_shrinks() -> None:
    doc = copy.deepcopy(TAKE)
    doc["nodes"] = doc["nodes"][:1]  # no L40S: nowhere for the 7B to go
    doc["duration_s"] = 900
    doc["workload"][0]["rate_rps"] = [[0, 3], [200, 30], [500, 2]]  # the 70B's tide rises, then ebbs
    doc["workload"][1]["rate_rps"] = 5
    out = run_policy(parse_scenario(doc), "flexpipe")
    seen = [(d["deployment"], d["outcome"]) for d in out["decisions"] if d["outcome"] != "blocked"]
    unload = next(d for d in out["decisions"] if d["outcome"] == "unload")
    assert unload["deployment"] == "lo" and unload["gives_to"] == "hi"
    assert "to deployment hi (priority 10 > 1)" in unload["reason"] and "no gear of it fits" in unload["reason"]
    # the taker switches onto the given GPUs before the giver comes back; the giver returns once
    # the taker's load ebbs and it shrinks
    i = seen.index(("lo", "unload"))
    assert seen[i + 1] == ("hi", "switch") and ("lo", "switch") in seen[i + 2:]
    assert seen.index(("lo", "switch"), i) > seen.index(("hi", "switch"), i + 2)
    assert out["unloads"] == 1
    # its requests waited; none was lost, every invariant held
    lo = out["per_deployment"]["lo"]
    assert lo["lost"] == 0 and lo["finished"] == lo["admitted"] and out["lost"] == 0
    assert out["transition_invariant_violations"] == [] and out["sequence_violations"] == []
    assert out["memory_violations"] == []


def test_a_gpu_two_plans_share_is_one_gpu_held() -> None:
    sim = two_on_one_node()
    free = [g.uuid for g in sim.snapshot().gpus if g.uuid not in sim.booked_bytes() and g.model == "A100-80G"][:4]
    sim.launch("sum", tp_plan("Llama-3-70B", free, kv_tokens=4096))
    sim.launch("chat", tp_plan("Llama-3-8B", free[:2], kv_tokens=4096))  # on two of the same four GPUs
    plans = [len(e.plan.gpu_uuids) for e in sim.live.values()]
    distinct = {u for e in sim.live.values() for u in e.plan.gpu_uuids}
    assert sum(plans) == len(distinct) + 2
    sim.advance_to(sim.scenario.duration_s + 1)
    assert sim.recorder.gpu_hours == pytest.approx(len(distinct) * sim.scenario.duration_s / 3600)
