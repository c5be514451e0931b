"""The gearbox pages as the server renders them: who sees what, and that they embed what the API says."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.test import Client

from console.gearbox.models import Decision, Transition
from tests.console.dashboard.test_pages import page_data
from tests.console.gearbox.ops import MOVED, running_deployment
from tests.console.people import Person

pytestmark = pytest.mark.django_db


@pytest.fixture
def chat() -> Any:
    return running_deployment()


def pages() -> list[str]:
    decision = Decision.objects.order_by("id").first()
    assert decision is not None
    return ["/deployments/", "/deployments/chat/", "/deployments/chat/transitions/2/", f"/decisions/{decision.pk}/"]


def test_every_gearbox_page_needs_a_login_and_the_viewer_role(chat: Any, outsider: Person, viewer: Person) -> None:
    for path in pages():
        resp = Client().get(path)
        assert resp.status_code == 302 and resp["Location"].startswith("/login/"), path
        refused = outsider.browser().get(path)
        assert refused.status_code == 403 and b"needs the <b>viewer</b> role" in refused.content, path
        html = viewer.browser().get(path).content.decode()
        assert re.search(r'data-nav="deployments" class="active"', html), path


def test_unknown_deployments_transitions_and_decisions_are_404(chat: Any, viewer: Person) -> None:
    browser = viewer.browser()
    last = Decision.objects.order_by("-id").first()
    assert last is not None
    for path in ("/deployments/nope/", "/deployments/chat/transitions/9/", "/deployments/nope/transitions/1/",
                 f"/decisions/{last.pk + 1000}/"):
        assert browser.get(path).status_code == 404, path


def test_a_viewer_gets_no_control_and_an_operator_gets_them_all(chat: Any, viewer: Person, operator: Person) -> None:
    html = viewer.browser().get("/deployments/chat/").content.decode()
    assert page_data(html, "deployment-data")["can_operate"] is False  # type: ignore[index]
    for marker in ('id="controls"', 'id="emergency-button"', 'id="pin-button"', 'id="emergency-dialog"',
                   "csrfmiddlewaretoken\" value"):
        assert marker not in html.split("<main>")[1], marker
    html = operator.browser().get("/deployments/chat/").content.decode()
    assert page_data(html, "deployment-data")["can_operate"] is True  # type: ignore[index]
    for marker in ('id="controls"', 'id="emergency-button"', 'id="pin-button"', 'id="unpin-button"',
                   'name="reason"', 'name="confirm"', 'data-mode="pinned"'):
        assert marker in html, marker


def test_the_deployment_page_embeds_what_the_api_shows(chat: Any, viewer: Person) -> None:
    data: Any = page_data(viewer.browser().get("/deployments/chat/").content.decode(), "deployment-data")
    assert data["deployment"] == viewer.api().get("/api/v1/deployments/chat").json()
    api_transitions = viewer.api().get("/api/v1/transitions", {"deployment": "chat"}).json()["results"]
    assert [t["seq"] for t in data["transitions"]] == [t["seq"] for t in api_transitions] == [2, 1]
    assert data["transitions"][0]["phases"] == api_transitions[0]["phases"]
    assert data["gears"]["current"]["gear_id"] == MOVED.gear_id
    assert [d["id"] for d in data["decisions"]] == list(Decision.objects.order_by("-id").values_list("id", flat=True))


def sampled_decision() -> dict[str, Any]:
    """A routing decision as a gateway samples it (scheduler.router on a mixed pool)."""
    from tests.scheduler.router.builders import idle, mixed_pool, req, router

    pool = idle(mixed_pool())
    d = router().route(req(30_000, 64, priority=2), pool, 0.0)
    return {**d.explain(), "taken_by": d.chosen_id, "at": "2026-01-01T00:00:00+00:00"}


def test_the_deployment_page_shows_the_newest_routing_decisions_the_gateways_sampled(chat: Any,
                                                                                       viewer: Person) -> None:
    from console.gateway import decisions

    redis_key = decisions.PREFIX + "chat"
    decisions._client().delete(redis_key)
    html = viewer.browser().get("/deployments/chat/").content.decode()
    assert page_data(html, "deployment-data")["route_samples"] == []  # type: ignore[index]
    assert 'data-testid="route-samples"' in html and "no request routed through a gateway yet" in html
    sample = sampled_decision()
    for _ in range(7):
        decisions.record("chat", sample)
    shown: Any = page_data(viewer.browser().get("/deployments/chat/").content.decode(), "deployment-data")
    assert len(shown["route_samples"]) == 5 and shown["route_samples"][0] == sample
    decisions._client().delete(redis_key)


def test_the_deployment_page_shows_the_learned_routing_s_newest_stage_changes(chat: Any, viewer: Person) -> None:
    from console.gateway import decisions, learned
    from tests.console.gearbox.test_pages_browser import ROLLED_BACK

    key = learned.PREFIX + "chat"
    decisions._client().delete(key)
    html = viewer.browser().get("/deployments/chat/").content.decode()
    assert 'data-testid="router-rollout"' in html
    assert page_data(html, "deployment-data")["router_rollout"] == []  # type: ignore[index]
    canary = {**ROLLED_BACK, "before": "cold", "after": "canary", "share": 0.1}
    learned.keep("chat", [canary, ROLLED_BACK])
    shown: Any = page_data(viewer.browser().get("/deployments/chat/").content.decode(), "deployment-data")
    assert [c["after"] for c in shown["router_rollout"]] == ["rolled_back", "canary"]  # newest first
    decisions._client().delete(key)


def test_the_review_pages_replay_the_decision_and_its_transition(chat: Any, viewer: Person) -> None:
    t = Transition.objects.get(seq=2)
    browser = viewer.browser()
    data: Any = page_data(browser.get("/deployments/chat/transitions/2/").content.decode(), "review-data")
    assert data["focus"] == "transition" and [x["seq"] for x in data["transitions"]] == [2]
    assert [s["step"] for s in data["transitions"][0]["steps"]][:2] == ["reserve", "prepare"]
    assert data["decision"]["id"] == t.decision_id and data["decision"]["trigger"] == "manual"
    data = page_data(browser.get(f"/decisions/{t.decision_id}/").content.decode(), "review-data")
    assert data["focus"] == "decision" and data["decision"]["candidates"][0]["gear_id"] == MOVED.gear_id
    assert [x["seq"] for x in data["transitions"]] == [2]
    assert data["transitions"][0] == viewer.api().get(f"/api/v1/transitions/{t.pk}").json()


def test_the_deployments_list_and_the_overview_show_the_gearbox_to_viewers_only(chat: Any, viewer: Person,
                                                                               outsider: Person) -> None:
    data: Any = page_data(viewer.browser().get("/deployments/").content.decode(), "deployments-data")
    assert [d["name"] for d in data["deployments"]] == ["chat"] and len(data["switches"]) == 2
    assert 'id="overview-deployments"' in viewer.browser().get("/").content.decode()
    resp = outsider.browser().get("/")  # the Overview's live paths need the viewer role: so does the page
    assert resp.status_code == 403 and 'id="heatmap"' not in resp.content.decode()


def test_the_deployment_page_starts_its_charts_from_the_stored_last_hour(chat: Any, viewer: Person) -> None:
    from console.gearbox import ticks
    from console.gearbox.models import ServingSample
    from tests.console.gearbox.ops import engine_report

    plan = MOVED.plans[0].plan_id
    for tokens in (700.0, 800.0, 900.0):  # three reports, each followed by a tick (the beat's)
        chat.report_engines("b1", engine_report(plan, tokens_per_s=tokens))
        ticks.tick()
    ticks.tick()  # no newer report: no new point
    assert ServingSample.objects.filter(deployment__name="chat").count() == 3
    data = page_data(viewer.browser().get("/deployments/chat/").content.decode(), "deployment-data")
    history = data["serving_history"]  # type: ignore[index]
    assert [p["tokens_per_s"] for p in history] == [700.0, 800.0, 900.0]
    assert all(p["at"].endswith("Z") and p["ttft_p95_ms"] == 180.0 for p in history)
