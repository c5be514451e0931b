from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.hardware import GpuSpec
from scheduler.topology import BlockPolicy, FragmentHistory, LinkState, Snapshot, atomic_blocks, partition
from tests.scheduler.builders import NOW_S, NodeSpec, make_fleet, with_gpus


def small_fleet() -> Snapshot:
    return make_fleet(
        [NodeSpec("a1", "H100-SXM", 8), NodeSpec("b1", "L40S", 4, nvlink=False, rack="B")],
        links=[LinkState("a1", "b1", 200.0, 5.0)],
    )


def test_a_snapshot_round_trips_through_plain_json() -> None:
    snap = replace(
        small_fleet(),
        custom_specs=(GpuSpec("X9", 1e14, 10**10, 1e12, 0.0, 3e10, "medium", "agent"),),
    )
    text = json.dumps(snap.to_dict())
    back = Snapshot.from_dict(json.loads(text))
    assert back == snap
    assert back.to_dict() == snap.to_dict()


def test_optional_keys_take_their_documented_defaults() -> None:
    snap = Snapshot.from_dict(
        {
            "now_s": 100.0,
            "nodes": [{"id": "n1"}],
            "gpus": [{"uuid": "g", "node_id": "n1", "index": 0, "model": "A100-80G",
                      "mem_total_bytes": 80 * 10**9, "mem_used_bytes": 0}],
        }
    )
    node, gpu = snap.nodes[0], snap.gpus[0]
    assert (node.rack, node.schedulable, node.last_seen_s) == ("n1", True, 100.0)
    assert (gpu.healthy, gpu.schedulable, gpu.nvlink_group, gpu.last_seen_s) == (True, True, None, 100.0)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["gpus"][3].update(mem_used_bytes=-1), r"gpus\[3\]\.mem_used_bytes: must be within"),
        (lambda d: d["gpus"][2].update(model="B300"), r"gpus\[2\]\.model: unknown GPU 'B300'; known: H200"),
        (lambda d: d["gpus"][1].update(node_id="zz"), r"gpus\[1\]\.node_id: unknown node 'zz'"),
        (lambda d: d["gpus"][0].update(colour="red"), r"gpus\[0\]\.colour: unknown key"),
        (lambda d: d["gpus"][4].pop("uuid"), r"gpus\[4\]\.uuid: required"),
        (lambda d: d["gpus"][5].update(sm_util=1.5), r"gpus\[5\]\.sm_util: must be within \[0, 1\]"),
        (lambda d: d["gpus"][6].update(uuid="a1-g0"), r"gpus\[6\]\.uuid: duplicate 'a1-g0'"),
        (lambda d: d["links"][0].update(b="nowhere"), r"links\[0\]\.b: unknown node 'nowhere'"),
        (lambda d: d["nodes"][1].update(schedulable="yes"), r"nodes\[1\]\.schedulable: must be true or false"),
        (lambda d: d.update(now_s="soon"), r"snapshot\.now_s: must be a finite number"),
    ],
)
def test_a_malformed_snapshot_names_the_path_of_the_bad_field(mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    d = small_fleet().to_dict()
    mutate(d)
    with pytest.raises(ValueError, match=message):
        Snapshot.from_dict(d)


def test_an_nvlink_domain_is_one_block_and_pcie_peers_another() -> None:
    blocks = {b.id: b for b in atomic_blocks(small_fleet())}
    assert set(blocks) == {"a1/nvl0", "b1/pcie"}
    assert blocks["a1/nvl0"].size == 8 and blocks["a1/nvl0"].link_kind == "nvlink"
    assert blocks["a1/nvl0"].tp_link_bytes_per_s == pytest.approx(450e9)
    assert blocks["b1/pcie"].size == 4 and blocks["b1/pcie"].link_kind == "pcie"


def test_two_nvlink_groups_on_one_node_are_two_blocks() -> None:
    snap = small_fleet()
    snap = with_gpus(snap, **{f"a1-g{i}": {"nvlink_group": "1"} for i in range(4, 8)})
    ids = sorted(b.id for b in atomic_blocks(snap))
    assert ids == ["a1/nvl0", "a1/nvl1", "b1/pcie"]


def test_slow_pcie_peers_are_single_gpu_blocks() -> None:
    blocks = atomic_blocks(small_fleet(), BlockPolicy(min_pcie_tp_bytes_per_s=100e9))
    assert sorted(b.id for b in blocks if b.node_id == "b1") == ["b1/gpu0", "b1/gpu1", "b1/gpu2", "b1/gpu3"]


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"healthy": False}, "unhealthy"),
        ({"schedulable": False}, "not schedulable"),
        ({"failed_checks": 3}, "3 failed checks in a row"),
        ({"last_seen_s": NOW_S - 61}, "heartbeat is 61 s old"),
    ],
)
def test_a_gpu_that_is_not_fit_leaves_its_block_with_a_reason(change: dict[str, object], why: str) -> None:
    part = partition(with_gpus(small_fleet(), **{"a1-g3": change}))
    block = next(b for b in part.blocks if b.id == "a1/nvl0")
    assert "a1-g3" not in block.gpu_uuids and block.size == 7
    assert part.excluded["a1-g3"] == why


