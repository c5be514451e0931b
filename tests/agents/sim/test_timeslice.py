"""Plans that share a GPU time-slice it (PlanEngine.update_share): a round is slowed by the plans
busy beside it, not by every plan that holds memory there. Stepped in simulated time."""

from __future__ import annotations

import pytest

from agents.sim.engine import ALWAYS_BUSY, BUSY_WINDOW_S, PlanEngine
from agents.sim.fleet import FleetSim
from tests.agents.sim.worlds import one_deployment
from tests.scheduler.builders import tp_plan


class Busy:
    def __init__(self, fraction: float) -> None:
        self.fraction = fraction

    def busy_fraction(self, t: float) -> float:
        return self.fraction


def two_plans_on_one_gpu() -> tuple[FleetSim, PlanEngine, PlanEngine]:
    sim = FleetSim(one_deployment(rate_rps=0))
    u = sim.cluster.gpu_uuid("a1", 0)
    a = sim.launch("d", tp_plan("Llama-3-8B", [u], kv_tokens=16_384), source="warm", accepting=False)
    b = sim.launch("d", tp_plan("Llama-3-8B", [u], kv_tokens=32_768), source="warm", accepting=False)
    return sim, a, b


def ttft_on(sim: FleetSim, engine: PlanEngine, prompt: int = 3000) -> float:
    engine.accepting = True
    req = sim.submit_to("d", engine.plan.plan_id, prompt, 1)
    engine.accepting = False
    assert req is not None
    start = sim.now_s
    sim.advance_to(start + 60)
    assert req.first_token_s is not None
    return req.first_token_s - start


def test_a_plan_beside_an_idle_one_runs_at_full_speed_and_beside_a_busy_one_at_half() -> None:
    sim, a, b = two_plans_on_one_gpu()
    assert a.co_tenants == ((b,),) and b.co_tenants == ((a,),)
    alone = a.profile.pipeline("prefill").prefill_time_s(3000)
    assert ttft_on(sim, a) == pytest.approx(alone, rel=1e-6)  # b holds memory there but runs nothing
    # b busy without a pause for longer than its busy window: a's next prefill waits its turn
    b.accepting = True
    for _ in range(40):
        sim.submit_to("d", b.plan.plan_id, 2000, 2000)
    b.accepting = False
    sim.advance_to(sim.now_s + 3 * BUSY_WINDOW_S)
    assert b.busy_fraction(sim.now_s) == pytest.approx(1.0, abs=0.01)
    slowed = ttft_on(sim, a)
    assert slowed == pytest.approx(2 * alone, rel=0.05)


def test_the_slowdown_is_one_plus_the_busy_fractions_on_the_most_contended_gpu() -> None:
    sim, a, _ = two_plans_on_one_gpu()
    a.co_tenants = ((Busy(0.3),), (Busy(0.2), Busy(0.4)))
    a.update_share(sim.now_s)
    assert a.share == pytest.approx(1.6)
    a.co_tenants = ((ALWAYS_BUSY,),)  # a fine-tune job's loop never pauses
    a.update_share(sim.now_s)
    assert a.share == 2.0


def test_a_plan_left_alone_gets_its_gpu_back() -> None:
    sim, a, b = two_plans_on_one_gpu()
    a.share = 2.0
    sim._release(b, sim.now_s)
    assert a.co_tenants == () and a.share == 1.0
