"""Issue 16 d4: routing weights that learn (Hedge), rolled out against round-robin with a rollback."""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduler.router.learning import (
    HedgeConfig,
    RolloutConfig,
    RolloutController,
    Stage,
    advocacy,
    hedge_update,
    learned_weights,
)

W = {"predicted_latency": 2.0, "prefix_affinity": 1.0, "topology_affinity": 1.0}


class TestHedge:
    def test_advocacy_is_the_chosen_slots_rank_among_the_candidates(self) -> None:
        scores = {"a": [10.0, 50.0, 90.0], "b": [30.0, 30.0, 30.0], "c": [90.0, 50.0, 10.0]}
        assert advocacy(scores, [0, 1, 2], chosen=2) == {"a": 1.0, "b": 0.5, "c": 0.0}
        assert advocacy(scores, [1, 2], chosen=1) == {"a": 0.0, "b": 0.5, "c": 1.0}

    def test_a_term_that_argues_for_violating_picks_loses_weight_and_the_total_is_kept(self) -> None:
        bad = {"predicted_latency": 0.0, "prefix_affinity": 1.0, "topology_affinity": 0.5}
        out = learned_weights(W, [(bad, True)] * 50)
        assert out["prefix_affinity"] < W["prefix_affinity"] and out["predicted_latency"] > W["predicted_latency"]
        assert sum(out.values()) == pytest.approx(sum(W.values()))

    def test_a_term_that_argues_against_requests_that_met_the_slo_loses_weight(self) -> None:
        out = hedge_update(W, {"predicted_latency": 1.0, "prefix_affinity": 0.0, "topology_affinity": 0.5}, False)
        assert out["prefix_affinity"] / out["predicted_latency"] < W["prefix_affinity"] / W["predicted_latency"]

    def test_no_term_falls_below_its_floor_so_it_can_come_back_after_a_drift(self) -> None:
        bad = {"predicted_latency": 0.0, "prefix_affinity": 1.0, "topology_affinity": 0.0}
        cfg = HedgeConfig(eta=0.5, min_share=0.05)
        out = learned_weights(W, [(bad, True)] * 2000, cfg)
        assert out["prefix_affinity"] == pytest.approx(0.05 * sum(W.values()))
        back = learned_weights(out, [(bad, False)] * 200, cfg)  # now the term is right
        assert back["prefix_affinity"] > 3 * out["prefix_affinity"]

    def test_a_bad_config_names_the_field(self) -> None:
        with pytest.raises(ValueError, match="eta"):
            HedgeConfig(eta=0)
        with pytest.raises(ValueError, match="min_share"):
            HedgeConfig(min_share=1.0)


CFG = RolloutConfig(cold_start_s=100, window_s=10, shares=(0.1, 0.5, 1.0), holdback=0.05, min_requests=20,
                    hold_s=50, anomaly_z=4.0)


def _window(c: RolloutController, t0: float, *, learned_rate: float, rr_rate: float, n: int = 400) -> float:
    """One window of `n` arrivals with the given violation rates per arm; returns its end."""
    counts = {"learned": 0, "rr": 0}
    for i in range(n):
        arm = c.arm(f"r{t0:.0f}-{i}")
        k = counts[arm]
        counts[arm] += 1
        rate = learned_rate if arm == "learned" else rr_rate
        c.finished(arm, violated=int((k + 1) * rate) > int(k * rate))  # `rate` of them, spread evenly
    return t0 + c.config.window_s


def _run(c: RolloutController, t: float, windows: int, **rates: float) -> float:
    for _ in range(windows):
        t = _window(c, t, **rates)
        c.tick(t)
    return t


