"""An overloaded gear (offered load above what it can serve: its queue grows) is never stuck on:
the gain of leaving it counts the throughput it leaves unserved, the cooldown does not hold an
upshift out of it (it still holds a downshift), and the control loop's cooldown short-cut asks
the gearbox first (`gearbox.overloaded`)."""

from __future__ import annotations

from dataclasses import replace

from scheduler import gearbox
from scheduler.control import ControlLoop, DeploymentState, FleetState, LoopConfig
from scheduler.gearbox import (
    DEFAULT_CONFIG,
    Deployment,
    LoadWindow,
    Outcome,
    decide,
    offered_load,
)
from scheduler.modelspec import model_spec
from scheduler.plan import Gear
from tests.scheduler.builders import CHAT_SLO
from tests.scheduler.test_gearbox import deployment, fleet, tp8, window  # the same fleet and deployment

M70 = model_spec("Llama-3-70B")
NOW = 1000.0
# Llama-3-70B at TP8 on one H100 node carries ~19 req/s of this chat load (the cost model's
# figure, read in the tests below rather than assumed); the fleet's 24 GPUs carry ~75 req/s
HEAVY_RPS = 18.0  # over the high watermark, under the capacity: not overloaded
OVER_RPS = 40.0  # over the TP8 gear's capacity, within the fleet's
BEYOND_RPS = 200.0  # over what any gear of the fleet can serve


def in_cooldown() -> Deployment:
    return deployment(last_switch_times_s=(NOW - 60,))  # one chosen switch a minute ago


def capacity_of(gear: Gear, rate: float) -> float:
    d = decide(deployment(), gear, fleet(), window(rate), NOW, model=M70)
    assert d.current_estimate is not None
    return d.current_estimate.capacity_rps


# --- (a) the gain of leaving an overloaded gear ------------------------------------------------------
def test_the_rates_these_tests_use_overload_the_gear_as_they_say() -> None:
    cap = capacity_of(tp8(), OVER_RPS)
    assert HEAVY_RPS < cap < OVER_RPS
    assert HEAVY_RPS / cap > DEFAULT_CONFIG.high_watermark
    assert not gearbox.overloaded(tp8(), M70, fleet(), window(HEAVY_RPS), NOW, CHAT_SLO)
    assert gearbox.overloaded(tp8(), M70, fleet(), window(OVER_RPS), NOW, CHAT_SLO)
    assert not gearbox.overloaded(None, M70, fleet(), window(OVER_RPS), NOW, CHAT_SLO)
    assert not gearbox.overloaded(tp8(), M70, fleet(), LoadWindow(), NOW, CHAT_SLO)  # silence is no load


def test_an_overloaded_gear_shifts_up_even_when_no_gear_serves_the_whole_load() -> None:
    # every gear is overloaded at 200 req/s, so none has goodput within the SLO at that load;
    # the gear with the most capacity still serves ~4x what the current one does
    d = decide(deployment(), tp8(), fleet(), window(BEYOND_RPS), NOW, model=M70)
    cur = d.current_estimate
    assert cur is not None and cur.overloaded
    assert d.outcome is Outcome.SWITCH, d.reasons
    chosen = next(c for c in d.candidates if c.gear == d.target)
    assert chosen.estimate.capacity_rps > 2 * cur.capacity_rps
    assert chosen.estimate.overloaded  # not even the best gear serves it all


def test_the_gain_of_leaving_an_overloaded_gear_is_at_least_the_throughput_it_leaves_unserved() -> None:
    for rate in (OVER_RPS, BEYOND_RPS):
        d = decide(deployment(), tp8(), fleet(), window(rate), NOW, model=M70)
        cur = d.current_estimate
        assert cur is not None and cur.overloaded
        for c in d.candidates:
            horizon = max(0.0, DEFAULT_CONFIG.horizon_s - c.cost.time_to_effect_s)
            served_more = c.estimate.throughput_tokens_s - cur.throughput_tokens_s
            assert c.gain_tokens >= served_more * horizon * (1 - 1e-9), (rate, c.gear.shape())
    # the floor is for an overloaded gear only: one that meets its load keeps the plain value
    # difference, and capacity it does not need is worth nothing (and costs rent)
    calm = decide(deployment(), tp8(), fleet(), window(3.0), NOW, model=M70)
    assert calm.current_estimate is not None and not calm.current_estimate.overloaded
    bigger = [c for c in calm.candidates if c.estimate.capacity_rps > calm.current_estimate.capacity_rps]
    assert bigger and all(c.gain_tokens <= 0 for c in bigger)


