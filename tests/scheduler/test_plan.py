from __future__ import annotations

import json

import pytest

from scheduler.modelspec import model_spec
from scheduler.plan import Gear, Plan, Stage, validate_gear, validate_plan
from tests.scheduler.builders import NodeSpec, make_fleet, one_plan_gear, tp_plan, with_gpus

M70 = model_spec("Llama-3-70B")
M8 = model_spec("Llama-3-8B")


def fleet():  # type: ignore[no-untyped-def]
    return make_fleet([NodeSpec("a1", "H100-SXM", 8), NodeSpec("a2", "H100-SXM", 8), NodeSpec("c1", "A100-40G", 8)])


def pp_plan() -> Plan:
    return Plan(
        M70.name,
        "colocated",
        (Stage(0, 40, tuple(f"a1-g{i}" for i in range(4))), Stage(40, 80, tuple(f"a2-g{i}" for i in range(4)))),
        kv_reserve_tokens=32768,
    )


def pd_plan() -> Plan:
    return Plan(M8.name, "disaggregated", (Stage(0, 32, ("a1-g0",)),), (Stage(0, 32, ("a2-g0", "a2-g1")),),
                kv_reserve_tokens=50000)


@pytest.mark.parametrize("plan", [pp_plan(), pd_plan(), tp_plan(M8, ["a1-g0"])])
def test_a_plan_round_trips_through_json_with_the_same_id(plan: Plan) -> None:
    back = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert back == plan
    assert back.plan_id == plan.plan_id


def test_the_plan_id_is_derived_from_content() -> None:
    a, b = tp_plan(M8, ["a1-g0", "a1-g1"]), tp_plan(M8, ["a1-g0", "a1-g1"])
    assert a is not b and a.plan_id == b.plan_id
    assert tp_plan(M8, ["a1-g1", "a1-g0"]).plan_id != a.plan_id  # rank order matters
    assert tp_plan(M8, ["a1-g0", "a1-g1"], kv_tokens=1).plan_id != a.plan_id


def test_a_gear_round_trips_and_checks_its_id() -> None:
    gear = Gear(M8.name, (tp_plan(M8, ["a1-g0"]), tp_plan(M8, ["a2-g0"])), (0.25, 0.75))
    d = json.loads(json.dumps({**gear.to_dict(), "gear_id": gear.gear_id}))
    assert Gear.from_dict(d) == gear
    d["gear_id"] = "g-0000"
    with pytest.raises(ValueError, match="gear.gear_id"):
        Gear.from_dict(d)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"model": "m", "mode": "mixed", "stages": []}, r"plan\.mode: must be 'colocated' or 'disaggregated'"),
        ({"model": "m", "mode": "colocated", "stages": [{"layers": [0], "gpus": ["g"]}]},
         r"plan\.stages\[0\]\.layers: must be \[start, end\)"),
        ({"model": "m", "mode": "colocated", "stages": [{"layers": [0, 4], "gpus": ["g"], "tp": 2}]},
         r"plan\.stages\[0\]\.tp: 2 does not match 1 GPUs"),
        ({"model": "m", "mode": "colocated", "stages": [], "kv_reserve_tokens": -1},
         r"plan\.kv_reserve_tokens: must be an integer >= 0"),
        ({"mode": "colocated", "stages": []}, r"plan\.model: required"),
    ],
)
def test_malformed_plan_json_names_the_field(raw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Plan.from_dict(raw)


def test_valid_plans_have_no_reasons() -> None:
    snap = fleet()
    assert validate_plan(pp_plan(), snap, M70) == []
    assert validate_plan(pd_plan(), snap, M8) == []
    assert validate_plan(tp_plan(M70, [f"a1-g{i}" for i in range(8)], 100000), snap, M70) == []


def test_it_rejects_tp_across_two_blocks() -> None:
    plan = tp_plan(M8, ["a1-g0", "a2-g0"])
    reasons = validate_plan(plan, fleet(), M8)
    assert any("TP group spans blocks" in r for r in reasons)


def test_it_rejects_weights_plus_kv_over_92_percent_of_a_gpu() -> None:
    # 70B at TP2 is ~70 GB per GPU of weights; with 80 GB GPUs, 0.92 x 80 = 73.6 GB
    plan = tp_plan(M70, ["a1-g0", "a1-g1"], kv_tokens=200_000)
    reasons = validate_plan(plan, fleet(), M70)
    assert any("fit under 92% of its memory" in r for r in reasons)
    assert validate_plan(tp_plan(M70, ["a1-g0", "a1-g1"], kv_tokens=1000), fleet(), M70) == []


def test_memory_other_tenants_use_counts_against_the_plan_but_our_own_does_not() -> None:
    snap = with_gpus(fleet(), **{"a1-g0": {"mem_used_bytes": 40 * 10**9}})
    plan = tp_plan(M8, ["a1-g0"], kv_tokens=200_000)  # 16 GB weights + 26 GB KV
    assert validate_plan(plan, snap, M8)
    assert validate_plan(plan, snap, M8, reclaimable_bytes={"a1-g0": 40 * 10**9}) == []


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        ([(0, 40), (41, 80)], "starts at layer 41, expected 40"),
        ([(0, 40), (30, 80)], "starts at layer 30, expected 40"),
        ([(0, 40)], "layers cover [0, 40), the model has 80"),
    ],
)
def test_layers_must_cover_the_model_exactly_once(stages: list[tuple[int, int]], message: str) -> None:
    plan = Plan(
        M70.name,
        "colocated",
        tuple(Stage(a, b, tuple(f"{n}-g{i}" for i in range(4))) for (a, b), n in zip(stages, ["a1", "a2"], strict=False)),
        kv_reserve_tokens=1000,
    )
    assert any(message in r for r in validate_plan(plan, fleet(), M70))


