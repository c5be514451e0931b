"""Names operators can read (console/gearbox/names.py): GPUs as node/index, gears by shape and placement."""

from __future__ import annotations

from console.gearbox.names import distinct, gear_name, placement, plan_label, readable
from scheduler.modelspec import model_spec
from scheduler.plan import Gear, Plan, Stage

M8 = model_spec("Llama-3-8B")
NAMES = {f"GPU-a1-{i}": f"h100-a/{i}" for i in range(8)} | {f"GPU-b1-{i}": f"a100-b/{i}" for i in range(4)}


def plan(*stages: tuple[str, ...], kv: int = 1000) -> Plan:
    n = M8.num_layers // len(stages)
    return Plan(M8.name, "colocated", tuple(Stage(i * n, (i + 1) * n if i < len(stages) - 1 else M8.num_layers, s)
                                            for i, s in enumerate(stages)), kv_reserve_tokens=kv)


def test_placement_groups_indices_by_node_as_ranges() -> None:
    assert placement(("GPU-a1-0", "GPU-a1-1", "GPU-a1-2", "GPU-a1-3"), NAMES) == "h100-a/0-3"
    assert placement(("GPU-a1-0", "GPU-a1-2", "GPU-b1-1"), NAMES) == "h100-a/0,2 + a100-b/1"
    assert placement(("GPU-5c1f0d2e-aaaa-bbbb",), NAMES) == "GPU-5c1f0d2e…"  # unknown: the uuid, shortened


def test_two_gears_of_one_shape_get_distinct_names() -> None:
    a = Gear(M8.name, (plan(("GPU-a1-0", "GPU-a1-1", "GPU-a1-2", "GPU-a1-3")),), (1.0,))
    b = Gear(M8.name, (plan(("GPU-a1-4", "GPU-a1-5", "GPU-a1-6", "GPU-a1-7")),), (1.0,))
    assert a.shape() == b.shape() == "TP4"
    assert (gear_name(a, NAMES), gear_name(b, NAMES)) == ("TP4 on h100-a/0-3", "TP4 on h100-a/4-7")
    same_place = Gear(M8.name, (plan(("GPU-a1-0", "GPU-a1-1", "GPU-a1-2", "GPU-a1-3"), kv=2000),), (1.0,))
    left, right = distinct((gear_name(a, NAMES), a.gear_id), (gear_name(same_place, NAMES), same_place.gear_id))
    assert left != right and a.gear_id in left and same_place.gear_id in right


def test_shapes_read_as_words() -> None:
    assert plan_label(plan(("GPU-a1-0", "GPU-a1-1", "GPU-a1-2", "GPU-a1-3"), ("GPU-b1-0", "GPU-b1-1"))) == "PP2 (TP4, TP2)"
    assert plan_label(plan(("GPU-a1-0", "GPU-a1-1"), ("GPU-a1-2", "GPU-a1-3"))) == "PP2×TP2"
    two = Gear(M8.name, (plan(("GPU-a1-0",)), plan(("GPU-b1-0",))), (0.75, 0.25))
    assert gear_name(two, NAMES) == "TP1 on h100-a/0 (75%) + TP1 on a100-b/0 (25%)"


def test_reasons_name_gpus_by_node_and_index_and_moments_in_utc() -> None:
    text = "stages[0]: GPU GPU-a1-3 cannot be used (not schedulable); cooldown: no automatic switch until t=1796160332 s"
    assert readable(text, NAMES) == ("stages[0]: GPU h100-a/3 cannot be used (not schedulable); cooldown: no automatic "
                                     "switch until 2026-12-01 21:25:32Z")