# --- (b) the cooldown: an upshift out of an overloaded gear is not held, a downshift is --------------
def test_within_the_cooldown_an_overloaded_gear_shifts_up_and_a_busy_one_stays() -> None:
    d = decide(in_cooldown(), tp8(), fleet(), window(OVER_RPS), NOW, model=M70)
    assert d.outcome is Outcome.SWITCH, d.reasons
    assert d.current_estimate is not None and d.target is not None
    chosen = next(c for c in d.candidates if c.gear == d.target)
    assert chosen.estimate.capacity_rps > d.current_estimate.capacity_rps
    assert any("overloaded" in r for r in d.reasons)
    assert not d.forced  # a chosen switch: it starts a cooldown (the long one after this second switch)
    # over the high watermark but serving its load: the cooldown holds it, as ever
    busy = decide(in_cooldown(), tp8(), fleet(), window(HEAVY_RPS), NOW, model=M70)
    assert busy.outcome is Outcome.STAY and "cooldown" in busy.reasons[-1]
    assert decide(deployment(), tp8(), fleet(), window(HEAVY_RPS), NOW, model=M70).outcome is Outcome.SWITCH


def test_within_the_cooldown_only_upshifts_are_eligible_out_of_an_overloaded_gear() -> None:
    d = decide(in_cooldown(), tp8(), fleet(), window(OVER_RPS), NOW, model=M70)
    assert d.current_estimate is not None
    cap = d.current_estimate.capacity_rps
    smaller = [c for c in d.candidates if c.estimate.capacity_rps <= cap]
    assert smaller and not any(c.passes for c in smaller)
    assert all("cooldown" in c.note for c in smaller)


def test_after_the_upshift_out_of_an_overloaded_gear_a_downshift_is_still_held() -> None:
    up = decide(in_cooldown(), tp8(), fleet(), window(OVER_RPS), NOW, model=M70)
    assert up.outcome is Outcome.SWITCH and up.target is not None, up.reasons
    after = gearbox.record_switch(in_cooldown(), NOW, forced=up.forced)  # two switches: the long cooldown
    later = NOW + DEFAULT_CONFIG.cooldown_s + 60  # past the short cooldown, inside the long one
    # the load falls away: the gear it would give back waits for the long cooldown
    d = decide(after, up.target, fleet(), window(1.0, now=later), later, model=M70)
    assert d.outcome is Outcome.STAY and "long cooldown" in d.reasons[-1], d.reasons
    free = decide(deployment(), up.target, fleet(), window(1.0, now=later), later, model=M70)
    assert free.outcome is Outcome.SWITCH  # ... which is what held it


# --- (c) the control loop's cooldown short-cut asks the gearbox first ---------------------------------
def loop_state(rate: float) -> DeploymentState:
    return DeploymentState(deployment=in_cooldown(), current=tp8(), load=window(rate), model=M70)


def test_the_cooldown_short_cut_asks_the_gearbox_whether_the_gear_is_overloaded() -> None:
    loop = ControlLoop(LoopConfig(skip_cooldown_stays=True))
    loop.observe([loop_state(OVER_RPS)], FleetState(snapshot=fleet()))
    s = loop.step(NOW).steps[0]
    assert s.decision is not None and loop.calls >= 1
    assert s.start is not None and len(s.start.target.gpu_uuids) > 8
    # a gear that serves its load is still skipped through its cooldown (no gearbox call)
    quiet = ControlLoop(LoopConfig(skip_cooldown_stays=True))
    quiet.observe([loop_state(HEAVY_RPS)], FleetState(snapshot=fleet()))
    assert quiet.step(NOW).steps[0].decision is None and quiet.calls == 0


def test_overloaded_reads_the_offered_load_with_its_backlog() -> None:
    calm = window(3.0)
    behind = LoadWindow(calm.samples[:-1] + (replace(calm.samples[-1], backlog=3000),))
    level = offered_load(behind, NOW)
    assert level is not None and level.rate_rps > capacity_of(tp8(), 3.0)
    assert not gearbox.overloaded(tp8(), M70, fleet(), calm, NOW, CHAT_SLO)
    assert gearbox.overloaded(tp8(), M70, fleet(), behind, NOW, CHAT_SLO)
