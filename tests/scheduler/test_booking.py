"""GPU memory across a transition (scheduler.booking): what a plan books, beside what, and the one refusal."""

from __future__ import annotations

from dataclasses import replace

from scheduler.booking import (
    beside_conflicts,
    new_plan_bytes,
    plan_memory,
    plans_memory,
    refuse_booking,
)
from scheduler.capabilities import TORCH_CAPS
from scheduler.modelspec import model_spec
from scheduler.plan import Gear
from scheduler.topology import Snapshot
from tests.scheduler.builders import NodeSpec, make_fleet, one_plan_gear, tp_plan

M70 = model_spec("Llama-3-70B")
GB = 10**9


def holding(snap: Snapshot, *gears: Gear) -> Snapshot:
    """The snapshot as agents report it while these gears run: their memory is in use."""
    held = plans_memory([p for g in gears for p in g.plans], M70)
    return replace(snap, gpus=tuple(replace(g, mem_used_bytes=min(g.mem_total_bytes, g.mem_used_bytes
                                                                  + held.get(g.uuid, 0))) for g in snap.gpus))


def test_the_refusal_names_the_first_gpu_over_92_percent_and_says_how_much_fits() -> None:
    total = 80 * GB
    assert refuse_booking({"g0": 10 * GB}, {"g0": 60 * GB}, {"g0": total}) is None  # 70 GB: 87.5%
    over = refuse_booking({"g1": 20 * GB, "g0": 20 * GB}, {"g0": 60 * GB, "g1": 0}, {"g0": total, "g1": total})
    assert over is not None and over.gpu == "g0"
    assert over.fraction_after == 1.0 and over.free_bytes == int(0.92 * total) - 60 * GB
    assert "above the 92% limit" in over.message() and "GPU g0" in over.message()
    assert refuse_booking({"elsewhere": 10**12}, {}, {"g0": total}) is None  # not this agent's GPU


def test_the_paper_reshape_on_the_same_gpus_does_not_fit_beside_the_running_gear() -> None:
    snap = make_fleet([NodeSpec("a1", gpus=8)])
    gpus = [f"a1-g{i}" for i in range(8)]
    tp8 = one_plan_gear(tp_plan(M70, gpus, kv_tokens=1_000_000))  # KV filling most of each GPU, as a baseline does
    two_tp4 = Gear(M70.name, (tp_plan(M70, gpus[:4], 60_000), tp_plan(M70, gpus[4:], 60_000)), (0.5, 0.5))
    running = holding(snap, tp8)
    found = beside_conflicts(tp8, two_tp4, M70, running)
    assert [c.gpu for c in found] == sorted(gpus)
    # with nothing running there, or once the TP8 is released, the same target fits
    assert beside_conflicts(None, two_tp4, M70, snap) == []
    assert beside_conflicts(tp8, two_tp4, M70, running, released=plan_memory(tp8.plans[0], M70)) == []


def test_a_plan_both_gears_keep_books_nothing_new() -> None:
    snap = make_fleet([NodeSpec("a1", gpus=8)])
    kept = tp_plan(M70, [f"a1-g{i}" for i in range(4)], 100_000)
    extra = tp_plan(M70, [f"a1-g{i}" for i in range(4, 8)], 100_000)
    current = one_plan_gear(kept)
    target = Gear(M70.name, (kept, extra), (0.5, 0.5))
    assert set(new_plan_bytes(current, target, M70)) == set(extra.gpu_uuids)
    assert beside_conflicts(current, target, M70, holding(snap, current)) == []


def test_resident_weights_count_once_only_where_the_engine_shares_them() -> None:
    snap = make_fleet([NodeSpec("a1", gpus=4)])
    gpus = [f"a1-g{i}" for i in range(4)]
    old = tp_plan(M70, gpus, kv_tokens=60_000)
    new = tp_plan(M70, gpus, kv_tokens=70_000)  # same shards, a bigger KV reserve: another plan
    current, target = one_plan_gear(old), one_plan_gear(new)
    running = holding(snap, current)
    assert beside_conflicts(current, target, M70, running)  # both copies of the weights count
    sharing = replace(running, nodes=tuple(replace(n, engine=replace(TORCH_CAPS, shares_weights=True))
                                           for n in running.nodes))
    assert beside_conflicts(current, target, M70, sharing) == []  # the shards map in place: KV only
    need = new_plan_bytes(current, target, M70, sharing=frozenset(gpus))
    assert need[gpus[0]] < plan_memory(new, M70)[gpus[0]]
