"""A real browser on the gearbox pages: an operator pins and presses emergency, a viewer cannot, the
pages follow the fleet live. Screenshots: artifacts/{deployment,deployments,decision,transition,overview}.png.

The console is a live daphne; a real Celery worker (in this process) runs the gearbox tick the
emergency request enqueues, as it does in production; the fleet is the database-backed simulated
agents of tests/console/gearbox/ops.py (driven in setUp, idle during the browser part).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from celery.contrib.testing.worker import start_worker

from console.audit.models import AuditEntry
from console.celery import app
from console.gateway import learned
from console.gearbox import ticks
from console.gearbox.models import Decision, Deployment, Transition
from tests.browser import WAIT_MS, screenshot
from tests.conftest import purge_tasks
from tests.console.gearbox.ops import MOVED, engine_report, running_deployment
from tests.console.pagetools import LivePageTestCase, chromium, elsewhere, log_in
from tests.console.people import make_person

os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # Playwright's sync API next to the ORM

pytestmark = [pytest.mark.browser]


@contextmanager
def celery_worker() -> Iterator[None]:
    """A worker on this test run's queue, emptied first: what setUp's acks and reports enqueued must not run."""
    purge_tasks()
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10,
                      queues=[app.conf.task_default_queue]):
        yield


ROLLED_BACK = {"at": "2026-12-01T10:00:00+00:00", "before": "canary", "after": "rolled_back", "share": 0.0,
               "reason": "SLA violations 12.0% against round-robin's 4.0% (x1.05 allowed): rolled back",
               "learned_violation_rate": 0.12, "rr_violation_rate": 0.04, "process": "gw-1:42"}


class GearboxPagesInTheBrowser(LivePageTestCase):

    def setUp(self) -> None:
        make_person("oscar", "operator")
        make_person("vera", "viewer")
        self.world = running_deployment(inflight=4)  # the move to b1 hands 4 long requests over
        self.plan_id = MOVED.plans[0].plan_id
        self.report(tokens_per_s=850.0, ttft_p95_ms=160.0)

    def report(self, **kw: float) -> None:
        elsewhere(self.world.report_engines, "b1", engine_report(self.plan_id, **kw))

    def test_an_operator_pins_the_gear_then_the_emergency_shows_live_in_the_timeline(self) -> None:
        with celery_worker(), chromium() as browser:
            page = log_in(browser, self.live_server_url, "oscar", "/deployments/chat/")
            page.wait_for_selector("#live-status[data-state=live]", timeout=WAIT_MS)
            assert page.get_attribute("#timeline", "data-labels") == "#1 auto|#2 manual"
            # no load sample in the gearbox's window yet: the chart says so, not an empty year-2000 axis
            assert "no load sample in the window yet" in page.inner_text("#chart-load")

            # engines report while the page is open: the charts grow without a reload
            for tokens, ttft in ((910.0, 175.0), (1020.0, 190.0)):
                points = int(page.get_attribute("#chart-throughput", "data-points") or 0)
                self.report(tokens_per_s=tokens, ttft_p95_ms=ttft)
                page.wait_for_function(
                    f"document.getElementById('chart-throughput').dataset.points === '{points + 1}'", timeout=WAIT_MS)
            assert page.evaluate("window.FlexPipe.deployment.points.at(-1).tokens_per_s") == 1020.0

            page.click("#pin-button")
            page.wait_for_selector("#mode[data-state=pinned]", timeout=WAIT_MS)
            dep = Deployment.objects.get(name="chat")
            assert dep.mode == "pinned" and dep.pinned_gear == MOVED.to_dict()
            assert AuditEntry.objects.get(event_type="gearbox.gear_pinned").actor == "user:oscar"
            assert page.is_disabled("#pin-button") and not page.is_disabled("#unpin-button")

            # the emergency asks for a reason and a confirmation before anything is sent
            page.click("#emergency-button")
            assert page.is_visible("#emergency-dialog") and page.is_disabled("#emergency-confirm")
            page.fill("#emergency-dialog textarea[name=reason]", "TTFT P95 above the SLO since the move to b1")
            assert page.is_disabled("#emergency-confirm")  # a reason alone is not enough
            page.check("#emergency-dialog input[name=confirm]")
            assert not page.is_disabled("#emergency-confirm")
            assert not Deployment.objects.get(name="chat").emergency_requested_at  # nothing sent yet
            page.click("#emergency-confirm")
            # it comes live, without a reload: waited on as a condition (the timeout only guards a hang;
            # how fast it comes - ~1 s on an idle 2-core machine - is the machine's speed, not a test's)
            page.wait_for_function(
                "() => (document.getElementById('timeline').dataset.labels || '').split('|').includes('#3 emergency')",
                timeout=WAIT_MS)
            assert page.is_hidden("#emergency-dialog")
            page.wait_for_selector("#transitions tr[data-seq='3'][data-kind=emergency]", timeout=WAIT_MS)

            third = Transition.objects.get(deployment__name="chat", seq=3)
            assert third.kind == "emergency" and third.to_gear == Deployment.objects.get(name="chat").baseline_gear
            requested = AuditEntry.objects.get(event_type="gearbox.emergency_requested")
            assert requested.actor == "user:oscar" and "TTFT P95" in requested.summary
            assert Deployment.objects.get(name="chat").mode == "emergency"  # it works on a pinned gear, and holds
            page.wait_for_selector("#gear-target:not([hidden])", timeout=WAIT_MS)
            screenshot(page, "deployment")

    def test_a_viewer_sees_no_control_and_the_api_refuses_the_emergency_anyway(self) -> None:
        from console.gateway import decisions
        from tests.console.gearbox.test_pages import sampled_decision

        sample = sampled_decision()
        decisions.record("chat", sample)  # what a gateway keeps of its routing (the page shows it too)
        learned.keep("chat", [ROLLED_BACK])  # and of its learned weights' rollout
        with chromium() as browser:
            page = log_in(browser, self.live_server_url, "vera", "/deployments/chat/")
            page.wait_for_selector("#live-status[data-state=live]", timeout=WAIT_MS)
            page.wait_for_selector("#timeline[data-rows='2']")
            row = page.locator(f"#route-samples tr[data-chosen='{sample['taken_by']}']")
            assert row.count() >= 1 and "priority 2" in row.first.inner_text()
            assert "memory_bound" in row.first.inner_text() or "4x L40S" in row.first.inner_text()
            stage = page.locator("#router-rollout tr[data-stage=rolled_back]").first.inner_text()
            assert "canary → rolled_back" in stage and "12.0% / 4.0%" in stage and "gw-1:42" in stage
            for selector in ("#controls", "#emergency-button", "#pin-button", "#unpin-button", "#emergency-dialog",
                             "#decisions button"):
                assert page.locator(selector).count() == 0, selector
            status = page.evaluate("""() => fetch('/api/v1/deployments/chat/emergency', {
                method: 'POST', credentials: 'same-origin',
                headers: {'Content-Type': 'application/json',
                          'X-CSRFToken': document.querySelector('[name=csrfmiddlewaretoken]').value},
                body: JSON.stringify({reason: 'I am only a viewer'})}).then(r => r.status)""")
            assert status == 403
            assert Deployment.objects.get(name="chat").emergency_requested_at is None
        decisions._client().delete(learned.PREFIX + "chat")

    def test_a_repeated_stay_is_one_row_whose_count_grows_live(self) -> None:
        deadline = time.monotonic() + 30
        while elsewhere(ticks.tick)["waiting"]:  # until the reports show what the move left
            assert time.monotonic() < deadline, "the reports never showed what the move left"
            elsewhere(self.world.reporter.report, "a1")
            self.report(tokens_per_s=850.0, ttft_p95_ms=160.0)
        for _ in range(2):
            elsewhere(ticks.tick)
        stay = Decision.objects.filter(deployment__name="chat").order_by("-id").first()
        assert stay is not None and stay.outcome == "stay" and stay.repeats == 3, (stay and stay.reasons)
        with chromium() as browser:
            page = log_in(browser, self.live_server_url, "vera", "/deployments/chat/")
            page.wait_for_selector("#live-status[data-state=live]", timeout=WAIT_MS)
            row = page.locator(f"#decisions tr[data-decision='{stay.pk}'][data-repeats='3']")
            row.wait_for(timeout=WAIT_MS)
            assert "×3, last" in row.inner_text()
            page.select_option("#decision-filter", "stay")  # the outcome filter still shows it
            row.wait_for(timeout=WAIT_MS)
            elsewhere(ticks.tick)  # one more: the same row counts it, pushed live
            page.locator(f"#decisions tr[data-decision='{stay.pk}'][data-repeats='4']").wait_for(timeout=WAIT_MS)
            assert page.locator("#decisions tr[data-outcome=stay]").count() == 1

    def test_the_list_the_reviews_and_the_overview_show_the_gearbox_live(self) -> None:
        with chromium() as browser:
            page = log_in(browser, self.live_server_url, "oscar", "/deployments/")
            page.wait_for_selector("#live-status[data-state=live]", timeout=WAIT_MS)
            page.wait_for_selector("#deployments tr[data-deployment=chat][data-health=ok]")
            assert page.get_attribute("#switch-timeline", "data-rows") == "2"
            screenshot(page, "deployments")

            page.goto(f"{self.live_server_url}/deployments/chat/transitions/2/")
            page.wait_for_selector("#live-status[data-state=live]", timeout=WAIT_MS)
            phases = page.get_attribute("section.transition[data-seq='2'] .t-phases", "data-phases")
            assert phases == "prepare,switch,cleanup"
            assert page.locator("#decision[data-decision]").is_visible()
            moved = Transition.objects.get(deployment__name="chat", seq=2)
            assert moved.seqs_migrated + moved.seqs_replayed == 4  # the in-flight requests were handed over
            assert "4 sequences" in page.inner_text("section.transition[data-seq='2'] .t-facts") or \
                f"({moved.seqs_replayed} sequences)" in page.inner_text("section.transition[data-seq='2'] .t-facts")
            screenshot(page, "transition")

            page.goto(f"{self.live_server_url}/")
            page.wait_for_selector("#gearbox-status[data-state=live]", timeout=WAIT_MS)
            page.wait_for_selector("#heatmap[data-grouping=block][data-rows='2']")
            page.wait_for_selector("#overview-deployments tr[data-deployment=chat][data-health=ok]")
            assert page.locator("#recent-switches tbody tr").count() == 2
            # another tenant takes a GPU of chat's gear: the heatmap moves it out of its block, chat degrades
            self.world.reporter.gone = {"GPU-b1-5"}
            self.report(tokens_per_s=640.0, ttft_p95_ms=420.0)
            page.wait_for_selector("#heatmap[data-grouping=block][data-rows='3']", timeout=WAIT_MS)
            page.wait_for_selector("#overview-deployments tr[data-deployment=chat][data-health=degraded]",
                                   timeout=WAIT_MS)
            out = page.evaluate("""() => {
                const d = document.getElementById('heatmap').data[0];
                const row = d.y.indexOf('b1 · out');  // its column is its GPU index
                return [d.customdata[row][5][0], d.text[row][5], d.customdata[row][5][6], d.x[5]]; }""")
            assert out == ["GPU-b1-5", "T", "in no block: not schedulable", "GPU 5"]
            # the gearbox reacts (a topology tick, once a1 too reported what the last move left there): the
            # switch appears among the recent ones
            elsewhere(self.world.reporter.report, "a1")
            assert elsewhere(ticks.tick, trigger="topology")["started"] == ["chat#3"]
            page.wait_for_selector("#recent-switches tr[data-seq='3'][data-kind=auto]", timeout=WAIT_MS)
            screenshot(page, "overview")

            # that decision replayed: the candidates it weighed, side by side
            decision = Decision.objects.get(deployment__name="chat", trigger="topology", outcome="switch")
            page.goto(f"{self.live_server_url}/decisions/{decision.pk}/")
            page.wait_for_selector("#live-status[data-state=live]", timeout=WAIT_MS)
            cards = page.locator("#candidates .candidate").count()
            assert cards == len(decision.candidates) >= 2
            assert page.locator(f"#candidates .candidate.chosen[data-gear='{decision.target_gear_id}']").count() == 1
            page.wait_for_selector("section.transition[data-seq='3']")
            steps = int(page.get_attribute("section.transition[data-seq='3'] .t-steps", "data-steps") or 0)
            assert page.is_hidden("section.transition[data-seq='3'] .t-table") == (steps == 0)  # no empty table
            screenshot(page, "decision")
