"""/api/v1 of the gearbox: who may read and steer, what each endpoint shows, and every refusal.

Reads need the viewer role; the verbs need the operator role. Anonymous callers and agent tokens
get 401, a user without a role or with too small a one 403. A refused request changes nothing:
the deployment, the transitions and the audit chain are as they were.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from console.audit.models import AuditEntry
from console.gearbox.models import Decision, Deployment, Transition
from console.registry.models import ModelVersion
from tests.console.conftest import AgentHTTP
from tests.console.gearbox.harness import M8
from tests.console.gearbox.ops import BASELINE, MOVED, advised, running_deployment
from tests.console.people import Person

pytestmark = pytest.mark.django_db



def reads() -> list[str]:
    t, d = Transition.objects.first(), Decision.objects.first()
    assert t is not None and d is not None
    return ["/api/v1/deployments", "/api/v1/deployments/chat", "/api/v1/gears", f"/api/v1/gears/{BASELINE.gear_id}",
            "/api/v1/plans", f"/api/v1/plans/{BASELINE.plans[0].plan_id}", "/api/v1/transitions",
            f"/api/v1/transitions/{t.pk}", "/api/v1/decisions", f"/api/v1/decisions/{d.pk}"]


def verbs() -> list[tuple[str, dict[str, Any]]]:
    d = Decision.objects.first()
    assert d is not None
    return [("/api/v1/deployments/chat/pin", {}), ("/api/v1/deployments/chat/unpin", {}),
            ("/api/v1/deployments/chat/mode", {"mode": "advisory"}),
            ("/api/v1/deployments/chat/emergency", {"reason": "latency alarm"}),
            ("/api/v1/deployments/chat/release", {}),
            (f"/api/v1/decisions/{d.pk}/approve", {})]


def post(client: Client, path: str, body: Any = None) -> Any:
    return client.post(path, json.dumps(body if body is not None else {}), content_type="application/json")


def snapshot() -> tuple[Any, ...]:
    """Everything a refused verb must leave as it was."""
    dep = Deployment.objects.values("mode", "pinned_gear", "current_gear", "emergency_requested_at").get(name="chat")
    return (dep, AuditEntry.objects.count(), Transition.objects.count(),
            list(Decision.objects.values_list("id", "approval")))


# --- who ---------------------------------------------------------------------------------------------
@pytest.fixture
def chat() -> Any:
    return running_deployment(moved=False)


def test_reading_needs_the_viewer_role_and_a_user_token(chat: Any, outsider: Person, viewer: Person,
                                                        agent: AgentHTTP) -> None:
    for path in reads():
        anonymous = Client().get(path)
        assert anonymous.status_code == 401 and anonymous["WWW-Authenticate"].startswith("Bearer"), path
        assert agent.get(path).status_code == 401, path  # an agent's token is valid on /agent/v1 only
        resp = outsider.api().get(path)
        assert resp.status_code == 403 and "viewer" in resp.json()["detail"], path
        assert viewer.api().get(path).status_code == 200, path
        assert viewer.browser().get(path).status_code == 200, path


def test_steering_needs_the_operator_role_and_refusals_change_nothing(chat: Any, outsider: Person, viewer: Person,
                                                                      agent: AgentHTTP) -> None:
    before = snapshot()
    for path, body in verbs():
        assert post(Client(), path, body).status_code == 401, path
        assert agent.post(path, body).status_code == 401, path
        for person in (outsider, viewer):
            resp = post(person.api(), path, body)
            assert resp.status_code == 403 and "operator" in resp.json()["detail"], (path, person.username)
    assert snapshot() == before


def test_a_browser_session_must_send_the_csrf_token(chat: Any, operator: Person) -> None:
    browser = operator.browser()
    refused = post(browser, "/api/v1/deployments/chat/mode", {"mode": "advisory"})
    assert refused.status_code == 403 and "CSRF" in refused.json()["detail"]
    assert Deployment.objects.get(name="chat").mode == "auto"
    browser.get("/deployments/chat/")  # the page sets the CSRF cookie
    token = browser.cookies["csrftoken"].value
    ok = browser.post("/api/v1/deployments/chat/mode", json.dumps({"mode": "advisory"}),
                      content_type="application/json", headers={"X-CSRFToken": token})
    assert ok.status_code == 200 and ok.json()["mode"] == "advisory"
    assert AuditEntry.objects.get(event_type="gearbox.mode_set").actor == "user:oscar"


# --- reading -----------------------------------------------------------------------------------------
def test_a_deployment_shows_its_slo_gears_routing_health_and_model_version(viewer: Person) -> None:
    running_deployment()
    common = {"name": M8.name, "engine": "vllm", "architecture": M8.name, "tokenizer": "/models/llama3-8b",
              "max_context": 8192, "min_gpu_mem_bytes": 2**34, "warmup_tokens": 64, "status": "verified",
              "registered_at": timezone.now(), "registered_by": "user:alice"}
    served = ModelVersion.objects.create(version="2026-11", weights_uri="hf://meta/llama3-8b/w", sha256="a" * 64,
                                         **common)
    Deployment.objects.filter(name="chat").update(model_version=served)
    # a newer version, registered and verified, is not what chat serves until it is rolled out
    ModelVersion.objects.create(version="2026-12", weights_uri="hf://meta/llama3-8b/w2", sha256="b" * 64, **common)
    body = viewer.api().get("/api/v1/deployments/chat").json()
    assert body["model_name"] == M8.name and body["model_version"]["version"] == "2026-11"
    assert body["slo"] == {"ttft_ms": 2000.0, "tpot_ms": 100.0} and body["mode"] == "auto"
    assert body["baseline_gear"]["gear_id"] == BASELINE.gear_id
    assert body["current_gear"]["gear_id"] == MOVED.gear_id and body["current_gear"]["shape"] == "TP2"
    assert body["pinned_gear"] is None and body["on_baseline"] is False
    routes = body["routing"]["routes"]
    assert [r["plan_id"] for r in routes] == [MOVED.plans[0].plan_id] and routes[0]["weight"] == 1.0
    assert routes[0]["nodes"] == ["b1"] and body["routing"]["version"] > 0
    assert body["health"] == {"state": "ok", "reasons": []} and body["active_transition"] is None
    assert body["last_transition_seq"] == 2 and body["emergency"] is None
    listed = viewer.api().get("/api/v1/deployments").json()
    assert listed["count"] == 1 and listed["results"] == [body]


def test_deployment_filters_are_checked_by_name(viewer: Person, chat: Any) -> None:
    api = viewer.api()
    assert api.get("/api/v1/deployments", {"mode": "auto"}).json()["count"] == 1
    assert api.get("/api/v1/deployments", {"pinned": "true"}).json()["count"] == 0
    assert api.get("/api/v1/deployments", {"model": "nope"}).json()["count"] == 0
    bad = api.get("/api/v1/deployments", {"mode": "turbo", "pinned": "maybe"})
    assert bad.status_code == 400 and set(bad.json()) == {"mode", "pinned"}
    assert api.get("/api/v1/deployments/nope").status_code == 404


def test_gears_and_plans_show_stages_on_gpus_and_who_uses_them(viewer: Person) -> None:
    running_deployment()
    api = viewer.api()
    gears = api.get("/api/v1/gears", {"deployment": "chat"}).json()
    assert {g["gear_id"] for g in gears["results"]} == {BASELINE.gear_id, MOVED.gear_id}
    moved = api.get(f"/api/v1/gears/{MOVED.gear_id}").json()
    assert moved["deployments"] == [{"deployment": "chat", "roles": ["current", "target", "proposed"],
                                    "transitions": [2]}]
    stage = moved["plans"][0]["stages"][0]
    assert stage["layers"] == [0, M8.num_layers] and stage["tp"] == 2 and stage["pipeline"] == "main"
    assert [(g["node"], g["index"], g["model"], g["in_block"]) for g in stage["gpus"]] == [
        ("b1", 4, "H100-SXM", True), ("b1", 5, "H100-SXM", True)]
    assert [g["gear_id"] for g in api.get("/api/v1/gears", {"role": "baseline"}).json()["results"]] == [
        BASELINE.gear_id]
    assert api.get("/api/v1/gears", {"role": "boss"}).status_code == 400
    assert api.get("/api/v1/gears/g-0123456789abcdef").status_code == 404

    plans = api.get("/api/v1/plans", {"routed": "true"}).json()["results"]
    assert [p["plan_id"] for p in plans] == [MOVED.plans[0].plan_id]
    assert plans[0]["routes"][0]["deployment"] == "chat" and plans[0]["gears"] == [MOVED.gear_id]
    plan = api.get(f"/api/v1/plans/{BASELINE.plans[0].plan_id}").json()
    assert plan["routes"] == [] and plan["deployments"] == ["chat"] and plan["shape"] == "TP2"
    assert api.get("/api/v1/plans", {"mode": "sideways"}).status_code == 400


def test_a_transition_shows_its_phases_steps_timings_and_what_moved(viewer: Person) -> None:
    running_deployment()
    api = viewer.api()
    listed = api.get("/api/v1/transitions", {"deployment": "chat"}).json()["results"]
    assert [(t["seq"], t["kind"], t["phase"]) for t in listed] == [(2, "manual", "done"), (1, "auto", "done")]
    second = api.get(f"/api/v1/transitions/{listed[0]['id']}").json()
    assert second["from_gear"]["gear_id"] == BASELINE.gear_id and second["to_gear"]["gear_id"] == MOVED.gear_id
    assert [p["phase"] for p in second["phases"]] == ["prepare", "switch", "cleanup"]
    assert all(p["duration_s"] is not None and not p["running"] for p in second["phases"])
    assert second["duration_s"] >= sum(p["duration_s"] for p in second["phases"]) - 0.01
    steps = [s["step"] for s in second["steps"]]
    assert steps[:2] == ["reserve", "prepare"] and "flip" in steps and steps[-1] == "unreserve"
    assert all(s["state"] in ("ok", "abandoned") and s["does"] for s in second["steps"])
    moved = second["moved"]
    assert set(moved) >= {"kv_bytes_migrated", "tokens_replayed", "seqs_migrated", "seqs_replayed", "forward", "back"}
    assert second["decision"] is not None and second["decision_summary"]["trigger"] == "manual"
    assert second["to_gear_detail"]["plans"][0]["stages"][0]["gpus"][0]["node"] == "b1"


def test_transition_filters_name_each_bad_value(viewer: Person, chat: Any) -> None:
    api = viewer.api()
    assert api.get("/api/v1/transitions", {"kind": "auto", "phase": "done"}).json()["count"] == 1
    assert api.get("/api/v1/transitions", {"active": "true"}).json()["count"] == 0
    assert api.get("/api/v1/transitions", {"since": (timezone.now() + timedelta(hours=1)).isoformat()}
                   ).json()["count"] == 0
    bad = api.get("/api/v1/transitions", {"phase": "warp", "kind": "x", "since": "yesterday", "active": "2"})
    assert bad.status_code == 400 and set(bad.json()) == {"phase", "kind", "since", "active"}
    # an offset PostgreSQL would refuse (beyond 15:59) is read in UTC; one that leaves the calendar is refused
    assert api.get("/api/v1/transitions", {"since": "0153-08-02T15:18:10+17:57"}).json()["count"] == 1
    assert "until" in api.get("/api/v1/transitions", {"until": "0001-01-01T00:00:00+01:00"}).json()
    order = api.get("/api/v1/transitions", {"since": "2026-01-02T00:00:00Z", "until": "2026-01-01T00:00:00Z"})
    assert order.status_code == 400 and "until" in order.json()
    last = Transition.objects.order_by("-pk").first()
    assert last is not None and api.get(f"/api/v1/transitions/{last.pk + 1000}").status_code == 404


def test_a_decision_shows_trigger_candidates_with_gain_cost_and_factor(viewer: Person) -> None:
    world = running_deployment(moved=False)
    d = advised(world)
    api = viewer.api()
    body = api.get(f"/api/v1/decisions/{d.pk}").json()
    assert body["trigger"] == "topology" and body["outcome"] == "advise" and body["approval"] == "pending"
    assert body["factor"] == pytest.approx(1.4) and body["reasons"]
    assert body["candidates"] and body["best"]["gear_id"] == body["target_gear_id"]
    first = body["candidates"][0]
    assert {"gain_tokens", "cost_tokens", "threshold_tokens", "factor", "passes", "cost", "estimate"} <= set(first)
    assert first["threshold_tokens"] == pytest.approx(first["cost_tokens"] * first["factor"])
    assert body["target_gear"]["gear_id"] == body["target_gear_id"]
    pending = api.get("/api/v1/decisions", {"approval": "pending", "deployment": "chat"}).json()["results"]
    assert [x["id"] for x in pending] == [d.pk]
    assert api.get("/api/v1/decisions", {"outcome": "switch"}).json()["results"][0]["transitions"] == [1]
    bad = api.get("/api/v1/decisions", {"outcome": "maybe", "trigger": "moon", "approval": "later"})
    assert bad.status_code == 400 and set(bad.json()) == {"outcome", "trigger", "approval"}


# --- pin, unpin, mode --------------------------------------------------------------------------------
def test_an_operator_pins_the_running_gear_by_word_or_id_and_unpins_it(operator: Person) -> None:
    running_deployment()
    api = operator.api()
    body = post(api, "/api/v1/deployments/chat/pin", {"gear_id": MOVED.gear_id}).json()
    assert body["mode"] == "pinned" and body["pinned_gear"]["gear_id"] == MOVED.gear_id
    entry = AuditEntry.objects.get(event_type="gearbox.gear_pinned")
    assert entry.actor == "user:oscar" and entry.user_id == operator.user.pk and entry.deployment == "chat"
    again = post(api, "/api/v1/deployments/chat/pin")  # "current" by default; nothing new
    assert again.status_code == 200 and AuditEntry.objects.filter(event_type="gearbox.gear_pinned").count() == 1
    unpinned = post(api, "/api/v1/deployments/chat/unpin", {"mode": "advisory"}).json()
    assert unpinned["mode"] == "advisory" and unpinned["pinned_gear"] is None
    assert AuditEntry.objects.get(event_type="gearbox.gear_unpinned").actor == "user:oscar"


def test_pinning_an_unknown_gear_is_a_400_naming_it_and_another_known_gear_a_409(operator: Person) -> None:
    running_deployment()
    api = operator.api()
    before = snapshot()
    unknown = post(api, "/api/v1/deployments/chat/pin", {"gear_id": "g-0123456789abcdef"})
    assert unknown.status_code == 400 and "g-0123456789abcdef" in unknown.json()["gear_id"][0]
    baseline = post(api, "/api/v1/deployments/chat/pin", {"gear_id": BASELINE.gear_id})  # known, not running
    assert baseline.status_code == 409 and "not the gear running now" in baseline.json()["gear_id"][0]
    typo = post(api, "/api/v1/deployments/chat/pin", {"gear": "current"})
    assert typo.status_code == 400 and "gear" in typo.json()
    assert snapshot() == before


def test_nothing_can_be_pinned_before_a_gear_runs(operator: Person) -> None:
    from tests.console.gearbox.harness import enroll_fleet, make_deployment

    enroll_fleet()
    make_deployment("chat", baseline=BASELINE)
    resp = post(operator.api(), "/api/v1/deployments/chat/pin")
    assert resp.status_code == 409 and "current_gear" in resp.json()
    assert Deployment.objects.get(name="chat").mode == "auto"


def test_the_mode_verb_sets_each_mode_and_refuses_others_by_name(admin: Person, chat: Any) -> None:
    api = admin.api()  # an admin has the operator's rights
    assert post(api, "/api/v1/deployments/chat/mode", {"mode": "advisory"}).json()["mode"] == "advisory"
    pinned = post(api, "/api/v1/deployments/chat/mode", {"mode": "pinned"}).json()
    assert pinned["mode"] == "pinned" and pinned["pinned_gear"]["gear_id"] == BASELINE.gear_id
    assert post(api, "/api/v1/deployments/chat/mode", {"mode": "auto"}).json()["pinned_gear"] is None
    assert [e.event_type for e in AuditEntry.objects.filter(actor="user:alice").order_by("seq")] == [
        "gearbox.mode_set", "gearbox.gear_pinned", "gearbox.gear_unpinned"]
    before = snapshot()
    for body in ({"mode": "turbo"}, {}, {"mode": None}):
        resp = post(api, "/api/v1/deployments/chat/mode", body)
        assert resp.status_code == 400 and "mode" in resp.json(), body
    unpin = post(api, "/api/v1/deployments/chat/unpin", {"mode": "pinned"})
    assert unpin.status_code == 400 and "mode" in unpin.json()
    assert post(api, "/api/v1/deployments/nope/mode", {"mode": "auto"}).status_code == 404
    assert snapshot() == before


# --- emergency ---------------------------------------------------------------------------------------
def test_an_emergency_without_a_reason_is_a_400_naming_reason(operator: Person, chat: Any) -> None:
    api = operator.api()
    before = snapshot()
    for body in ({}, {"reason": ""}, {"reason": "   "}, {"reason": None}, {"reason": "x" * 501}):
        resp = post(api, "/api/v1/deployments/chat/emergency", body)
        assert resp.status_code == 400 and list(resp.json()) == ["reason"], body
    assert snapshot() == before


def test_an_emergency_is_requested_once_and_asking_again_changes_nothing(operator: Person) -> None:
    running_deployment()
    api = operator.api()
    post(api, "/api/v1/deployments/chat/pin")
    first = post(api, "/api/v1/deployments/chat/emergency", {"reason": "TTFT alarm on chat"})
    assert first.status_code == 202 and first.json()["state"] == "requested"
    dep = first.json()["deployment"]
    assert dep["emergency"]["reason"] == "TTFT alarm on chat" and dep["emergency"]["actor"] == "user:oscar"
    assert dep["emergency"]["state"] == "pending" and dep["emergency"]["target"]["gear_id"] == BASELINE.gear_id
    assert dep["health"]["state"] == "degraded" and dep["mode"] == "emergency"  # it overrides the pin, and holds
    again = post(api, "/api/v1/deployments/chat/emergency", {"reason": "still bad"})
    assert again.status_code == 200 and again.json()["state"] == "already_requested"
    assert AuditEntry.objects.get(event_type="gearbox.emergency_requested").actor == "user:oscar"
    assert AuditEntry.objects.filter(event_type="gearbox.emergency_repeated").count() == 1


def test_an_emergency_on_the_baseline_with_nothing_running_holds_it(operator: Person, chat: Any) -> None:
    resp = post(operator.api(), "/api/v1/deployments/chat/emergency", {"reason": "drill"})
    assert resp.status_code == 200 and resp.json()["state"] == "holding"
    assert resp.json()["deployment"]["emergency"]["state"] == "holding"
    dep = Deployment.objects.get(name="chat")
    assert dep.emergency_requested_at is None and dep.mode == "emergency" and dep.pinned_gear == dep.baseline_gear
    assert Transition.objects.filter(kind="emergency").count() == 0


def test_a_blocked_emergency_is_a_409_with_the_reason_what_to_do_and_an_offer(operator: Person) -> None:
    world = running_deployment()
    world.reporter.gone = {BASELINE.gpu_uuids[0]}  # another tenant took a GPU of the baseline
    world.reporter.report("a1")
    before = Deployment.objects.values("mode", "pinned_gear", "emergency_requested_at").get(name="chat")
    resp = post(operator.api(), "/api/v1/deployments/chat/emergency", {"reason": "latency alarm"})
    assert resp.status_code == 409
    body = resp.json()
    assert body["emergency"][0].startswith("emergency: the baseline gear cannot run on this snapshot: ")
    assert "a1/0" in body["emergency"][0] and BASELINE.gpu_uuids[0] not in body["emergency"][0]
    assert body["emergency"][1].startswith("to fix: restore its GPUs, set a new baseline, or downshift to")
    assert Decision.objects.get(pk=body["decision"]).outcome == "blocked"
    offer = body["offers"][0]
    assert offer["label"] == "the planner's best safe gear - not the baseline" and " on " in offer["name"]
    assert Deployment.objects.values("mode", "pinned_gear", "emergency_requested_at").get(name="chat") == before
    taken = post(operator.api(), "/api/v1/deployments/chat/emergency",
                 {"reason": "latency alarm", "gear_id": offer["gear_id"]})
    assert taken.status_code == 202 and taken.json()["deployment"]["emergency"]["target"]["gear_id"] == offer["gear_id"]
    assert post(operator.api(), "/api/v1/deployments/chat/emergency",
                {"reason": "x", "gear_id": "not-a-gear"}).status_code == 400


def test_release_hands_an_emergency_back_and_refuses_what_it_cannot(operator: Person, viewer: Person,
                                                                    chat: Any) -> None:
    api = operator.api()
    resp = post(api, "/api/v1/deployments/chat/release")
    assert resp.status_code == 409 and "holds no emergency" in resp.json()["mode"][0]
    assert post(api, "/api/v1/deployments/nope/release").status_code == 404
    post(api, "/api/v1/deployments/chat/emergency", {"reason": "drill"})
    before = snapshot()
    assert post(viewer.api(), "/api/v1/deployments/chat/release").status_code == 403
    assert post(api, "/api/v1/deployments/chat/release", {"mode": "turbo"}).status_code == 400
    assert post(api, "/api/v1/deployments/chat/release", {"mode": "auto", "now": True}).status_code == 400
    refused = post(api, "/api/v1/deployments/chat/mode", {"mode": "auto"})
    assert refused.status_code == 409 and "release it first" in refused.json()["mode"][0]
    assert snapshot() == before
    done = post(api, "/api/v1/deployments/chat/release", {"mode": "advisory"})
    assert done.status_code == 200 and done.json()["mode"] == "advisory" and done.json()["emergency"] is None
    assert AuditEntry.objects.get(event_type="gearbox.emergency_released").actor == "user:oscar"


# --- approve -----------------------------------------------------------------------------------------
def test_an_operator_approves_an_advised_decision_once(operator: Person) -> None:
    world = running_deployment(moved=False)
    d = advised(world)
    api = operator.api()
    started = post(api, f"/api/v1/decisions/{d.pk}/approve")
    assert started.status_code == 201
    body = started.json()
    assert body["kind"] == "approved" and body["decision"] == d.pk and body["seq"] == 2 and body["active"]
    assert AuditEntry.objects.get(event_type="gearbox.decision_approved").actor == "user:oscar"
    before = snapshot()
    again = post(api, f"/api/v1/decisions/{d.pk}/approve")
    assert again.status_code == 409 and "not waiting for approval" in again.json()["decision"][0]
    assert snapshot() == before


def test_approving_a_decision_that_is_not_advisory_is_refused_naming_it(operator: Person, chat: Any) -> None:
    switch = Decision.objects.get(outcome="switch")  # the gearbox switched by itself: nothing to approve
    api = operator.api()
    before = snapshot()
    resp = post(api, f"/api/v1/decisions/{switch.pk}/approve")
    assert resp.status_code == 409 and f"decision {switch.pk} is not waiting" in resp.json()["decision"][0]
    assert post(api, f"/api/v1/decisions/{switch.pk}/approve", {"force": True}).status_code == 400
    assert post(api, f"/api/v1/decisions/{switch.pk + 1000}/approve").status_code == 404
    assert snapshot() == before
