"""A real browser logs in, sees every GPU of a scenario in the heatmap and watches it change live."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.test import override_settings
from playwright.sync_api import sync_playwright

from agents.sim.cluster import TENANT
from agents.sim.live import LiveFleet
from agents.sim.scenario import load_scenario
from tests.browser import WAIT_MS, launch, screenshot
from tests.console.pagetools import LivePageTestCase

os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # Playwright's sync API next to the ORM
ROOT = Path(__file__).resolve().parents[3]
JOIN = "fpj_browser-test"

pytestmark = [pytest.mark.browser]


@override_settings(FLEXPIPE_ENROLL_TOKEN=JOIN)
class OverviewInTheBrowser(LivePageTestCase):

    def setUp(self) -> None:
        user = get_user_model().objects.create_user("operator", password="operator-pass-1")
        user.groups.add(Group.objects.get_or_create(name="operator")[0])  # the live paths need a role
        self.scenario = load_scenario(ROOT / "scenarios" / "demo.yaml")
        self.fleet = LiveFleet(self.scenario, self.live_server_url, JOIN, report_interval_s=3600)
        self.fleet.step()  # every agent registers and reports once

    def tearDown(self) -> None:
        self.fleet.close()

    def test_an_operator_sees_every_gpu_and_a_report_changes_the_page_without_reload(self) -> None:
        total = sum(n.gpus for n in self.scenario.nodes)
        with sync_playwright() as pw:
            browser = launch(pw)
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                page.set_default_timeout(WAIT_MS)
                requested: list[str] = []
                page.on("request", lambda r: requested.append(r.url))
                page.goto(self.live_server_url + "/")
                assert "/login/" in page.url  # the dashboard needs a login
                page.fill("input[name=username]", "operator")
                page.fill("input[name=password]", "operator-pass-1")
                page.click("button[type=submit]")
                page.wait_for_selector("#live-status[data-state=live]", timeout=WAIT_MS)
                page.wait_for_function(f"document.getElementById('heatmap').dataset.gpuCount === '{total}'",
                                       timeout=WAIT_MS)
                cells = page.evaluate("""() => {
                    const d = document.getElementById('heatmap').data[0];
                    return d.customdata.flat().filter(c => c).map(c => c[0]); }""")
                assert sorted(cells) == sorted(g.uuid for n in self.fleet.cluster.nodes.values() for g in n.gpus)
                rows = page.locator("#nodes tbody tr").count()
                assert rows == len(self.scenario.nodes)
                screenshot(page, "overview-fleet")
                # plotly.js comes from this server: the page never reaches a CDN or any other host.
                assert page.evaluate("() => typeof window.Plotly.react") == "function"
                assert any(u.startswith(self.live_server_url + "/static/vendor/plotly/") for u in requested)
                offsite = [u for u in requested if not u.startswith((self.live_server_url, "data:", "blob:"))]
                assert offsite == []
                page.evaluate("() => { window.__noReloadMarker = 'still the same page'; }")

                # Another tenant takes one GPU of the L40S node: its agent reports, the page follows.
                node = self.fleet.cluster.nodes["l40s-c"]
                gpu = next(g for g in node.gpus if g.ours)
                gpu.owner = TENANT
                self.fleet.agents["l40s-c"].dirty = True
                marker = page.evaluate("() => window.FlexPipe.cluster.nodes['l40s-c'].last_seen_at")
                self.fleet.step()
                page.wait_for_function(
                    f"() => window.FlexPipe.cluster.gpus['{gpu.uuid}'].allocatable === false", timeout=WAIT_MS)
                assert page.evaluate("() => window.FlexPipe.cluster.nodes['l40s-c'].last_seen_at") != marker
                # rows are atomic blocks (then each node's GPUs in no block): find the GPU's cell by its uuid
                cell = page.evaluate(f"""() => {{
                    const d = document.getElementById('heatmap').data[0];
                    for (let r = 0; r < d.customdata.length; r++)
                      for (let c = 0; c < d.customdata[r].length; c++)
                        if (d.customdata[r][c] && d.customdata[r][c][0] === '{gpu.uuid}')
                          return [d.text[r][c], d.customdata[r][c][4]];
                    return null; }}""")
                assert cell == ["T", "held by another tenant"]
                # a reload would have dropped the marker set before the report
                assert page.evaluate("() => window.__noReloadMarker") == "still the same page"
                screenshot(page, "overview-after-preemption")
            finally:
                browser.close()


def test_the_seed_draws_which_gpu_a_preemption_takes() -> None:
    # Not a browser test, but it guards the one above: the fleet is deterministic per seed.
    scenario = load_scenario(ROOT / "scenarios" / "demo.yaml")
    from agents.sim.cluster import SimCluster

    a = SimCluster(scenario, random.Random(scenario.seed))
    b = SimCluster(scenario, random.Random(scenario.seed))
    assert [c.gpus for c in a.advance_to(1000)] == [c.gpus for c in b.advance_to(1000)]
