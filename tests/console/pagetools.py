"""Helpers for browser tests of the console's pages: people with passwords and a logged-in page."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

from channels.testing import ChannelsLiveServerTestCase
from daphne.testing import DaphneProcess
from django.db import connections
from playwright.sync_api import sync_playwright

from tests.browser import WAIT_MS, launch
from tests.console.people import PASSWORD

T = TypeVar("T")


class _ForkedDaphne(DaphneProcess):
    def run(self) -> None:
        # The server is forked from the test process, which may have run async tests before. A fork
        # keeps only the forking thread, so asgiref's thread-sensitive executor would point at a worker
        # thread that does not exist here (every database_sync_to_async call, the websocket login
        # included, would wait forever); and a channel layer carried over would share the parent's
        # Redis connections and client prefix. Start both afresh.
        from asgiref.sync import SyncToAsync
        from channels.layers import channel_layers

        SyncToAsync.single_thread_executor = ThreadPoolExecutor(max_workers=1)
        channel_layers.backends.clear()
        super().run()


class LivePageTestCase(ChannelsLiveServerTestCase):
    """A live daphne (HTTP and websockets) serving the console and its static files, for a real browser."""

    serve_static = True
    ProtocolServerProcess = _ForkedDaphne


@contextmanager
def chromium() -> Iterator[Any]:
    """Debian's Chromium for one test.

    While Playwright's sync API runs, its event loop makes Django keep a separate database
    connection for ORM calls made by the test (connections are context-local under a running
    loop); it is closed here, or the test database could not be dropped at the end.
    """
    with sync_playwright() as pw:
        browser = launch(pw)
        try:
            yield browser
        finally:
            browser.close()
            connections.close_all()


def log_in(browser: Any, base_url: str, username: str, path: str) -> Any:
    """A fresh browser context, logged in through the real login form, on `path`."""
    context = browser.new_context(viewport={"width": 1360, "height": 900})
    context.set_default_timeout(WAIT_MS)  # clicks, fills and waits with no timeout of their own
    page = context.new_page()
    page.goto(base_url + path)
    assert "/login/" in page.url, page.url  # every page needs a login
    page.fill("input[name=username]", username)
    page.fill("input[name=password]", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url(base_url + path)
    return page


def elsewhere(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run a write (and its on-commit push) in a thread of its own, as a web or Celery process would.

    Playwright's sync API keeps an event loop running in the test's thread, where the push's
    async_to_sync may not run. The thread closes its database connection when it is done.
    """
    result: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread below
            errors.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]
