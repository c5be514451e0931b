"""The global correction's rules (scheduler/control/correction.py) and the engines' hint book."""

from __future__ import annotations

import pytest

from scheduler.control.correction import (
    CorrectionConfig,
    Direction,
    GlobalCorrection,
    Hint,
    HintBook,
    PlanSignal,
    SlidingWindow,
    hints_from_payload,
    imbalance,
)


def by_plan(hints: object) -> dict[str, Hint]:
    return {h.plan_id: h for h in hints.hints}  # type: ignore[attr-defined]


def test_a_balanced_pool_holds_every_knob() -> None:
    loop = GlobalCorrection()
    out = loop.step(0.5, "chat", [PlanSignal("a", 10, 2), PlanSignal("b", 11, 1), PlanSignal("c", 9, 3)])
    assert out.imbalance < 0.1
    for h in out.hints:
        assert (h.direction, h.weight_multiplier, h.batch_scale) == (Direction.HOLD, 1.0, 1.0)


def test_a_plan_three_times_as_loaded_loses_weight_to_the_idlest() -> None:
    loop = GlobalCorrection()
    plans = [PlanSignal("hot", 30, 30), PlanSignal("a", 10, 10), PlanSignal("cold", 8, 0)]
    first = by_plan(loop.step(0.5, "chat", plans))
    assert first["hot"].weight_multiplier == pytest.approx(1 / 1.25)
    assert first["cold"].weight_multiplier == pytest.approx(1.25)
    assert first["a"].weight_multiplier == 1.0
    for k in range(2, 20):  # the imbalance stays: the multipliers go on to their bounds, not past
        last = by_plan(loop.step(0.5 * k, "chat", plans))
    assert last["hot"].weight_multiplier == 0.5 and last["cold"].weight_multiplier == 2.0


def test_capacity_normalises_load_a_faster_plan_may_hold_more() -> None:
    loop = GlobalCorrection()
    out = loop.step(0.5, "chat", [PlanSignal("big", 30, 0, capacity=3.0), PlanSignal("small", 10, 0)])
    assert out.imbalance == 0.0 and {h.weight_multiplier for h in out.hints} == {1.0}


def test_weights_return_towards_one_once_balanced_and_hold_in_the_hysteresis_band() -> None:
    loop = GlobalCorrection()
    loop.step(0.5, "chat", [PlanSignal("a", 30, 0), PlanSignal("b", 10, 0)])
    held = by_plan(loop.step(1.0, "chat", [PlanSignal("a", 12, 0), PlanSignal("b", 10, 0)]))  # imbalance 0.09
    assert held["a"].weight_multiplier == 1.0  # under imbalance_low: back one step, to 1 exactly
    loop.step(1.5, "chat", [PlanSignal("a", 30, 0), PlanSignal("b", 10, 0)])
    band = by_plan(loop.step(2.0, "chat", [PlanSignal("a", 13, 0), PlanSignal("b", 10, 0)]))  # 0.13: held
    assert band["a"].weight_multiplier == pytest.approx(0.8) and band["b"].weight_multiplier == pytest.approx(1.25)


def test_a_violation_rate_above_target_speeds_the_plan_up_with_a_smaller_batch_threshold() -> None:
    loop = GlobalCorrection()
    out = by_plan(loop.step(0.5, "chat", [PlanSignal("late", 5, 5, finished=40, violated=8),
                                          PlanSignal("fine", 5, 0, finished=40, violated=0)]))
    assert out["late"].direction == Direction.SPEED_UP
    assert out["late"].batch_scale == round(1 / 1.5, 6)
    assert out["fine"].direction == Direction.HOLD and out["fine"].batch_scale == 1.0
    for k in range(2, 30):
        last = by_plan(loop.step(0.5 * k, "chat", [PlanSignal("late", 5, 5, finished=40, violated=8)]))
    assert last["late"].batch_scale == CorrectionConfig().batch_scale_min  # bounded


