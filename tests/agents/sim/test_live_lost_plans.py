"""A plan that dies under its running agent, end to end: the simulated agents over real HTTP, a
live console and a real Celery worker (as tests/console/gearbox/test_end_to_end.py).

The chat plan's GPU fails and is back before anything moved: the gear looks as valid as before,
but the plan stopped (FleetSim). Only the agent's report - the plans it runs, agents.protocol
Report.plans - tells the console; it drops the plan, brings a gear up again, and the requests the
plan held wait for it and are served: none lost.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
from django.core.management import call_command

from agents.sim.cluster import FAILED, US
from agents.sim.live import LiveFleet
from agents.sim.scenario import load_scenario
from console.audit.models import AuditEntry
from console.gearbox.models import Deployment, Transition
from scheduler.invariants import check
from scheduler.plan import Gear
from tests.demo_fleet import DEMO, run_until, story

JOIN = "fpj_live-lost-plans"
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


@pytest.fixture
def fleet(live_server: Any, settings: Any, worker: None) -> Iterator[LiveFleet]:
    """The demo's deployments and cluster without its scripted events: only this test's failure."""
    settings.FLEXPIPE_ENROLL_TOKEN = JOIN
    call_command("load_scenario_deployments", str(DEMO))
    f = LiveFleet(dataclasses.replace(load_scenario(DEMO), events=()), live_server.url, JOIN,
                  report_interval_s=1.0, long_poll_s=2.0)
    yield f
    f.close()


def chat_plan_serving(fleet: LiveFleet, plan_id: str) -> bool:
    engine = fleet.sim.engine_of("chat-8b", plan_id)
    routed = Deployment.objects.get(name="chat-8b").routing or []
    return engine is not None and engine.state == "serving" and any(
        r["plan_id"] == plan_id and r["weight"] > 0 for r in routed)


def test_a_plan_that_dies_under_its_running_agent_is_replaced_and_its_requests_are_served(fleet: LiveFleet) -> None:
    run_until(fleet, lambda: all(d.current_gear for d in Deployment.objects.all()), 120, "baselines up")
    dep = Deployment.objects.get(name="chat-8b")
    plan = Gear.from_dict(dep.current_gear).plans[0]
    run_until(fleet, lambda: bool(fleet.sim.engine_of("chat-8b", plan.plan_id) and any(
        r.deployment == "chat-8b" for r in fleet.sim.in_system.values())), 60, "chat requests in flight")

    # its GPU fails and is back at once: the plan stopped, its gear looks as valid as before
    fleet.sim.set_gpu_owner([plan.gpu_uuids[0]], FAILED)
    fleet.sim.advance_to(fleet.sim.now_s)
    fleet.sim.set_gpu_owner([plan.gpu_uuids[0]], US)
    fleet.sim.advance_to(fleet.sim.now_s)
    held = {rid for rid, r in fleet.sim.in_system.items() if r.deployment == "chat-8b"}
    assert held and plan.plan_id not in fleet.sim.plans_on("h100-a")
    assert fleet.sim.engine_of("chat-8b", plan.plan_id) is None

    run_until(fleet, lambda: AuditEntry.objects.filter(event_type="gearbox.plans_lost", deployment="chat-8b").exists(),
              60, "the dead plan dropped")
    assert AuditEntry.objects.filter(event_type="fleet.plans_lost").count() == 1
    run_until(fleet, lambda: Transition.objects.filter(deployment__name="chat-8b", seq__gt=1, phase="done").exists()
              and bool(Deployment.objects.get(name="chat-8b").current_gear), 120, "a gear up again")
    again = Transition.objects.filter(deployment__name="chat-8b", seq__gt=1, phase="done").first()
    assert again is not None and again.decision is not None and again.decision.trigger == "topology", story()
    served = {p.plan_id for p in Gear.from_dict(Deployment.objects.get(name="chat-8b").current_gear).plans}
    run_until(fleet, lambda: any(chat_plan_serving(fleet, p) for p in served), 60, "the new gear serving")

    # nothing admitted is lost: the chat requests in flight when the plan died waited and are served
    run_until(fleet, lambda: not held & set(fleet.sim.in_system), 120, "the requests it held served")
    assert not fleet.sim.recorder.failed, fleet.sim.recorder.failed[:5]
    violations = check(fleet.log, complete=False)
    assert not violations, violations[:5]
