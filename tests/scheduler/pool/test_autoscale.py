"""The pool's scale rule and soft limits (scheduler/pool/autoscale.py): named cases, no database."""

from __future__ import annotations

import pytest

from scheduler.costmodel import Slo
from scheduler.gearbox import DEFAULT_CONFIG, Mode
from scheduler.gearbox import Deployment as GbDeployment
from scheduler.pool.autoscale import (
    SEED_004_WEIGHTS,
    Direction,
    ScaleConfig,
    TwuSample,
    admission_shares,
    scale_signal,
)

NOW = 10_000.0
DEP = GbDeployment(id="chat", model="Llama-3-8B", slo=Slo(ttft_ms=2000, tpot_ms=100), baseline=None)


def series(short: float, long: float) -> list[TwuSample]:
    """Samples every 15 s over the long window: `long` before the short window, `short` in it."""
    out = []
    t = NOW - DEFAULT_CONFIG.long_window_s + 15
    while t <= NOW:
        in_short = t > NOW - DEFAULT_CONFIG.short_window_s
        out.append(TwuSample(t, short if in_short else long))
        t += 15
    return out


def test_it_scales_out_when_both_windows_are_above_the_high_watermark() -> None:
    sig = scale_signal(series(0.95, 0.9), NOW, DEP)
    assert sig.direction is Direction.OUT
    assert sig.short_twu == pytest.approx(0.95) and sig.long_twu is not None and sig.long_twu > 0.85


def test_it_scales_in_below_the_low_watermark_not_out_as_the_seeds_example_says() -> None:
    # seed 004's example config calls TWU < 0.4 "scale up"; its text says idle cycles: scale in
    sig = scale_signal(series(0.2, 0.25), NOW, DEP, replicas=3)
    assert sig.direction is Direction.IN


def test_one_spike_does_not_move_the_pool() -> None:
    assert scale_signal(series(0.99, 0.5), NOW, DEP).direction is Direction.HOLD  # long window stays low
    assert scale_signal(series(0.1, 0.6), NOW, DEP, replicas=3).direction is Direction.HOLD
    assert scale_signal(series(0.6, 0.6), NOW, DEP).direction is Direction.HOLD


def test_silence_holds() -> None:
    sig = scale_signal([], NOW, DEP, replicas=3)
    assert sig.direction is Direction.HOLD and "silence" in sig.reason
    old = [TwuSample(NOW - DEFAULT_CONFIG.long_window_s - 1, 0.0)]
    assert scale_signal(old, NOW, DEP, replicas=3).direction is Direction.HOLD


def test_the_gearbox_cooldown_and_pins_hold_the_signal() -> None:
    recent = GbDeployment(**{**DEP.__dict__, "last_switch_times_s": (NOW - 60,)})
    sig = scale_signal(series(0.95, 0.95), NOW, recent)
    assert sig.direction is Direction.HOLD and "cooldown" in sig.reason
    after = DEFAULT_CONFIG.cooldown_s
    later = [TwuSample(s.t_s + after, s.twu) for s in series(0.95, 0.95)]
    assert scale_signal(later, NOW + after, recent).direction is Direction.OUT  # the cooldown is over
    assert scale_signal(series(0.95, 0.95), NOW, DEP.__class__(**{**DEP.__dict__, "mode": Mode.PINNED})
                        ).direction is Direction.HOLD


def test_replica_bounds_hold_with_the_reason() -> None:
    out = scale_signal(series(0.95, 0.95), NOW, DEP, replicas=4, max_replicas=4)
    assert out.direction is Direction.HOLD and "max_replicas" in out.reason
    inn = scale_signal(series(0.1, 0.1), NOW, DEP, replicas=2, min_replicas=2)
    assert inn.direction is Direction.HOLD and "min_replicas" in inn.reason
    assert scale_signal(series(0.1, 0.1), NOW, DEP, replicas=1).direction is Direction.HOLD


def test_the_band_must_be_wide_enough_not_to_undo_itself() -> None:
    with pytest.raises(ValueError, match="low_watermark"):
        ScaleConfig(low_watermark=0.5, high_watermark=0.85)
    with pytest.raises(ValueError, match="pool.high"):
        ScaleConfig.from_dict({"high": 0.9})
    with pytest.raises(ValueError, match="pool.low_watermark"):
        ScaleConfig.from_dict({"low_watermark": "0.3"})
    assert ScaleConfig.from_dict({"high_watermark": 0.9}).high_watermark == 0.9