def test_a_calm_plan_with_a_queue_never_grows_above_the_default() -> None:
    loop = GlobalCorrection()
    calm = [PlanSignal("q", 5, 20, kv_usage=0.5, finished=40, violated=0)]
    for k in range(1, 60):  # 30 s calm with requests waiting: the threshold stays the engine's own
        out = by_plan(loop.step(0.5 * k, "chat", calm))
        assert out["q"].batch_scale == 1.0 and out["q"].direction == Direction.HOLD


def test_the_threshold_grows_back_towards_the_default_once_violations_clear() -> None:
    loop = GlobalCorrection()  # hold: one window (10 s)
    late = [PlanSignal("p", 5, 5, finished=40, violated=8)]
    clear = [PlanSignal("p", 5, 5, finished=40, violated=0)]
    scales = [by_plan(loop.step(0.5 * k, "chat", late))["p"].batch_scale for k in range(1, 22)]
    assert (scales[0], scales[-1]) == (round(1 / 1.5, 6), 0.5)  # two moves, a window apart
    scales = [by_plan(loop.step(10.5 + 0.5 * k, "chat", clear))["p"].batch_scale for k in range(1, 60)]
    assert scales[:19] == [0.5] * 19  # held a window after the last move
    assert scales[19] == 0.75  # the window since the move is clean: one step up
    assert scales[39] == 1.0 and max(scales) == 1.0  # then to the default, never past it


def test_wind_up_hold_judges_only_what_finished_under_the_new_setting() -> None:
    loop = GlobalCorrection(CorrectionConfig(batch_hold_s=5.0))  # shorter than the window (10 s)
    assert by_plan(loop.step(0.5, "chat", [PlanSignal("p", 5, 5, finished=100, violated=50)]))["p"].batch_scale < 1
    clear = [PlanSignal("p", 5, 5, finished=10, violated=0)]
    scales = [by_plan(loop.step(0.5 + 0.5 * k, "chat", clear))["p"].batch_scale for k in range(1, 11)]
    # the window still holds the 50 misses that caused the move (50 of 200 at 5.5 s), but they
    # were served under the old threshold: the verdict counts the clean ones since, and the plan
    # steps back to the default instead of down again
    assert loop.windows[("chat", "p")].rate() > CorrectionConfig().violation_target
    assert scales[:9] == [round(1 / 1.5, 6)] * 9 and scales[9] == 1.0


def test_too_few_samples_give_no_verdict_and_the_threshold_returns_to_the_default() -> None:
    loop = GlobalCorrection()
    loop.step(0.5, "chat", [PlanSignal("p", 5, 5, finished=40, violated=20)])
    assert loop.batch[("chat", "p")] < 1
    # nothing finishes: the window slides past the bad samples, and with no verdict (under
    # min_samples) the threshold walks back to the default - requests waiting or not
    for k in range(1, 40):
        last = by_plan(loop.step(0.5 + 0.5 * k, "chat", [PlanSignal("p", 5, 5, finished=0)]))
        if k == 19:
            assert loop.windows[("chat", "p")].rate(20) is not None  # still inside the window
    assert last["p"].batch_scale == 1.0 and last["p"].direction == Direction.HOLD


def test_the_window_forgets_what_is_older_than_window_s() -> None:
    w = SlidingWindow(10.0)
    w.add(0.0, 10, 5)
    w.add(5.0, 10, 0)
    assert w.rate() == 0.25
    w.add(10.0, 0, 0)
    assert (w.finished, w.violated, w.rate()) == (10, 0, 0.0)
    assert w.rate(min_samples=11) is None


def test_imbalance_is_std_over_mean() -> None:
    assert imbalance([]) == imbalance([5.0]) == imbalance([0.0, 0.0]) == 0.0
    assert imbalance([1.0, 3.0]) == pytest.approx(0.5)


