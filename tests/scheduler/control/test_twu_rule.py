"""The control loop's TWU rule (scheduler/control/loop.py rule 11), one named case each; no database.

The TWU samples are given (`DeploymentState.twu`) where a case is about the rule itself, so the
load window - what the gearbox prices - can stay in the band where the gearbox alone would not
call it a LOAD decision; one case leaves them to the loop, which prices the load window.
"""

from __future__ import annotations

from dataclasses import replace

from scheduler.control import DeploymentState, FirstStage, LoopConfig, Staged, Step
from scheduler.gearbox import DEFAULT_CONFIG, LoadSample, LoadWindow, Mode, Outcome, Trigger, offered_load
from scheduler.pool.autoscale import TwuSample, gear_twu_samples, window_mean
from scheduler.transition import Kind
from tests.scheduler.builders import one_plan_gear, tp_plan
from tests.scheduler.control.test_loop import M70, NOW, fleet, state, step, tp8

MID_RATE = 12.0  # req/s: tp8 of Llama-3-70B on H100s near 0.64 of its modelled capacity (no LOAD of its own)
LOW_RATE = 8.0  # ... near 0.42: still no LOAD of its own, but a TP4 serves it within the SLOs


def twu(short: float, long: float) -> tuple[TwuSample, ...]:
    """A sample every 15 s over the long window: `short` in the short window, `long` before it."""
    out = []
    t = NOW - DEFAULT_CONFIG.long_window_s + 15
    while t <= NOW:
        out.append(TwuSample(t, short if t > NOW - DEFAULT_CONFIG.short_window_s else long))
        t += 15
    return tuple(out)


def one(s: DeploymentState, config: LoopConfig | None = None) -> Step:
    return step(s, config=config).steps[0]


def led_by_twu(s: Step) -> bool:
    return s.decision is not None and bool(s.decision.reasons) and s.decision.reasons[0].startswith("TWU asks")


def test_these_rates_alone_are_no_load_decision() -> None:
    # (the premise of the cases below: without TWU the gearbox sees no LOAD at these rates)
    for rate in (MID_RATE, LOW_RATE):
        s = one(state(current=tp8("a1"), rate=rate, twu=twu(0.6, 0.6)))
        assert s.decision is not None and s.decision.trigger is Trigger.PERIODIC and not led_by_twu(s), rate


def test_twu_above_the_high_watermark_in_both_windows_is_a_load_decision_asking_for_more() -> None:
    s = one(state(current=tp8("a1"), rate=MID_RATE, twu=twu(0.95, 0.9)))
    d = s.decision
    assert d is not None and s.trigger is Trigger.LOAD and d.trigger is Trigger.LOAD, d
    assert led_by_twu(s) and "more capacity" in d.reasons[0] and "above the high watermark" in d.reasons[0]
    cur = d.current_estimate
    assert cur is not None
    # the ask leaves out every candidate with no more modelled capacity than the current gear
    smaller = [c for c in d.candidates if c.estimate.capacity_rps <= cur.capacity_rps and not c.standing]
    assert smaller and all(not c.passes and "asks for more capacity" in c.note for c in smaller)
    # hysteresis still decides: at this offered load no larger gear is worth its switch
    assert d.outcome is Outcome.STAY, d.reasons


def test_twu_above_in_one_window_only_does_nothing() -> None:
    for short, long in ((0.95, 0.6), (0.6, 0.95)):
        s = one(state(current=tp8("a1"), rate=MID_RATE, twu=twu(short, long)))
        assert s.decision is not None and s.decision.trigger is Trigger.PERIODIC and not led_by_twu(s), (short, long)
        plain = one(state(current=tp8("a1"), rate=MID_RATE, twu=twu(0.6, 0.6)))
        assert s.decision == plain.decision  # the rule left the step as it was


def test_twu_below_the_low_watermark_asks_for_less_and_gives_gpus_back() -> None:
    s = one(state(current=tp8("a1"), rate=LOW_RATE, twu=twu(0.2, 0.3)))
    d = s.decision
    assert d is not None and d.trigger is Trigger.LOAD and led_by_twu(s) and "less capacity" in d.reasons[0]
    assert all(not c.passes for c in d.candidates if c.estimate.gpus >= 8 and not c.standing)
    assert d.outcome is Outcome.SWITCH and d.target is not None and len(d.target.gpu_uuids) < 8, d.reasons


def test_the_loop_prices_the_load_window_when_no_samples_are_given() -> None:
    # no `twu`: both drivers leave it to the loop, which reads the same load window they pass
    high = state(current=tp8("a1"), rate=20.0)
    samples = gear_twu_samples(high.load, tp8("a1"), high.model, fleet(), NOW)
    assert (window_mean(samples, NOW, DEFAULT_CONFIG.short_window_s) or 0) > 0.85
    s = one(high)
    d = s.decision
    assert d is not None and d.trigger is Trigger.LOAD and led_by_twu(s)
    assert d.outcome is Outcome.SWITCH and d.target is not None and d.current_estimate is not None
    target = next(c for c in d.candidates if c.gear == d.target)
    assert target.estimate.capacity_rps > d.current_estimate.capacity_rps
    # given samples win over the window: the same load with TWU in the band is the gearbox's own call
    told = one(replace(high, twu=twu(0.6, 0.6)))
    assert told.decision is not None and not led_by_twu(told)


