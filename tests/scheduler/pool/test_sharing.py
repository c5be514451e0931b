"""GPU sharing by memory fraction (scheduler/pool/sharing.py, the loop's decision snapshot):
up to max_models_per_gpu deployments share a GPU when their weights + KV reserves fit under 92%
together; a third, or one that does not fit, is kept off it with the reason. Pure: no database."""

from __future__ import annotations

import pytest

from scheduler.booking import plans_memory
from scheduler.control import ControlLoop, FleetState, LoopConfig
from scheduler.costmodel import decode_step_s
from scheduler.gearbox import DEFAULT_CONFIG, decide
from scheduler.gearbox.measures import _value, rent_off
from scheduler.plan import MEM_FRACTION, validate_plan
from scheduler.pool.sharing import MAX_MODELS_PER_GPU, shared_snapshot, sharing_conflicts
from tests.scheduler.builders import one_plan_gear, tp_plan
from tests.scheduler.control.test_loop import M70, NOW, fleet, state, tp8, window
from tests.scheduler.test_gearbox import deployment

A2 = tp8("a2")
A2_GPUS = frozenset(A2.gpu_uuids)


def test_the_default_is_seed_004s_two_models_per_gpu() -> None:
    assert MAX_MODELS_PER_GPU == 2 and LoopConfig().max_models_per_gpu == 2
    with pytest.raises(ValueError, match="max_models_per_gpu: must be an integer >= 1"):
        LoopConfig(max_models_per_gpu=0)


def test_another_deployments_gpu_is_partly_used_by_its_booked_bytes_not_unschedulable() -> None:
    booked = plans_memory(A2.plans, M70)
    view = shared_snapshot(fleet(), "me", {"other": A2_GPUS}, {"other": booked})
    for u in A2_GPUS:
        g = view.gpu_by_uuid[u]
        assert g.schedulable and g.mem_used_bytes == booked[u]
    # a third deployment, unknown bookings, or exclusive GPUs: unschedulable
    full = shared_snapshot(fleet(), "me", {"other": A2_GPUS, "third": A2_GPUS}, {"other": booked, "third": booked})
    unknown = shared_snapshot(fleet(), "me", {"other": A2_GPUS}, {})
    exclusive = shared_snapshot(fleet(), "me", {"other": A2_GPUS}, {"other": booked}, max_models_per_gpu=1)
    for snap in (full, unknown, exclusive):
        assert not any(snap.gpu_by_uuid[u].schedulable for u in A2_GPUS)
    # one already on the GPU stays on it beside one other
    mine = shared_snapshot(fleet(), "other", {"other": A2_GPUS, "third": A2_GPUS}, {"other": booked, "third": booked},
                           own_bytes=booked)
    assert all(mine.gpu_by_uuid[u].schedulable for u in A2_GPUS)


def test_two_deployments_share_a_gpu_within_092_and_a_third_is_kept_off() -> None:
    # three deployments all asking for a2's block for their baseline, highest priority first
    first, second, third = (state(n, priority=p) for n, p in (("first", 5), ("second", 3), ("third", 1)))
    loop = ControlLoop()
    loop.observe([third, second, first], FleetState(snapshot=fleet()))
    out = loop.step(NOW).by_id()
    a, b, c = (out[n].start for n in ("first", "second", "third"))
    assert a is not None and b is not None and c is not None
    assert a.target == A2 and b.target == A2  # the second shares a2 with the first
    together = {u: plans_memory(a.target.plans, M70)[u] + plans_memory(b.target.plans, M70)[u] for u in A2_GPUS}
    total = fleet().gpu_by_uuid["a2-g0"].mem_total_bytes
    assert all(0 < v <= MEM_FRACTION * total for v in together.values())
    assert not set(c.target.gpu_uuids) & A2_GPUS  # a2 holds two deployments already
    # exclusive GPUs: the second goes elsewhere too
    loop = ControlLoop(LoopConfig(max_models_per_gpu=1))
    loop.observe([second, first], FleetState(snapshot=fleet()))
    again = loop.step(NOW).by_id()["second"].start
    assert again is not None and not set(again.target.gpu_uuids) & A2_GPUS


