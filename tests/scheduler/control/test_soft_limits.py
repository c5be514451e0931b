"""The control loop's soft limits (scheduler/control/loop.py rule 14; seed 004 section 3.2): over the
pool's soft limit a heavy model's deployment decides after the lighter ones of its priority, so the
light ones' scale-outs get the free GPUs first. Pure: the loop stepped by hand, no database.

The pool: a1 (8 H100) held by a Llama-3-70B deployment, a2-g0 by a Llama-3-8B one, a2-g1 and a2-g2
free, the rest of a2 another tenant's (not the pool's). Both deployments ask for more capacity (TWU
given, `twu`); the two free GPUs are what they compete for.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduler.control import ControlLoop, ControlOutput, DeploymentState, FleetState, LoopConfig
from scheduler.gearbox import Deployment, Mode, Outcome
from scheduler.modelspec import model_spec
from scheduler.pool.autoscale import DEFAULT_SCALE
from scheduler.topology import Snapshot
from tests.scheduler.builders import CHAT_SLO, NodeSpec, make_fleet, one_plan_gear, tp_plan
from tests.scheduler.control.test_loop import window
from tests.scheduler.control.test_twu_rule import twu

NOW = 1000.0
M70, M8 = model_spec("Llama-3-70B"), model_spec("Llama-3-8B")
WEIGHTS = {"Llama-3-70B": 8.7, "Llama-3-8B": 2.3}  # the seed's Qwen2-72B weight stands for the 70B here
FREE = {"a2-g1", "a2-g2"}


def pool() -> Snapshot:
    snap = make_fleet([NodeSpec("a1"), NodeSpec("a2")])
    tenant = {f"a2-g{i}" for i in range(3, 8)}
    return replace(snap, gpus=tuple(replace(g, schedulable=False) if g.uuid in tenant else g for g in snap.gpus))


def dep(name: str, model: str, gpus: list[str], *, rate: float, index: int, load: float,
        priority: int = 10) -> DeploymentState:
    spec = model_spec(model)
    gear = one_plan_gear(tp_plan(model, gpus, kv_tokens=100_000 if spec is M70 else 20_000))
    d = Deployment(id=name, model=model, slo=CHAT_SLO, baseline=gear, priority=priority, mode=Mode.AUTO)
    return DeploymentState(deployment=d, current=gear, load=window(rate, NOW), model=spec, index=index,
                           twu=twu(load, load))


def both(load: float = 1.1, *, light_priority: int = 10) -> tuple[DeploymentState, DeploymentState]:
    # the heavy one comes first in file order (index 0): without soft limits it decides first
    heavy = dep("big", M70.name, [f"a1-g{i}" for i in range(8)], rate=30.0, index=0, load=load)
    light = dep("small", M8.name, ["a2-g0"], rate=120.0, index=1, load=load, priority=light_priority)
    return heavy, light


def step(*states: DeploymentState, weights: dict[str, float] | None = None) -> ControlOutput:
    loop = ControlLoop(LoopConfig(max_models_per_gpu=1, model_weights=WEIGHTS if weights is None else weights))
    held = {s.deployment.id: frozenset(s.current.gpu_uuids) for s in states if s.current is not None}
    loop.observe(states, FleetState(snapshot=pool(), held=held))
    return loop.step(NOW)


def took_free(out: ControlOutput, name: str) -> bool:
    start = out.by_id()[name].start
    return start is not None and bool(FREE & set(start.target.gpu_uuids))


def soft_reason(out: ControlOutput, name: str) -> str | None:
    d = out.by_id()[name].decision
    assert d is not None
    return next((r for r in d.reasons if "over the soft limit" in r), None)


def test_over_the_soft_limit_the_light_model_decides_first_and_gets_the_free_gpus() -> None:
    out = step(*both())
    # the pool's TWU: 9 of its 11 GPUs at 1.1, two free ones at 0
    assert out.pool_twu == pytest.approx(1.1 * 9 / 11)
    assert out.pool_twu > DEFAULT_SCALE.soft_limit_twu and out.shares is not None
    assert out.shares.factors["Llama-3-70B"] < out.shares.factors["Llama-3-8B"] < 1.0
    assert [s.deployment_id for s in out.steps] == ["small", "big"]
    assert took_free(out, "small") and not took_free(out, "big")
    # nothing is refused: the heavy one still decides, on what is left, and says why it came second
    big = out.by_id()["big"].decision
    assert big is not None and big.outcome is Outcome.SWITCH
    why = soft_reason(out, "big")
    assert why is not None and "decided after lighter small" in why and "x 0.80" in why
    assert soft_reason(out, "small") is None


def test_without_weights_the_same_pool_decides_in_file_order_and_the_heavy_one_takes_them() -> None:
    out = step(*both(), weights={})
    assert out.pool_twu is None and out.shares is None
    assert [s.deployment_id for s in out.steps] == ["big", "small"]
    assert took_free(out, "big") and not took_free(out, "small")
    assert soft_reason(out, "big") is None


def test_at_or_under_the_soft_limit_the_order_is_priority_then_file_order() -> None:
    out = step(*both(load=0.95))  # 0.95 x 9 / 11 = 0.78: busy deployments, a pool under 0.8
    assert out.pool_twu is not None and out.pool_twu < DEFAULT_SCALE.soft_limit_twu
    assert out.shares is not None and set(out.shares.factors.values()) == {1.0}
    assert [s.deployment_id for s in out.steps] == ["big", "small"]
    assert soft_reason(out, "big") is None


def test_equal_weights_change_no_order_and_priority_comes_before_weight() -> None:
    same = step(*both(), weights={"Llama-3-70B": 2.0, "Llama-3-8B": 2.0})
    assert [s.deployment_id for s in same.steps] == ["big", "small"]
    # a lighter model of a lower priority does not jump a heavier one of a higher priority
    lower = step(*both(light_priority=1))
    assert [s.deployment_id for s in lower.steps] == ["big", "small"]
    assert soft_reason(lower, "big") is None


def test_a_model_without_a_weight_weighs_one_and_bad_weights_are_refused_naming_the_model() -> None:
    out = step(*both(), weights={"Llama-3-70B": 8.7})  # the 8B unnamed: 1.0, lighter still
    assert [s.deployment_id for s in out.steps] == ["small", "big"]
    for bad in (0.0, -1.0, float("nan"), True):
        with pytest.raises(ValueError, match="model_weights.Llama-3-8B: must be a finite number > 0"):
            LoopConfig(model_weights={"Llama-3-8B": bad})
