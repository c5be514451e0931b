"""The gearbox under the real memory constraint: candidates that do not fit beside the current gear
are reached in two stages (or said to be blocked, with what it would take), never double-booked."""

from __future__ import annotations

import json
from dataclasses import replace

from scheduler.booking import beside_conflicts, plans_memory
from scheduler.gearbox import Decision, Deployment, LoadSample, LoadWindow, Mode, Outcome, Trigger, decide
from scheduler.modelspec import model_spec
from scheduler.plan import Gear
from scheduler.staging import combine, drain_gear
from scheduler.topology import Snapshot
from tests.scheduler.builders import CHAT_SLO, NodeSpec, make_fleet, one_plan_gear, tp_plan

M70 = model_spec("Llama-3-70B")
NOW = 1000.0


def holding(snap: Snapshot, gear: Gear) -> Snapshot:
    held = plans_memory(gear.plans, M70)
    return replace(snap, gpus=tuple(replace(g, mem_used_bytes=min(g.mem_total_bytes, g.mem_used_bytes
                                                                  + held.get(g.uuid, 0))) for g in snap.gpus))


def busy(rate: float) -> LoadWindow:
    return LoadWindow(tuple(LoadSample(NOW - 300 + 15 * i, rate, 4000, 300, 0.5, 0.5) for i in range(21)))


def tp8_full() -> Gear:
    # the baseline's TP8 with its KV reserve filling the GPUs (as FleetSim.baseline_plan makes it)
    return one_plan_gear(tp_plan(M70, [f"a1-g{i}" for i in range(8)], kv_tokens=1_000_000))


def world(*nodes: NodeSpec) -> tuple[Snapshot, Gear]:
    gear = tp8_full()
    return holding(make_fleet([NodeSpec("a1", gpus=8), *nodes]), gear), gear


def dep(**kw: object) -> Deployment:
    return replace(Deployment(id="sum", model=M70.name, slo=CHAT_SLO, baseline=tp8_full()), **kw)  # type: ignore[arg-type]


def test_a_switch_that_would_double_book_goes_in_two_stages_and_each_fits() -> None:
    snap, current = world(NodeSpec("b1", "A100-80G", rack="B"))
    d = decide(dep(), current, snap, busy(4.0), NOW, model=M70)
    assert d.outcome is Outcome.SWITCH and d.target is not None
    # whatever it picked, the transition it starts fits beside the running gear
    assert beside_conflicts(current, d.target, M70, snap) == []
    reshapes = [c for c in d.candidates if c.path is not None and c.path.kind in ("staged", "drain")]
    assert reshapes, [c.path.kind if c.path else None for c in d.candidates]
    for c in reshapes:
        assert c.path is not None and c.path.conflicts and c.path.via is not None
        assert c.cost.tokens >= 0 and "does not fit beside the current gear" in c.path.note
    # the best is the TP8's re-shape into TP4s on its own GPUs: reached through another gear first
    assert d.stage == 1 and d.staged_target is not None and d.staged_target.shape() == "2x TP4"
    assert beside_conflicts(current, d.staged_target, M70, snap)


def test_the_second_stage_follows_without_cooldown_or_hysteresis_and_starts_no_cooldown() -> None:
    snap, current = world(NodeSpec("b1", "A100-80G", rack="B"))
    target = Gear(M70.name, (tp_plan(M70, [f"a1-g{i}" for i in range(4)], 200_000),
                             tp_plan(M70, [f"a1-g{i}" for i in range(4, 8)], 200_000)), (0.5, 0.5))
    via = one_plan_gear(tp_plan(M70, [f"b1-g{i}" for i in range(8)], 200_000))
    after_first = holding(make_fleet([NodeSpec("a1", gpus=8), NodeSpec("b1", "A100-80G", rack="B")]), via)
    d = decide(dep(last_switch_times_s=(NOW - 5,)), via, after_first, busy(6.0), NOW, model=M70,
               staged_target=target)
    assert d.outcome is Outcome.SWITCH and d.target == target and d.stage == 2
    assert d.forced  # it starts no cooldown: the first stage counted for both
    # while the first stage's gear still held the target's GPUs it could not go on: decided afresh
    d2 = decide(dep(last_switch_times_s=(NOW - 5,)), current, snap, busy(6.0), NOW, model=M70, staged_target=target)
    assert d2.stage != 2 and any("cannot go on" in r for r in d2.reasons)
    # operators win: a pinned deployment's staged switch stops there
    d3 = decide(dep(mode=Mode.PINNED), via, after_first, busy(6.0), NOW, model=M70, staged_target=target)
    assert d3.outcome is Outcome.STAY


def test_with_no_room_anywhere_a_reshape_is_blocked_and_says_what_a_drain_would_take() -> None:
    snap, current = world()  # one node: nothing fits beside the TP8
    target = Gear(M70.name, (tp_plan(M70, [f"a1-g{i}" for i in range(4)], 200_000),
                             tp_plan(M70, [f"a1-g{i}" for i in range(4, 8)], 200_000)), (0.5, 0.5))
    d = decide(dep(), current, snap, busy(2.0), NOW, trigger=Trigger.MANUAL, requested_gear=target, model=M70)
    assert d.outcome is Outcome.BLOCKED
    why = d.candidates[0].path
    assert why is not None and why.kind == "blocked" and "full drain" in why.note and "without service" in why.note
    assert drain_gear(current, why.conflicts, snap) is None  # one plan: nothing could keep serving


def test_a_staged_decision_round_trips_through_json() -> None:
    snap, current = world(NodeSpec("b1", "A100-80G", rack="B"))
    d = decide(dep(), current, snap, busy(6.0), NOW, model=M70)
    back = Decision.from_dict(json.loads(json.dumps(d.to_dict())))
    assert back.to_dict() == d.to_dict()


def test_two_switches_cost_what_both_cost_plus_the_dwell() -> None:
    snap, current = world(NodeSpec("b1", "A100-80G", rack="B"))
    d = decide(dep(), current, snap, busy(6.0), NOW, model=M70)
    one = d.candidates[0].cost
    two = combine(one, one, 10.0)
    assert two.tokens == 2 * one.tokens + 10.0 and two.time_to_effect_s == 2 * one.time_to_effect_s