def test_a_plan_that_does_not_fit_beside_the_others_is_kept_off_with_the_reason() -> None:
    booked = plans_memory(A2.plans, M70)
    view = shared_snapshot(fleet(), "big", {"other": A2_GPUS}, {"other": booked})
    # 1M tokens of KV reserve: fits a2 alone, not beside the other's 70B
    huge = one_plan_gear(tp_plan(M70, list(A2.gpu_uuids), kv_tokens=1_000_000))
    assert validate_plan(A2.plans[0], view, M70) == []
    assert validate_plan(huge.plans[0], fleet(), M70) == []
    reasons = validate_plan(huge.plans[0], view, M70)
    assert reasons and "GiB fit under 92% of its memory" in reasons[0]
    # and the loop does not place it there: its baseline is brought up elsewhere, or not at all
    loop = ControlLoop()
    loop.observe([state("other", priority=5, current=A2), state("big", priority=1, baseline=huge)],
                 FleetState(snapshot=fleet(), held={"other": A2_GPUS}))
    s = loop.step(NOW).by_id()["big"]
    assert s.decision is not None
    assert s.start is None or s.start.target != huge


def test_the_stores_reservation_check_counts_deployments_per_gpu() -> None:
    assert sharing_conflicts("me", {"g": {"a"}}) == []
    assert sharing_conflicts("me", {"g": {"a"}}, 1) == ["GPU g is booked by deployment a"]
    assert sharing_conflicts("me", {"g": {"a", "b"}}) == [
        "GPU g is booked by deployments a, b: at most 2 deployments share a GPU (max_models_per_gpu)"]
    assert sharing_conflicts("a", {"g": {"a", "b"}}) == []  # already one of them


def test_a_gpu_another_deployment_holds_is_priced_at_its_time_slice_of_compute() -> None:
    booked = plans_memory(A2.plans, M70)
    base = fleet()
    view = shared_snapshot(base, "me", {"other": A2_GPUS}, {"other": booked})
    u = sorted(A2_GPUS)[0]
    assert base.gpu_by_uuid[u].compute_share == 1.0 and view.gpu_by_uuid[u].compute_share == 0.5
    # the same plan's decode step takes twice as long beside the other deployment as alone
    plan = A2.plans[0]
    alone = decode_step_s(plan, M70, base, 16, 1024)
    beside = decode_step_s(plan, M70, view, 16, 1024)
    assert beside == pytest.approx(2 * alone)
    # a GPU nobody else holds keeps its full speed in the view
    other = next(g.uuid for g in base.gpus if g.uuid not in A2_GPUS)
    assert view.gpu_by_uuid[other].compute_share == 1.0


def test_a_gpu_another_deployment_holds_is_rented_at_its_share_by_the_joiner_and_the_incumbent_alike() -> None:
    booked = plans_memory(A2.plans, M70)
    base = fleet()
    joiner = shared_snapshot(base, "me", {"other": A2_GPUS}, {"other": booked})
    incumbent = shared_snapshot(base, "other", {"other": A2_GPUS, "me": A2_GPUS}, {"other": booked, "me": booked},
                                own_bytes=booked)
    assert rent_off(A2, base) == 0.0  # nobody else there: it pays for all eight
    assert rent_off(A2, joiner) == rent_off(A2, incumbent) == pytest.approx(4.0)  # half of each of the eight
    # a gear on GPUs nobody else holds pays its whole rent in the same view
    assert rent_off(tp8("a1"), joiner) == 0.0
    assert _value(None, 100.0, 4.0) == 0.0


def test_the_gearbox_charges_a_shared_gear_the_rent_of_its_share() -> None:
    booked = plans_memory(A2.plans, M70)
    view = shared_snapshot(fleet(), "other", {"other": A2_GPUS, "me": A2_GPUS}, {"other": booked, "me": booked},
                           own_bytes=booked)
    d = decide(deployment(), A2, view, window(3.0), NOW, model=M70)
    est, w = d.current_estimate, d.workload
    assert est is not None and w is not None and est.gpus == 8
    rent = DEFAULT_CONFIG.gpu_rent * est.capacity_rps * w.output_tokens_mean / est.gpus
    assert d.current_value_tokens_s == pytest.approx(est.goodput_tokens_s - rent * 4)  # eight GPUs, half of each
