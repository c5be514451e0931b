"""/metrics of the gearbox: the current plan and gear, phases, switch durations, the migration queue, the
shadow plan and decisions - each following the rows as transitions run."""

from __future__ import annotations

import time

import pytest

from console.fleet.models import AgentCommand
from console.gearbox import ticks
from console.gearbox.actions import do_pin_gear, do_request_gear
from console.gearbox.emergency import do_emergency_downshift
from console.gearbox.executor import build_executor
from console.gearbox.models import Transition
from tests.console.gearbox.conftest import _fast_transitions  # noqa: F401 - short dwells and drain budget here too
from tests.console.gearbox.harness import gear
from tests.console.gearbox.ops import BASELINE, MOVED, running_deployment
from tests.console.metrics.test_metrics import scrape
from tests.console.people import Person

pytestmark = pytest.mark.django_db


def test_the_current_gear_its_switches_and_the_decisions_are_exported(viewer: Person) -> None:
    running_deployment()
    m = scrape(viewer.api())
    chat = (("deployment", "chat"),)
    assert m[("flexpipe_deployment_plan_info", (("deployment", "chat"), ("gear", MOVED.gear_id),
                                                ("plan_id", MOVED.plans[0].plan_id)))] == 1
    assert not [k for k in m if k[0] == "flexpipe_deployment_plan_info" and ("gear", BASELINE.gear_id) in k[1]]
    assert m[("flexpipe_deployment_gear", chat)] == 2  # the second transition brought this gear up
    assert m[("flexpipe_deployment_pinned", chat)] == 0
    assert m[("flexpipe_transition_phase", (("deployment", "chat"), ("phase", "idle")))] == 1
    assert m[("flexpipe_transition_phase", (("deployment", "chat"), ("phase", "prepare")))] == 0
    assert m[("flexpipe_shadow_plan_status", (("deployment", "chat"), ("status", "none")))] == 1
    assert m[("flexpipe_migration_queue_length", chat)] == 0
    finished = Transition.objects.filter(phase="done")
    took = sum((t.finished_at - t.created_at).total_seconds() for t in finished)  # type: ignore[operator]
    assert m[("flexpipe_switch_duration_seconds_count", chat)] == 2
    assert m[("flexpipe_switch_duration_seconds_sum", chat)] == pytest.approx(took, abs=1e-3)
    assert m[("flexpipe_switch_duration_seconds_bucket", (("deployment", "chat"), ("le", "+Inf")))] == 2
    fastest = min((t.finished_at - t.created_at).total_seconds() for t in finished)  # type: ignore[operator]
    le = next(b for b in (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300) if b >= fastest)
    assert m[("flexpipe_switch_duration_seconds_bucket", (("deployment", "chat"), ("le", str(float(le)))))] >= 1
    assert m[("flexpipe_decisions_total", (("deployment", "chat"), ("outcome", "switch"), ("reason", "periodic")))] == 1
    assert m[("flexpipe_decisions_total", (("deployment", "chat"), ("outcome", "switch"), ("reason", "manual")))] == 1
    assert m[("flexpipe_decisions_pending_approval", chat)] == 0


def test_phase_shadow_plan_and_pin_follow_a_running_emergency(viewer: Person) -> None:
    world = running_deployment()
    do_pin_gear("chat", actor="system:test")
    do_emergency_downshift("chat", reason="drill", actor="system:test")
    assert ticks.tick(trigger="emergency", deployment="chat")["started"] == ["chat#3"]
    m = scrape(viewer.api())
    assert m[("flexpipe_deployment_pinned", (("deployment", "chat"),))] == 1
    assert m[("flexpipe_transition_phase", (("deployment", "chat"), ("phase", "prepare")))] == 1
    assert m[("flexpipe_transition_phase", (("deployment", "chat"), ("phase", "idle")))] == 0
    assert m[("flexpipe_shadow_plan_status", (("deployment", "chat"), ("status", "preparing")))] == 1
    assert m[("flexpipe_decisions_total", (("deployment", "chat"), ("outcome", "switch"),
                                           ("reason", "emergency")))] == 1

    # the agents prepare the shadow plan; the executor stops at the canary (a dwell)
    ex = build_executor()
    deadline = time.monotonic() + 120  # a condition, not a speed: generous for a loaded machine
    while Transition.objects.get(seq=3).step != "canary":
        assert time.monotonic() < deadline, Transition.objects.get(seq=3).step
        ex.advance("chat")
        world.agents.run()
        time.sleep(0.01)
    m = scrape(viewer.api())
    assert m[("flexpipe_transition_phase", (("deployment", "chat"), ("phase", "switch")))] == 1
    assert m[("flexpipe_shadow_plan_status", (("deployment", "chat"), ("status", "canary")))] == 1
    assert m[("flexpipe_deployment_routing_version", (("deployment", "chat"),))] > 0


def test_the_migration_queue_counts_migrations_whose_command_is_not_acknowledged(viewer: Person) -> None:
    world = running_deployment(moved=False)
    for _ in range(6):  # long requests in flight on the running plan: the move hands them over
        world.agents.fleet.submit("chat", 4000, 4000)
    world.agents.run(0.3)
    # to two other GPUs of the same node: NVLink makes migrating the KV cheaper than replaying it
    do_request_gear("chat", gear("a1", [2, 3]), actor="system:test")
    ex = build_executor()
    deadline = time.monotonic() + 120  # a condition, not a speed: generous for a loaded machine
    while Transition.objects.get(seq=2).step != "move":
        assert time.monotonic() < deadline, Transition.objects.get(seq=2).step
        ex.advance("chat")
        if Transition.objects.get(seq=2).step != "move":
            world.agents.run()
        time.sleep(0.01)
    move = AgentCommand.objects.get(kind="move_sequences", transition_seq=2)
    migrations = [x for x in move.payload["moves"] if x["action"] == "migrate"]
    assert move.state == "pending" and migrations, move.payload["moves"]
    assert scrape(viewer.api())[("flexpipe_migration_queue_length", (("deployment", "chat"),))] == len(migrations)
    while AgentCommand.objects.get(pk=move.pk).state != "ok":  # the leaving plan's agent hands them over
        assert time.monotonic() < deadline
        world.agents.run(0.05)
    assert scrape(viewer.api())[("flexpipe_migration_queue_length", (("deployment", "chat"),))] == 0
