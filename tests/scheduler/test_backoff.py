"""Back-off after refused PREPAREs (scheduler.backoff): pure values, and what the gearbox makes of them."""

from __future__ import annotations

import json
from dataclasses import replace

from scheduler.backoff import BASE_S, MAX_S, Backoff, fingerprint, refusal
from scheduler.gearbox import Deployment, LoadSample, LoadWindow, Outcome, decide
from scheduler.modelspec import model_spec
from scheduler.transition import Intent, Kind, Phase, Step, StepRecord, StepState, TransitionRecord
from tests.scheduler.builders import CHAT_SLO, NodeSpec, make_fleet, one_plan_gear, tp_plan

M8 = model_spec("Llama-3-8B")
NOW = 1000.0


def snap():  # noqa: ANN201 - a builder
    return make_fleet([NodeSpec("a1", gpus=4), NodeSpec("b1", gpus=4)])


def plan(node: str = "b1", n: int = 1):  # noqa: ANN201
    return tp_plan(M8, [f"{node}-g{i}" for i in range(n)], 50_000)


def test_waits_double_from_30_seconds_up_to_10_minutes_and_a_success_ends_the_streak() -> None:
    book, s = Backoff(), snap()
    waits = []
    for i in range(8):
        before = book
        book = book.failed([plan(n=1 + i % 2)], NOW, "prepare failed: no weights", s)
        waits.append(book.hold_until_s - NOW if book.hold_until_s else None)
        assert book.streak == before.streak + 1
    assert waits[:5] == [BASE_S, 2 * BASE_S, 4 * BASE_S, 8 * BASE_S, 16 * BASE_S] and waits[-1] == MAX_S
    assert book.holding(NOW + 1) == book.hold_until_s and book.holding(NOW + MAX_S + 1) is None
    done = book.succeeded()
    assert done.streak == 0 and done.holding(NOW) is None and done.entries == book.entries
    assert done.failed([plan()], NOW, "x", s).hold_until_s == NOW + BASE_S  # the next streak starts again


def test_a_backed_off_plan_is_not_proposed_and_while_holding_nor_is_anything_on_the_refusing_node() -> None:
    s = snap()
    refused = plan("b1", 1)
    book = Backoff().failed([refused], NOW, "prepare failed", s)
    assert book.blocked(one_plan_gear(refused), NOW)
    other_on_b1 = plan("b1", 2)
    assert book.blocked(one_plan_gear(other_on_b1), NOW, s)  # same node, while the deployment waits
    assert not book.blocked(one_plan_gear(plan("a1", 1)), NOW, s)  # elsewhere: free to go
    assert not book.blocked(one_plan_gear(refused), NOW + BASE_S)  # the wait is over


def test_a_topology_change_touching_its_gpus_resets_an_entry_and_nothing_else_does() -> None:
    s = snap()
    book = Backoff().failed([plan("b1", 2)], NOW, "prepare failed", s)
    same = book.observe(replace(s, now_s=NOW + 5), now_s=NOW + 5)
    assert same.entries == book.entries
    lost = replace(s, gpus=tuple(replace(g, healthy=False) if g.uuid == "b1-g1" else g for g in s.gpus))
    reset = book.observe(lost, now_s=NOW + 5)
    assert not reset.entries and reset.holding(NOW + 5) is None and reset.streak == 0
    # an agent that registered again (its epoch moved) touches its GPUs too
    book2 = Backoff().failed([plan("b1", 1)], NOW, "x", s, extra={"b1": 1})
    assert book2.observe(s, extra={"b1": 2}, now_s=NOW).entries == {}
    assert fingerprint(s, ["nowhere"]) == (("nowhere", "absent"),)


def test_it_round_trips_through_json_and_garbage_is_no_back_off() -> None:
    book = Backoff().failed([plan()], NOW, "prepare out_of_memory: GPU b1-g0 ...", snap())
    assert Backoff.from_dict(json.loads(json.dumps(book.to_dict()))) == book
    assert Backoff.from_dict({"entries": [{"plan_id": 3}], "streak": "x"}) == Backoff()
    assert Backoff.from_dict(None) == Backoff()


def _rolled_back(step: Step, reason: str, abort: str = "") -> TransitionRecord:
    g = one_plan_gear(plan())
    st = StepRecord(step, 1, StepState.FAILED, NOW, Intent(), reason=reason, error="refused")
    return TransitionRecord("d", 1, Kind.AUTO, M8.name, None, g, Phase.ROLLED_BACK, NOW, steps=(st,),
                            abort_reason=abort)


def test_only_refusals_count_not_an_operators_abort_nor_a_lost_race() -> None:
    assert refusal(_rolled_back(Step.PREPARE, "failed")) is not None
    assert refusal(_rolled_back(Step.MOVE, "out_of_memory")) is not None
    assert refusal(_rolled_back(Step.MOVE, "preempted")) is None  # the topology moved: no back-off
    assert refusal(_rolled_back(Step.PREPARE, "failed", abort="emergency downshift")) is None


def test_the_gearbox_says_backing_off_until_and_makes_no_automatic_switch_before() -> None:
    s = snap()
    current = one_plan_gear(tp_plan(M8, ["a1-g0"], 50_000))
    dep = Deployment(id="d", model=M8.name, slo=CHAT_SLO, baseline=current)
    load = LoadWindow(tuple(LoadSample(NOW - 300 + 15 * i, 40.0, 512, 200, 0.8, 0.6) for i in range(21)))
    free = decide(dep, current, s, load, NOW, model=M8)
    assert free.outcome is Outcome.SWITCH and free.target is not None
    book = Backoff().failed(free.target.plans, NOW - 1, "prepare failed", s)
    held = decide(dep, current, s, load, NOW, model=M8, backoff=book)
    assert held.outcome is Outcome.STAY and "backing off until t=" in held.reasons[-1]
    blocked = [c for c in held.candidates if c.gear == free.target]
    assert blocked and not blocked[0].passes and "backing off until" in blocked[0].note
