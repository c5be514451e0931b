"""The global correction's hints on the simulated fleet: over the protocol path (a Command the
agent pulled, checked, carried out, acked) to the engine's local loop; stale and lapsed hints;
a global loop that stops leaves the local loops serving (agents/sim/hints.py)."""

from __future__ import annotations

from typing import Any

from agents.protocol import Command, check_result
from agents.sim.engine import PlanEngine
from agents.sim.fleet import FleetSim
from agents.sim.live import HttpMailbox
from agents.sim.workload import build_workload
from scheduler.costmodel import MAX_BATCHED_TOKENS
from scheduler.plan import Plan, Stage
from tests.agents.sim.worlds import one_deployment


def serving(sim: FleetSim, *gpus: int) -> tuple[PlanEngine, str]:
    plan = Plan("Llama-3-8B", "colocated", (Stage(0, 32, tuple(sim.cluster.gpu_uuid("a1", i) for i in gpus)),),
                kv_reserve_tokens=200_000)
    engine = sim.add_plan("d", plan, source="warm")
    sim.advance_to(engine.ready_s + 1e-6)
    assert engine.state == "serving"
    return engine, sim.plan_nodes(plan)[0]


def hints(plan_id: str, version: int, scale: float, *, ttl_s: float = 5.0, weight: float = 1.0) -> dict[str, Any]:
    return {"deployment": "d", "hints_version": version, "ttl_s": ttl_s,
            "plans": [{"plan_id": plan_id, "direction": "speed_up" if scale < 1 else "slow_down",
                       "weight_multiplier": weight, "batch_scale": scale}]}


def send(box: HttpMailbox, node: str, cid: int, payload: dict[str, Any]) -> dict[str, Any]:
    """Deliver one apply_hints as an agent pulls it; its ack's result (checked as the console checks it)."""
    box.deliver(node, [Command(cid, "apply_hints", payload)])
    [(to, got, ack)] = box.acks()
    assert (to, got, ack.status) == (node, cid, "ok"), ack
    return check_result("apply_hints", ack.result)


def first_chunk(sim: FleetSim, engine: PlanEngine, prompt: int = 8_000) -> int:
    """Submit one long prompt now: the prompt tokens of its first round (the batch-token threshold)."""
    sim.submit("d", prompt, 4)
    [(_, tokens)] = engine.prefill.chunks
    return tokens


def test_a_hint_reaches_the_engine_over_the_protocol_and_sets_its_batch_threshold() -> None:
    sim = FleetSim(one_deployment(rate_rps=0))
    engine, node = serving(sim, 0)
    box = HttpMailbox(hints_to=sim.apply_hints)
    result = send(box, node, 1, hints(engine.plan.plan_id, 1, 0.25))
    assert result == {"applied": True, "hints_version": 1, "plans": [engine.plan.plan_id], "unknown": []}
    assert first_chunk(sim, engine) == MAX_BATCHED_TOKENS // 4  # a quarter of the engine's own


def test_without_a_hint_the_engine_batches_at_its_own_threshold() -> None:
    sim = FleetSim(one_deployment(rate_rps=0))
    engine, _ = serving(sim, 0)
    assert first_chunk(sim, engine) == MAX_BATCHED_TOKENS


def test_an_older_version_is_ignored_and_a_plan_not_led_here_is_named() -> None:
    sim = FleetSim(one_deployment(rate_rps=0))
    engine, node = serving(sim, 0)
    box = HttpMailbox(hints_to=sim.apply_hints)
    send(box, node, 1, hints(engine.plan.plan_id, 5, 0.25))
    stale = send(box, node, 2, hints(engine.plan.plan_id, 4, 2.0))
    assert stale == {"applied": False, "hints_version": 5, "plans": [], "unknown": []}
    other = send(box, node, 3, hints("p-nobody", 6, 0.5))
    assert other["unknown"] == ["p-nobody"] and other["plans"] == []
    assert first_chunk(sim, engine) == MAX_BATCHED_TOKENS // 4  # the stale hint changed nothing


def test_a_bad_hint_is_refused_naming_the_field_and_changes_nothing() -> None:
    sim = FleetSim(one_deployment(rate_rps=0))
    engine, node = serving(sim, 0)
    box = HttpMailbox(hints_to=sim.apply_hints)
    bad = hints(engine.plan.plan_id, 1, 0.0)
    box.deliver(node, [Command(1, "apply_hints", bad)])
    [(_, _, ack)] = box.acks()
    assert ack.status == "failed" and "payload.plans[0].batch_scale" in ack.detail
    assert engine.local.book is None and first_chunk(sim, engine) == MAX_BATCHED_TOKENS


def test_with_the_global_loop_stopped_the_hint_lapses_and_the_local_loop_keeps_serving() -> None:
    scenario = one_deployment(rate_rps=4.0, duration_s=60, prompt={"dist": "fixed", "value": 3000})
    sim = FleetSim(scenario)
    engine, node = serving(sim, 0)
    box = HttpMailbox(hints_to=sim.apply_hints)
    send(box, node, 1, hints(engine.plan.plan_id, 1, 0.25, ttl_s=5.0))  # the global loop's last word
    start = sim.now_s
    sim.feed(build_workload(scenario).arrivals)
    sim.advance_to(start + 2.0)
    assert engine.batch_tokens(sim.now_s) == MAX_BATCHED_TOKENS // 4  # the hint is live
    sim.run_to_completion()  # nothing more comes from the global loop
    assert sim.now_s > start + 5.0
    assert engine.batch_tokens(sim.now_s) == MAX_BATCHED_TOKENS  # lapsed: the engine's own again
    admitted = sum(sim.recorder.admitted)
    assert admitted > 100 and len(sim.recorder.f_e2e) == admitted and not sim.recorder.failed


