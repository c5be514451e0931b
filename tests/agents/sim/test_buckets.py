"""Issue 16 d2: batching split by prompt length in the simulated engine (scheduler/buckets.py, agents/sim/pipe.py)."""

from __future__ import annotations

import statistics

import pytest

from agents.sim.fleet import FleetSim, SimOptions
from scheduler.buckets import LengthBuckets
from scheduler.plan import Plan
from tests.agents.sim.worlds import one_deployment


def _sim(buckets: LengthBuckets | None, kv_tokens: int | None = None) -> tuple[FleetSim, dict[int, list[float]]]:
    sim = FleetSim(one_deployment(rate_rps=0), options=SimOptions(length_buckets=buckets))
    base = sim.baseline_plan("d")
    plan = base if kv_tokens is None else Plan(base.model, "colocated", base.stages, kv_reserve_tokens=kv_tokens)
    sim.launch("d", plan, source="warm", accepting=True)
    done: dict[int, list[float]] = {}  # request id -> (ttft, preemptions) for each time it finished
    finished = sim.finished

    def hook(req, t):  # type: ignore[no-untyped-def]
        done.setdefault(req.rid, []).append(req.first_token_s - req.arrival_s)
        done[req.rid].append(req.preemptions)
        return finished(req, t)

    sim.finished = hook  # type: ignore[method-assign]
    return sim, done


def _short_ttft(buckets: LengthBuckets | None) -> tuple[float, float]:
    sim, done = _sim(buckets)
    long_rid = sim.submit("d", 30_000, 16)
    sim.advance_to(0.01)
    shorts = [sim.submit("d", 200, 16) for _ in range(8)]
    sim.run_to_completion()
    return statistics.fmean(done[r][0] for r in shorts), done[long_rid][0]


def test_short_prompts_are_not_held_behind_a_long_prefill() -> None:
    fcfs_short, fcfs_long = _short_ttft(None)
    split_short, split_long = _short_ttft(LengthBuckets())
    assert split_short < fcfs_short / 4  # the 200-token prompts no longer wait out a 30K-token prefill
    assert split_long < fcfs_long * 1.5  # and the long prompt pays little for it


def _behind_a_queue(buckets: LengthBuckets | None) -> float:
    sim, done = _sim(buckets)
    for _ in range(12):  # 60K prompt tokens waiting: many rounds of prefill
        sim.submit("d", 5_000, 16)
    sim.advance_to(0.01)
    short = sim.submit("d", 200, 16)
    sim.run_to_completion()
    return done[short][0]


def test_a_short_prompt_is_admitted_before_a_queue_of_longer_ones() -> None:
    # buckets order the waiting queue too, not only the round: the short prompt that came last does
    # not wait for the twelve 5K-token prompts queued before it
    assert _behind_a_queue(LengthBuckets()) < _behind_a_queue(None) / 4


def test_a_round_of_one_bucket_is_not_split() -> None:
    b = LengthBuckets()
    assert not b.split(200, 1500) and not b.split(3000, 20000) and b.split(200, 30_000)
    assert not b.split(1900, 2100)  # neighbours across an edge: spread under the ratio
    assert [b.of(n) for n in (1, 2047, 2048, 32767, 32768, 10**6)] == [0, 0, 1, 1, 2, 2]


def test_when_kv_runs_out_the_long_prompt_is_preempted_and_finishes_later_exactly_once() -> None:
    sim, done = _sim(LengthBuckets(), kv_tokens=12_000)
    long_rid = sim.submit("d", 9_000, 400)
    sim.advance_to(0.5)  # its prefill is done: it decodes, and its KV grows
    shorts = [sim.submit("d", 500, 600) for _ in range(5)]
    sim.run_to_completion()
    assert not sim.recorder.failed
    assert sorted(done) == sorted([long_rid, *shorts])
    assert all(len(v) == 2 for v in done.values())  # each finished exactly once
    assert done[long_rid][1] >= 1 and all(done[r][1] == 0 for r in shorts)


@pytest.mark.parametrize("kw,field", [({"edges": (32768, 2048)}, "edges"), ({"shares": (1.0, 0.5)}, "shares"),
                                      ({"split_ratio": 0.5}, "split_ratio")])
def test_a_bad_config_names_the_field(kw: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        LengthBuckets(**kw)  # type: ignore[arg-type]
