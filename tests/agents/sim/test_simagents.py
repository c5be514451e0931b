"""The simulated agents' answers that agent protocol v1 spells out (agents/sim/simagents.py):
conflicting and draining prepares refused, an abort's drain, a release's fallback - each with
invariants 1-2 checked on the simulator's per-sequence log."""

from __future__ import annotations

from typing import Any

from agents.sim.fleet import FleetSim
from agents.sim.simagents import SimAgents
from scheduler.invariants import EventLog, check, summary
from scheduler.plan import Plan, Stage
from scheduler.transition import CommandIntent, CommandKind, Step
from tests.agents.sim.worlds import one_deployment

NODES = [{"id": "a1", "gpu": "H100-SXM", "gpus": 8, "nvlink": True, "rack": "A"},
         {"id": "b1", "gpu": "H100-SXM", "gpus": 8, "nvlink": True, "rack": "B"}]


class World:
    """One simulator with no workload, its agents, and every answer they gave."""

    def __init__(self) -> None:
        self.sim = FleetSim(one_deployment(rate_rps=0, nodes=NODES))
        self.sim.events = EventLog(record_decodes=False)
        self.acks: dict[str, tuple[bool, str, dict[str, Any]]] = {}
        self.agents = SimAgents(self.sim, lambda cmd, ok, detail, result: self.acks.__setitem__(
            cmd.key, (ok, detail, dict(result))))
        self.sim.listener = self.agents.listener()
        self.n = 0

    def plan(self, node: str) -> Plan:
        gpus = tuple(self.sim.cluster.gpu_uuid(node, i) for i in (0, 1))
        return Plan("Llama-3-8B", "colocated", (Stage(0, 32, gpus),), kv_reserve_tokens=200_000)

    def send(self, kind: CommandKind, of: Plan, node: str, deployment: str = "d", **payload: Any) -> str:
        self.n += 1
        key = f"{kind.value}-{self.n}"
        self.agents.execute(CommandIntent(key, node, kind, {"plan_id": of.plan_id, "deployment": deployment,
                                                            **payload}, deployment, 1, Step.PREPARE, 1))
        return key

    def serve(self, plan: Plan, node: str, version: int = 1) -> None:
        key = self.send(CommandKind.PREPARE_PLAN, plan, node, plan=plan.to_dict())
        self.sim.advance_to(self.sim.now_s + 10)
        assert self.acks[key][0]
        engine = self.sim.engine_of("d", plan.plan_id)
        assert engine is not None and engine.state == "serving"
        self.sim.set_routing("d", {engine.engine_id: 1.0}, version=version)

    def clean(self) -> None:
        self.sim.run_to_completion()
        assert self.sim.events is not None
        assert check(self.sim.events.events) == []


def test_the_same_plan_for_another_deployment_is_a_plan_of_its_own_refused_only_for_memory() -> None:
    # as on the node daemon, which keys plans by (deployment, plan_id) and books each one
    # (tests/agents/node/test_commands.py: the same plan for two deployments)
    w = World()
    d = w.sim.deployments["d"]
    w.sim.add_deployment("e", d.model, d.slo)  # same model: the same plan could serve either
    w.sim.add_deployment("f", d.model, d.slo)
    plan = w.plan("b1")
    w.serve(plan, "b1")
    key = w.send(CommandKind.PREPARE_PLAN, plan, "b1", deployment="e", plan=plan.to_dict())
    w.sim.advance_to(w.sim.now_s + 10)
    assert w.acks[key][0], w.acks[key][1]
    mine, theirs = w.sim.engine_of("d", plan.plan_id), w.sim.engine_of("e", plan.plan_id)
    assert mine is not None and theirs is not None and mine.engine_id != theirs.engine_id
    # a third, larger copy does not fit beside the two: refused in the booking's words, nothing booked
    big = Plan(plan.model, "colocated", plan.stages, kv_reserve_tokens=600_000)
    key = w.send(CommandKind.PREPARE_PLAN, big, "b1", deployment="f", plan=big.to_dict())
    ok, detail, result = w.acks[key]
    assert not ok and result["reason"] == "out_of_memory" and "92%" in detail
    assert w.sim.engine_of("f", big.plan_id) is None and len(w.sim.plans("d")) == 1
    # releasing one deployment's copy leaves the other's serving
    release = w.send(CommandKind.RELEASE_PLAN, plan, "b1", deployment="e", drain_timeout_s=0.0)
    w.sim.advance_to(w.sim.now_s + 10)
    assert w.acks[release][0] and w.sim.engine_of("e", plan.plan_id) is None
    assert w.sim.engine_of("d", plan.plan_id) is mine and mine.state == "serving"
    w.clean()


