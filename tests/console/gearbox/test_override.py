"""Gear override and baseline: an operator picks a planner candidate or writes the stages; the gear is
checked against invariant 4, run as a transition and pinned (console/gearbox/override.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.test import Client

from console.audit.models import AuditEntry
from console.gearbox import ticks
from console.gearbox.actions import do_sync_deployment
from console.gearbox.models import Decision, Deployment, Transition
from scheduler.plan import Gear
from tests.console.gearbox.harness import M8
from tests.console.gearbox.ops import BASELINE, drive, running_deployment
from tests.console.people import Person

pytestmark = pytest.mark.django_db


def post(client: Client, path: str, body: Any = None) -> Any:
    return client.post(path, json.dumps(body if body is not None else {}), content_type="application/json")


def state() -> tuple[Any, ...]:
    dep = Deployment.objects.values("mode", "pinned_gear", "current_gear", "baseline_gear").get(name="chat")
    return dep, AuditEntry.objects.count(), Transition.objects.count(), Decision.objects.count()


def spec(node: str, gpus: list[int], **plan: Any) -> dict[str, Any]:
    return {"plans": [{"stages": [{"gpus": [f"{node}/{i}" for i in gpus], "tp": len(gpus)}], **plan}]}


def test_the_candidates_come_with_names_and_estimates_and_reading_them_changes_nothing(viewer: Person) -> None:
    running_deployment(moved=False)
    before = state()
    resp = viewer.api().get("/api/v1/deployments/chat/candidates")
    assert resp.status_code == 200
    body = resp.json()
    assert body["current_gear_id"] == BASELINE.gear_id and body["candidates"]
    first = body["candidates"][0]
    assert " on " in first["name"] and "/" in first["name"] and "GPU-" not in first["name"]
    assert first["estimate"]["capacity_rps"] > 0 and first["estimate"]["ttft_p99_s"] > 0
    assert BASELINE.gear_id not in [c["gear_id"] for c in body["candidates"]]  # the running gear is not a choice
    assert state() == before
    assert Client().get("/api/v1/deployments/chat/candidates").status_code == 401
    assert viewer.api().get("/api/v1/deployments/nope/candidates").status_code == 404


def test_an_override_to_a_candidate_runs_as_a_transition_and_holds(operator: Person) -> None:
    world = running_deployment(moved=False)
    api = operator.api()
    chosen = api.get("/api/v1/deployments/chat/candidates").json()["candidates"][-1]
    resp = post(api, "/api/v1/deployments/chat/override", {"gear_id": chosen["gear_id"], "reason": "drill"})
    assert resp.status_code == 201, resp.json()
    t = resp.json()
    assert t["kind"] == "manual" and t["to_gear"]["gear_id"] == chosen["gear_id"] and t["seq"] == 2
    dep = Deployment.objects.get(name="chat")
    assert dep.mode == "pinned" and Gear.from_dict(dep.pinned_gear).gear_id == chosen["gear_id"]
    entry = AuditEntry.objects.get(event_type="gearbox.gear_overridden")
    assert entry.actor == "user:oscar" and entry.transition_seq == 2 and "then pinned" in entry.summary
    drive(world.agents)
    for node in ("a1", "b1"):
        world.reporter.report(node)
    dep = Deployment.objects.get(name="chat")
    assert Gear.from_dict(dep.current_gear).gear_id == chosen["gear_id"]
    for trigger in ("ended", "periodic", "topology"):
        assert ticks.tick(trigger=trigger)["started"] == []  # pinned: the gearbox leaves it there


def test_an_override_to_a_spec_names_gpus_by_node_and_index(operator: Person) -> None:
    world = running_deployment(moved=False)
    resp = post(operator.api(), "/api/v1/deployments/chat/override", {"spec": spec("b1", [2, 3])})
    assert resp.status_code == 201, resp.json()
    target = Transition.objects.get(seq=2).to_gear
    gear = Gear.from_dict(target)
    assert gear.plans[0].gpu_uuids == ("GPU-b1-2", "GPU-b1-3") and gear.plans[0].kv_reserve_tokens > 0
    assert resp.json()["to_gear"]["name"] == "TP2 on b1/2-3"
    drive(world.agents)


@pytest.mark.parametrize("body, field, words", [
    ({}, "gear_id", "exactly one of gear_id"),
    ({"gear_id": "g-0000000000000000", "spec": spec("b1", [0, 1])}, "gear_id", "exactly one"),
    ({"spec": "TP2 please"}, "spec", "must be an object"),
    ({"spec": {"plans": []}}, "spec.plans", "non-empty list"),
    ({"spec": {"plans": [{"stages": [{"gpus": ["b1/0", "b1/1"], "tp": 4}]}]}}, "spec.plans[0].stages[0].tp",
     "must equal the number of GPUs"),
    ({"spec": {"plans": [{"stages": [{"gpus": ["z9/0"]}]}]}}, "spec.plans[0].stages[0].gpus[0]", "no GPU 'z9/0'"),
    ({"spec": {"plans": [{"stages": [{"gpus": ["b1/0"], "colour": "red"}]}]}}, "spec.plans[0].stages[0].colour",
     "unknown field"),
    # invariant 4: TP across two nodes' NVLink domains; the GPUs chat runs on are not free for a second copy
    ({"spec": spec("b1", [0]) | {"plans": [{"stages": [{"gpus": ["a1/7", "b1/0"]}]}]}}, "spec", "breaks invariant 4"),
    ({"spec": spec("b1", [0, 1, 2], kv_reserve_tokens=10**9)}, "spec", "breaks invariant 4"),
    ({"spec": spec("b1", [0, 1]) | {"weights": [0.5]}}, "spec.weights", "sum to 1"),
    ({"gear_id": "g-0000000000000000"}, "gear_id", "not one of the planner's candidates"),
    ({"gear_id": "g-0000000000000000", "reason": "x" * 501}, "reason", ""),
])
def test_a_bad_override_is_refused_naming_the_field_and_changes_nothing(operator: Person, body: dict[str, Any],
                                                                        field: str, words: str) -> None:
    running_deployment(moved=False)
    before = state()
    resp = post(operator.api(), "/api/v1/deployments/chat/override", body)
    assert resp.status_code in (400, 409), resp.json()
    assert field in resp.json(), resp.json()
    assert words in resp.json()[field][0]
    assert state() == before


def test_override_is_for_operators_and_not_while_a_transition_runs_or_an_emergency_holds(
        operator: Person, viewer: Person) -> None:
    world = running_deployment(moved=False)
    chosen = viewer.api().get("/api/v1/deployments/chat/candidates").json()["candidates"][0]["gear_id"]
    assert post(viewer.api(), "/api/v1/deployments/chat/override", {"gear_id": chosen}).status_code == 403
    assert post(Client(), "/api/v1/deployments/chat/override", {"gear_id": chosen}).status_code == 401
    assert post(operator.api(), "/api/v1/deployments/nope/override", {"gear_id": chosen}).status_code == 404
    assert post(operator.api(), "/api/v1/deployments/chat/override", {"gear_id": chosen}).status_code == 201
    busy = post(operator.api(), "/api/v1/deployments/chat/override", {"spec": spec("b1", [6, 7])})
    assert busy.status_code == 409 and "in a transition" in busy.json()["deployment"][0]
    drive(world.agents)
    post(operator.api(), "/api/v1/deployments/chat/emergency", {"reason": "drill"})
    held = post(operator.api(), "/api/v1/deployments/chat/override", {"spec": spec("b1", [6, 7])})
    assert held.status_code == 409 and "release it first" in held.json()["mode"][0]


def test_the_baseline_is_set_to_the_running_gear_or_a_spec_and_the_loader_keeps_it(operator: Person,
                                                                                    viewer: Person) -> None:
    world = running_deployment()  # runs MOVED (b1/4-5), baseline a1/0-1
    api = operator.api()
    assert post(viewer.api(), "/api/v1/deployments/chat/baseline", {"gear_id": "current"}).status_code == 403
    resp = post(api, "/api/v1/deployments/chat/baseline", {"gear_id": "current"})
    assert resp.status_code == 200 and resp.json()["on_baseline"] is True
    entry = AuditEntry.objects.get(event_type="gearbox.baseline_set")
    assert entry.actor == "user:oscar" and "b1/4-5" in entry.summary
    before = state()
    bad = post(api, "/api/v1/deployments/chat/baseline", {"spec": spec("a1", [0, 1, 2], kv_reserve_tokens=10**9)})
    assert bad.status_code == 400 and "breaks invariant 4" in bad.json()["spec"][0]
    assert state() == before
    resp = post(api, "/api/v1/deployments/chat/baseline", {"spec": spec("a1", [2, 3])})
    assert resp.status_code == 200 and resp.json()["baseline_gear"]["name"] == "TP2 on a1/2-3"
    assert Transition.objects.count() == 2  # setting a baseline switches nothing
    # the scenario loader runs again (the next make run): the operator's baseline stays
    _, what = do_sync_deployment(name="chat", model_name=M8.name, ttft_ms=2000, tpot_ms=100, priority=0,
                                 baseline=BASELINE, actor="system:scenario")
    assert what == "unchanged"
    assert Gear.from_dict(Deployment.objects.get(name="chat").baseline_gear).plans[0].gpu_uuids == (
        "GPU-a1-2", "GPU-a1-3")
    world.reporter.report("a1")
