"""Issue 16 d1: each band of the spillover rule (seed 003: 30% / 10% of a plan's KV free)."""

from __future__ import annotations

import pytest

from scheduler.router.spillover import Band, SpillConfig, admits, band, pull_back_s, reorder


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
