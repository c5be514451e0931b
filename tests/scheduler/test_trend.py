"""The load window's trend (scheduler/gearbox: `LoadWindow.trend`, `planned_load`; the TWU rule's
`rise`, scheduler/pool/autoscale.py): named cases, no database."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest

from scheduler.costmodel import Slo
from scheduler.gearbox import DEFAULT_CONFIG, LoadSample, LoadWindow, offered_load, planned_load
from scheduler.gearbox import Deployment as GbDeployment
from scheduler.pool.autoscale import Direction, TwuSample, scale_signal

NOW = 10_000.0
EVERY_S = 30.0  # the simulator's tick; the fit needs no particular spacing
DEP = GbDeployment(id="code", model="Llama-3-70B", slo=Slo(ttft_ms=2500, tpot_ms=100), baseline=None)
# a fixed +-3% wiggle, the size of Poisson noise on ~1000 arrivals a sample: deterministic
WIGGLE = (0.03, -0.03, 0.02, -0.02, 0.0, 0.03, -0.03, 0.01, -0.01, 0.0, 0.02)


def window(rate_at: Callable[[float], float], *, noise: bool = False, backlog: int = 0) -> LoadWindow:
    """Samples every EVERY_S over the long window, rate_at(t) req/s each (times the wiggle)."""
    out = []
    n = int(DEFAULT_CONFIG.long_window_s // EVERY_S)
    for i in range(n):
        t = NOW - (n - 1 - i) * EVERY_S
        rate = rate_at(t) * (1 + (WIGGLE[i % len(WIGGLE)] if noise else 0.0))
        out.append(LoadSample(t, rate, 1500, 300, backlog=backlog if i == n - 1 else 0))
    return LoadWindow(tuple(out))


def ramp(per_s: float, at_now: float = 10.0) -> Callable[[float], float]:
    return lambda t: at_now + per_s * (t - NOW)


def twu(value: float) -> list[TwuSample]:
    return [TwuSample(NOW - i * 15.0, value) for i in range(20)]


def test_a_rising_window_forecasts_above_its_level() -> None:
    w = window(ramp(0.01), noise=True)  # +0.6 req/s a minute, 10 req/s now
    trend = w.trend(NOW, DEFAULT_CONFIG.long_window_s)
    assert trend is not None and trend.significant(DEFAULT_CONFIG.trend_min_t)
    assert trend.slope_rps_s == pytest.approx(0.01, rel=0.15)
    plan = planned_load(w, NOW)
    level = offered_load(w, NOW)
    assert level is not None and plan.workload is not None and plan.trend is not None
    # the line at now + lead, over the level (the window's mean trails a ramp by half its length)
    want = 10.0 + 0.01 * DEFAULT_CONFIG.trend_lead_s
    assert plan.workload.rate_rps == pytest.approx(min(want, DEFAULT_CONFIG.trend_max_rise * level.rate_rps), rel=0.05)
    assert plan.workload.rate_rps > level.rate_rps and plan.rise > 1
    # same request shape as the level: only the rate is forecast
    assert plan.workload.prompt_tokens_mean == level.prompt_tokens_mean
    assert "load rising" in plan.reason(DEFAULT_CONFIG)


def test_a_flat_window_plans_for_its_level() -> None:
    for noise in (False, True):
        w = window(lambda t: 10.0, noise=noise)
        plan = planned_load(w, NOW)
        assert plan.workload == offered_load(w, NOW) and plan.trend is None and plan.rise == 1.0, noise
        assert plan.reason(DEFAULT_CONFIG) == ""


def test_a_falling_window_never_lowers_the_load() -> None:
    w = window(ramp(-0.02, at_now=4.0), noise=True)
    trend = w.trend(NOW, DEFAULT_CONFIG.long_window_s)
    assert trend is not None and trend.slope_rps_s < 0
    plan = planned_load(w, NOW)
    assert plan.workload == offered_load(w, NOW) and plan.rise == 1.0


def test_a_falling_window_never_triggers_a_scale_in_by_forecast() -> None:
    # TWU in the band (0.5: neither OUT nor IN); the load is falling fast: the IN test reads the
    # measured means, and a falling forecast has no rise to pass it
    falling = planned_load(window(ramp(-0.02, at_now=4.0)), NOW)
    sig = scale_signal(twu(0.5), NOW, DEP, replicas=3, rise=falling.rise)
    assert falling.rise == 1.0 and sig.direction is Direction.HOLD
    with pytest.raises(ValueError, match="rise"):
        scale_signal(twu(0.5), NOW, DEP, replicas=3, rise=0.5)


def test_a_rise_scales_out_ahead_of_the_watermark_and_never_holds_a_scale_in() -> None:
    assert scale_signal(twu(0.8), NOW, DEP).direction is Direction.HOLD
    out = scale_signal(twu(0.8), NOW, DEP, rise=1.2)
    assert out.direction is Direction.OUT and "rising trend" in out.reason
    # the IN test is the level's: a rise does not turn it into anything else
    assert scale_signal(twu(0.2), NOW, DEP, replicas=3, rise=1.5).direction is Direction.IN


def test_the_switch_turns_the_trend_off() -> None:
    w = window(ramp(0.01))
    off = replace(DEFAULT_CONFIG, trend=False)
    plan = planned_load(w, NOW, off)
    assert plan.workload == offered_load(w, NOW, off) and plan.trend is None
    assert planned_load(w, NOW, replace(DEFAULT_CONFIG, trend_lead_s=0.0)).trend is None


def test_the_forecast_is_capped_and_counts_the_backlog() -> None:
    steep = window(ramp(0.1, at_now=40.0))  # +6 req/s a minute: a burst, not a tide
    level = offered_load(steep, NOW)
    plan = planned_load(steep, NOW)
    assert level is not None and plan.workload is not None
    assert plan.workload.rate_rps == pytest.approx(DEFAULT_CONFIG.trend_max_rise * level.rate_rps)
    behind = window(ramp(0.005), backlog=120)
    calm = window(ramp(0.005))
    a, b = planned_load(behind, NOW).workload, planned_load(calm, NOW).workload
    assert a is not None and b is not None and a.rate_rps > b.rate_rps


def test_too_few_samples_have_no_trend() -> None:
    two = LoadWindow(window(ramp(0.01)).samples[-2:])
    assert two.trend(NOW, DEFAULT_CONFIG.long_window_s) is None
    assert planned_load(two, NOW).trend is None
    assert planned_load(LoadWindow(), NOW).workload is None


def test_bad_trend_settings_name_the_field() -> None:
    with pytest.raises(ValueError, match="trend_max_rise"):
        replace(DEFAULT_CONFIG, trend_max_rise=0.9)
    with pytest.raises(ValueError, match="trend_lead_s"):
        replace(DEFAULT_CONFIG, trend_lead_s=-1.0)


def test_no_scale_in_into_a_rise() -> None:
    # a gentle climb: the TWU rule's IN waits (and the gearbox plans for the forecast where
    # it passes its bar); a flat or falling load lets the IN through
    w = window(ramp(0.002, at_now=4.0), noise=True)
    plan = planned_load(w, NOW)
    assert plan.slope_t >= DEFAULT_CONFIG.trend_hold_in_t
    held = scale_signal(twu(0.2), NOW, DEP, replicas=3, rise=plan.rise, slope_t=plan.slope_t)
    assert held.direction is Direction.HOLD and "no scale-in into a rise" in held.reason
    for flat_or_falling in (window(lambda t: 4.0), window(ramp(-0.01, at_now=4.0), noise=True)):
        p = planned_load(flat_or_falling, NOW)
        assert p.slope_t <= 0
        assert scale_signal(twu(0.2), NOW, DEP, replicas=3, rise=p.rise, slope_t=p.slope_t).direction is Direction.IN
    assert planned_load(w, NOW, replace(DEFAULT_CONFIG, trend=False)).slope_t == 0.0


def test_a_scale_in_that_would_flap_waits_for_a_clear_fall() -> None:
    # out then in within the flap window starts the long cooldown: only a clear fall lets it through
    flapping = replace(DEP, last_switch_times_s=(NOW - DEFAULT_CONFIG.cooldown_s - 10,))
    assert scale_signal(twu(0.2), NOW, DEP, replicas=3, slope_t=0.5).direction is Direction.IN
    for slope_t in (0.5, 0.0, -0.5):
        held = scale_signal(twu(0.2), NOW, flapping, replicas=3, slope_t=slope_t)
        assert held.direction is Direction.HOLD and "long cooldown" in held.reason, slope_t
    assert scale_signal(twu(0.2), NOW, flapping, replicas=3, slope_t=-1.5).direction is Direction.IN
    off = replace(DEFAULT_CONFIG, trend=False)
    assert scale_signal(twu(0.2), NOW, flapping, replicas=3, slope_t=0.5, gearbox=off).direction is Direction.IN
