"""pick: weighted sum, deadline first, ties to the least loaded, then to the seeded generator;
the top-K, then the retry pool."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np

from scheduler.router.pick import pick


def arr(*v: float) -> np.ndarray:
    return np.array(v, dtype=np.float64)


def yes(n: int) -> np.ndarray:
    return np.ones(n, dtype=np.bool_)


def test_the_highest_total_first_and_at_most_top_k() -> None:
    order = pick(arr(10, 50, 30, 40), yes(4), None, None, arr(1, 1, 1, 1), 3, random.Random(0))
    assert order == (1, 3, 2)


def test_ties_go_to_the_least_loaded_then_to_the_generator_evenly() -> None:
    assert pick(arr(50, 50, 10), yes(3), None, None, arr(3, 2, 1), 3, random.Random(0))[0] == 1
    firsts = Counter(pick(arr(50, 50, 50), yes(3), None, None, arr(1, 1, 1), 3, random.Random(s))[0]
                     for s in range(300))
    assert set(firsts) == {0, 1, 2} and min(firsts.values()) > 60
    assert pick(arr(50, 50), yes(2), None, None, arr(1, 1), 2, random.Random(5)) == \
        pick(arr(50, 50), yes(2), None, None, arr(1, 1), 2, random.Random(5))


def test_plans_predicted_to_miss_the_deadline_come_after_those_that_meet_it() -> None:
    ok = np.array([False, True, True])
    assert pick(arr(90, 40, 50), yes(3), None, ok, arr(1, 1, 1), 3, random.Random(0)) == (2, 1, 0)


def test_demoted_plans_are_tried_after_the_top_k_of_the_others() -> None:
    demoted = np.array([True, False, False, False])
    order = pick(arr(90, 40, 50, 30), yes(4), demoted, None, arr(1, 1, 1, 1), 2, random.Random(0))
    assert order == (0, 2)  # 0 beats every healthy plan even so priced: it takes the overflow
    order = pick(arr(20, 40, 50, 30), yes(4), demoted, None, arr(1, 1, 1, 1), 2, random.Random(0))
    assert order == (2, 1, 0)
    all_demoted = pick(arr(20, 40), yes(2), np.array([True, True]), None, arr(1, 1), 2, random.Random(0))
    assert all_demoted == (1, 0)  # every candidate demoted: all primary, by score