def test_within_the_soft_limit_shares_follow_the_weights() -> None:
    got = admission_shares(SEED_004_WEIGHTS, 0.7)
    total = sum(SEED_004_WEIGHTS.values())
    for model, w in SEED_004_WEIGHTS.items():
        assert got.shares[model] == pytest.approx(w / total)


def test_over_the_soft_limit_the_heavy_model_shrinks_and_nobody_is_refused() -> None:
    base = admission_shares(SEED_004_WEIGHTS, 0.5).shares
    full = admission_shares(SEED_004_WEIGHTS, 1.2)
    assert full.factors["Qwen2-72B"] == pytest.approx(0.6)  # the seed's x0.6 at full pressure
    assert full.shares["Qwen2-72B"] < base["Qwen2-72B"]
    assert full.shares["Phi-3-mini"] > base["Phi-3-mini"]
    assert sum(full.shares.values()) == pytest.approx(1.0)
    assert min(full.shares.values()) > 0
    half = admission_shares(SEED_004_WEIGHTS, 0.9)  # halfway from the soft limit to full pressure
    assert half.factors["Qwen2-72B"] == pytest.approx(0.8)
    assert base["Qwen2-72B"] > half.shares["Qwen2-72B"] > full.shares["Qwen2-72B"]


def test_models_without_demand_give_their_share_away_and_unknown_ones_are_named() -> None:
    got = admission_shares(SEED_004_WEIGHTS, 0.5, demand={"Phi-3-mini": 3, "Llama-3-8B": 1, "Qwen2-72B": 0})
    assert set(got.shares) == {"Phi-3-mini", "Llama-3-8B"}
    assert got.shares["Llama-3-8B"] == pytest.approx(2.3 / 3.3)
    with pytest.raises(ValueError, match="weights.Mixtral"):
        admission_shares(SEED_004_WEIGHTS, 0.5, demand={"Mixtral": 1})
    with pytest.raises(ValueError, match="weights.x"):
        admission_shares({"x": 0.0}, 0.5)
    assert admission_shares(SEED_004_WEIGHTS, None).shares == admission_shares(SEED_004_WEIGHTS, 0.0).shares


def test_a_load_window_at_the_gears_capacity_reads_as_twu_one_and_drives_the_rule() -> None:
    from scheduler.costmodel import PlanProfile, Workload, steady_state
    from scheduler.gearbox import LoadSample, LoadWindow
    from scheduler.modelspec import model_spec
    from scheduler.plan import Gear
    from scheduler.pool.autoscale import load_twu_samples
    from scheduler.pool.twu import TokenCosts
    from tests.scheduler.builders import NodeSpec, make_fleet, tp_plan

    m8 = model_spec("Llama-3-8B")
    snap = make_fleet([NodeSpec("a1")])
    a, b = tp_plan(m8, ["a1-g0"], 100_000), tp_plan(m8, ["a1-g1", "a1-g2"], 200_000)
    shape = Workload(0.0, 512.0, 200.0)
    states = {p.plan_id: steady_state(PlanProfile.build(p, m8, snap), shape) for p in (a, b)}
    caps = [states[p.plan_id].capacity_rps for p in (a, b)]
    gear = Gear(m8.name, (a, b), (caps[0] / sum(caps), caps[1] / sum(caps)))  # split by capacity
    costs = {p.plan_id: TokenCosts.of(PlanProfile.build(p, m8, snap), shape) for p in (a, b)}
    st = states[a.plan_id]
    full = sum(caps)
    window = LoadWindow(tuple(LoadSample(NOW - 300 + 15 * i, full * f, st.prompt, st.output)
                              for i, f in enumerate([0.9] * 16 + [1.0] * 4, start=1)))
    samples = load_twu_samples(window, gear, costs)
    assert len(samples) == 20 and samples[-1].twu == pytest.approx(1.0, rel=1e-6)
    assert samples[0].twu == pytest.approx(0.9, rel=1e-6)
    assert scale_signal(samples, NOW, DEP).direction is Direction.OUT
    assert load_twu_samples(window, gear, {a.plan_id: costs[a.plan_id]}) == ()  # a plan without costs: unknown
