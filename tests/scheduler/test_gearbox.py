from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler import costmodel
from scheduler.gearbox import (
    Decision,
    Deployment,
    GearboxConfig,
    LoadSample,
    LoadWindow,
    Mode,
    Outcome,
    Trigger,
    cooldown_until,
    decide,
    margin_load,
    offered_load,
    overloaded,
    record_switch,
    safe_rank,
    standing,
)
from scheduler.modelspec import model_spec
from scheduler.plan import Gear
from scheduler.topology import FragmentHistory, Snapshot, atomic_blocks
from tests.scheduler.builders import CHAT_SLO, NodeSpec, make_fleet, one_plan_gear, tp_plan, with_gpus

M70 = model_spec("Llama-3-70B")
M8 = model_spec("Llama-3-8B")
NOW = 1000.0


def fleet() -> Snapshot:
    return make_fleet([NodeSpec("a1", "H100-SXM"), NodeSpec("a2", "H100-SXM"), NodeSpec("b1", "A100-80G", rack="B")])


def tp8(node: str = "a1") -> Gear:
    return one_plan_gear(tp_plan(M70, [f"{node}-g{i}" for i in range(8)], kv_tokens=100_000))


def deployment(**changes: object) -> Deployment:
    base = Deployment(id="chat", model=M70.name, slo=CHAT_SLO, baseline=tp8("a2"))
    return replace(base, **changes)  # type: ignore[arg-type]


