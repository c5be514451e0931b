"""The heatmap patches the cells a delta changes instead of redrawing (issue 19): a report of one GPU
restyles the trace with that cell's new value; Plotly.react / newPlot are not called again."""

from __future__ import annotations

import os

import pytest
from django.test import Client, override_settings

from tests.browser import WAIT_MS
from tests.builders import GIB, JOIN_TOKEN, report_body
from tests.console.conftest import enroll
from tests.console.pagetools import LivePageTestCase, chromium, elsewhere, log_in
from tests.console.people import make_person

os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # Playwright's sync API next to the ORM

pytestmark = [pytest.mark.browser]

COUNT_DRAWS = """() => {
    window.__draws = { react: 0, newPlot: 0, restyle: 0 };
    ["react", "newPlot", "restyle"].forEach(function (name) {
        const real = window.Plotly[name];
        window.Plotly[name] = function () { window.__draws[name] += 1; return real.apply(this, arguments); };
    });
}"""
Z = "() => document.getElementById('heatmap').data[0].z.map(row => row.slice())"
CELL = """(uuid) => {
    const d = document.getElementById('heatmap').data[0];
    for (let r = 0; r < d.customdata.length; r++)
        for (let c = 0; c < d.customdata[r].length; c++)
            if (d.customdata[r][c] && d.customdata[r][c][0] === uuid) return [r, c];
    return null; }"""


@override_settings(FLEXPIPE_ENROLL_TOKEN=JOIN_TOKEN)
class HeatmapCellsInTheBrowser(LivePageTestCase):

    def setUp(self) -> None:
        make_person("oscar", "operator")
        client = Client()
        self.agents = {n: enroll(client, n, gpus=4) for n in ("a1", "a2")}
        for node, agent in self.agents.items():
            assert agent.post("/agent/v1/report", report_body(node, gpus=4, used_gib=10)).status_code == 200

    def test_a_report_of_one_gpu_patches_its_cell_without_a_full_redraw(self) -> None:
        with chromium() as browser:
            page = log_in(browser, self.live_server_url, "oscar", "/")
            page.wait_for_function("document.getElementById('heatmap').dataset.gpuCount === '8'", timeout=WAIT_MS)
            # the gearbox socket's blocks arrived: the heatmap is drawn by block, as it stays
            page.wait_for_function("document.getElementById('heatmap').dataset.grouping === 'block'", timeout=WAIT_MS)
            page.evaluate(COUNT_DRAWS)
            before = page.evaluate(Z)
            at = page.evaluate(CELL, "GPU-a1-0")
            assert at is not None and before[at[0]][at[1]] == 10 / 80

            body = report_body("a1", seq=2, gpus=4, used_gib=10)
            body["gpus"][0]["mem_used_bytes"] = 30 * GIB
            assert elsewhere(self.agents["a1"].post, "/agent/v1/report", body).status_code == 200
            page.wait_for_function(f"(at) => document.getElementById('heatmap').data[0].z[at[0]][at[1]] === {30 / 80}",
                                   arg=at, timeout=WAIT_MS)
            after = page.evaluate(Z)
            changed = [(r, c) for r, row in enumerate(after) for c, v in enumerate(row) if before[r][c] != v]
            assert changed == [tuple(at)]
            draws = page.evaluate("() => window.__draws")
            assert draws["react"] == 0 and draws["newPlot"] == 0 and draws["restyle"] >= 1, draws
            assert page.evaluate("() => window.FlexPipe.cluster.draws.patches") >= 1
            # the node table follows too: a1's row is the patched one, still one row per node
            assert page.locator("#nodes tbody tr").count() == 2
