"""The simulated engine's prefix cache and priority queue, and the router in FleetSim: a cached
prefix skips its prefill, bounded by the plan's KV; urgent requests are admitted first and low
priority ones preempted first; requests sharing a prefix follow it to its plan."""

from __future__ import annotations

import pytest

from agents.sim.fleet import FleetSim
from scheduler.plan import Plan
from tests.agents.sim.worlds import one_deployment

BLOCKS = tuple(range(100, 108))  # eight 512-token blocks


def ttfts(sim: FleetSim) -> dict[int, float]:
    """request id -> its TTFT, filled as requests finish (the recorder keeps no ids)."""
    out: dict[int, float] = {}
    finished = sim.finished

    def hook(req, t):  # type: ignore[no-untyped-def]
        out[req.rid] = req.first_token_s - req.arrival_s
        return finished(req, t)

    sim.finished = hook  # type: ignore[method-assign]
    return out


def one_plan(kv_tokens: int | None = None) -> tuple[FleetSim, object]:
    sim = FleetSim(one_deployment(rate_rps=0))
    base = sim.baseline_plan("d")
    plan = base if kv_tokens is None else Plan(base.model, "colocated", base.stages, kv_reserve_tokens=kv_tokens)
    return sim, sim.launch("d", plan, source="warm", accepting=True)


def test_a_cached_prefix_skips_exactly_the_prefill_of_its_blocks() -> None:
    sim, engine = one_plan()
    sim.submit("d", 4096, 8, blocks=BLOCKS)
    sim.advance_to(30)
    sim.submit("d", 4096, 8, blocks=BLOCKS)  # the same prompt again: 7 of its 8 blocks hit
    sim.submit("d", 4096, 8, blocks=tuple(range(200, 208)))  # another prompt: no hit
    sim.advance_to(90)
    ttft = sim.recorder.f_ttft
    pipe = engine.pipes[0]  # type: ignore[attr-defined]
    assert pipe.cache.hit_tokens == 4095  # every block but the last token's: its logits are recomputed
    assert ttft[1] < ttft[0] / 10
    prof = engine.profile.pipeline("prefill")  # type: ignore[attr-defined]
    assert ttft[0] == pytest.approx(prof.prefill_time_s(4096), rel=1e-9)
    assert ttft[1] == pytest.approx(prof.latency_interval(1, 1, 4095)[0], rel=1e-6)


def test_the_cache_holds_no_more_blocks_than_the_plans_kv_reserve() -> None:
    sim, engine = one_plan(kv_tokens=4 * 512)
    pipe = engine.pipes[0]  # type: ignore[attr-defined]
    assert pipe.cache.capacity_blocks == 4
    sim.submit("d", 3 * 512, 4, blocks=(1, 2, 3))
    sim.advance_to(10)
    sim.submit("d", 3 * 512, 4, blocks=(7, 8, 9))
    sim.advance_to(20)
    assert len(pipe.cache) == 4
    assert 1 in pipe.cache and 2 not in pipe.cache  # the first prompt's head stayed, its tail went
    sim.submit("d", 3 * 512, 4, blocks=(1, 2, 3))
    sim.advance_to(30)
    assert pipe.cache.hit_tokens == 512


def test_an_urgent_request_is_admitted_before_earlier_ones_and_low_priority_ones_after() -> None:
    sim, engine = one_plan(kv_tokens=5000)  # room for one 4000-token prompt at a time
    got = ttfts(sim)
    first = sim.submit("d", 4000, 200)
    low = sim.submit("d", 4000, 5, priority=5)
    normal = sim.submit("d", 4000, 5)
    urgent = sim.submit("d", 4000, 5, priority=-3)
    sim.run_to_completion()
    assert len(got) == 4 and not sim.recorder.failed
    assert got[first] < got[urgent] < got[normal] < got[low]  # the first was running already


def test_within_a_class_the_earliest_deadline_is_admitted_first() -> None:
    sim, _ = one_plan(kv_tokens=5000)
    got = ttfts(sim)
    sim.submit("d", 4000, 100)
    late = sim.submit("d", 4000, 5, deadline_s=60.0)
    soon = sim.submit("d", 4000, 5, deadline_s=5.0)
    none = sim.submit("d", 4000, 5)
    sim.run_to_completion()
    assert got[soon] < got[late] < got[none]


def test_bad_priority_and_deadline_are_refused_naming_the_field() -> None:
    sim, _ = one_plan()
    with pytest.raises(ValueError, match="priority: must be in"):
        sim.submit("d", 10, 10, priority=5000)
    with pytest.raises(ValueError, match="deadline_s: must be > 0"):
        sim.submit("d", 10, 10, deadline_s=0.0)


def test_the_router_sends_requests_that_share_a_prefix_to_the_plan_that_holds_it() -> None:
    sim = FleetSim(one_deployment(rate_rps=0))
    base = sim.baseline_plan("d")
    other = Plan(base.model, "colocated", (type(base.stages[0])(0, base.stages[0].layer_end,
                                                                 (sim.cluster.gpu_uuid("a1", 5),)),),
                 kv_reserve_tokens=base.kv_reserve_tokens)
    a = sim.launch("d", base, source="warm", accepting=True)
    b = sim.launch("d", other, source="warm", accepting=True)
    for k in range(6):
        sim.submit("d", 4096 + 512 * k, 4, blocks=tuple(range(8 + k)))  # one conversation, turn by turn
        sim.advance_to(10.0 * (k + 1))
    hits = {e.plan.plan_id: e.pipes[0].cache.hit_tokens for e in (a, b)}
    assert sorted(hits.values())[0] == 0 and sorted(hits.values())[1] >= 5 * 4095


def test_when_kv_runs_out_the_low_priority_sequence_is_preempted_not_the_newest() -> None:
    sim, _ = one_plan(kv_tokens=3000)
    preempted: dict[int, int] = {}
    finished = sim.finished

    def hook(req, t):  # type: ignore[no-untyped-def]
        preempted[req.rid] = req.preemptions
        return finished(req, t)

    sim.finished = hook  # type: ignore[method-assign]
    low = sim.submit("d", 1000, 900, priority=1)
    sim.advance_to(1.0)  # admitted and decoding
    normal = sim.submit("d", 1000, 900)  # admitted after it: plain last-admitted would pick this one
    sim.run_to_completion()
    assert preempted[low] >= 1 and preempted[normal] == 0
