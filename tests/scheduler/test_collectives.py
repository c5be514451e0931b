"""Measured collective curves (scheduler.collectives) and the cost model's preference for them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduler.collectives import CollectiveCurve
from scheduler.costmodel import PlanProfile, gpu_path, transfer_time_s
from scheduler.modelspec import model_spec
from scheduler.topology import Snapshot
from tests.scheduler.builders import NodeSpec, make_fleet, tp_plan

M8 = model_spec("Llama-3-8B")


def curve(points: tuple[tuple[int, float], ...], op: str = "all_reduce", **kw: object) -> CollectiveCurve:
    return CollectiveCurve(op=op, scope=kw.pop("scope", "intra"), node=kw.pop("node", "a1"),  # type: ignore[arg-type]
                           ranks=kw.pop("ranks", 4), points=points, **kw)  # type: ignore[arg-type]


def test_it_interpolates_between_sizes_extends_the_last_slope_and_keeps_the_floor() -> None:
    c = curve(((1000, 10e-6), (2000, 12e-6), (4000, 20e-6)))
    assert c.time_s(1000) == 10e-6 and c.time_s(1500) == pytest.approx(11e-6)
    assert c.time_s(10) == 10e-6  # below the smallest size: the latency floor
    assert c.time_s(8000) == pytest.approx(36e-6)  # beyond: the last segment's bandwidth
    assert c.bandwidth_bytes_per_s() == pytest.approx(2000 / 8e-6) and c.latency_s() == 10e-6
    held_out = c.without(2000)
    assert held_out is not None and held_out.time_s(2000) == pytest.approx(10e-6 + 1000 * 10e-6 / 3000)
    assert curve(((64, 1e-5),)).without(64) is None


@pytest.mark.parametrize("points,field", [
    (((100, 1e-5), (50, 2e-5)), "points[1]"), (((100, -1.0),), "points[0]"), ((), "points")])
def test_a_bad_curve_names_the_point(points: tuple[tuple[int, float], ...], field: str) -> None:
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        curve(points)


def with_curves(snap: Snapshot, *curves: CollectiveCurve) -> Snapshot:
    out = replace(snap, collectives=curves)
    out.validate()
    return out


def test_the_cost_model_prefers_a_measured_all_reduce_to_its_own_model() -> None:
    snap = make_fleet([NodeSpec("a1", gpus=4)])
    plan = tp_plan(M8, [f"a1-g{i}" for i in range(4)], 8192)
    modelled = PlanProfile.build(plan, M8, snap).pipeline("decode").iteration
    slow = curve(((1024, 5e-3), (1 << 20, 6e-3)))  # a (deliberately) terrible measured all-reduce
    measured = PlanProfile.build(plan, M8, with_curves(snap, slow)).pipeline("decode").iteration
    from scheduler.costmodel import Batch

    b = Batch(decode_seqs=8, decode_context_tokens=8 * 512)
    assert measured(b).allreduce_s == pytest.approx(2 * M8.num_layers * slow.time_s(8 * M8.hidden_size * 2))
    assert measured(b).allreduce_s > 50 * modelled(b).allreduce_s
    # another TP size on the node has no curve: the physical model
    tp2 = tp_plan(M8, ["a1-g0", "a1-g1"], 8192)
    with_curve = PlanProfile.build(tp2, M8, with_curves(snap, slow)).pipeline("decode").iteration(b).allreduce_s
    assert with_curve == PlanProfile.build(tp2, M8, snap).pipeline("decode").iteration(b).allreduce_s


def test_copies_between_two_nodes_use_their_measured_send_recv() -> None:
    snap = make_fleet([NodeSpec("a1", gpus=1), NodeSpec("b1", gpus=1, rack="B")])
    sr = curve(((4096, 50e-6), (1 << 24, 20e-3)), op="send_recv", scope="inter", node="b1", peer="a1", ranks=2)
    path = gpu_path(with_curves(snap, sr), "a1-g0", "b1-g0")
    assert path.curve == sr and transfer_time_s(1 << 24, path) == pytest.approx(20e-3)
    with pytest.raises(ValueError, match=r"collectives\[0\]\.peer"):
        with_curves(snap, replace(sr, peer="x9"))
    assert Snapshot.from_dict(with_curves(snap, sr).to_dict()).collectives == (sr,)
