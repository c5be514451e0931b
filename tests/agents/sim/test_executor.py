"""Gear changes through scheduler.transition's executor, with the simulator as every agent."""

from __future__ import annotations

from typing import Any

from agents.sim.engine import PlanEngine
from agents.sim.executor import TransitionDriver
from agents.sim.fleet import FleetSim
from agents.sim.workload import build_workload
from scheduler.invariants import check
from scheduler.plan import Gear, Plan, Stage
from scheduler.transition import Phase, TransitionRecord
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


def test_a_gear_change_runs_every_phase_and_the_simulator_follows_the_routing_table() -> None:
    sim, driver, fwd = world()
    sim.advance_to(100)
    old = sim.plans("d")[0]
    target = tp2(sim, "b1")
    assert driver.start("d", target, "test") is not None and driver.running("d")
    sim.advance_to(160)
    (rec,) = fwd.finished
    assert rec.phase is Phase.DONE and driver.current_gear("d") == target
    assert old.state == "released" and [e.plan for e in sim.plans("d")] == list(target.plans)
    switch = sim.recorder.switches[-1]
    assert switch.outcome == "done" and switch.serving_s is not None and switch.serving_s > switch.started_s
    assert rec.moved.seqs_migrated + rec.moved.seqs_replayed + rec.moved.seqs_finished > 0
    sim.run_to_completion()
    assert not sim.recorder.failed and len(sim.recorder.f_e2e) == sum(sim.recorder.admitted)
    assert check(driver.log.events, complete=True) == []


def test_a_target_that_loses_its_gpus_while_loading_rolls_back_and_the_old_gear_keeps_serving() -> None:
    # b1 is preempted whole while the new plan loads there
    sim, driver, fwd = world(events=[{"at_s": 100.2, "kind": "preempt", "node": "b1", "gpus": 8}])
    sim.advance_to(100)
    old = sim.plans("d")[0]
    driver.start("d", tp2(sim, "b1"), "test")
    sim.advance_to(200)
    (rec,) = fwd.finished
    assert rec.phase is Phase.ROLLED_BACK and "preempt" in rec.error
    assert old.state == "serving" and old.accepting and driver.current_gear("d").plans == (old.plan,)
    sim.run_to_completion()
    assert not sim.recorder.failed and len(sim.recorder.f_e2e) == sum(sim.recorder.admitted)
    assert check(driver.log.events, complete=True) == []


def test_the_simulated_agents_answer_commands_fed_by_hand_as_the_live_fleet_would() -> None:
    from agents.sim.executor import SimAgents
    from scheduler.transition import CommandIntent, CommandKind, Step

    scenario = one_deployment(rate_rps=0, nodes=NODES)
    acks: list[tuple[str, bool, float]] = []
    sim = FleetSim(scenario)
    agents = SimAgents(sim, lambda cmd, ok, detail, result: acks.append((cmd.key, ok, sim.now_s)))
    sim.listener = agents.listener()
    plan = tp2(sim, "b1").plans[0]

    def cmd(key: str, kind: CommandKind, step: Step, **payload: Any) -> CommandIntent:
        return CommandIntent(key, "b1", kind, {"plan_id": plan.plan_id, "deployment": "d", **payload}, "d", 1,
                             step, 1)

    agents.execute(cmd("1", CommandKind.PREPARE_PLAN, Step.PREPARE, plan=plan.to_dict()))
    assert acks == []  # the weights are still loading
    sim.advance_to(10)
    (key, ok, at), = acks
    engine = sim.engine_of("d", plan.plan_id)
    assert key == "1" and ok and engine is not None and at == engine.ready_s > 0
    sim.set_weights("d", {plan.plan_id: 1.0})
    sim.submit("d", 300, 50)
    agents.execute(cmd("2", CommandKind.RELEASE_PLAN, Step.RELEASE, drain_timeout_s=30.0))
    sim.advance_to(20)
    assert acks[-1][:2] == ("2", True) and engine.state == "released"
    assert len(sim.recorder.f_e2e) == 1  # the drain let the running request finish


def test_a_hand_over_needs_a_lease_newer_than_the_one_the_sequence_holds() -> None:
    from agents.sim.executor import SimAgents
    from scheduler.transition import CommandIntent, CommandKind, Step

    scenario = one_deployment(rate_rps=0, nodes=NODES)
    acks: dict[str, tuple[bool, Any]] = {}
    sim = FleetSim(scenario)
    agents = SimAgents(sim, lambda cmd, ok, detail, result: acks.__setitem__(cmd.key, (ok, result)))
    sim.listener = agents.listener()
    a, b = tp2(sim, "a1").plans[0], tp2(sim, "b1").plans[0]
    for plan, node in ((a, "a1"), (b, "b1")):
        agents.execute(CommandIntent(f"prep-{node}", node, CommandKind.PREPARE_PLAN,
                                     {"plan_id": plan.plan_id, "deployment": "d", "plan": plan.to_dict()},
                                     "d", 1, Step.PREPARE, 1))
    sim.advance_to(10)
    assert acks["prep-a1"][0] and acks["prep-b1"][0]
    src, dst = sim.engine_of("d", a.plan_id), sim.engine_of("d", b.plan_id)
    assert src is not None and dst is not None
    sim.set_routing("d", {src.engine_id: 1.0}, version=3)  # the table at version 3 sends it to a
    rid = sim.submit("d", 500, 4000)
    sim.advance_to(11)
    req = sim.in_system[rid]
    assert req.engine_id == src.engine_id and req.lease == 3

    def move(key: str, frm: Plan, node: str, to: Plan, to_node: str, version: int) -> dict[str, Any]:
        agents.execute(CommandIntent(key, node, CommandKind.MOVE_SEQUENCES, {
            "plan_id": frm.plan_id, "deployment": "d", "routing_version": version, "boundary": "decode_end",
            "moves": [{"seq_id": str(rid), "action": "migrate", "target_plan": to.plan_id, "target_node": to_node,
                       "target_addr": "", "bw_cap_bytes_per_s": 0.0, "lazy": False, "est_stall_s": 0.0}]},
            "d", 1, Step.MOVE, 1))
        sim.advance_to(sim.now_s + 2)
        ok, result = acks[key]
        (moved,) = result["moved"]
        assert ok == moved["ok"] and (ok or result["reason"] == moved["reason"])
        return dict(moved)

    stale = move("m1", a, "a1", b, "b1", 3)  # built on the table the sequence was admitted under
    assert not stale["ok"] and stale["reason"] == "stale_lease"
    assert req.engine_id == src.engine_id and req.lease == 3  # it stays with its owner, decoding
    assert move("m2", a, "a1", b, "b1", 4)["ok"]  # the flip's version: newer, it moves
    assert req.engine_id == dst.engine_id and req.lease == 4
    back = move("m3", b, "b1", a, "a1", 4)  # a late copy of that move's version, the other way
    assert not back["ok"] and back["reason"] == "stale_lease" and req.engine_id == dst.engine_id
    sim.run_to_completion()
    assert len(sim.recorder.f_e2e) == 1 and not sim.recorder.failed
