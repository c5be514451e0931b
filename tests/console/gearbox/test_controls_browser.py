"""A real browser on the operator controls: an emergency that holds across ticks until it is released, a
blocked emergency shown in red with its offer, an override to a chosen candidate - and, open in the
same browser the whole time, an idle live page that stays connected for 60 s.

The idle page waits on the clock for real (the channel layer's 5-s blocking receive against the
Redis client's read timeout only shows over time), but not on its own: it opens when the class
starts, the other tests of the class run meanwhile, and the last test waits only for what is left
of the 60 s. It is the Registry page, whose websocket hears registry events only - none of these
tests makes one - so the server has nothing to send it but its pings. Screenshots: artifacts/
controls-*.png.

The fleet is the database-backed simulated agents of tests/console/gearbox/ops.py; the test drives
the ticks and transitions itself (`elsewhere`), as beat and a worker would.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
from django.test import override_settings
from playwright.sync_api import sync_playwright
from prometheus_client.parser import text_string_to_metric_families

from console.gearbox import ticks
from console.gearbox.models import Deployment, Transition
from scheduler.plan import Gear
from tests.browser import WAIT_MS, launch, screenshot
from tests.console.gearbox.ops import BASELINE, MOVED, drive, running_deployment
from tests.console.gearbox.test_emergency import heavy_load
from tests.console.pagetools import LivePageTestCase, elsewhere, log_in
from tests.console.people import make_person

os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # Playwright's sync API next to the ORM

pytestmark = [pytest.mark.browser]
IDLE_S = 60.0


class OperatorControlsInTheBrowser(LivePageTestCase):
    browser: Any
    idle_page: Any
    idle_since: float

    @classmethod
    def setUpClass(cls) -> None:
        # a short canary dwell (the default holds every switch 2 s): these tests are about the controls
        cls._fast = override_settings(FLEXPIPE_CANARY_DWELL_S=0.2)
        cls._fast.enable()
        super().setUpClass()
        # the idle page's user lives until the first test's flush; its socket, open by then, stays open
        make_person("ida", "viewer")
        cls._pw = sync_playwright().start()
        try:
            cls.browser = launch(cls._pw)
            cls.idle_page = log_in(cls.browser, f"http://{cls.host}:{cls._port}", "ida", "/registry/")
            cls.idle_page.wait_for_selector("#live-status[data-state=live]", timeout=WAIT_MS)
            cls.idle_since = time.monotonic()
        except BaseException:
            cls._pw.stop()  # no tearDownClass after a failed setUpClass: leave no browser behind
            super().tearDownClass()
            cls._fast.disable()
            raise

    @classmethod
    def tearDownClass(cls) -> None:
        try:
            cls.browser.close()
            cls._pw.stop()
        finally:
            super().tearDownClass()
            cls._fast.disable()

    def setUp(self) -> None:
        # Playwright's event loop runs in this thread for the whole class: writes whose commit pushes
        # to the pages (async_to_sync) run in a thread of their own, as a web or Celery process would
        elsewhere(make_person, "oscar", "operator")
        self.world = elsewhere(running_deployment)  # chat runs MOVED (b1/4-5), its baseline is a1/0-1

    def page(self, path: str = "/deployments/chat/") -> Any:
        page = log_in(self.browser, self.live_server_url, "oscar", path)
        page.wait_for_selector("#live-status[data-state=live]", timeout=WAIT_MS)
        return page

    def press_emergency(self, page: Any, reason: str) -> None:
        page.click("#emergency-button")
        page.fill("#emergency-dialog textarea[name=reason]", reason)
        page.check("#emergency-dialog input[name=confirm]")
        page.click("#emergency-confirm")

    def report_all(self) -> None:
        for node in ("a1", "b1"):
            elsewhere(self.world.reporter.report, node)

    # -- the tests ------------------------------------------------------------------------------------
    def test_a_blocked_emergency_is_shown_in_red_and_its_offered_gear_can_be_taken(self) -> None:
        self.world.reporter.gone = {BASELINE.gpu_uuids[0]}  # another tenant took a GPU of the baseline
        elsewhere(self.world.reporter.report, "a1")
        page = self.page()
        try:
            self.press_emergency(page, "latency alarm")
            page.wait_for_selector("#emergency-error[data-state=blocked]", timeout=WAIT_MS)
            assert page.is_visible("#emergency-dialog")  # it stays open: nothing was done
            text = page.inner_text("#emergency-error")
            assert "Blocked — nothing was changed." in text and "the baseline gear cannot run" in text
            assert "a1/0" in text and BASELINE.gpu_uuids[0] not in text
            assert "error" in (page.get_attribute("#control-result", "class") or "")
            assert page.inner_text("#control-result").startswith("emergency downshift BLOCKED")
            assert page.evaluate("getComputedStyle(document.getElementById('emergency-error')).color") \
                == "rgb(192, 54, 44)"  # red
            offer = page.locator("#emergency-dialog-offers .offer").first
            assert "the planner's best safe gear - not the baseline" in (offer.locator(".label").text_content() or "")
            dep = Deployment.objects.get(name="chat")
            assert dep.mode == "auto" and dep.emergency_requested_at is None  # the refusal changed nothing
            screenshot(page, "controls-emergency-blocked")

            gear_id = offer.get_attribute("data-offer")
            offer.locator("button[data-accept-offer]").click()
            page.wait_for_selector("#emergency-dialog", state="hidden", timeout=WAIT_MS)
            page.wait_for_selector("#emergency-banner[data-state=pending]", timeout=WAIT_MS)
            assert "not the baseline" in page.inner_text("#emergency-banner")
            assert Gear.from_dict(Deployment.objects.get(name="chat").pinned_gear).gear_id == gear_id
        finally:
            page.context.close()

    def test_an_emergency_holds_across_ticks_until_an_operator_releases_it(self) -> None:
        page = self.page()
        try:
            self.press_emergency(page, "TTFT P95 above the SLO since the move")
            page.wait_for_selector("#emergency-banner[data-state=pending]", timeout=WAIT_MS)
            page.wait_for_selector("#mode[data-state=emergency]")
            assert page.is_disabled("#controls [data-mode=auto]") and page.is_disabled("#pin-button")
            assert elsewhere(ticks.tick, trigger="emergency", deployment="chat")["started"] == ["chat#3"]
            elsewhere(drive, self.world.agents)
            self.report_all()
            page.wait_for_selector("#emergency-banner[data-state=holding]", timeout=WAIT_MS)
            # a load the gearbox would shift up for, and ticks of every kind: the gear stays
            elsewhere(heavy_load, "chat", 120.0)
            for trigger in ("ended", "periodic", "topology", "periodic"):
                assert elsewhere(ticks.tick, trigger=trigger)["started"] == [], trigger
            page.wait_for_selector("#decisions tr[data-outcome=stay]", timeout=WAIT_MS)
            assert page.get_attribute("#timeline", "data-labels") == "#1 auto|#2 manual|#3 emergency"
            dep = Deployment.objects.get(name="chat")
            assert dep.current_gear == dep.baseline_gear and dep.mode == "emergency"
            assert page.is_visible("#emergency-banner") and "never switched automatically" in page.inner_text(
                "#emergency-banner")
            screenshot(page, "controls-emergency-holding")

            page.click("#emergency-banner [data-release=auto]")
            page.wait_for_selector("#mode[data-state=auto]", timeout=WAIT_MS)
            page.wait_for_selector("#emergency-banner", state="hidden")
            assert page.inner_text("#control-result") == "emergency released: mode auto"
            assert Deployment.objects.get(name="chat").mode == "auto"
        finally:
            page.context.close()

    def test_an_override_to_a_chosen_candidate_runs_and_holds(self) -> None:
        page = self.page()
        try:
            page.click("#candidates-button")
            page.wait_for_selector("#candidates[data-rows]:not([hidden]) tbody tr", timeout=WAIT_MS)
            rows = page.locator("#candidates tbody tr")
            assert rows.count() >= 2
            first = rows.nth(1)
            name = first.locator("td").first.inner_text()
            assert " on " in name and "GPU-" not in name  # shape and placement, GPUs as node/index
            assert "tok/s" in first.inner_text() and "req/s" in first.inner_text()  # with its estimates
            gear_id = first.get_attribute("data-gear")
            first.locator("button[data-override]").click()
            page.wait_for_selector("#mode[data-state=pinned]", timeout=WAIT_MS)
            assert page.inner_text("#control-result").startswith("override: transition #3 to ")
            t = Transition.objects.get(deployment__name="chat", seq=3)
            assert t.kind == "manual" and Gear.from_dict(t.to_gear).gear_id == gear_id
            elsewhere(drive, self.world.agents)
            self.report_all()
            page.wait_for_function(f"document.getElementById('gear-current').dataset.gearId === '{gear_id}'",
                                   timeout=WAIT_MS)
            for trigger in ("ended", "periodic"):
                assert elsewhere(ticks.tick, trigger=trigger)["started"] == []  # pinned: it holds
            assert Gear.from_dict(Deployment.objects.get(name="chat").current_gear).gear_id == gear_id != MOVED.gear_id
            screenshot(page, "controls-override")
        finally:
            page.context.close()

    def test_the_idle_live_page_stayed_connected_for_60_s_and_the_client_gauge_returns_to_0(self) -> None:
        left = IDLE_S - (time.monotonic() - self.idle_since)
        if left > 0:
            self.idle_page.wait_for_timeout(left * 1000)  # the clock, for what the tests above left of it
        stats = self.idle_page.evaluate("window.FlexPipe.live.stats")
        assert time.monotonic() - self.idle_since >= IDLE_S
        assert stats["opens"] == 1 and stats["closes"] == [], stats  # no close, no reconnect, for 60 s
        assert stats["pings"] >= 2, stats  # the server pinged it (every 20 s)
        assert self.idle_page.get_attribute("#live-status", "data-state") == "live"
        screenshot(self.idle_page, "controls-idle-page")
        self.idle_page.context.close()

        viewer = elsewhere(make_person, "vic", "viewer")  # (ida may be gone with another test's flush)
        deadline = time.monotonic() + 15
        while True:
            gauges = clients(self.live_server_url, viewer.token)
            if all(v == 0 for v in gauges.values()):
                break
            assert time.monotonic() < deadline, gauges  # every page of this class is closed by now
            time.sleep(0.2)
        assert gauges.get("registry") == 0


def clients(base_url: str, token: str) -> dict[str, float]:
    """flexpipe_websocket_clients by page, from the live server's /metrics."""
    import httpx

    text = httpx.get(base_url + "/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=10).text
    return {s.labels["page"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "flexpipe_websocket_clients"}
