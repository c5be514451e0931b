"""A real browser walks the navigation: every item leads to its page, which highlights it."""

from __future__ import annotations

import os

import pytest

from tests.browser import WAIT_MS, screenshot
from tests.console.pagetools import LivePageTestCase, chromium, log_in
from tests.console.people import make_person

os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")

pytestmark = [pytest.mark.browser]


class NavigationInTheBrowser(LivePageTestCase):

    def setUp(self) -> None:
        make_person("oscar", "operator")

    def test_each_navigation_item_opens_its_page_and_is_highlighted_there(self) -> None:
        with chromium() as browser:
            page = log_in(browser, self.live_server_url, "oscar", "/")
            # (the gearbox pages' browser tests take the screenshots of Deployments and Overview)
            for key, path, shot in (("deployments", "/deployments/", None), ("audit", "/audit/", None),
                                    ("registry", "/registry/", None), ("alerts", "/alerts/", "alerts"),
                                    ("overview", "/", None)):
                page.click(f"nav.main-nav a[data-nav={key}]")
                page.wait_for_url(self.live_server_url + path)
                assert page.get_attribute("nav.main-nav a.active", "data-nav") == key
                if key == "overview":
                    page.wait_for_selector("#live-status[data-state=live]", timeout=WAIT_MS)
                if shot:
                    screenshot(page, shot)
            page.click("nav.main-nav a[data-nav=api]")
            page.wait_for_selector(".swagger-ui .opblock-tag", timeout=WAIT_MS)  # Swagger UI, all local
            screenshot(page, "api-docs")