def test_a_prepare_of_a_plan_being_released_is_refused_and_the_drain_goes_on() -> None:
    w = World()
    plan = w.plan("b1")
    w.serve(plan, "b1")
    rid = w.sim.submit("d", 500, 4000)
    w.sim.advance_to(w.sim.now_s + 1)
    release = w.send(CommandKind.RELEASE_PLAN, plan, "b1", drain_timeout_s=600.0)
    again = w.send(CommandKind.PREPARE_PLAN, plan, "b1", plan=plan.to_dict())
    ok, detail, result = w.acks[again]
    assert not ok and result["reason"] == "failed" and "being released" in detail
    assert release not in w.acks and w.sim.in_system[rid].engine_id  # still draining, still held
    w.clean()
    assert w.acks[release][0] and len(w.sim.recorder.f_e2e) == 1


def test_an_abort_lets_sequences_finish_for_its_drain_then_ends_the_rest_with_an_error() -> None:
    w = World()
    plan = w.plan("b1")
    w.serve(plan, "b1")
    short = w.sim.submit("d", 200, 10)
    long = w.sim.submit("d", 500, 4000)
    w.sim.advance_to(w.sim.now_s + 0.05)
    key = w.send(CommandKind.ABORT_PLAN, plan, "b1", reason="rolled back", drain_timeout_s=3.0)
    w.sim.advance_to(w.sim.now_s + 2.9)
    assert key not in w.acks  # the drain runs on
    w.sim.advance_to(w.sim.now_s + 0.2)
    ok, _, result = w.acks[key]
    assert ok and result["failed"] == [str(long)]
    assert [f[0] for f in w.sim.recorder.failed] == [long] and "aborted: rolled back" in w.sim.recorder.failed[0][3]
    assert short not in w.sim.in_system and w.sim.engine_of("d", plan.plan_id) is None
    w.clean()
    assert len(w.sim.recorder.f_e2e) == 1


def test_an_abort_of_a_plan_that_empties_within_its_drain_is_answered_when_it_is_empty() -> None:
    w = World()
    plan = w.plan("b1")
    w.serve(plan, "b1")
    w.sim.submit("d", 200, 10)
    w.sim.advance_to(w.sim.now_s + 0.05)
    key = w.send(CommandKind.ABORT_PLAN, plan, "b1", reason="rolled back", drain_timeout_s=600.0)
    w.sim.advance_to(w.sim.now_s + 5)
    ok, _, result = w.acks[key]
    assert ok and result["failed"] == [] and not w.sim.recorder.failed
    w.clean()


