"""A "stay" that repeats the last decision is counted on its row, not stored again (issue 19)."""

from __future__ import annotations

import json
import time

import pytest

from console.audit.models import AuditEntry
from console.gearbox import ticks
from console.gearbox.models import Decision
from console.gearbox.repeats import reasons_key
from tests.console.gearbox.harness import FleetReporter, SimAgents, enroll_fleet, make_deployment
from tests.console.gearbox.test_gearbox_actions import bring_up
from tests.console.metrics.test_metrics import scrape
from tests.console.people import Person

pytestmark = pytest.mark.django_db


def settled() -> FleetReporter:
    """One deployment up on its baseline, and the reports showing it: from here each tick stays."""
    rep = enroll_fleet()
    make_deployment()
    bring_up(SimAgents())
    deadline = time.monotonic() + 30
    while ticks.tick()["waiting"]:
        assert time.monotonic() < deadline, "the reports never showed what the first transition left"
        rep.report("a1")
        rep.report("b1")
    return rep


def stays() -> list[Decision]:
    return list(Decision.objects.filter(outcome="stay").order_by("id"))


def test_fifty_identical_stay_ticks_are_one_row_that_counts_them_and_one_audit_entry(viewer: Person) -> None:
    settled()
    first = stays()
    assert len(first) == 1 and first[0].repeats == 1  # the tick that found the reports settled
    audited = AuditEntry.objects.filter(event_type="gearbox.decision").count()
    for _ in range(49):
        ticks.tick()
    rows = stays()
    assert len(rows) == 1, [(r.trigger, r.reasons) for r in rows]  # was: 50 rows of ~6.7 KB
    assert rows[0].repeats == 50 and rows[0].last_at is not None and rows[0].last_at > rows[0].at
    assert AuditEntry.objects.filter(event_type="gearbox.decision").count() == audited
    # the decisions counter still counts every tick's decision
    stay = (("deployment", "chat"), ("outcome", "stay"), ("reason", "periodic"))
    assert scrape(viewer.api())[("flexpipe_decisions_total", stay)] == 50


def test_a_different_decision_is_a_new_row_whose_audit_entry_names_the_run_it_ends() -> None:
    settled()
    for _ in range(4):
        ticks.tick()
    run = stays()[-1]
    assert run.repeats == 5
    ticks.tick(trigger="topology")  # another trigger: another decision, even though it stays too
    rows = stays()
    assert [(r.trigger, r.repeats) for r in rows] == [("periodic", 5), ("topology", 1)]
    entry = AuditEntry.objects.get(event_type="gearbox.decision", decision_id=rows[-1].pk)
    ended = json.loads(entry.body)["data"]["ends_run"]
    assert ended["decision_id"] == run.pk and ended["repeats"] == 5
    ticks.tick()  # periodic again: the run before the topology one is over, a new row starts
    assert [(r.trigger, r.repeats) for r in stays()] == [("periodic", 5), ("topology", 1), ("periodic", 1)]


def test_the_decisions_api_shows_the_count_and_its_stay_filter_still_works(operator: Person) -> None:
    settled()
    for _ in range(2):
        ticks.tick()
    body = operator.api().get("/api/v1/decisions?deployment=chat&outcome=stay").json()
    assert [(d["outcome"], d["repeats"]) for d in body["results"]] == [("stay", 3)]
    assert body["results"][0]["last_at"] > body["results"][0]["at"]
    switches = operator.api().get("/api/v1/decisions?deployment=chat&outcome=switch").json()["results"]
    assert [d["repeats"] for d in switches] == [1]


def test_reasons_are_the_same_once_their_figures_are_set_aside_but_names_keep_their_digits() -> None:
    a = ["no candidate's gain beats its cost x hysteresis", "best: TP4 gain 812 tokens vs threshold 950 (cost 678 x 1.4)"]
    b = ["no candidate's gain beats its cost x hysteresis", "best: TP4 gain 790 tokens vs threshold 950 (cost 678 x 1.4)"]
    assert reasons_key(a) == reasons_key(b)
    assert reasons_key(["best: TP4 gain 1"]) != reasons_key(["best: TP2 gain 1"])
    assert reasons_key(["GPU-a1-0 lost"]) != reasons_key(["GPU-a1-1 lost"])
    assert reasons_key(["2x TP2 on b1"]) != reasons_key(["3x TP2 on b1"])
    assert reasons_key(["utilisation 80% (short window)"]) == reasons_key(["utilisation 85% (short window)"])
