"""jitter: a plan whose TTFTs spread far beyond prediction is demoted to the retry pool and comes
back when its window is healthy; a plan merely mispredicted is not demoted."""

from __future__ import annotations

import random

from scheduler.router import Pool
from scheduler.router.jitter import JitterConfig, JitterTracker
from tests.scheduler.router.builders import copies, facts, idle, req, router


def feed(tracker: JitterTracker, plan_id: str, t0: float, n: int, *, spread: bool, bias: float = 1.0,
         seed: int = 0) -> float:
    """n first tokens on `plan_id` from t0, one a second; `spread`: one in ten is eight times late."""
    rng = random.Random(seed)
    t = t0
    for i in range(n):
        late = 8.0 if spread and i % 10 == 3 else 1.0
        tracker.observe(plan_id, t, bias * late * rng.uniform(0.9, 1.1), 1.0)
        t += 1.0
    return t


def test_a_jittery_plan_is_demoted_and_comes_back() -> None:
    pool = idle(Pool(copies(facts("h100"), 3), model="Qwen2-72B"))
    r = router()
    a, b, c = pool.ids
    end = 0.0
    for pid, jittery in ((a, False), (b, True), (c, False)):
        end = max(end, feed(r.jitter, pid, 0.0, 60, spread=jittery, seed=len(pid)))
    assert r.jitter.demoted(end) == {b}
    z = r.jitter.zscores(end)
    assert z[b] > 3.0 and abs(z[a]) < 1.5
    d = r.route(req(2000), pool, end)
    assert d.demoted is not None and d.demoted.tolist() == [False, True, False]
    assert d.order[-1] == 1 and set(d.order[:2]) == {0, 2}  # tried last: the retry pool
    assert d.explain()["plans"][1]["demoted"] is True
    # it is healthy again: once its bad window has passed (5 minutes), it takes traffic again
    later = end + 310.0
    for pid in (a, b, c):
        feed(r.jitter, pid, later, 40, spread=False, seed=7)
    assert r.jitter.demoted(later + 40) == frozenset()
    assert r.route(req(2000), pool, later + 40).demoted is None


def test_a_plan_that_is_consistently_slower_than_predicted_is_not_demoted() -> None:
    t = JitterTracker()
    feed(t, "ok", 0.0, 60, spread=False)
    end = feed(t, "shared-gpus", 0.0, 60, spread=False, bias=2.0)  # e.g. time-sliced during a switch
    assert t.demoted(end) == frozenset()


def test_demotion_needs_evidence_and_company() -> None:
    t = JitterTracker(JitterConfig(min_samples=20))
    end = feed(t, "alone", 0.0, 100, spread=True)
    assert t.demoted(end) == frozenset()  # one plan: nothing to compare with
    feed(t, "other", 0.0, 10, spread=False)
    assert t.demoted(end) == frozenset()  # the other has too few samples to say what normal is


def test_a_demoted_plan_takes_the_overflow_when_the_healthy_ones_are_far_slower() -> None:
    from scheduler.router import PlanLoad

    pool = Pool(copies(facts("h100"), 2), model="Qwen2-72B")
    r = router()
    end = max(feed(r.jitter, pool.ids[0], 0.0, 60, spread=False), feed(r.jitter, pool.ids[1], 0.0, 60, spread=True))
    assert r.jitter.demoted(end) == {pool.ids[1]}
    pool.set_loads([PlanLoad(running=8, waiting=20, queued_tokens=400_000), PlanLoad()])
    d = r.route(req(2000), pool, end)
    assert d.chosen == 1  # even priced by its tail, the idle jittery plan beats a long queue
