"""The gateway's side of the router: the routing table and the fleet's rows as the router's pool,
engine reports and this process's book as load, decisions sampled for the deployment page."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.utils import timezone

from console.fleet.models import Gpu, Node
from console.gateway import decisions, routing
from scheduler.costmodel import max_kv_tokens
from scheduler.hardware import CATALOG
from scheduler.modelspec import model_spec
from scheduler.plan import Plan, Stage
from tests.console.gateway.world import make_deployment, make_node

pytestmark = pytest.mark.django_db
MODEL = model_spec("Qwen2-72B")


@pytest.fixture(autouse=True)
def _fresh(settings: Any) -> Iterator[None]:
    settings.FLEXPIPE_ROUTER_SEED = 11
    settings.FLEXPIPE_ROUTER_SAMPLE_S = 0.0
    settings.FLEXPIPE_ROUTER_REPORT_TTL_S = 0.0
    settings.FLEXPIPE_ROUTER_FLEET_TTL_S = 0.0
    routing.reset()
    yield
    routing.reset()


def gpu_node(node_id: str, model: str, *, nvlink: bool = True) -> Node:
    node = make_node(node_id, f"127.0.0.1:{7000 + len(node_id)}")
    spec = CATALOG[model]
    for i in range(8):
        Gpu.objects.create(node=node, uuid=f"{node_id}-g{i}", index=i, model=model, mem_total_bytes=spec.mem_bytes,
                           nvlink_group="0" if nvlink else "", mem_used_bytes=600 * 2**20, updated_at=timezone.now())
    Node.objects.filter(pk=node.pk).update(last_seen_at=timezone.now())
    return node


def tp4(node_id: str) -> dict[str, Any]:
    from console.gearbox.snapshot import fleet_snapshot

    stages = (Stage(0, MODEL.num_layers, tuple(f"{node_id}-g{i}" for i in range(4))),)
    plan = Plan(MODEL.name, "colocated", stages, kv_reserve_tokens=max_kv_tokens(stages, MODEL,
                                                                                 fleet_snapshot(timezone.now())))
    return plan.to_dict()


def route(plan: dict[str, Any], node: str, **kw: Any) -> dict[str, Any]:
    return {"plan_id": Plan.from_dict(plan).plan_id, "plan": plan, "weight": 1.0, "frozen": False, "nodes": [node],
            **kw}


def order(routes: list[dict[str, Any]], prompt: int, *, outstanding: dict[str, int] | None = None,
          **kw: Any) -> routing.Routed:
    return async_to_sync(routing.order)("chat", MODEL.name, 1, routes, list(range(prompt)), 64,
                                        outstanding=outstanding or {}, **kw)


def test_a_30k_token_prompt_goes_to_the_h100_plan_by_the_fleets_own_rows() -> None:
    gpu_node("h1", "H100-SXM")
    gpu_node("l1", "L40S", nvlink=False)
    h, low = route(tp4("h1"), "h1"), route(tp4("l1"), "l1")
    make_deployment("chat", [low, h])
    routed = order([low, h], 30_000)
    assert [c.plan_id for c in routed.candidates] == [h["plan_id"], low["plan_id"]]
    plans = routed.decision.explain()["plans"]
    assert plans[1]["gpu"] == "4x H100-SXM" and plans[1]["rank"] == 1


def test_frozen_weightless_and_leaderless_routes_are_never_tried_and_the_decision_says_why() -> None:
    gpu_node("h1", "H100-SXM")
    plan = tp4("h1")
    ok = route(plan, "h1")
    other = Plan.from_dict(plan)
    others = [{**ok, "plan_id": f"{other.plan_id}-{k}"} for k in range(3)]
    routes = [{**others[0], "frozen": True}, {**others[1], "weight": 0.0}, {**others[2], "nodes": []}, ok]
    routed = order(routes, 100)
    assert [c.plan_id for c in routed.candidates] == [ok["plan_id"]]
    reasons = [p.get("filtered") for p in routed.decision.explain()["plans"]]
    assert reasons[:3] == ["prefilter: frozen by a switch in progress", "prefilter: routing weight 0",
                           "prefilter: not routable (not serving, or its leader has no data address)"]


def test_a_plan_whose_engine_reported_its_kv_full_is_tried_after_one_with_room() -> None:
    gpu_node("h1", "H100-SXM")
    gpu_node("h2", "H100-SXM")
    a, b = route(tp4("h1"), "h1"), route(tp4("h2"), "h2")
    Node.objects.filter(node_id="h1").update(engines=[{"plan_id": a["plan_id"], "running": 3, "waiting": 0,
                                                        "tokens_per_s": 1.0, "kv_usage": 1.0}])
    routed = order([a, b], 2000)
    assert [c.plan_id for c in routed.candidates] == [b["plan_id"]]
    assert "last report" in routed.decision.explain()["plans"][0]["filtered"]


def test_plans_the_fleet_cannot_describe_are_routed_by_load_alone() -> None:
    make_node("x1", "127.0.0.1:9")  # no GPU rows: the plan's hardware is unknown
    gpu_node("h1", "H100-SXM")
    plan = tp4("h1")
    unknown = {**route(plan, "x1"), "plan_id": "p-unknown-a"}
    also = {**route(plan, "x1"), "plan_id": "p-unknown-b"}
    Gpu.objects.all().delete()
    routed = order([unknown, also], 500, outstanding={"p-unknown-a": 2})
    assert [c.plan_id for c in routed.candidates] == ["p-unknown-b", "p-unknown-a"]
    assert routed.decision.explain()["plans"][0]["gpu"] == "4x unknown"


def test_the_book_counts_prompts_waiting_for_their_first_token_as_queued_work() -> None:
    gpu_node("h1", "H100-SXM")
    a = route(tp4("h1"), "h1")
    first = order([a], 8000)
    routing.admitted(first, first.candidates[0], "seq-1")
    second = order([a], 100, outstanding={a["plan_id"]: 1})
    assert second.decision.explain()["plans"][0]["load"]["queued_tokens"] == 8000
    routing.first_token("seq-1")
    third = order([a], 100, outstanding={a["plan_id"]: 1})
    assert third.decision.explain()["plans"][0]["load"]["queued_tokens"] == 0
    routing.done("seq-1")
    routing.admitted(third, third.candidates[0], "seq-2")  # one that fails before its first token
    routing.done("seq-2")
    assert order([a], 100).decision.explain()["plans"][0]["load"]["queued_tokens"] == 0


def test_a_priority_and_a_deadline_reach_the_router_and_a_sample_reaches_the_deployment_page() -> None:
    gpu_node("h1", "H100-SXM")
    a = route(tp4("h1"), "h1")
    routed = order([a], 700, priority=7, deadline_ms=2500.0)
    routing.admitted(routed, routed.candidates[0], "seq-9")
    req = routed.decision.explain()["request"]
    assert (req["priority"], req["deadline_ms"], req["prompt_blocks"]) == (7, 2500.0, 1)
    decisions.record("chat", {**routed.decision.explain(), "taken_by": a["plan_id"]})  # (as the sampler's thread)
    kept = decisions.recent("chat")
    assert kept and kept[0]["taken_by"] == a["plan_id"] and kept[0]["request"]["priority"] == 7


def test_the_global_correction_s_live_multiplier_scales_a_route_s_weight_until_its_ttl() -> None:
    from datetime import timedelta

    from console.fleet.hints import do_send_hints
    from console.fleet.models import AgentCommand

    gpu_node("h1", "H100-SXM")
    gpu_node("h2", "H100-SXM")
    a, b = route(tp4("h1"), "h1"), route(tp4("h2"), "h2")
    make_deployment("chat", [a, b])

    def hint(plan: dict[str, Any], mult: float) -> dict[str, Any]:
        return {"plan_id": plan["plan_id"], "direction": "hold", "weight_multiplier": mult, "batch_scale": 1.0}

    busy = {a["plan_id"]: 2, b["plan_id"]: 2}  # the same load on both: the weights decide
    do_send_hints("chat", 1, 5.0, {"h1": [hint(a, 0.5)], "h2": [hint(b, 2.0)]}, now=timezone.now())
    assert [c.plan_id for c in order([a, b], 500, outstanding=busy).candidates][0] == b["plan_id"]
    do_send_hints("chat", 2, 5.0, {"h1": [hint(a, 2.0)], "h2": [hint(b, 0.5)]}, now=timezone.now())
    assert [c.plan_id for c in order([a, b], 500, outstanding=busy).candidates][0] == a["plan_id"]
    assert routing._hinted("chat") == {a["plan_id"]: 2.0, b["plan_id"]: 0.5}
    AgentCommand.objects.update(created_at=timezone.now() - timedelta(seconds=6))  # past the ttl: lapsed
    assert routing._hinted("chat") == {}
    assert routing._hinted("other") == {}
