"""A FlexPipe deployment that loses its only GPU comes back when the GPU does, and nothing it
admitted is lost - whether another GPU is free to move to (it moves at once) or not (its
requests wait in its queue, and the baseline comes up again when the GPU returns)."""

from __future__ import annotations

from typing import Any

import pytest

from agents.sim.run import run_policy
from agents.sim.scenario import Scenario
from tests.agents.sim.worlds import one_deployment

LOSS_S, BACK_S = 100.0, 300.0  # the other tenant takes a1's GPU at 100 s and gives it back at 300 s
A1 = {"id": "a1", "gpu": "H100-SXM", "gpus": 1, "nvlink": True, "rack": "A"}
A2 = {"id": "a2", "gpu": "H100-SXM", "gpus": 4, "nvlink": True, "rack": "A"}


def lose_only_gpu(*, spare: bool) -> Scenario:
    return one_deployment(seed=5, duration_s=900, prompt={"dist": "fixed", "value": 256},
                          output={"dist": "fixed", "value": 64}, nodes=[A1, A2] if spare else [A1],
                          events=[{"at_s": LOSS_S, "kind": "preempt", "node": "a1", "gpus": 1,
                                   "duration_s": BACK_S - LOSS_S}])


def assert_nothing_lost(r: dict[str, Any]) -> None:
    assert r["lost"] == 0, r["failures"]
    assert r["admitted"] == r["finished"] > 0
    assert r["sequence_violations"] == []  # invariants 1-2 over every request's life
    assert r["transition_invariant_violations"] == []
    assert r["memory_violations"] == []


def test_with_no_other_gpu_the_deployment_waits_then_comes_back_when_its_gpu_returns() -> None:
    r = run_policy(lose_only_gpu(spare=False), "flexpipe")
    assert_nothing_lost(r)
    shapes = [(t, shape) for t, dep, shape, _ in r["gear_timeline"] if dep == "d"]
    assert shapes[0] == (0.0, "TP1") and (LOSS_S, "none") in shapes
    assert shapes[-1][1] == "TP1" and shapes[-1][0] >= BACK_S  # serving again, after the GPU came back
    back = [d for d in r["decisions"] if d["outcome"] == "switch"]
    assert [(d["trigger"], d["target"]) for d in back] == [("topology", "TP1")]
    assert back[0]["t_s"] >= BACK_S
    before = [d for d in r["decisions"] if d["t_s"] < BACK_S]
    assert before and all(d["outcome"] == "blocked" for d in before)  # nothing to move to meanwhile
    wait = r["event_to_serving_s"][0]
    assert wait is not None and BACK_S - LOSS_S <= wait < BACK_S - LOSS_S + 30


@pytest.mark.parametrize("spare", [True, False], ids=["another-gpu-free", "no-other-gpu"])
def test_requests_admitted_while_nothing_serves_all_finish(spare: bool) -> None:
    r = run_policy(lose_only_gpu(spare=spare), "flexpipe")
    assert_nothing_lost(r)
    if spare:  # it moved to a2 at once: served again within seconds of the loss
        wait = r["event_to_serving_s"][0]
        assert wait is not None and wait < 10
        assert [d["outcome"] for d in r["decisions"]][:1] == ["switch"]
