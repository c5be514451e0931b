"""The simulator's driver API: what the live fleet uses (advance, add/remove plans, submit,
engine reports, GPU load, snapshots) and how losses are handled."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from agents.protocol import EngineReport
from agents.sim.fleet import IDLE_MEM_BYTES, FleetSim
from agents.sim.scenario import load_scenario, parse_scenario
from agents.sim.workload import build_workload
from scheduler.plan import Plan, Stage, stage_bytes_per_gpu
from scheduler.topology import atomic_blocks
from tests.agents.sim.worlds import LIVELY, lively, one_deployment


def tp(sim: FleetSim, node: str, *idx: int, kv: int = 100_000, model: str = "Llama-3-8B") -> Plan:
    layers = 32 if model == "Llama-3-8B" else 80
    return Plan(model, "colocated", (Stage(0, layers, tuple(sim.cluster.gpu_uuid(node, i) for i in idx)),),
                kv_reserve_tokens=kv)


def test_a_commanded_plan_serves_only_after_its_modelled_weight_load() -> None:
    sim = FleetSim(one_deployment(rate_rps=0))
    engine = sim.add_plan("d", tp(sim, "a1", 0, 1).to_dict())
    assert engine.state == "loading" and engine.ready_s > 0.1  # 8B over PCIe: a fraction of a second or more
    rid = sim.submit("d", 200, 20)
    sim.advance_to(engine.ready_s - 1e-6)
    assert engine.state == "loading" and sim.deployments["d"].pending[0].rid == rid
    sim.advance_to(engine.ready_s + 5)
    assert engine.state == "serving" and len(sim.recorder.f_e2e) == 1
    assert sim.recorder.f_ttft[0] > engine.ready_s  # it waited for the plan


def test_removing_a_plan_moves_its_sequences_and_releases_its_gpus() -> None:
    scenario = one_deployment(rate_rps=8.0, duration_s=120)
    sim = FleetSim(scenario)
    first = sim.add_plan("d", tp(sim, "a1", 0, 1), source="warm")
    second = sim.add_plan("d", tp(sim, "a1", 2, 3), source="warm")
    sim.feed(build_workload(scenario).arrivals)
    sim.advance_to(60)
    assert first.load > 0
    sim.remove_plan("d", first.plan.plan_id)
    sim.advance_to(61)
    assert first.state == "released" and sim.engine_of("d", first.plan.plan_id) is None
    used = {g.uuid: g.mem_used_bytes for g in sim.snapshot().gpus}
    assert used[sim.cluster.gpu_uuid("a1", 0)] == IDLE_MEM_BYTES
    sim.run_to_completion()
    assert second.state == "serving"
    assert len(sim.recorder.f_e2e) == sum(sim.recorder.admitted) and not sim.recorder.failed


def test_engine_reports_have_the_protocols_shape_and_reset_per_interval() -> None:
    scenario = one_deployment(rate_rps=5.0, duration_s=120)
    sim = FleetSim(scenario)
    sim.start_baselines()
    sim.feed(build_workload(scenario).arrivals)
    sim.advance_to(60)
    (m,) = sim.engine_reports()
    assert isinstance(m.report, EngineReport) and m.deployment == "d" and m.node_ids == ("a1",)
    r = m.report
    assert r.arrivals > 200 and r.finished > 200 and r.tokens_per_s > 0 and 0 < r.kv_usage <= 1
    assert r.ttft_p50_ms is not None and r.ttft_p95_ms is not None and r.ttft_p50_ms <= r.ttft_p95_ms
    assert r.prompt_tokens_mean == 500 and r.output_tokens_mean == 100
    sim.advance_to(61)
    (again,) = sim.engine_reports()
    assert again.report.finished < 20  # counters restart with each report


def test_gpu_load_reports_memory_and_utilisation_of_every_plan_gpu() -> None:
    scenario = one_deployment(rate_rps=5.0, duration_s=60, tp=2)
    sim = FleetSim(scenario)
    sim.start_baselines()
    sim.feed(build_workload(scenario).arrivals)
    sim.advance_to(30)
    load = sim.gpu_load()
    assert set(load) == {("a1", 0), ("a1", 1)}
    for mem, util in load.values():
        assert 0.1 < mem <= 0.92 + 0.01 and 0 < util <= 1


def test_the_snapshot_shows_plan_memory_other_tenants_and_failures() -> None:
    sim = lively()
    fleet = FleetSim(sim)
    plan = fleet.start_baselines()["chat"].plan
    snap = fleet.snapshot()
    model = fleet.deployments["chat"].model
    need = stage_bytes_per_gpu(plan.stages[0], model, plan.kv_reserve_tokens)
    for u in plan.gpu_uuids:
        assert snap.gpu_by_uuid[u].mem_used_bytes == IDLE_MEM_BYTES + need
    fleet.advance_to(460)  # a1 preempted (4 GPUs), b1 failed (1 GPU)
    snap = fleet.snapshot()
    assert sum(1 for g in snap.gpus if g.node_id == "a1" and not g.schedulable) == 4
    assert sum(1 for g in snap.gpus if g.node_id == "b1" and not g.healthy) == 1
    assert all(b.size <= 4 for b in atomic_blocks(snap) if b.node_id == "a1")


def test_a_plan_that_loses_a_gpu_stops_and_its_requests_finish_elsewhere() -> None:
    doc = copy.deepcopy(LIVELY)
    doc["events"] = [{"at_s": 100, "kind": "preempt", "node": "a1", "gpus": 8}]
    scenario = parse_scenario(doc)
    sim = FleetSim(scenario)
    engines = sim.start_baselines()
    spare = sim.add_plan("chat", tp(sim, "b1", 0, 1), source="warm")
    sim.feed(build_workload(scenario).arrivals)
    sim.advance_to(99)
    assert engines["chat"].load > 0
    sim.advance_to(101)
    assert engines["chat"].state == "dead" and spare.state == "serving"
    change = sim.recorder.changes[0]
    assert set(change.broke) == {"chat", "sum"}
    sim.advance_to(scenario.duration_s)
    # the 70B has nowhere to go: its requests wait, admitted and counted, never dropped
    assert sim.deployments["sum"].pending
    chat_done = sum(1 for d in sim.recorder.f_dep if d == 0)
    assert chat_done > 0.9 * sim.recorder.admitted[0]


def test_bad_driver_input_is_refused_with_the_field_named() -> None:
    sim = FleetSim(lively())
    with pytest.raises(ValueError, match="deployment: unknown 'nope'"):
        sim.submit("nope", 10, 10)
    with pytest.raises(ValueError, match="prompt_tokens"):
        sim.submit("chat", 0, 10)
    sim.advance_to(201)  # four GPUs of a1 are another tenant's now
    taken = [g.index for g in sim.cluster.nodes["a1"].gpus if not g.ours]
    with pytest.raises(ValueError, match="plan.gpus"):
        sim.add_plan("chat", tp(sim, "a1", taken[0]))
    with pytest.raises(ValueError, match="plan.model"):
        sim.add_plan("chat", tp(sim, "b1", 0, 1, 2, 3, model="Llama-3-70B"))
    with pytest.raises(ValueError, match="plan_id"):
        sim.remove_plan("chat", "p-nothere")


def test_a_baseline_that_does_not_fit_in_memory_names_its_key_path() -> None:
    doc = copy.deepcopy(LIVELY)
    doc["models"][1]["baseline"] = {"tp": 1, "nodes": ["c1"]}  # a 70B model on one 48 GB GPU
    with pytest.raises(ValueError, match=r"models\[1\]\.baseline"):
        FleetSim(parse_scenario(doc)).start_baselines()


SHIPPED = sorted((Path(__file__).resolve().parents[3] / "scenarios").glob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_every_shipped_scenarios_baselines_fit_in_memory(path: Path) -> None:
    sim = FleetSim(load_scenario(path))
    engines = sim.start_baselines()
    assert set(engines) == set(sim.deployments)
    assert all(e.state == "serving" and e.plan.kv_reserve_tokens > 0 for e in engines.values())
