"""Debian's Chromium driven by Playwright (never a downloaded browser), for browser tests."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = os.environ.get("FLEXPIPE_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"
# How long a browser test waits for a condition (a selector, a value on the page) before it fails.
# Only a hang waits this long: a wait returns as soon as its condition holds. It is generous because
# CI runs the suite with every core busy, where a page that answers in 0.5 s alone took over 5 s.
WAIT_MS = int(os.environ.get("FLEXPIPE_BROWSER_WAIT_MS", "60000"))
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
]


def require_chromium() -> None:
    if not (Path(CHROMIUM).exists() or shutil.which(CHROMIUM)):
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium (apt-get install chromium); "
                    ".ci/run does it for CI")


def launch(playwright: Any) -> Any:
    require_chromium()
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)


def screenshot(page: Any, name: str) -> Path:
    """Save the whole page as artifacts/<name>.png (kept as a test artifact)."""
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path