def test_within_the_cooldown_the_twu_signal_does_nothing() -> None:
    recent = state(current=tp8("a1"), rate=MID_RATE, twu=twu(0.95, 0.95), switches=(NOW - 60,))
    s = one(recent)
    d = s.decision
    assert d is not None and d.trigger is Trigger.PERIODIC and not led_by_twu(s) and d.outcome is Outcome.STAY
    assert any("cooldown" in r for r in d.reasons)
    # the cooldown is the gearbox's one: the simulator's short-cut (rule 10) skips the same step
    assert one(recent, LoopConfig(skip_cooldown_stays=True)).decision is None
    # and once it is over the same samples ask again
    later = replace(recent, deployment=replace(recent.deployment,
                                               last_switch_times_s=(NOW - DEFAULT_CONFIG.cooldown_s - 1,)))
    assert led_by_twu(one(later))


def test_an_operators_pin_holds_against_the_twu_signal() -> None:
    for samples in (twu(0.95, 0.95), twu(0.1, 0.1)):
        s = one(state(current=tp8("a1"), rate=MID_RATE, twu=samples, mode=Mode.PINNED))
        d = s.decision
        assert d is not None and d.outcome is Outcome.STAY and d.target is None
        assert d.trigger is Trigger.PERIODIC and not led_by_twu(s) and any("pinned" in r for r in d.reasons)


def test_an_operators_emergency_comes_before_the_twu_signal() -> None:
    s = one(state(current=tp8("a1"), rate=MID_RATE, twu=twu(0.95, 0.95), emergency_target=tp8("a2")))
    d = s.decision
    assert s.emergency and d is not None and d.trigger is Trigger.EMERGENCY and not led_by_twu(s)
    assert d.outcome is Outcome.SWITCH and d.target == tp8("a2")


def test_the_twu_rule_waits_for_a_staged_second_stage() -> None:
    staged = Staged(tp8("a2"), Kind.AUTO, FirstStage.DONE)
    s = one(state(current=tp8("a1"), rate=MID_RATE, twu=twu(0.1, 0.1), staged=staged))
    assert s.decision is not None and s.decision.stage == 2 and not led_by_twu(s)


def test_the_ask_never_trades_the_slo() -> None:
    # a TP4 over its capacity misses its SLOs; TWU samples that say "less" (a stale or wrong
    # report) leave the gears that meet them eligible, however many GPUs they hold
    tp4 = one_plan_gear(tp_plan(M70, [f"a1-g{i}" for i in range(4)], kv_tokens=50_000))
    d = one(state(current=tp4, rate=18.0, twu=twu(0.1, 0.1))).decision
    assert d is not None and d.trigger is Trigger.LOAD and "less capacity" in d.reasons[0]
    kept = [c for c in d.candidates if c.standing and c.estimate.gpus >= 4]
    assert kept and all("asks for less" not in c.note for c in kept)
    assert all("asks for less" in c.note for c in d.candidates if not c.standing and c.estimate.gpus >= 4)
    assert d.outcome is Outcome.SWITCH and d.target is not None and len(d.target.gpu_uuids) > 4, d.reasons


def rising(to_rate: float, *, per_s: float) -> LoadWindow:
    """Samples every 15 s over the long window, rising by `per_s` req/s a second to `to_rate` now."""
    n = int(DEFAULT_CONFIG.long_window_s // 15)
    return LoadWindow(tuple(LoadSample(NOW - 15 * (n - 1 - i), to_rate - per_s * 15 * (n - 1 - i), 512, 200, 0.8, 0.6)
                            for i in range(n)))


def test_a_rising_load_is_planned_for_ahead_of_its_level_and_the_switch_turns_it_off() -> None:
    # the level (the larger window mean) is near MID_RATE, in the band; the load climbs 1.2 req/s a
    # minute: the gearbox plans for the forecast, and the loop's TWU OUT test reads it too - both
    # drivers get this through the loop, from the load window they pass
    s = replace(state(current=tp8("a1")), load=rising(MID_RATE + 3.0, per_s=0.02))
    on = one(s)
    d = on.decision
    level = offered_load(s.load, NOW)
    assert d is not None and d.workload is not None and level is not None
    assert d.workload.rate_rps > level.rate_rps and any(r.startswith("load rising") for r in d.reasons)
    off_cfg = LoopConfig(gearbox=replace(DEFAULT_CONFIG, trend=False))
    off = one(s, off_cfg).decision
    assert off is not None and off.workload == level and not any(r.startswith("load rising") for r in off.reasons)
    # asymmetric: the same climb turned round (falling to the level's rate) plans for the level
    falling = replace(s, load=rising(MID_RATE - 3.0, per_s=-0.02))
    down = one(falling).decision
    assert down is not None and down.workload == offered_load(falling.load, NOW)
