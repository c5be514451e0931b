"""A deployment the simulated fleet was not configured with comes up from what its PREPARE carries.

The console creates deployments the scenario never listed (POST /api/v1/deployments), of registry
models outside the built-in catalog too; its prepare_plan carries the model's shape (model_spec)
and the deployment's SLO (agents/protocol/). SimAgents on FleetSim - what the live fleet of
`make run` runs - serves such a deployment with that shape, books its memory by the same 92% rule,
and refuses a prepare that lacks either piece naming the field, booking nothing.
"""

from __future__ import annotations

from typing import Any

import pytest

from agents.sim.executor import SimAgents
from agents.sim.fleet import FleetSim
from scheduler.booking import plan_memory
from scheduler.modelspec import from_hf_config, model_spec
from scheduler.plan import Plan, Stage
from scheduler.transition import CommandIntent, CommandKind, Step
from tests.agents.sim.worlds import one_deployment

# A ~51 B Llama-shaped model the catalog does not know (tests/console/gearbox/test_deployment_api.py's):
# 103 GB of bf16 weights, more than one 80 GB H100 holds
BIG = from_hf_config({"model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 60,
                      "num_attention_heads": 64, "num_key_value_heads": 8, "intermediate_size": 28672,
                      "vocab_size": 32000, "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}, name="big-51b")
SLO = {"ttft_ms": 1500, "tpot_ms": 80}

Acks = dict[str, tuple[bool, str, dict[str, Any]]]


def fleet() -> tuple[FleetSim, SimAgents, Acks]:
    sim = FleetSim(one_deployment(rate_rps=0))  # one H100 node; its scenario serves "d" only
    acks: Acks = {}
    agents = SimAgents(sim, lambda cmd, ok, detail, result: acks.__setitem__(cmd.key, (ok, detail, dict(result))))
    sim.listener = agents.listener()
    return sim, agents, acks


def big_plan(sim: FleetSim, gpus: tuple[int, ...], kv_tokens: int = 100_000) -> Plan:
    return Plan(BIG.name, "colocated", (Stage(0, BIG.num_layers, tuple(sim.cluster.gpu_uuid("a1", i) for i in gpus)),),
                kv_reserve_tokens=kv_tokens)


def prepare(key: str, plan: Plan, **extra: Any) -> CommandIntent:
    payload = {"plan_id": plan.plan_id, "deployment": "big", "plan": plan.to_dict(), "model": plan.model, **extra}
    return CommandIntent(key, "a1", CommandKind.PREPARE_PLAN, payload, "big", 1, Step.PREPARE, 1)


def test_a_prepare_with_the_model_spec_brings_up_a_deployment_outside_the_scenario_and_it_serves() -> None:
    with pytest.raises(ValueError):
        model_spec(BIG.name)  # the catalog does not know it
    sim, agents, acks = fleet()
    plan = big_plan(sim, (2, 3))
    agents.execute(prepare("p", plan, model_spec=BIG.to_dict(), slo=SLO))
    sim.advance_to(60)
    ok, detail, _ = acks["p"]
    assert ok, detail
    dep = sim.deployments["big"]
    assert dep.model == BIG and (dep.slo.ttft_ms, dep.slo.tpot_ms) == (1500, 80)
    engine = sim.engine_of("big", plan.plan_id)
    assert engine is not None and engine.state == "serving" and engine.ready_s > 0  # after its weights loaded
    booked = sim.booked_bytes()
    for uuid, want in plan_memory(plan, BIG).items():  # the shape it carried is what it holds
        assert booked[uuid] - 600 * 2**20 == want > BIG.weight_bytes // 2
    sim.set_weights("big", {plan.plan_id: 1.0})
    ids = [sim.submit("big", 400, 30) for _ in range(5)]
    sim.advance_to(120)
    assert not any(i in sim.in_system for i in ids) and not sim.recorder.failed
    assert sim.recorder.f_dep.count(sim.recorder.dep_index["big"]) == 5  # served and recorded as big's
    # the same prepare again (a retry): acked at once, nothing booked twice
    agents.execute(prepare("p2", plan, model_spec=BIG.to_dict(), slo=SLO))
    assert acks["p2"][0] and sim.booked_bytes() == booked


@pytest.mark.parametrize("extra,field", [
    ({"slo": SLO}, "payload.model_spec"),
    ({"model_spec": BIG.to_dict()}, "payload.slo"),
    ({"model_spec": {**BIG.to_dict(), "num_layers": -1}, "slo": SLO}, "payload.model_spec.num_layers"),
    ({"model_spec": {**BIG.to_dict(), "name": "other"}, "slo": SLO}, "payload.model_spec.name"),
])
def test_a_prepare_for_an_unknown_deployment_without_its_shape_is_refused_naming_the_field(extra: dict[str, Any],
                                                                                          field: str) -> None:
    sim, agents, acks = fleet()
    agents.execute(prepare("p", big_plan(sim, (2, 3)), **extra))
    ok, detail, result = acks["p"]
    assert not ok and detail.startswith(field) and result == {"reason": "failed"}
    assert "big" not in sim.deployments and sim.booked_bytes() == {}  # nothing of it booked or kept


def test_the_carried_shape_is_booked_by_the_same_92_percent_rule() -> None:
    sim, agents, acks = fleet()
    one = big_plan(sim, (0,), kv_tokens=1000)  # 103 GB of weights on one 80 GB GPU
    agents.execute(prepare("p", one, model_spec=BIG.to_dict(), slo=SLO))
    ok, detail, result = acks["p"]
    assert not ok and result["reason"] == "out_of_memory" and result["gpus"] == [one.gpu_uuids[0]]
    assert "92%" in detail and sim.booked_bytes() == {} and sim.refused_prepares == 1
