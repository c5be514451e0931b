"""prefilter: model, open (frozen, routable, weight), priority class - each rule alone."""

from __future__ import annotations

from scheduler.router import Pool
from scheduler.router.prefilter import prefilter, why
from tests.scheduler.router.builders import facts, mixed_snapshot, req, router


def test_frozen_unroutable_and_weightless_plans_never_pass_and_say_why() -> None:
    snap = mixed_snapshot()
    pool = Pool([facts("h100", snap, frozen=True), facts("a100", snap, routable=False),
                 facts("l40s", snap, weight=0.0)], model="Qwen2-72B")
    assert not prefilter(req(), pool).any()
    assert [why(req(), pool, i) for i in range(3)] == [
        "frozen by a switch in progress", "not routable (not serving, or its leader has no data address)",
        "routing weight 0"]
    d = router().route(req(), pool, 0.0)
    assert d.order == () and d.reason(0) == "prefilter: frozen by a switch in progress"


def test_a_plan_of_another_model_is_no_candidate() -> None:
    pool = Pool([facts("h100")], model="Llama-3-70B")
    assert not prefilter(req(), pool).any()
    assert why(req(), pool, 0) == "serves Qwen2-72B, not Llama-3-70B"


def test_a_plan_reserved_for_urgent_traffic_refuses_low_priority_requests() -> None:
    snap = mixed_snapshot()
    pool = Pool([facts("h100", snap, priority_max=0), facts("l40s", snap)], model="Qwen2-72B")
    assert prefilter(req(priority=0), pool).tolist() == [True, True]
    assert prefilter(req(priority=-5), pool).tolist() == [True, True]
    assert prefilter(req(priority=3), pool).tolist() == [False, True]
    assert why(req(priority=3), pool, 0) == "takes priority <= 0; the request has 3"
    assert router().route(req(priority=3), pool, 0.0).order == (1,)
