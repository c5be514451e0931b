"""Issue 16 d1: each band of the spillover rule (seed 003: 30% / 10% of a plan's KV free)."""

from __future__ import annotations

import math

import pytest

from scheduler.router.spillover import (
    Band,
    SpillConfig,
    SpillWatch,
    admits,
    band,
    pull_back_s,
    reorder,
    reroute,
)


@pytest.mark.parametrize("free,expected", [(0.95, Band.PROBE), (0.31, Band.PROBE), (0.30, Band.NORMAL),
                                           (0.10, Band.NORMAL), (0.099, Band.HIGH_ONLY), (0.0, Band.HIGH_ONLY)])
def test_the_band_follows_the_free_share(free: float, expected: Band) -> None:
    assert band(free) is expected


def test_above_30_percent_free_a_plan_takes_its_own_traffic_and_about_half_of_spilled_requests() -> None:
    assert admits(0.6, spilled=False, high_priority=False, key="k")[0]
    taken = sum(admits(0.6, spilled=True, high_priority=False, key=f"r{i}")[0] for i in range(4000))
    assert 0.45 < taken / 4000 < 0.55
    # the same request gets the same answer: a retry does not roll the dice again
    assert len({admits(0.6, spilled=True, high_priority=False, key="r7")[0] for _ in range(10)}) == 1


def test_between_10_and_30_percent_a_plan_takes_its_own_traffic_and_no_spilled_request() -> None:
    assert admits(0.2, spilled=False, high_priority=False, key="k") == (True, "20% KV free: its own traffic")
    ok, why = admits(0.2, spilled=True, high_priority=True, key="k")
    assert not ok and "no spilled" in why


def test_below_10_percent_only_high_priority_requests_get_in() -> None:
    assert not admits(0.05, spilled=False, high_priority=False, key="k")[0]
    assert admits(0.05, spilled=False, high_priority=True, key="k")[0]
    assert admits(0.05, spilled=True, high_priority=True, key="k")[0]
    assert "high priority only" in admits(0.05, spilled=True, high_priority=False, key="k")[1]


def test_pulling_kv_back_over_pcie_gen5_costs_its_bytes_over_the_link() -> None:
    # 4 GiB of KV over 512 Gb/s (PCIe Gen5 x16, ~64 GB/s): about 67 ms
    assert pull_back_s(4 * 2**30, 512) == pytest.approx(4 * 2**30 * 8 / 512e9)


@pytest.mark.parametrize("kw,field", [({"probe_above": 0.05}, "probe_above"), ({"probe_share": 1.5}, "probe_share"),
                                      ({"spill_timeout_s": -1}, "spill_timeout_s")])
