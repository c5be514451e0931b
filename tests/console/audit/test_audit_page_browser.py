"""A real browser on the Audit page: the chain badge, and new entries arriving without a reload."""

from __future__ import annotations

import os

import pytest
from django.utils import timezone

from console.audit.chain import record
from tests.browser import WAIT_MS, screenshot
from tests.console.pagetools import LivePageTestCase, chromium, elsewhere, log_in
from tests.console.people import make_person

os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # Playwright's sync API next to the ORM

pytestmark = [pytest.mark.browser]


class AuditPageInTheBrowser(LivePageTestCase):

    def setUp(self) -> None:
        make_person("vera", "viewer")
        now = timezone.now()
        record("registry.version_registered", actor="user:alice", summary="tiny-llama v1 registered", at=now,
               data={"sha256": "ab" * 32}, after={"status": "awaiting_agent"})
        record("fleet.node_registered", actor="agent:a1", summary="a1 enrolled with 4 GPU(s)", at=now)
        record("registry.version_quarantined", actor="agent:a1", summary="tiny-llama v1 quarantined", at=now,
               before={"status": "awaiting_agent"}, after={"status": "quarantined"})

    def test_a_viewer_sees_the_chain_intact_and_new_entries_arrive_live_without_reload(self) -> None:
        with chromium() as browser:
            page = log_in(browser, self.live_server_url, "vera", "/audit/")
            page.wait_for_selector("#chain-status[data-state=ok]", timeout=WAIT_MS)
            assert page.inner_text("#chain-status") == "chain intact · 3 entries verified"
            page.wait_for_selector("#live-status[data-state=live]", timeout=WAIT_MS)
            assert page.locator("#audit-table tr.entry").count() == 3
            page.evaluate("window.__sameDocument = true")  # a reload would wipe it

            elsewhere(record, "registry.version_retired", actor="user:alice", summary="tiny-llama v1 retired: live",
                      at=timezone.now(), before={"status": "quarantined"}, after={"status": "retired"})
            row = page.wait_for_selector("#audit-table tr.entry[data-seq='4']", timeout=WAIT_MS)
            assert "tiny-llama v1 retired: live" in row.inner_text()
            assert page.locator("#audit-table tr.entry").first.get_attribute("data-seq") == "4"  # newest first
            assert page.evaluate("window.__sameDocument") is True

            row.click()  # the entry opens to its before/after and hashes
            detail = page.wait_for_selector("#audit-table tr.detail pre")
            assert '"status": "retired"' in detail.inner_text() and "prev " in detail.inner_text()

            page.click("#verify-again")
            page.wait_for_selector("#chain-status[data-checked='4']", timeout=WAIT_MS)
            screenshot(page, "audit")

    def test_a_filtered_page_only_takes_live_entries_that_match_its_filter(self) -> None:
        with chromium() as browser:
            page = log_in(browser, self.live_server_url, "vera", "/audit/?type=registry.*")
            page.wait_for_selector("#live-status[data-state=live]", timeout=WAIT_MS)
            assert page.locator("#audit-table tr.entry").count() == 2
            elsewhere(record, "fleet.node_registered", actor="agent:b1", summary="b1 enrolled", at=timezone.now())
            elsewhere(record, "registry.version_registered", actor="user:alice", summary="v2 registered",
                      at=timezone.now())
            page.wait_for_selector("#audit-table tr.entry[data-seq='5']", timeout=WAIT_MS)
            assert page.locator("#audit-table tr.entry[data-seq='4']").count() == 0
            assert page.evaluate("window.FlexPipe.audit.live") == 2  # both arrived; one was filtered out