def window(rate: float, now: float = NOW, span: float = 300.0) -> LoadWindow:
    return LoadWindow(tuple(LoadSample(now - span + 15 * i, rate, 512, 200, 0.8, 0.6) for i in range(int(span // 15) + 1)))


def lose(snap: Snapshot, *uuids: str) -> Snapshot:
    return with_gpus(snap, **{u: {"healthy": False} for u in uuids})


# --- operators ------------------------------------------------------------------------------------
def test_emergency_goes_to_the_baseline_whatever_the_mode_cooldown_or_transition() -> None:
    dep = deployment(mode=Mode.PINNED, last_switch_times_s=(NOW - 10,))
    d = decide(dep, tp8("a1"), fleet(), window(3.0), NOW, trigger=Trigger.EMERGENCY, transition_running=True)
    assert d.outcome is Outcome.SWITCH and d.target == dep.baseline
    assert any("supersedes the running transition" in r for r in d.reasons)


def test_emergency_is_idempotent() -> None:
    dep = deployment()
    d = decide(dep, dep.baseline, fleet(), window(3.0), NOW, trigger=Trigger.EMERGENCY)
    assert d.outcome is Outcome.STAY and d.target is None


def test_emergency_to_a_broken_baseline_is_blocked_with_the_reason_and_offers_the_best_safe_gears() -> None:
    dep = deployment()
    d = decide(dep, tp8("a1"), lose(fleet(), "a2-g3"), window(3.0), NOW, trigger=Trigger.EMERGENCY)
    assert d.outcome is Outcome.BLOCKED and d.target is None
    assert d.reasons[0].startswith("emergency: the baseline gear cannot run on this snapshot: ")
    assert "a2-g3" in d.reasons[0]
    assert d.reasons[1].startswith("to fix: restore its GPUs, set a new baseline, or downshift to the planner's "
                                   "best safe gear ")
    offers = d.candidates
    assert offers and all(o.note == "offered: the planner's best safe gear" for o in offers)
    assert all("a2-g3" not in o.gear.gpu_uuids and o.gear != tp8("a1") for o in offers)
    assert list(offers) == sorted(offers, key=safe_rank)
    best = offers[0]
    assert all((best.standing, best.estimate.goodput_tokens_s) >= (o.standing, o.estimate.goodput_tokens_s)
               for o in offers)
    assert best.gear.shape() in d.reasons[1]


def test_an_emergency_to_a_gear_the_operator_accepted_instead_goes_there() -> None:
    dep = deployment()
    snap = lose(fleet(), "a2-g3")
    offer = decide(dep, tp8("a1"), snap, window(3.0), NOW, trigger=Trigger.EMERGENCY).candidates[0].gear
    d = decide(dep, tp8("a1"), snap, window(3.0), NOW, trigger=Trigger.EMERGENCY, requested_gear=offer)
    assert d.outcome is Outcome.SWITCH and d.target == offer
    assert d.reasons[0] == "emergency downshift to the accepted emergency gear (operator)"
    again = decide(dep, offer, snap, window(3.0), NOW, trigger=Trigger.EMERGENCY, requested_gear=offer)
    assert again.outcome is Outcome.STAY


def test_an_emergency_deployment_holds_its_gear_like_a_pin() -> None:
    dep = deployment(mode=Mode.EMERGENCY)
    busy = window(40.0)  # far over what the baseline carries: an auto deployment would shift up
    assert decide(replace(dep, mode=Mode.AUTO), dep.baseline, fleet(), busy, NOW).outcome is Outcome.SWITCH
    d = decide(dep, dep.baseline, fleet(), busy, NOW)
    assert d.outcome is Outcome.STAY and d.reasons == ("emergency: holds its gear until an operator releases it",)
    broken = decide(dep, dep.baseline, lose(fleet(), "a2-g1"), busy, NOW, trigger=Trigger.TOPOLOGY)
    assert broken.outcome is Outcome.BLOCKED and "an operator must act" in broken.reasons[-1]


def test_a_manual_switch_skips_hysteresis_and_cooldown_but_not_validation() -> None:
    dep = deployment(last_switch_times_s=(NOW - 5,))
    wanted = one_plan_gear(tp_plan(M70, [f"b1-g{i}" for i in range(4)], kv_tokens=20_000))
    d = decide(dep, tp8("a1"), fleet(), window(3.0), NOW, trigger=Trigger.MANUAL, requested_gear=wanted)
    assert d.outcome is Outcome.SWITCH and d.target == wanted
    broken = decide(dep, tp8("a1"), lose(fleet(), "b1-g0"), window(3.0), NOW, trigger=Trigger.MANUAL,
                    requested_gear=wanted)
    assert broken.outcome is Outcome.BLOCKED
    busy = decide(dep, tp8("a1"), fleet(), window(3.0), NOW, trigger=Trigger.MANUAL, requested_gear=wanted,
                  transition_running=True)
    assert busy.outcome is Outcome.DEFERRED


# --- automatic rules --------------------------------------------------------------------------------
def test_it_never_switches_while_a_transition_runs() -> None:
    d = decide(deployment(), tp8("a1"), lose(fleet(), "a1-g0"), window(3.0), NOW, transition_running=True)
    assert d.outcome is Outcome.DEFERRED


def test_an_invalid_current_gear_moves_at_once_even_in_cooldown() -> None:
    dep = deployment(last_switch_times_s=(NOW - 30, NOW - 10))  # deep in a long cooldown
    d = decide(dep, tp8("a1"), lose(fleet(), "a1-g5"), window(3.0), NOW, trigger=Trigger.TOPOLOGY)
    assert not d.current_valid
    assert d.outcome is Outcome.SWITCH and d.target is not None
    assert "a1-g5" not in d.target.gpu_uuids
    assert any("do not apply to an invalid gear" in r for r in d.reasons)


def test_with_no_gear_left_anywhere_it_is_blocked_and_says_why() -> None:
    snap = lose(fleet(), *[f"{n}-g{i}" for n in ("a1", "a2", "b1") for i in range(8)])
    d = decide(deployment(), tp8("a1"), snap, window(3.0), NOW, trigger=Trigger.TOPOLOGY)
    assert d.outcome is Outcome.BLOCKED and any("no usable GPU" in r for r in d.reasons)


def test_within_the_cooldown_a_valid_gear_stays() -> None:
    dep = deployment(last_switch_times_s=(NOW - 60,))
    d = decide(dep, tp8("a1"), fleet(), window(0.2), NOW)
    assert d.outcome is Outcome.STAY and "cooldown" in d.reasons[-1]
    assert d.cooldown_until_s == NOW - 60 + GearboxConfig().cooldown_s


def test_two_switches_in_the_flap_window_bring_the_long_cooldown() -> None:
    cfg = GearboxConfig()
    once = deployment(last_switch_times_s=(NOW - 400,))
    twice = deployment(last_switch_times_s=(NOW - 1000, NOW - 400))
    assert cooldown_until(once, cfg) == NOW - 400 + cfg.cooldown_s
    assert cooldown_until(twice, cfg) == NOW - 400 + cfg.long_cooldown_s
    assert decide(twice, tp8("a1"), fleet(), window(0.2), NOW).outcome is Outcome.STAY


def test_it_switches_only_when_gain_beats_cost_times_hysteresis() -> None:
    d = decide(deployment(), tp8("a1"), fleet(), window(0.3), NOW)
    assert d.factor == 1.4
    for c in d.candidates:
        assert c.threshold_tokens == pytest.approx(c.cost.tokens * d.factor)
        assert c.passes == (c.gain_tokens > c.threshold_tokens)
    assert d.outcome is Outcome.SWITCH
    chosen = next(c for c in d.candidates if c.gear == d.target)
    assert chosen.passes
    # the same move, valued over one second instead of ten minutes, is not worth its cost
    short = decide(deployment(), tp8("a1"), fleet(), window(0.3), NOW, config=GearboxConfig(horizon_s=1.0))
    assert short.outcome is Outcome.STAY and not any(c.passes for c in short.candidates)


def test_advisory_deployments_get_advice_instead_of_a_switch() -> None:
    d = decide(deployment(mode=Mode.ADVISORY), tp8("a1"), fleet(), window(0.3), NOW)
    assert d.outcome is Outcome.ADVISE and d.target is not None


def test_a_load_trigger_needs_both_windows_to_agree() -> None:
    spike = LoadWindow(tuple(
        LoadSample(NOW - 300 + 15 * i, 40.0 if i >= 18 else 3.0, 512, 200) for i in range(21)))
    steady_high = window(40.0)
    assert decide(deployment(), tp8("a1"), fleet(), spike, NOW).trigger is Trigger.PERIODIC
    assert decide(deployment(), tp8("a1"), fleet(), steady_high, NOW).trigger is Trigger.LOAD


def test_it_plans_for_the_larger_of_the_two_windows() -> None:
    dip = LoadWindow(tuple(LoadSample(NOW - 300 + 15 * i, 1.0 if i >= 18 else 6.0, 512, 200) for i in range(21)))
    load = offered_load(dip, NOW)
    assert load is not None and load.rate_rps > 4.0


def test_hysteresis_must_stay_within_1_3_and_1_5() -> None:
    with pytest.raises(ValueError, match="hysteresis"):
        GearboxConfig(hysteresis=1.2)
    GearboxConfig(hysteresis=1.3)
    GearboxConfig(hysteresis=1.5)


# --- properties ------------------------------------------------------------------------------------
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from([Trigger.PERIODIC, Trigger.TOPOLOGY, Trigger.LOAD]),
    st.floats(0.0, 60.0),
    st.lists(st.sampled_from([f"a1-g{i}" for i in range(8)] + [f"b1-g{i}" for i in range(8)]), max_size=4),
    st.booleans(),
)
def test_a_pinned_deployment_never_switches_automatically(trigger: Trigger, rate: float, lost: list[str],
                                                          switched_long_ago: bool) -> None:
    dep = deployment(mode=Mode.PINNED, last_switch_times_s=(NOW - 1e5,) if switched_long_ago else ())
    d = decide(dep, tp8("a1"), lose(fleet(), *lost), window(rate), NOW, trigger=trigger)
    assert d.outcome in (Outcome.STAY, Outcome.BLOCKED)
    assert d.target is None


def oscillate(config: GearboxConfig, period_s: float, low: float, high: float) -> list[tuple[float, bool]]:
    """20 minutes of ticks every 30 s with the load flipping between `low` and `high`
    (8B on one H100 carries ~40 rps); switches are applied. Returns each switch's time and
    whether it was an upshift out of an overloaded gear (what the cooldown does not hold)."""
    dep = deployment(model=M8.name, baseline=one_plan_gear(tp_plan(M8, ["a2-g0"], 100_000)))
    gear = one_plan_gear(tp_plan(M8, ["a1-g0"], 100_000))
    snap = fleet()
    samples: list[LoadSample] = []
    switches: list[tuple[float, bool]] = []
    for k in range(40):
        now = 30.0 * k
        rate = high if (now // period_s) % 2 else low
        samples.append(LoadSample(now, rate, 512, 200))
        load, at = LoadWindow(tuple(samples)), replace(snap, now_s=now)
        d = decide(replace(dep, last_switch_times_s=tuple(t for t, _ in switches[-2:])), gear, at, load, now,
                   model=M8, config=config)
        if d.outcome is Outcome.SWITCH:
            assert d.target is not None and d.current_estimate is not None
            more = next(c for c in d.candidates if c.gear == d.target).estimate.capacity_rps
            up = more > d.current_estimate.capacity_rps and overloaded(gear, M8, at, load, now, CHAT_SLO, config)
            switches.append((now, up))
            gear = d.target
    return switches


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(30, 240), st.floats(0.1, 1.0), st.floats(90.0, 200.0))
def test_an_oscillating_load_switches_at_most_once_per_cooldown(period_s: int, low: float, high: float) -> None:
    # bar an upshift out of an overloaded gear (the cooldown is asymmetric): a downshift, or any
    # other switch, keeps the cooldown after the one before it
    cfg = GearboxConfig()
    switches = oscillate(cfg, period_s, low, high)
    assert switches  # the load does move the gear
    for (a, _), (b, up) in zip(switches, switches[1:], strict=False):
        assert up or b - a >= cfg.cooldown_s, switches


def test_without_the_cooldown_the_same_oscillation_flaps() -> None:
    flapping = oscillate(GearboxConfig(cooldown_s=0, long_cooldown_s=0), 60, 0.5, 120.0)
    damped = oscillate(GearboxConfig(), 60, 0.5, 120.0)
    assert len(flapping) >= 5 * len(damped) > 0


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.floats(0.0, 30.0), st.lists(st.sampled_from([f"a1-g{i}" for i in range(8)]), max_size=3),
       st.sampled_from(list(Mode)))
def test_decide_is_deterministic(rate: float, lost: list[str], mode: Mode) -> None:
    snap = lose(fleet(), *lost)
    dep = deployment(mode=mode)
    history = FragmentHistory().observe(atomic_blocks(fleet()), NOW - 600).observe(atomic_blocks(snap), NOW - 60)
    first = decide(dep, tp8("a1"), snap, window(rate), NOW, history=history)
    costmodel.clear_caches()
    second = decide(dep, tp8("a1"), snap, window(rate), NOW, history=history)
    assert first == second
    assert json.dumps(first.to_dict(), sort_keys=True) == json.dumps(second.to_dict(), sort_keys=True)


def test_a_decision_round_trips_through_json_with_everything_the_console_shows() -> None:
    d = decide(deployment(), tp8("a1"), lose(fleet(), "a1-g2"), window(5.0), NOW, trigger=Trigger.TOPOLOGY)
    payload = json.loads(json.dumps(d.to_dict()))
    assert payload["trigger"] == "topology" and payload["outcome"] == "switch"
    assert payload["target_gear_id"] == d.target.gear_id  # type: ignore[union-attr]
    for c in payload["candidates"]:
        assert {"gain_tokens", "cost", "threshold_tokens", "passes", "estimate"} <= set(c)
    assert Decision.from_dict(payload) == d


def test_a_malformed_decision_names_the_missing_field() -> None:
    d = decide(deployment(), tp8("a1"), fleet(), window(5.0), NOW).to_dict()
    del d["trigger"]
    with pytest.raises(ValueError, match=r"decision\.trigger: required"):
        Decision.from_dict(d)


def test_load_windows_average_and_forget_old_samples() -> None:
    w = LoadWindow()
    for t in range(0, 600, 60):
        w = w.add(LoadSample(float(t), float(t), 100.0, 50.0), keep_s=300)
    assert min(s.t_s for s in w.samples) > 540 - 300
    last_two = w.over(540.0, 90.0)
    assert last_two is not None and last_two.rate_rps == pytest.approx((480 + 540) / 2)
    assert w.over(10_000.0, 60.0) is None


def test_missing_load_samples_never_shed_gpus() -> None:
    d = decide(deployment(), tp8("a1"), fleet(), LoadWindow(), NOW)
    assert d.outcome is Outcome.STAY and d.workload is None
    assert "no load samples" in d.reasons[-1]


def test_with_no_gear_yet_it_places_one_sized_for_the_load() -> None:
    d = decide(deployment(), None, fleet(), window(3.0), NOW)
    assert d.outcome is Outcome.SWITCH and d.target is not None
    assert d.current_gear_id is None and d.current_value_tokens_s == 0.0
    chosen = next(c for c in d.candidates if c.gear == d.target)
    assert chosen.estimate.capacity_rps >= 3.0


# --- forced moves, standing, tiny gains, backlog ------------------------------------------------------
def test_a_forced_move_starts_no_cooldown_and_a_load_change_after_it_switches_at_once() -> None:
    dep = deployment()
    moved = decide(dep, tp8("a1"), lose(fleet(), "a1-g3"), window(0.3), NOW, trigger=Trigger.TOPOLOGY)
    assert moved.outcome is Outcome.SWITCH and moved.forced and moved.target is not None
    after = record_switch(dep, NOW, forced=moved.forced)
    assert after.last_switch_times_s == () and cooldown_until(after) is None
    # a minute later the load jumps: the gearbox answers now, not after the cooldown
    later = NOW + 60
    d = decide(after, moved.target, replace(lose(fleet(), "a1-g3"), now_s=later), window(8.0, now=later), later)
    assert d.outcome is Outcome.SWITCH, d.reasons
    # a switch the gearbox chose does start one
    chosen = record_switch(after, later, forced=d.forced)
    assert not d.forced and cooldown_until(chosen) == later + GearboxConfig().cooldown_s


def test_an_emergency_downshift_is_forced() -> None:
    dep = deployment()
    d = decide(dep, tp8("a1"), fleet(), window(3.0), NOW, trigger=Trigger.EMERGENCY)
    assert d.outcome is Outcome.SWITCH and d.forced
    assert record_switch(dep, NOW, forced=d.forced) == dep


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.floats(0.1, 12.0), st.lists(st.sampled_from([f"a1-g{i}" for i in range(8)]), max_size=2))
def test_a_gear_that_misses_the_slo_never_outranks_one_that_meets_it(rate: float, lost: list[str]) -> None:
    snap = lose(fleet(), *lost)
    d = decide(deployment(), tp8("a1"), snap, window(rate), NOW)
    flags = [c.standing for c in d.candidates]
    assert flags == sorted(flags, reverse=True), [(c.gear.shape(), c.standing) for c in d.candidates]
    workload = offered_load(window(rate), NOW)
    assert workload is not None
    held = d.current_estimate.gpus if d.current_valid and d.current_estimate is not None else 0
    for c in d.candidates:  # standing needs the SLOs met at the offered load (and beyond it)
        assert not c.standing or standing(c.estimate, workload, shrinking=0 < c.estimate.gpus < held)
    if d.outcome is Outcome.SWITCH and not d.forced and standing(d.current_estimate, workload):
        target = next(c for c in d.candidates if c.gear == d.target)
        assert target.standing  # a gear that meets the SLOs is only left for another that does


def test_a_tiny_gain_never_switches_however_cheap_the_move() -> None:
    cfg = GearboxConfig()
    d = decide(deployment(), tp8("a1"), fleet(), window(0.3), NOW)
    assert d.outcome is Outcome.SWITCH
    target = next(c for c in d.candidates if c.gear == d.target)
    offered = 0.3 * 200
    assert target.gain_tokens > cfg.min_relative_gain * offered * (cfg.horizon_s - target.cost.time_to_effect_s)
    # ask for more than that gain is worth: the gearbox stays, although the gain beats the cost
    share = target.gain_tokens / (offered * cfg.horizon_s) * 1.5
    strict = decide(deployment(), tp8("a1"), fleet(), window(0.3), NOW, config=GearboxConfig(min_relative_gain=share))
    assert strict.outcome is Outcome.STAY and any(c.passes for c in strict.candidates)


def test_a_backlog_counts_as_load() -> None:
    calm = window(1.0)
    behind = LoadWindow(calm.samples[:-1] + (replace(calm.samples[-1], backlog=1200),))
    cfg = GearboxConfig()
    plain, loaded = offered_load(calm, NOW, cfg), offered_load(behind, NOW, cfg)
    assert plain is not None and loaded is not None
    assert loaded.rate_rps == pytest.approx(plain.rate_rps + 1200 / cfg.backlog_drain_s)
    # the gear that carries 1 req/s is too small once the queue counts
    small = decide(deployment(), tp8("a1"), fleet(), calm, NOW).target
    assert small is not None
    d = decide(deployment(), small, fleet(), behind, NOW)
    assert d.trigger is Trigger.LOAD and d.outcome is Outcome.SWITCH, d.reasons
    assert d.target is not None and len(d.target.gpu_uuids) > len(small.gpu_uuids)


def test_a_gear_that_gives_gpus_back_must_stand_below_the_shrink_watermark() -> None:
    cfg = GearboxConfig()
    d = decide(deployment(), tp8("a1"), fleet(), window(1.0), NOW)
    workload = offered_load(window(1.0), NOW)
    assert workload is not None
    meets = next(c.estimate for c in d.candidates if c.standing)
    between = replace(meets, utilization=(cfg.shrink_watermark + cfg.high_watermark) / 2)
    assert standing(between, workload)  # meets the SLOs with the headroom a growing gear needs
    assert not standing(between, workload, shrinking=True)  # too close to the next rise to shrink onto
    assert standing(replace(meets, utilization=cfg.shrink_watermark * 0.9), workload, shrinking=True)
    if d.outcome is Outcome.SWITCH:
        target = next(c for c in d.candidates if c.gear == d.target)
        assert target.estimate.gpus >= 8 or target.estimate.utilization <= cfg.shrink_watermark


def test_a_gear_must_still_meet_the_slos_with_the_watermarks_margin_of_load() -> None:
    d = decide(deployment(), tp8("a1"), fleet(), window(1.0), NOW)
    workload = offered_load(window(1.0), NOW)
    assert workload is not None
    meets = next(c.estimate for c in d.candidates if c.standing)
    edge = replace(meets, goodput_tokens_s=0.6 * meets.throughput_tokens_s)  # 18% more load: 60% on time
    assert standing(meets, workload) and not standing(meets, workload, at_margin=edge)
    assert margin_load(workload).rate_rps == pytest.approx(workload.rate_rps / GearboxConfig().high_watermark)