def test_versions_increase_and_due_sends_changes_and_refreshes() -> None:
    loop = GlobalCorrection(CorrectionConfig(ttl_s=4.0), start_version=1_000)
    plans = [PlanSignal("a", 5, 0), PlanSignal("b", 5, 0)]
    first = loop.step(0.5, "chat", plans)
    assert first.hints_version == 1_001 and first.ttl_s == 4.0
    assert [h.plan_id for h in loop.due(first, 0.5)] == ["a", "b"]  # never sent
    second = loop.step(1.0, "chat", plans)
    assert second.hints_version == 1_002 and loop.due(second, 1.0) == []  # unchanged, fresh
    assert len(loop.due(loop.step(2.5, "chat", plans), 2.5)) == 2  # ttl / 2 since sent: refreshed
    moved = loop.step(3.0, "chat", [PlanSignal("a", 40, 0), PlanSignal("b", 5, 0)])
    assert [h.plan_id for h in loop.due(moved, 3.0)] == ["a", "b"]  # both multipliers changed


def test_a_plan_gone_is_forgotten() -> None:
    loop = GlobalCorrection()
    loop.step(0.5, "chat", [PlanSignal("a", 30, 0), PlanSignal("b", 5, 0)])
    loop.step(1.0, "chat", [PlanSignal("b", 5, 0)])
    assert ("chat", "a") not in loop.weights and ("chat", "a") not in loop.windows


def test_the_book_ignores_a_stale_version_and_lapses_to_defaults_after_the_ttl() -> None:
    book = HintBook()
    fast = Hint("p", Direction.SPEED_UP, 0.5, 0.25)
    assert book.apply("chat", 7, 5.0, [fast], now_s=100.0)
    assert book.batch_tokens("chat", "p", 101.0, 2048) == 512 and book.weight("chat", "p", 101.0) == 0.5
    late = Hint("p", Direction.SLOW_DOWN, 2.0, 2.0)
    assert not book.apply("chat", 6, 5.0, [late], now_s=102.0)  # older: changes nothing
    assert not book.apply("chat", 7, 5.0, [late], now_s=102.0)  # the same version again: nothing
    assert book.batch_tokens("chat", "p", 102.0, 2048) == 512
    assert book.apply("other", 3, 5.0, [late], now_s=102.0)  # versions are per deployment
    assert book.batch_tokens("chat", "p", 105.0, 2048) == 2048  # ttl over: the engine's own
    assert book.weight("chat", "p", 105.0) == 1.0 and book.live("chat", "p", 105.0) is None


def test_a_payload_reads_back_into_hints() -> None:
    payload = {"deployment": "chat", "hints_version": 9, "ttl_s": 2.5,
               "plans": [{"plan_id": "p", "direction": "speed_up", "weight_multiplier": 0.8,
                          "batch_scale": 0.5}]}
    assert hints_from_payload(payload) == ("chat", 9, 2.5, [Hint("p", Direction.SPEED_UP, 0.8, 0.5)])
    assert Hint("p", Direction.SPEED_UP, 0.8, 0.5).to_dict() == payload["plans"][0]  # type: ignore[index]


@pytest.mark.parametrize("change,field", [
    ({"weight_min": 0.0}, "weight_min"), ({"batch_scale_min": 2.0}, "batch_scale_min"), ({"batch_step": 1.0}, "batch_step"),
    ({"imbalance_low": 0.5}, "imbalance_low"), ({"ttl_s": float("nan")}, "ttl_s"), ({"batch_hold_s": -1.0}, "batch_hold_s"),
])
def test_a_bad_config_names_the_field(change: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        CorrectionConfig(**change)  # type: ignore[arg-type]


def test_a_bad_signal_names_the_plan() -> None:
    with pytest.raises(ValueError, match="p.capacity"):
        PlanSignal("p", 1, 1, capacity=0.0)
    with pytest.raises(ValueError, match="violated"):
        PlanSignal("p", 1, 1, finished=1, violated=2)


def test_a_moved_threshold_is_held_until_the_window_can_see_the_move() -> None:
    loop = GlobalCorrection(CorrectionConfig(batch_hold_s=5.0))
    late = [PlanSignal("p", 5, 5, finished=40, violated=20)]
    scales = [by_plan(loop.step(0.5 * k, "chat", late))["p"].batch_scale for k in range(1, 13)]
    assert scales[0] == round(1 / 1.5, 6)
    assert set(scales[1:10]) == {scales[0]}  # held for 5 s
    assert scales[10] == 0.5  # then the next move (bounded by batch_scale_min)