def test_the_hinted_threshold_is_read_on_the_local_loop() -> None:
    sim = FleetSim(one_deployment(rate_rps=0))
    engine, node = serving(sim, 0)
    box = HttpMailbox(hints_to=sim.apply_hints)
    send(box, node, 1, hints(engine.plan.plan_id, 1, 0.25, ttl_s=1.0))
    t = sim.now_s
    assert engine.batch_tokens(t) == MAX_BATCHED_TOKENS // 4
    # the hint lapses at t + 1; the engine notices at its next look, one local period at most later
    assert engine.batch_tokens(t + 1.0 - 1e-6) == MAX_BATCHED_TOKENS // 4
    assert engine.batch_tokens(t + 1.0 + sim.local_loop_s) == MAX_BATCHED_TOKENS


def test_the_weight_multiplier_lives_as_long_as_the_hint() -> None:
    sim = FleetSim(one_deployment(rate_rps=0))
    engine, node = serving(sim, 0)
    box = HttpMailbox(hints_to=sim.apply_hints)
    assert sim.hinted_weight("d", engine.plan.plan_id) == 1.0
    send(box, node, 1, hints(engine.plan.plan_id, 1, 1.0, ttl_s=2.0, weight=0.5))
    assert sim.hinted_weight("d", engine.plan.plan_id) == 0.5
    sim.advance_to(sim.now_s + 2.0)
    assert sim.hinted_weight("d", engine.plan.plan_id) == 1.0


def test_the_live_fleet_routes_by_table_weight_times_the_live_multiplier() -> None:
    from pathlib import Path

    from agents.sim.live import LiveFleet
    from agents.sim.scenario import load_scenario
    from scheduler.transition import Route, RoutingState

    root = Path(__file__).resolve().parents[3]
    fleet = LiveFleet(load_scenario(root / "scenarios" / "demo.yaml"), "http://127.0.0.1:9", "unused",
                      long_poll_s=None)  # nothing is sent: only its routing is stepped here
    try:
        sim = fleet.sim
        first = Plan("Llama-3-8B", "colocated", (Stage(0, 32, (sim.cluster.gpu_uuid("h100-a", 6),)),),
                     kv_reserve_tokens=100_000)
        second = Plan("Llama-3-8B", "colocated", (Stage(0, 32, (sim.cluster.gpu_uuid("h100-a", 7),)),),
                      kv_reserve_tokens=100_000)
        a, b = (sim.add_plan("chat-8b", p, source="warm", route=False) for p in (first, second))
        fleet.routes["chat-8b"] = RoutingState("chat-8b", 3, (Route(first, 0.5, nodes=("h100-a",)),
                                                               Route(second, 0.5, nodes=("h100-a",))))
        fleet._follow_routing()
        assert (a.weight, b.weight) == (0.5, 0.5)
        payload = {"deployment": "chat-8b", "hints_version": 1, "ttl_s": 2.0, "plans": [
            {"plan_id": first.plan_id, "direction": "hold", "weight_multiplier": 0.5, "batch_scale": 1.0},
            {"plan_id": second.plan_id, "direction": "hold", "weight_multiplier": 2.0, "batch_scale": 1.0}]}
        fleet.mailbox.deliver("h100-a", [Command(1, "apply_hints", payload)])
        [(_, _, ack)] = fleet.mailbox.acks()
        assert ack.status == "ok" and check_result("apply_hints", ack.result)["plans"] == [first.plan_id,
                                                                                            second.plan_id]
        fleet._follow_routing()
        assert (a.weight, b.weight) == (0.25, 1.0)  # the table's weights times the hints'
        sim.advance_to(sim.now_s + 2.0 * fleet.time_scale)  # the hints lapse (ttl in sim time): the table's weights
        fleet._follow_routing()
        assert (a.weight, b.weight) == (0.5, 0.5)
    finally:
        fleet.close()


def test_the_global_loop_in_the_simulator_sends_hints_and_when_it_stops_the_engines_serve_alone() -> None:
    from agents.sim.hints import SimGlobalLoop

    scenario = one_deployment(rate_rps=12.0, duration_s=60, prompt={"dist": "fixed", "value": 3000})
    sim = FleetSim(scenario)
    a, _ = serving(sim, 0)
    b, _ = serving(sim, 1)
    loop = SimGlobalLoop(sim, stop_s=sim.now_s + 30.0)
    sim.feed(build_workload(scenario).arrivals)
    sim.run_to_completion()
    assert loop.sent > 0 and loop.loop.version > 10
    assert all(e.batch_tokens(sim.now_s) == MAX_BATCHED_TOKENS for e in (a, b))  # lapsed after the stop
    assert (a.weight, b.weight) == (1.0, 1.0)  # the table's own weights again
    admitted = sum(sim.recorder.admitted)
    assert admitted > 500 and len(sim.recorder.f_e2e) == admitted and not sim.recorder.failed
