"""order_routes: filter (frozen, weightless, nodeless) -> draw by weight -> ties by fewest outstanding."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

from console.gateway.routing import order_routes


def r(plan_id: str, weight: float, *, frozen: bool = False, nodes: tuple[str, ...] = ("n1",)) -> dict[str, Any]:
    return {"plan_id": plan_id, "weight": weight, "frozen": frozen, "nodes": list(nodes)}


def test_frozen_weightless_and_nodeless_routes_are_never_candidates() -> None:
    routes = [r("frozen", 1, frozen=True), r("zero", 0), r("nowhere", 1, nodes=()), r("ok", 0.2)]
    for seed in range(20):
        assert [c.plan_id for c in order_routes(routes, {}, random.Random(seed))] == ["ok"]
    assert order_routes([r("frozen", 1, frozen=True)], {}, random.Random(0)) == []


def test_draws_follow_the_weights_and_every_other_route_follows_as_a_fallback() -> None:
    routes = [r("big", 0.9, nodes=("a1", "a2")), r("small", 0.1, nodes=("b1",))]
    rng = random.Random(7)
    firsts = Counter(order_routes(routes, {}, rng)[0].plan_id for _ in range(2000))
    assert 0.85 < firsts["big"] / 2000 < 0.95
    order = order_routes(routes, {}, random.Random(1))
    assert sorted(c.plan_id for c in order) == ["big", "small"]
    assert {c.plan_id: c.leader for c in order} == {"big": "a1", "small": "b1"}  # the leader is listed first


def test_between_equal_weights_the_route_with_fewer_outstanding_requests_goes_first() -> None:
    routes = [r("p1", 0.5), r("p2", 0.5)]
    for seed in range(20):
        assert order_routes(routes, {"p1": 3, "p2": 1}, random.Random(seed))[0].plan_id == "p2"
        assert order_routes(routes, {"p2": 4}, random.Random(seed))[0].plan_id == "p1"