def test_it_rejects_unhealthy_and_missing_gpus_with_the_reason() -> None:
    snap = with_gpus(fleet(), **{"a1-g1": {"healthy": False}})
    reasons = validate_plan(tp_plan(M8, ["a1-g0", "a1-g1"]), snap, M8)
    assert any("a1-g1 cannot be used (unhealthy)" in r for r in reasons)
    assert any("not in the snapshot" in r for r in validate_plan(tp_plan(M8, ["zz"]), snap, M8))


def test_it_rejects_a_gpu_used_twice_and_a_tp_that_does_not_shard_the_heads() -> None:
    reasons = validate_plan(tp_plan(M8, ["a1-g0", "a1-g0"]), fleet(), M8)
    assert any("used twice" in r for r in reasons)
    reasons = validate_plan(tp_plan(M8, ["a1-g0", "a1-g1", "a1-g2"]), fleet(), M8)
    assert any("must divide num_heads" in r for r in reasons)


def test_a_gear_rejects_plans_that_share_gpus_and_weights_that_do_not_sum_to_one() -> None:
    a, b = tp_plan(M8, ["a1-g0"]), tp_plan(M8, ["a1-g0", "a1-g1"])
    reasons = validate_gear(Gear(M8.name, (a, b), (0.5, 0.4)), fleet(), M8)
    assert any("also used by plans[0]" in r for r in reasons)
    assert any("sum to 1" in r for r in reasons)
    assert validate_gear(one_plan_gear(a), fleet(), M8) == []


def test_validation_never_raises_on_nonsense() -> None:
    plan = Plan("other", "disaggregated", (Stage(5, 2, ("zz",)),), kv_reserve_tokens=0)
    reasons = validate_plan(plan, fleet(), M8)
    assert len(reasons) >= 4


def test_a_plan_keeps_its_hash_only_inside_one_process() -> None:
    import pickle

    plan = pd_plan()
    assert {plan: 1}[pd_plan()] == 1  # equal plans are the same key
    hash(plan)
    copy = pickle.loads(pickle.dumps(plan))
    assert "_hash" not in copy.__dict__  # str hashes differ between processes: never pickled
    assert copy == plan and hash(copy) == hash(plan)
