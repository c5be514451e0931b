"""Topology events share one pending tick (issue 19): a burst queues one task, an event during a
running tick queues exactly one more. Real Redis, a real Celery worker where a tick runs."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery.contrib.testing.worker import start_worker

from console.celery import app
from console.fleet.signals import topology_changed
from console.gearbox import coalesce, ticks
from tests.conftest import TEST_REDIS_URL, purge_tasks
from tests.console.gearbox.harness import enroll_fleet

pytestmark = pytest.mark.django_db(transaction=True)


def queued_ticks() -> list[dict[str, Any]]:
    """The gearbox.tick messages waiting in this test worker's queue: their kwargs and eta."""
    out = []
    for raw in redis.Redis.from_url(TEST_REDIS_URL).lrange(app.conf.task_default_queue, 0, -1):
        msg = json.loads(raw)
        if msg["headers"]["task"] == "gearbox.tick":
            out.append({"eta": msg["headers"].get("eta")} | json.loads(base64.b64decode(msg["body"]))[1])
    return out


def pending() -> bool:
    return bool(redis.Redis.from_url(TEST_REDIS_URL).exists(coalesce.pending_key("topology", None)))


@pytest.fixture
def clean() -> Iterator[None]:
    purge_tasks()
    yield
    purge_tasks()


def until(cond: Callable[[], bool], what: str, max_s: float = 60.0) -> None:
    deadline = time.monotonic() + max_s
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {max_s:g} s"
        time.sleep(0.02)


def test_a_hundred_topology_events_queue_one_tick_that_waits_the_merge_window(clean: None) -> None:
    for n in range(100):
        topology_changed.send(sender=None, node_ids=[f"n{n}"])
    queued = queued_ticks()
    assert len(queued) == 1, queued  # was: 100
    assert queued[0]["trigger"] == "topology" and "deployment" not in queued[0]
    assert queued[0]["eta"] is not None  # sent with the window as countdown: later events ride on it
    assert pending()


def test_enrolling_a_fleet_queues_one_topology_tick(clean: None) -> None:
    enroll_fleet({f"n{i}": "AB"[i % 2] for i in range(12)})  # 12 registrations, 12 first reports
    assert [q["trigger"] for q in queued_ticks()] == ["topology"]


def test_an_event_while_a_tick_runs_gets_exactly_one_more_tick_after_it(
        clean: None, monkeypatch: pytest.MonkeyPatch) -> None:
    real = ticks.tick
    calls: list[str] = []
    finished: list[str] = []

    def tick_with_events_inside(**kw: Any) -> dict[str, object]:
        calls.append(str(kw.get("trigger")))
        if len(calls) == 1:  # the fleet changes while the first tick runs: ten more events
            for n in range(10):
                topology_changed.send(sender=None, node_ids=[f"late{n}"])
        try:
            return real(**kw)
        finally:
            finished.append(str(kw.get("trigger")))

    monkeypatch.setattr(ticks, "tick", tick_with_events_inside)
    for n in range(100):
        topology_changed.send(sender=None, node_ids=[f"n{n}"])
    assert len(queued_ticks()) == 1
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10,
                      queues=[app.conf.task_default_queue]):
        until(lambda: len(finished) == 2, "the first tick and the one its late events asked for")
        # nothing is pending after the second: a third could only come from a mark, and none is set
        assert not pending() and queued_ticks() == []
    assert calls == ["topology", "topology"]


def test_a_lost_tick_holds_events_back_no_longer_than_its_mark_lives(
        clean: None, settings: Any) -> None:
    settings.FLEXPIPE_TICK_PENDING_TTL_S = 1.0
    topology_changed.send(sender=None, node_ids=["a"])
    redis.Redis.from_url(TEST_REDIS_URL).delete(app.conf.task_default_queue)  # the task is lost
    ttl_ms = redis.Redis.from_url(TEST_REDIS_URL).pttl(coalesce.pending_key("topology", None))
    assert 0 < ttl_ms <= 1000
    until(lambda: not pending(), "the mark of the lost tick expired")
    topology_changed.send(sender=None, node_ids=["a"])
    assert len(queued_ticks()) == 1


def test_two_ticks_that_find_a_deployment_waiting_for_reports_queue_one_re_tick(clean: None) -> None:
    from django.utils import timezone

    from console.gearbox import tasks
    from console.gearbox.models import Transition
    from tests.console.gearbox.harness import SimAgents, make_deployment
    from tests.console.gearbox.test_gearbox_actions import bring_up

    enroll_fleet()
    make_deployment()
    bring_up(SimAgents())
    Transition.objects.filter(seq=1).update(finished_at=timezone.now())  # the reports predate its end
    purge_tasks()
    for _ in range(2):
        assert tasks.tick.apply(kwargs={"trigger": "periodic"}).get()["waiting"] == ["chat"]
    queued = queued_ticks()
    assert [(q["trigger"], q["deployment"]) for q in queued] == [("periodic", "chat")], queued  # was: two
    assert queued[0]["eta"] is not None  # in RETICK_S, as before