def test_a_release_past_its_drain_hands_what_is_left_to_its_fallback_under_the_fallbacks_version() -> None:
    w = World()
    a, b = w.plan("a1"), w.plan("b1")
    w.serve(b, "b1")
    w.serve(a, "a1", version=3)  # the table at version 3 sends new requests to a
    rid = w.sim.submit("d", 500, 4000)
    w.sim.advance_to(w.sim.now_s + 1)
    req = w.sim.in_system[rid]
    assert req.lease == 3 and req.owner == a.plan_id
    key = w.send(CommandKind.RELEASE_PLAN, a, "a1", drain_timeout_s=2.0, fallback={
        "target_plan": b.plan_id, "target_node": "b1", "target_addr": "", "routing_version": 4})
    w.sim.advance_to(w.sim.now_s + 2.5)
    ok, _, result = w.acks[key]
    assert ok and result["handed_over"] == [str(rid)] and result["failed"] == []
    assert req.owner == b.plan_id and req.lease == 4 and req.replays == 1
    (stall,) = w.agents.stalls
    assert stall.seq_id == str(rid) and stall.action == "replay" and stall.kv_bytes == 0
    assert stall.replay_tokens == stall.context_tokens > 500 and stall.stall_s > 0  # prompt + what it had made
    w.clean()
    assert w.sim.events is not None and summary(w.sim.events.events).get("seq_handover") == 1
    assert len(w.sim.recorder.f_e2e) == 1 and not w.sim.recorder.failed


def test_a_release_past_its_drain_without_a_fallback_ends_what_is_left_with_an_error() -> None:
    w = World()
    plan = w.plan("b1")
    w.serve(plan, "b1")
    rid = w.sim.submit("d", 500, 4000)
    w.sim.advance_to(w.sim.now_s + 1)
    key = w.send(CommandKind.RELEASE_PLAN, plan, "b1", drain_timeout_s=2.0)
    w.sim.advance_to(w.sim.now_s + 2.5)
    ok, _, result = w.acks[key]
    assert ok and result["failed"] == [str(rid)] and result["handed_over"] == []
    assert "ran out of its 2 s drain" in w.sim.recorder.failed[0][3]
    w.clean()


def test_a_lost_node_answers_nothing_more_and_ends_the_sequences_of_its_plans_with_an_error() -> None:
    w = World()
    a, b = w.plan("a1"), w.plan("b1")
    w.serve(b, "b1")
    w.serve(a, "a1")
    rid = w.sim.submit("d", 500, 4000)
    w.sim.advance_to(w.sim.now_s + 1)
    release = w.send(CommandKind.RELEASE_PLAN, a, "a1", drain_timeout_s=600.0)
    w.agents.lose_node("a1")
    assert [(f[0], f[3]) for f in w.sim.recorder.failed] == [(rid, "node a1 lost")]
    assert w.sim.engine_of("d", a.plan_id) is None and w.sim.engine_of("d", b.plan_id) is not None
    again = w.send(CommandKind.PREPARE_PLAN, a, "a1", plan=a.to_dict())
    w.clean()
    assert release not in w.acks and again not in w.acks  # a dead agent answers nothing
    assert w.sim.engine_of("d", a.plan_id) is None  # and runs nothing


def test_a_migration_records_its_stall_as_its_ack_reports_it() -> None:
    w = World()
    a, b = w.plan("a1"), w.plan("b1")
    w.serve(b, "b1")
    w.serve(a, "a1", version=3)
    rid = w.sim.submit("d", 500, 4000)
    w.sim.advance_to(w.sim.now_s + 1)
    key = w.send(CommandKind.MOVE_SEQUENCES, a, "a1", routing_version=4, boundary="decode_end", moves=[
        {"seq_id": str(rid), "action": "migrate", "target_plan": b.plan_id, "target_node": "b1",
         "target_addr": "", "bw_cap_bytes_per_s": 0.0, "lazy": False, "est_stall_s": 0.0}])
    w.sim.advance_to(w.sim.now_s + 2)
    ok, _, result = w.acks[key]
    (moved,) = result["moved"]
    (stall,) = w.agents.stalls
    assert ok and moved["action"] == stall.action == "migrate"
    assert stall.stall_s == moved["stall_s"] > 0 and stall.kv_bytes == moved["kv_bytes"] > 0
    assert stall.context_tokens == moved["context_tokens"] and stall.replay_tokens == 0
    w.clean()