class TestRollout:
    def test_a_cold_start_on_round_robin_then_ten_fifty_hundred_percent(self) -> None:
        c = RolloutController(CFG)
        assert c.stage is Stage.COLD and c.arm("x") == "rr"
        t = _run(c, 0.0, 10, learned_rate=0.0, rr_rate=0.1)  # cold: every request on round-robin
        assert c.window.requests == {"learned": 0, "rr": 0}
        assert c.stage is Stage.CANARY and c.share == 0.1
        t = _run(c, t, 1, learned_rate=0.05, rr_rate=0.10)
        assert c.stage is Stage.CANARY and c.share == 0.5
        _run(c, t, 1, learned_rate=0.05, rr_rate=0.10)
        assert c.stage is Stage.FULL and c.share == pytest.approx(0.95)  # the control holdback stays
        assert [(e.before, e.after) for e in c.events] == [
            (Stage.COLD, Stage.CANARY), (Stage.CANARY, Stage.CANARY), (Stage.CANARY, Stage.FULL)]
        last = c.events[-1]
        assert (last.learned_violation_rate, last.rr_violation_rate) == (pytest.approx(0.05), pytest.approx(0.10))

    @pytest.mark.parametrize("learned,rolled", [(0.12, True), (0.106, True), (0.104, False), (0.10, False)])
    def test_it_rolls_back_exactly_past_round_robins_rate_times_1_05(self, learned: float, rolled: bool) -> None:
        c = RolloutController(RolloutConfig(cold_start_s=0, window_s=10, min_requests=20, hold_s=50))
        c.tick(0.0)
        t = 0.0
        for _ in range(5):  # five windows: at 1000 requests per arm the rates are exact to 0.1%
            counts = {"learned": 0, "rr": 0}
            for i in range(2000):
                arm = "learned" if i % 2 else "rr"
                k = counts[arm]
                counts[arm] += 1
                rate = learned if arm == "learned" else 0.10
                c.finished(arm, violated=(k % 1000) < round(rate * 1000))
            t += 10
            change = c.tick(t)
            if change is not None and change.after is Stage.ROLLED_BACK:
                break
        assert (c.stage is Stage.ROLLED_BACK) is rolled
        if rolled:
            assert c.share == 0.0 and "rolled back" in c.events[-1].reason
            assert c.events[-1].rr_violation_rate == pytest.approx(0.10)

    def test_after_a_rollback_it_holds_on_round_robin_then_tries_ten_percent_again(self) -> None:
        c = RolloutController(CFG)
        t = _run(c, 0.0, 10, learned_rate=0.0, rr_rate=0.1)
        t = _run(c, t, 1, learned_rate=0.30, rr_rate=0.10)
        assert c.stage is Stage.ROLLED_BACK and c.arm("any") == "rr"
        t = _run(c, t, 5, learned_rate=0.0, rr_rate=0.1)
        assert c.stage is Stage.CANARY and c.share == 0.1

    def test_a_window_with_too_few_requests_on_an_arm_decides_nothing(self) -> None:
        c = RolloutController(replace(CFG, min_requests=100))
        t = _run(c, 0.0, 10, learned_rate=0.0, rr_rate=0.1)
        t = _run(c, t, 1, learned_rate=0.9, rr_rate=0.0)  # ~40 on the learned arm: too few
        assert c.stage is Stage.CANARY and c.share == 0.1

    def test_a_burst_of_arrivals_is_an_anomaly_that_falls_back_to_round_robin(self) -> None:
        c = RolloutController(CFG)
        t = _run(c, 0.0, 10, learned_rate=0.0, rr_rate=0.1)
        assert c.stage is Stage.CANARY
        t = _run(c, t, 1, learned_rate=0.05, rr_rate=0.1, n=4000)  # ten times the usual rate: viral
        assert c.stage is Stage.FALLBACK and "anomaly" in c.events[-1].reason

    def test_a_change_of_plans_is_an_anomaly(self) -> None:
        c = RolloutController(CFG)
        c.plans_seen(frozenset({"p1"}), 0.0)
        t = _run(c, 0.0, 10, learned_rate=0.0, rr_rate=0.1)
        assert c.plans_seen(frozenset({"p1"}), t) is None
        change = c.plans_seen(frozenset({"p1", "p2"}), t)
        assert change is not None and change.after is Stage.FALLBACK

    def test_the_same_request_key_always_takes_the_same_arm(self) -> None:
        c = RolloutController(RolloutConfig(cold_start_s=0))
        c.tick(0.0)
        assert len({c.arm("req-42") for _ in range(20)}) == 1
        arms = [c.arm(f"req-{i}") for i in range(10000)]
        assert 0.08 < arms.count("learned") / len(arms) < 0.12

    @pytest.mark.parametrize("field,value", [("shares", (0.5, 0.1)), ("rollback_ratio", 0.9), ("window_s", 0),
                                             ("holdback", 1.0)])
    def test_a_bad_config_names_the_field(self, field: str, value: object) -> None:
        with pytest.raises(ValueError, match=field):
            RolloutConfig(**{field: value})  # type: ignore[arg-type]

    def test_an_unknown_arm_is_refused(self) -> None:
        with pytest.raises(ValueError, match="arm"):
            RolloutController().finished("sometimes", True)
