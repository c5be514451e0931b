"""The live fleet serves on FleetSim's engines: what the console stores is what PlanEngine measured.

The demo's deployments, the simulated agents over real HTTP against a live server, and a real
Celery worker running the ticks and transitions (as tests/console/gearbox/test_end_to_end.py).
Once the controller has brought the baselines up, a burst of long requests fills the chat
plan's KV cache: its leader's report says so (KV usage, requests waiting for admission); then
the scenario's preemption at t=45 s breaks a plan, and its requests are served on the gear the
controller moves to - none lost, every failure explicit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest

from agents.protocol import EngineReport
from agents.sim.live import LiveFleet
from console.fleet.models import Node
from console.gearbox.models import Deployment
from scheduler.invariants import check
from scheduler.plan import Gear
from tests.demo_fleet import demo_fleet, run_until

JOIN = "fpj_live-serving"
BURST = 200  # requests of 6000 + 2000 tokens: more KV than the chat baseline's ~1M tokens hold
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


@pytest.fixture
def fleet(live_server: Any, settings: Any, worker: None) -> Iterator[LiveFleet]:
    settings.FLEXPIPE_ENROLL_TOKEN = JOIN
    f = demo_fleet(live_server.url, JOIN)
    yield f
    f.close()


def gear_of(name: str) -> Gear | None:
    raw = Deployment.objects.get(name=name).current_gear
    return Gear.from_dict(raw) if raw else None


def stored_reports(plan_ids: set[str]) -> list[dict[str, Any]]:
    """The engine reports the console holds for these plans (what its gearbox and charts read)."""
    return [e for node in Node.objects.all() for e in node.engines if e.get("plan_id") in plan_ids]


def test_the_console_sees_planengine_metrics_and_the_preemption_is_served_through(fleet: LiveFleet) -> None:
    run_until(fleet, lambda: all(d.current_gear for d in Deployment.objects.all()), 90, "baselines up")
    chat = gear_of("chat-8b")
    assert chat is not None
    chat_plans = {p.plan_id for p in chat.plans}
    engine = fleet.sim.engine_of("chat-8b", chat.plans[0].plan_id)
    assert engine is not None and engine.state == "serving"  # the plan the controller commanded runs on FleetSim

    # a burst of long requests, then 40 simulated seconds in one pass: the plan's KV fills up
    ids = [fleet.sim.submit("chat-8b", 6000, 2000) for _ in range(BURST)]
    fleet.t0 -= max(0.0, 40.0 - fleet.sim_time_s())
    fleet.step()

    def full() -> bool:
        return any(r["kv_usage"] > 0.5 and r["waiting"] > 0 and r["running"] > 0 for r in stored_reports(chat_plans))

    run_until(fleet, full, 30, "a report of the chat plan with its KV filling up and requests waiting")
    report = next(r for r in stored_reports(chat_plans) if r["kv_usage"] > 0.5)
    assert set(report) == {f.name for f in dataclasses.fields(EngineReport)}  # the keys the console parses
    assert report["tokens_per_s"] > 0 and report["running"] + report["waiting"] >= BURST // 2
    assert report["kv_usage"] <= 1.0
    kv_now = max(p.kv_used / p.kv_cap for p in engine.pipes)
    assert kv_now > 0.5  # what the report said is what the PlanEngine holds

    # the scenario's preemption at t=45 s: another tenant takes four H100s of h100-a
    before = {name: set(g.gpu_uuids) for name in ("chat-8b", "summarize-70b") if (g := gear_of(name))}
    fleet.t0 -= max(0.0, 45.5 - fleet.sim_time_s())
    fleet.step()
    taken = {g.uuid for g in fleet.cluster.nodes["h100-a"].gpus if not g.ours}
    assert len(taken) == 4
    hit = [name for name, gpus in before.items() if gpus & taken]
    assert hit, "the preemption hits a running plan"
    broken = [e for e in fleet.sim.engines.values() if e.state == "dead"]
    assert broken, "FleetSim stopped the plans on the taken GPUs"

    def moved() -> bool:
        gears = {n: gear_of(n) for n in hit}
        return all(g is not None and not (set(g.gpu_uuids) & taken) for g in gears.values())

    run_until(fleet, moved, 120, "a new gear off the preempted GPUs")
    new_plans = {p.plan_id for n in hit if (g := gear_of(n)) for p in g.plans}
    run_until(fleet, lambda: any(r["running"] > 0 or r["finished"] > 0 for r in stored_reports(new_plans)), 30,
              "the new gear serving")
    # nothing admitted is lost: each burst request is still being served, finished, or failed
    # with a recorded reason; no invariant of the engines' log is broken
    ended = {e.seq_id for e in fleet.log.of("seq_finished", "seq_failed")}
    assert all(rid in fleet.sim.in_system or str(rid) in ended for rid in ids)
    violations = check(fleet.log, complete=False)
    assert not violations, violations[:5]
    assert len(fleet.log.of("seq_admitted")) >= BURST