def test_a_bad_config_names_the_field(kw: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SpillConfig(**kw)
    with pytest.raises(ValueError, match="link_gbps"):
        pull_back_s(1.0, 0)


def test_a_request_stays_with_its_first_choice_while_that_takes_its_own_traffic() -> None:
    assert reorder((2, 0, 1), [0.5, 0.5, 0.2], high_priority=False, key="k") == ((2, 0, 1), "")


def test_a_saturated_first_choice_spills_to_the_first_plan_with_room_and_goes_last() -> None:
    free = [0.2, 0.9, 0.05]  # slot 2 (first choice) nearly full, slot 0 takes no spills, slot 1 probes
    keys = [k for k in (f"r{i}" for i in range(50)) if admits(0.9, spilled=True, high_priority=False, key=k)[0]]
    order, why = reorder((2, 0, 1), free, high_priority=False, key=keys[0])
    assert order == (1, 0, 2) and why.startswith("spilled")


def test_when_no_plan_takes_the_spill_the_request_waits_at_its_first_choice() -> None:
    order, why = reorder((2, 0), [0.2, 0.5, 0.05], high_priority=False, key="k")
    assert order == (2, 0) and "waits at its first choice" in why
    assert reorder((2, 0), [0.2, 0.5, 0.05], high_priority=True, key="k") == ((2, 0), "")  # high: it gets in


# -- the spillover timeout ------------------------------------------------------------------------


def test_a_spilled_request_admitted_in_time_is_not_counted() -> None:
    watch = SpillWatch(SpillConfig(spill_timeout_s=2.0))
    assert watch.spilled("r1", "home", "p2", 10.0) is not None
    watch.admitted("r1")  # its prefill started at p2 before the deadline
    assert watch.expire("r1", 12.0) is None
    assert (watch.spills, watch.timeouts, watch.waiting) == (1, 0, 0)


def test_a_spilled_request_past_the_timeout_times_out_exactly_once_and_is_counted_at_its_plan() -> None:
    watch = SpillWatch(SpillConfig(spill_timeout_s=2.0))
    s = watch.spilled("r1", "home", "p2", 10.0)
    assert s is not None and s.deadline_s == 12.0
    assert watch.expire("r1", 11.9) is None  # not due yet: still watched
    out = watch.expire("r1", 12.0)
    assert out is not None and (out.home, out.at) == ("home", "p2")
    assert watch.expire("r1", 13.0) is None  # a second timer for it finds nothing
    # spilled again after its re-route: counted as a spill, never watched again (no bouncing)
    assert watch.spilled("r1", "home", "p3", 12.0) is None
    assert watch.expire("r1", 99.0) is None
    assert (watch.spills, watch.timeouts) == (2, 1)


def test_with_the_timeout_off_nothing_is_watched() -> None:
    watch = SpillWatch(SpillConfig(spill_timeout_s=math.inf))
    assert watch.spilled("r1", "home", "p2", 0.0) is None
    assert watch.expire("r1", 1e9) is None and watch.spills == 1


def test_a_timed_out_request_goes_back_to_its_first_choice_once_that_takes_its_own_traffic() -> None:
    # home (slot 0) has 20% free again: NORMAL band, its own traffic -> back home
    slot, why = reroute((1, 2, 0), [0.2, 0.5, 0.9], home=0, waiting_at=1, high_priority=False, key="k")
    assert slot == 0 and "back to its first choice" in why


def test_a_timed_out_request_whose_home_is_still_full_goes_to_the_next_plan_that_takes_a_spill() -> None:
    free = [0.05, 0.5, 0.9]
    keys = [k for k in (f"r{i}" for i in range(50)) if admits(0.9, spilled=True, high_priority=False, key=k)[0]]
    slot, why = reroute((1, 2, 0), free, home=0, waiting_at=1, high_priority=False, key=keys[0])
    assert slot == 2 and why.startswith("spillover timeout")


def test_a_timed_out_request_no_other_plan_takes_keeps_its_place_and_is_never_dropped() -> None:
    # home full, the only other plan in the NORMAL band (takes no spills): it stays where it waits
    slot, why = reroute((1, 2, 0), [0.05, 0.9, 0.2], home=0, waiting_at=1, high_priority=False, key="k")
    assert slot == 1 and "keeps its place" in why
    # whatever the loads, the answer is a plan of the pool (never none)
    for free in ([0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.05, 0.05, 0.5]):
        assert reroute((2, 1, 0), free, home=0, waiting_at=2, high_priority=False, key="k")[0] in (0, 1, 2)


def test_a_nan_timeout_names_the_field() -> None:
    with pytest.raises(ValueError, match="spill_timeout_s"):
        SpillConfig(spill_timeout_s=math.nan)


def test_the_router_settings_carry_the_spill_config_and_name_a_bad_field() -> None:
    from scheduler.router import RouterConfig

    assert RouterConfig.from_dict({"spill": {"spill_timeout_s": 5}}).spill == SpillConfig(spill_timeout_s=5.0)
    assert RouterConfig.from_dict({}).spill is None
    with pytest.raises(ValueError, match=r"FLEXPIPE_ROUTER\.spill\.spill_timeout_s"):
        RouterConfig.from_dict({"spill": {"spill_timeout_s": -1}})
    with pytest.raises(ValueError, match=r"FLEXPIPE_ROUTER\.spill\.timeout"):
        RouterConfig.from_dict({"spill": {"timeout": 1}})
