"""Scale to zero through the console's tick (console/gearbox/zero.py; the control loop's rules 9b and 9):
real PostgreSQL, the simulated agents answering the commands through the database."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.utils import timezone

from console.audit.models import AuditEntry
from console.fleet.models import AgentCommand
from console.gearbox import present, ticks
from console.gearbox.actions import do_pin_gear, do_record_load
from console.gearbox.models import Deployment, Transition
from console.gearbox.zero import do_request_wake
from scheduler.gearbox import LoadSample
from tests.console.gearbox.ops import World, drive, running_deployment

pytestmark = pytest.mark.django_db


def quiet(world: World, *, idle_s: float = 60.0) -> None:
    """The deployment may scale to zero after `idle_s`, came up long ago, and its load window (what
    the engine reports feed each tick) shows no arrivals for five minutes."""
    now = timezone.now()
    Deployment.objects.filter(name="chat").update(idle_to_zero_s=idle_s, min_replicas=0)
    Transition.objects.filter(deployment__name="chat").update(finished_at=now - timedelta(minutes=10))
    for k in range(20, -1, -1):
        do_record_load(Deployment.objects.get(name="chat"),
                       LoadSample((now - timedelta(seconds=15 * k)).timestamp(), 0.0, 512, 128))


def health() -> dict[str, object]:
    dep = Deployment.objects.get(name="chat")
    return present.health(dep, None, present.fleet_view(timezone.now(), with_blocks=False), None)


def test_a_deployment_scales_to_zero_and_its_next_request_is_held_and_served() -> None:
    world = running_deployment(moved=False)
    quiet(world)
    ticks.tick()
    dep = Deployment.objects.get(name="chat")
    assert dep.current_gear is None and dep.routing == [] and dep.zero_since is not None
    releases = AgentCommand.objects.filter(kind="release_plan", key__startswith="gearbox.zero/chat/")
    assert [c.node.node_id for c in releases] == ["a1"]
    entry = AuditEntry.objects.get(event_type="gearbox.scaled_to_zero")
    body = json.loads(entry.body)
    assert "no arrivals for" in entry.summary and body["before"]["gear"] and body["after"]["gear"] is None
    assert health()["state"] == "scaled to zero"

    # nothing held: it stays at zero, deciding nothing (and the release is not done yet)
    assert ticks.tick()["started"] == [] and Deployment.objects.get(name="chat").current_gear is None
    world.agents.run(15.0)  # the agent drains the plan, frees its GPUs and acks
    world.reporter.report("a1")
    assert ticks.tick()["started"] == []

    # the gateway holds a request: the mark is set once (one cold start), and the tick wakes it
    assert do_request_wake("chat") and not do_request_wake("chat")
    out = ticks.tick()
    assert out["started"] == ["chat#2"], out
    woke = AuditEntry.objects.get(event_type="gearbox.waking_from_zero")
    assert woke.transition_seq == 2 and "a request is held" in woke.summary
    assert drive(world.agents).phase == "done"
    ticks.tick()  # back up: no longer at zero
    dep = Deployment.objects.get(name="chat")
    assert dep.current_gear is not None and dep.zero_since is None and dep.wake_requested_at is None
    assert [r["plan_id"] for r in dep.routing] and health()["state"] != "scaled to zero"
    # ... and it serves the held request (the gateway admits it now: tests/console/gateway)
    req = world.agents.fleet.submit("chat", 200, 20)
    world.agents.run_out()
    assert req is not None and world.agents.fleet.open_sequences() == 0
    # the idle time counts from the wake-up: the old quiet window does not send it straight back
    assert ticks.tick()["started"] == [] and Deployment.objects.get(name="chat").zero_since is None


def test_a_pinned_deployment_never_scales_to_zero() -> None:
    world = running_deployment(moved=False)
    do_pin_gear("chat", actor="system:test")
    quiet(world)
    ticks.tick()
    dep = Deployment.objects.get(name="chat")
    assert dep.current_gear is not None and dep.zero_since is None and dep.routing
    assert not AuditEntry.objects.filter(event_type="gearbox.scaled_to_zero").exists()
    assert not do_request_wake("chat")  # not at zero: nothing to wake


def test_a_deployment_that_unloaded_for_a_higher_priority_is_kept_off_the_gpus_it_gave_for_the_hold() -> None:
    from console.gearbox.control import observe
    from console.gearbox.snapshot import fleet_snapshot
    from console.gearbox.zero import do_scale_to_zero
    from scheduler.pool.priority import UNLOAD_HOLD_S

    running_deployment(moved=False)
    dep = Deployment.objects.get(name="chat")
    gave = tuple(sorted({u for p in dep.current_gear["plans"] for s in p["stages"] for u in s["gpus"]}))
    now = timezone.now()
    assert do_scale_to_zero(dep, "unloads: gives ...", now=now, actor="system:gearbox", gives_to="hi", given=gave)
    data = json.loads(AuditEntry.objects.get(event_type="gearbox.scaled_to_zero").body)["data"]
    assert data["gives_to"] == "hi" and data["given"] == list(gave)
    base = fleet_snapshot(now, cached=False)
    seen = observe("chat", base, now + timedelta(seconds=5))
    assert seen is not None and seen.state.at_zero and seen.state.keep_off == frozenset(gave)
    # once the hold is over, what the taker did not take is anyone's again
    later = observe("chat", base, now + timedelta(seconds=UNLOAD_HOLD_S + 1))
    assert later is not None and later.state.keep_off == frozenset()
