from __future__ import annotations

import copy
import random
import statistics

import pytest

from agents.sim.scenario import parse_scenario
from agents.sim.scenario_load import DistSpec
from agents.sim.workload import build_workload, sample_tokens
from scheduler.modelspec import model_spec
from tests.agents.sim.worlds import LIVELY, lively, one_deployment


def test_the_same_seed_draws_the_same_requests_and_another_seed_does_not() -> None:
    a, b = build_workload(lively()), build_workload(lively())
    assert a == b
    assert build_workload(lively(seed=6)).arrivals != a.arrivals


def test_arrivals_follow_the_piecewise_rate() -> None:
    s = one_deployment(rate_rps=[[0, 2], [300, 2], [301, 8]], duration_s=900)
    times = [a.t_s for a in build_workload(s).arrivals]
    early = sum(1 for t in times if t < 300)
    late = sum(1 for t in times if 400 <= t < 900)
    # Poisson counts: 600 and 4000 expected; four standard deviations either side
    assert abs(early - 600) < 4 * 600**0.5
    assert abs(late - 4000) < 4 * 4000**0.5
    assert times == sorted(times) and times[-1] < 900


def test_lognormal_lengths_have_the_stated_mean_and_respect_the_clip() -> None:
    rng = random.Random(1)
    d = DistSpec("lognormal", mean=400, sigma=0.6, max=5000)
    xs = [sample_tokens(d, rng) for _ in range(20000)]
    assert abs(statistics.fmean(xs) - 400) / 400 < 0.03
    assert min(xs) >= 1 and max(xs) <= 5000
    clipped = [sample_tokens(DistSpec("lognormal", mean=400, sigma=0.6, max=300), rng) for _ in range(2000)]
    assert max(clipped) == 300
    assert {sample_tokens(DistSpec("fixed", value=7), rng) for _ in range(10)} == {7}
    assert {sample_tokens(DistSpec("uniform", min=2, max=4), rng) for _ in range(200)} == {2, 3, 4}


def test_a_deployments_requests_do_not_change_when_another_deployment_is_added() -> None:
    base = copy.deepcopy(LIVELY)
    only_chat = copy.deepcopy(base)
    only_chat["workload"] = [base["workload"][0]]
    with_sum = build_workload(parse_scenario(base)).of("chat")
    assert build_workload(parse_scenario(only_chat)).of("chat") == with_sum


def test_requests_are_cut_to_the_model_context_and_the_cut_is_counted() -> None:
    s = one_deployment(model="Llama-2-7B", prompt={"dist": "fixed", "value": 4000},
                       output={"dist": "fixed", "value": 500}, rate_rps=1.0, duration_s=100)
    w = build_workload(s)
    window = model_spec("Llama-2-7B").max_context_tokens
    assert w.clipped == len(w.arrivals) > 0
    assert all(a.prompt_tokens + a.output_tokens <= window and a.output_tokens >= 1 for a in w.arrivals)


@pytest.mark.parametrize("rate", [0, [[0, 0], [100, 0]]])
def test_a_zero_rate_draws_nothing(rate: object) -> None:
    assert build_workload(one_deployment(rate_rps=rate)).arrivals == ()