def test_a_node_with_a_stale_heartbeat_takes_all_its_gpus_out() -> None:
    snap = small_fleet()
    nodes = tuple(replace(n, last_seen_s=NOW_S - 120) if n.id == "b1" else n for n in snap.nodes)
    part = partition(replace(snap, nodes=nodes))
    assert [b.id for b in part.blocks] == ["a1/nvl0"]
    assert part.excluded["b1-g0"].startswith("node b1 heartbeat")


def test_block_ids_stay_the_same_when_the_block_shrinks() -> None:
    before = {b.id for b in atomic_blocks(small_fleet())}
    after = {b.id for b in atomic_blocks(with_gpus(small_fleet(), **{"a1-g0": {"healthy": False}}))}
    assert before == after


def test_links_resolve_measured_then_rack_defaults() -> None:
    snap = make_fleet([NodeSpec("a1"), NodeSpec("a2"), NodeSpec("c1", rack="C")], links=[LinkState("a1", "a2", 25.0)])
    assert snap.node_link_bytes_per_s("a1", "a2") == pytest.approx(25e9 / 8)  # measured override
    assert snap.node_link_bytes_per_s("a2", "c1") == pytest.approx(100e9 / 8)  # inter-rack default
    assert snap.gpu_link_bytes_per_s("a1-g0", "a1-g1") == pytest.approx(450e9)  # NVLink


# --- fragment history ---------------------------------------------------------------------------
def blocks_of(sizes: dict[str, int]):  # type: ignore[no-untyped-def]
    snap = make_fleet([NodeSpec(n, gpus=8) for n in sizes])
    down = {f"{n}-g{i}": {"healthy": False} for n, k in sizes.items() for i in range(k, 8)}
    return atomic_blocks(with_gpus(snap, **down))


def test_a_block_that_never_changes_is_fully_stable_and_costs_one_point() -> None:
    h = FragmentHistory()
    for t in range(0, 3600, 60):
        h = h.observe(blocks_of({"a1": 8}), float(t))
    assert h.sizes("a1/nvl0") == ((0.0, 8),)
    assert h.stability("a1/nvl0", 3600.0) == 1.0


def test_a_block_that_keeps_shrinking_scores_lower_than_one_that_shrank_once() -> None:
    once, often = FragmentHistory(), FragmentHistory()
    for t, k in enumerate([8, 8, 8, 8, 8, 4]):
        once = once.observe(blocks_of({"a1": k}), 600.0 * t)
    for t, k in enumerate([8, 6, 8, 5, 8, 4]):
        often = often.observe(blocks_of({"a1": k}), 600.0 * t)
    assert 0.0 < often.stability("a1/nvl0", 3000.0) < once.stability("a1/nvl0", 3000.0) < 1.0


def test_a_gone_block_scores_zero_and_is_forgotten_after_the_horizon() -> None:
    h = FragmentHistory(horizon_s=1000.0)
    h = h.observe(blocks_of({"a1": 8, "a2": 8}), 0.0)
    h = h.observe(blocks_of({"a1": 8}), 100.0)
    assert h.stability("a2/nvl0", 100.0) == 0.0
    h = h.observe(blocks_of({"a1": 8}), 2000.0)
    assert "a2/nvl0" not in h.trajectories


def test_it_rejects_an_observation_older_than_the_last() -> None:
    h = FragmentHistory().observe(blocks_of({"a1": 8}), 100.0)
    with pytest.raises(ValueError, match="now_s"):
        h.observe(blocks_of({"a1": 4}), 50.0)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=8), min_size=1, max_size=80), st.integers(min_value=2, max_value=12))
def test_trajectories_stay_bounded_and_scores_stay_in_0_1(sizes: list[int], max_points: int) -> None:
    h = FragmentHistory(horizon_s=1e9, max_points=max_points)
    for i, k in enumerate(sizes):
        h = h.observe(blocks_of({"a1": k}) if k else [], 10.0 * i)
    for points in h.trajectories.values():
        assert len(points) <= max_points
    score = h.stability("a1/nvl0", 10.0 * len(sizes))
    assert 0.0 <= score <= 1.0


def test_the_history_round_trips_through_json() -> None:
    h = FragmentHistory().observe(blocks_of({"a1": 8}), 0.0).observe(blocks_of({"a1": 5}), 60.0)
    back = FragmentHistory.from_dict(json.loads(json.dumps(h.to_dict())))
    assert back.trajectories == h.trajectories and back.horizon_s == h.horizon_s


def test_a_malformed_history_names_the_bad_point() -> None:
    with pytest.raises(ValueError, match=r"history\.trajectories\['a1/nvl0'\]\[1\]"):
        FragmentHistory.from_dict({"trajectories": {"a1/nvl0": [[0, 8], [10, -1]]}})



def test_a_snapshot_partitions_once_per_policy_and_a_changed_one_afresh() -> None:
    snap = small_fleet()
    assert partition(snap) is partition(snap)  # every deployment decided on one tick shares it
    strict = BlockPolicy(min_pcie_tp_bytes_per_s=1e12)
    assert partition(snap, strict) is not partition(snap)
    assert {b.id for b in partition(snap, strict).blocks} != {b.id for b in partition(snap).blocks}
    changed = with_gpus(snap, **{"a1-g3": {"healthy": False}})
    assert "a1-g3" in partition(changed).excluded and "a1-g3" not in partition(snap).excluded
