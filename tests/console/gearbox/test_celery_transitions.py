"""Transitions driven by Celery: the tick task starts them, agents' acks advance them on a real worker."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import redis

from console.celery import app
from console.gearbox import tasks
from console.gearbox.models import Transition
from scheduler.invariants import assert_clean
from tests.conftest import TEST_REDIS_URL
from tests.console.gearbox.harness import SimAgents, django_log, enroll_fleet, make_deployment

pytestmark = pytest.mark.django_db(transaction=True)


def purge_queue() -> None:
    """Tasks left in this test worker's queue by earlier tests (signals enqueue ticks) must not run here."""
    client = redis.Redis.from_url(TEST_REDIS_URL)
    client.delete(app.conf.task_default_queue)




def until(cond: Callable[[], bool], agents: SimAgents, max_s: float = 45.0) -> None:
    deadline = time.monotonic() + max_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        agents.run()
        time.sleep(0.02)


def test_a_tick_on_a_worker_starts_the_first_transition_and_acks_carry_it_to_the_end(worker: None) -> None:
    enroll_fleet()
    make_deployment()
    agents = SimAgents()
    # registering the nodes already sent a topology tick; whichever tick runs first starts it
    result = tasks.tick.delay(trigger="periodic")
    assert result.get(timeout=30)["started"] in ([], ["chat#1"])
    assert Transition.objects.count() == 1
    # from here nobody calls the executor: each ack (command_acked) enqueues transitions.advance
    until(lambda: Transition.objects.get(seq=1).phase == "done", agents)
    assert_clean(django_log("chat", agents.log), complete=False)


def test_the_sweep_advances_a_transition_whose_advance_was_lost(worker: None) -> None:
    enroll_fleet()
    make_deployment()
    agents = SimAgents()
    tasks.tick.delay(trigger="periodic").get(timeout=30)
    assert Transition.objects.count() == 1
    purge_queue()  # every pending advance is lost, as if the worker that held them died
    assert tasks.sweep.delay().get(timeout=30) == ["chat#1"]
    until(lambda: Transition.objects.get(seq=1).phase == "done", agents)
