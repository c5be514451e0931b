"""The global correction end to end over real HTTP (pytest-django's live server): the simulated
agents report their engines, the console's loop (console/gearbox/correction.py) decides hints and
queues apply_hints, the plan's leader pulls it, its engine takes the threshold, and the ack the
console stores passes the protocol's check. Then the loop stops: the hint lapses and the engine
serves at its own threshold."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from agents.protocol import check_result
from agents.sim.live import LiveFleet
from agents.sim.scenario import load_scenario
from console.fleet.models import AgentCommand, Node
from console.gearbox import correction
from console.gearbox.models import Deployment
from scheduler.costmodel import MAX_BATCHED_TOKENS

ROOT = Path(__file__).resolve().parents[3]
JOIN = "fpj_hints-test"
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def fleet(live_server: Any, settings: Any) -> Iterator[LiveFleet]:
    settings.FLEXPIPE_ENROLL_TOKEN = JOIN
    correction.reset()
    wall = [1_000.0]  # the fleet's clock: sim time moves only when the test says (deterministic)
    f = LiveFleet(load_scenario(ROOT / "scenarios" / "demo.yaml"), live_server.url, JOIN, report_interval_s=3600,
                  long_poll_s=None, clock=lambda: wall[0])
    f.wall = wall  # type: ignore[attr-defined]
    yield f
    f.close()
    correction.reset()


def test_a_global_hint_reaches_the_simulated_engine_over_the_protocol_and_lapses_when_the_loop_stops(
        fleet: LiveFleet) -> None:
    fleet.step()  # every agent registers
    plan = fleet.sim.baseline_plan("chat-8b")
    engine = fleet.sim.add_plan("chat-8b", plan, source="warm")
    leader = fleet.sim.plan_nodes(plan)[0]
    now = timezone.now()
    Deployment.objects.create(name="chat-8b", model_name=plan.model, ttft_ms=500.0, tpot_ms=50.0,
                              baseline_gear={"model": plan.model, "plans": [], "weights": []}, routing_version=1,
                              routing=[{"plan_id": plan.plan_id, "plan": plan.to_dict(), "weight": 1.0,
                                        "frozen": False, "nodes": [leader]}], created_at=now, updated_at=now)
    wall = fleet.wall  # type: ignore[attr-defined]
    wall[0] += (engine.ready_s + 1.0) / fleet.time_scale  # sim time past the plan's load: it serves
    fleet.step()
    assert engine.state == "serving"
    for _ in range(100):  # a burst of long prompts: most of them miss the scenario's TTFT objective
        fleet.sim.submit("chat-8b", 8000, 50)
    wall[0] += 120.0 / fleet.time_scale  # two simulated minutes: every one of them finished
    fleet.agents[leader].dirty = True
    fleet.step()
    [stored] = [e for e in Node.objects.get(node_id=leader).engines if e["plan_id"] == plan.plan_id]
    assert stored["finished"] >= 100 and stored["slo_violations"] > 0.05 * stored["finished"]
    sent = correction.correct()
    assert sent["chat-8b"]["nodes"] == [leader]  # type: ignore[index]
    cmd = AgentCommand.objects.get(kind="apply_hints")
    [hint] = cmd.payload["plans"]
    assert hint["direction"] == "speed_up"  # late requests: smaller rounds
    hinted = int(MAX_BATCHED_TOKENS * hint["batch_scale"])
    assert hinted < MAX_BATCHED_TOKENS and engine.batch_tokens(fleet.sim.now_s) == MAX_BATCHED_TOKENS
    fleet.step()  # the leader pulls it, its engine takes it, the ack goes back
    fleet.step()
    cmd.refresh_from_db()
    assert cmd.state == "ok", cmd.detail
    assert check_result("apply_hints", cmd.result)["plans"] == [plan.plan_id]
    assert engine.local.book is not None
    assert engine.batch_tokens(fleet.sim.now_s) == hinted
    # the global loop stops here: one ttl later (in sim time: the fleet's time scale) the engine is
    # back at its own threshold, and it goes on serving
    ttl_sim = float(cmd.payload["ttl_s"]) * fleet.time_scale
    done = engine.rep_finished
    wall[0] += (ttl_sim + 60.0) / fleet.time_scale
    fleet.step()
    assert engine.batch_tokens(fleet.sim.now_s) == MAX_BATCHED_TOKENS
    assert engine.state == "serving" and engine.rep_finished > done  # (reports every 3600 s: not reset)
    # (the demo's other deployment has no plan here: its requests fail; chat-8b's never do)
    assert not [f for f in fleet.sim.recorder.failed if f[1] == "chat-8b"]
