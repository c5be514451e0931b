"""The simulator's per-sequence log (agents/sim/seqlog.py): every request's owner, hand-overs and
end, checked by scheduler.invariants for invariants 1 and 2 - and the simulated agents' faults."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from agents.sim.engine import PlanEngine
from agents.sim.executor import SimAgents, TransitionDriver
from agents.sim.faults import Fault
from agents.sim.fleet import FleetSim
from agents.sim.workload import build_workload
from scheduler.invariants import EventLog, check, summary
from scheduler.plan import Gear, Plan, Stage
from scheduler.transition import CommandIntent, CommandKind, Phase, Step, TransitionRecord
from tests.agents.sim.worlds import one_deployment

NODES = [{"id": "a1", "gpu": "H100-SXM", "gpus": 8, "nvlink": True, "rack": "A"},
         {"id": "b1", "gpu": "H100-SXM", "gpus": 8, "nvlink": True, "rack": "B"}]


class Forward:
    """The listener a policy would be: engine news go to the driver."""

    def __init__(self) -> None:
        self.driver: TransitionDriver | None = None
        self.finished: list[TransitionRecord] = []

    def on_cluster_change(self, sim: FleetSim, t: float, changes: Any, broke: Any) -> None:
        assert self.driver is not None
        self.driver.kick_all()

    def on_ready(self, sim: FleetSim, t: float, engine: PlanEngine) -> None:
        assert self.driver is not None
        self.driver.on_ready(engine)

    def on_released(self, sim: FleetSim, t: float, engine: PlanEngine) -> None:
        assert self.driver is not None
        self.driver.on_stopped(engine)


def world(events: list[dict[str, Any]] | None = None) -> tuple[FleetSim, TransitionDriver, Forward]:
    scenario = one_deployment(rate_rps=6.0, duration_s=300, nodes=NODES, events=events,
                              prompt={"dist": "lognormal", "mean": 800, "sigma": 0.5, "max": 4000},
                              output={"dist": "lognormal", "mean": 300, "sigma": 0.5, "max": 1500})
    fwd = Forward()
    sim = FleetSim(scenario, listener=fwd)
    sim.events = EventLog(record_decodes=False)
    driver = TransitionDriver(sim, on_finished=lambda rec, t: fwd.finished.append(rec))
    fwd.driver = driver
    base = sim.start_baselines()["d"]
    driver.seed("d", Gear(base.plan.model, (base.plan,), (1.0,)))
    sim.feed(build_workload(scenario).arrivals)
    return sim, driver, fwd


def tp2(sim: FleetSim, node: str) -> Gear:
    plan = Plan("Llama-3-8B", "colocated", (Stage(0, 32, tuple(sim.cluster.gpu_uuid(node, i) for i in (0, 1))),),
                kv_reserve_tokens=200_000)
    return Gear(plan.model, (plan,), (1.0,))


def test_a_gear_change_through_the_driver_leaves_a_clean_log() -> None:
    sim, driver, fwd = world()
    sim.advance_to(100)
    driver.start("d", tp2(sim, "b1"), "test")
    sim.run_to_completion()
    assert fwd.finished[0].phase is Phase.DONE
    assert sim.events is not None
    counts = summary(sim.events.events)
    assert counts["seq_admitted"] == counts["seq_finished"] == sum(sim.recorder.admitted)
    assert check(sim.events.events) == []


def test_moved_sequences_are_paused_at_a_safe_boundary_and_handed_over_under_a_newer_lease() -> None:
    sim, agents, acks = agents_world()
    a, b = tp2(sim, "a1").plans[0], tp2(sim, "b1").plans[0]
    for plan, node in ((a, "a1"), (b, "b1")):
        agents.execute(cmd(f"prep-{node}", node, CommandKind.PREPARE_PLAN, plan, plan=plan.to_dict()))
    sim.advance_to(10)
    src = sim.engine_of("d", a.plan_id)
    assert src is not None
    sim.set_routing("d", {src.engine_id: 1.0}, version=3)
    rids = [sim.submit("d", 500, 4000) for _ in range(3)]
    sim.advance_to(11)
    moves = [{"seq_id": str(rid), "action": action, "target_plan": b.plan_id, "target_node": "b1",
              "target_addr": "", "bw_cap_bytes_per_s": 0.0, "lazy": False, "est_stall_s": 0.0}
             for rid, action in zip(rids, ("migrate", "replay", "finish"), strict=True)]
    agents.execute(cmd("m1", "a1", CommandKind.MOVE_SEQUENCES, a, Step.MOVE, routing_version=4,
                       boundary="decode_end", moves=moves))
    sim.run_to_completion()
    assert acks["m1"][0][0]
    assert sim.events is not None
    events = sim.events.events
    handed = [e for e in events if e.kind == "seq_handover"]
    assert sorted(e.seq_id for e in handed) == sorted(str(r) for r in rids[:2])  # the third finished on a
    assert all(e.plan_id == a.plan_id and e.to_plan == b.plan_id and e.version == 4 for e in handed)
    assert all(e.boundary == "decode_end" for e in events if e.kind == "seq_paused")
    assert check(events) == []


def test_a_plan_that_loses_its_gpus_returns_its_sequences_and_they_end_elsewhere() -> None:
    # a1's baseline is preempted under load; its requests go back to the router and wait there
    # until the preemption ends (no other plan serves)
    sim, _, _ = world(events=[{"at_s": 60, "kind": "preempt", "node": "a1", "gpus": 8, "duration_s": 30}])
    sim.run_to_completion()
    assert sim.events is not None
    counts = summary(sim.events.events)
    assert counts["seq_returned"] >= 1
    assert counts["seq_admitted"] == counts.get("seq_finished", 0) + counts.get("seq_failed", 0)
    assert check(sim.events.events) == []


def test_the_log_catches_a_plan_finishing_a_sequence_it_does_not_own() -> None:
    sim, driver, _ = world()
    sim.advance_to(100)
    other = sim.launch("d", tp2(sim, "b1").plans[0], source="warm", accepting=False)
    rid = next(iter(sim.in_system))
    req = sim.in_system[rid]
    req.engine_id = other.engine_id  # a bug: the wrong engine finishes it
    sim.finished(req, sim.now_s)
    assert sim.events is not None
    found = check(sim.events.events, complete=False)
    assert any(v.invariant == 2 and f"finished sequence {rid}" in v.what for v in found), found


def cmd(key: str, node: str, kind: CommandKind, target: Plan, step: Step = Step.PREPARE, **payload: Any
        ) -> CommandIntent:
    return CommandIntent(key, node, kind, {"plan_id": target.plan_id, "deployment": "d", **payload}, "d", 1, step, 1)


def agents_world() -> tuple[FleetSim, SimAgents, dict[str, list[tuple[bool, dict[str, Any]]]]]:
    sim = FleetSim(one_deployment(rate_rps=0, nodes=NODES))
    sim.events = EventLog(record_decodes=False)
    acks: dict[str, list[tuple[bool, dict[str, Any]]]] = {}
    agents = SimAgents(sim, lambda c, ok, detail, result: acks.setdefault(c.key, []).append((ok, dict(result))))
    sim.listener = agents.listener()
    return sim, agents, acks


def test_a_command_delivered_twice_runs_once_and_is_answered_once() -> None:
    sim, agents, acks = agents_world()
    plan = tp2(sim, "b1").plans[0]
    prep = cmd("p1", "b1", CommandKind.PREPARE_PLAN, plan, plan=plan.to_dict())
    agents.execute(prep)
    agents.execute(prep)
    sim.advance_to(30)
    assert len(acks["p1"]) == 1 and acks["p1"][0][0]
    assert acks["p1"][0][1]["reserved_bytes"]  # what the node's agent reserved (agents/protocol/)
    assert len([e for e in sim.plans("d") if e.plan.plan_id == plan.plan_id]) == 1


def test_injected_faults_fail_hang_or_take_the_gpus_half_way() -> None:
    sim, agents, acks = agents_world()
    plan = tp2(sim, "b1").plans[0]
    agents.inject(Fault("b1", "prepare_plan", "lose_gpus"))
    agents.execute(cmd("p1", "b1", CommandKind.PREPARE_PLAN, plan, plan=plan.to_dict()))
    engine = sim.engine_of("d", plan.plan_id)
    assert engine is not None and engine.state == "loading"
    sim.advance_to(30)
    (ok, result), = acks["p1"]
    assert not ok and result["reason"] == "preempted" and engine.engine_id not in sim.live
    agents.execute(cmd("p2", "b1", CommandKind.PREPARE_PLAN, plan, plan=plan.to_dict()))
    sim.advance_to(60)
    assert acks["p2"][0][0]  # the GPUs stay ours (a crash): a clean prepare brings it up
    agents.inject(Fault("b1", "freeze_plan", "fail", reason="failed"))
    agents.inject(Fault("b1", "thaw_plan", "hang"))
    agents.execute(cmd("f1", "b1", CommandKind.FREEZE_PLAN, plan, Step.FREEZE, routing_version=1))
    agents.execute(cmd("t1", "b1", CommandKind.THAW_PLAN, plan, Step.FREEZE))
    sim.advance_to(70)
    assert acks["f1"] == [(False, {"reason": "failed"})] and "t1" not in acks


def test_with_decodes_recorded_only_the_owner_of_a_sequence_decodes_it_across_a_gear_change() -> None:
    sim, driver, fwd = world()
    sim.events = EventLog(record_decodes=True)
    sim.advance_to(100)
    driver.start("d", tp2(sim, "b1"), "test")
    sim.run_to_completion()
    assert fwd.finished[0].phase is Phase.DONE
    events = sim.events.events
    decoders = {e.plan_id for e in events if e.kind == "seq_decoded"}
    assert len(decoders) == 2  # the old plan and the new one both decoded
    assert check(events) == []
    # the checker does read them: the same log with one decode moved to the other plan fails
    i = next(i for i, e in enumerate(events) if e.kind == "seq_decoded")
    other = next(iter(decoders - {events[i].plan_id}))
    forged = events[:i] + [replace(events[i], plan_id=other)] + events[i + 1:]
    assert any(v.invariant == 2 for v in check(forged))
