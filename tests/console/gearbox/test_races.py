"""Races on the real database: two ticks at once, two executors on one transition."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from django.db import connection

from console.gearbox import actions, ticks
from console.gearbox.executor import build_executor
from console.gearbox.models import Decision, Deployment, Transition, TransitionStep
from scheduler.invariants import assert_clean
from tests.console.gearbox.harness import SimAgents, django_log, enroll_fleet, gear, make_deployment

pytestmark = pytest.mark.django_db(transaction=True)


def in_threads(n: int, fn: Any) -> list[Any]:
    out: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001 - reported to the test below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    return out


def test_two_ticks_that_race_to_the_claim_start_one_transition(monkeypatch: Any) -> None:
    enroll_fleet()
    make_deployment()
    both_decided = threading.Barrier(2, timeout=20)
    real_locked = actions._locked

    def lock_when_both_decided(*args: Any, **kwargs: Any) -> Any:
        # each tick saw no transition and decided to switch; from here both lock the deployment,
        # record and claim. The deployment's row lock serialises the two: the second claims after
        # the first committed its transition - and loses the conditional update.
        both_decided.wait()
        return real_locked(*args, **kwargs)

    monkeypatch.setattr(actions, "_locked", lock_when_both_decided)
    results = in_threads(2, lambda: ticks.tick())
    assert sorted(len(r["started"]) for r in results) == [0, 1]
    assert Transition.objects.count() == 1
    switches = list(Decision.objects.filter(outcome="switch").order_by("id"))
    assert len(switches) == 2
    assert [bool(d.note) for d in switches].count(True) == 1
    assert "another transition claimed" in next(d.note for d in switches if d.note)


def test_two_executors_advancing_one_transition_at_once_do_every_step_once() -> None:
    enroll_fleet()
    make_deployment()
    agents = SimAgents()
    build_executor().start("chat", gear("a1", [0, 1]))
    stop = threading.Event()

    def advance_until_done() -> None:
        ex = build_executor()
        while not stop.is_set():
            out = ex.advance("chat")
            if out.record is None or not out.record.active:
                return
            time.sleep(0.005)

    workers = [threading.Thread(target=lambda: (advance_until_done(), connection.close())) for _ in range(2)]
    for w in workers:
        w.start()
    deadline = time.monotonic() + 120
    while any(w.is_alive() for w in workers) and time.monotonic() < deadline:
        agents.run()
        time.sleep(0.01)
    stop.set()
    for w in workers:
        w.join(timeout=10)
    row = Transition.objects.get(seq=1)
    assert row.phase == "done"
    ok = list(TransitionStep.objects.filter(transition=row, state="ok").values_list("step", flat=True))
    assert sorted(ok) == sorted(set(ok)) and len(ok) == 9  # each step succeeded exactly once
    assert_clean(django_log("chat", agents.log), complete=False)


@pytest.mark.skipif(connection.vendor != "postgresql", reason="row locks and deadlock detection are PostgreSQL's")
def test_an_operator_action_during_a_tick_that_claims_a_transition_does_not_deadlock(monkeypatch: Any) -> None:
    # The tick records its decision (audit head) and then claims the deployment row; an operator
    # action locks the deployment row and then appends to the audit chain. Without one lock order
    # the two deadlock and PostgreSQL aborts one of them. Here the operator is let in exactly
    # between the tick's audit append and its claim - if the tick still lets it in.
    enroll_fleet()
    make_deployment()
    tick_has_audit_head, operator_has_deployment = threading.Event(), threading.Event()
    real_record, real_locked = actions.do_record_decision, actions._locked

    def record_then_let_the_operator_in(*args: Any, **kwargs: Any) -> Any:
        row = real_record(*args, **kwargs)
        tick_has_audit_head.set()
        operator_has_deployment.wait(timeout=2.0)  # a lock order that blocks the operator: times out
        return row

    def locked(*args: Any, **kwargs: Any) -> Any:
        row = real_locked(*args, **kwargs)
        if threading.current_thread().name == "operator":
            operator_has_deployment.set()
        return row

    monkeypatch.setattr(actions, "do_record_decision", record_then_let_the_operator_in)
    monkeypatch.setattr(actions, "_locked", locked)
    errors: list[BaseException] = []

    def run(fn: Any) -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connection.close()

    def operator() -> None:
        assert tick_has_audit_head.wait(timeout=20)
        actions.do_set_mode("chat", "advisory", actor="system:test")

    threads = [threading.Thread(target=run, args=(ticks.tick,), name="tick"),
               threading.Thread(target=run, args=(operator,), name="operator")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert Transition.objects.count() == 1
    assert Deployment.objects.get(name="chat").mode == "advisory"
