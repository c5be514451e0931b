"""Production defaults: DEBUG is off unless asked for, the demo's SECRET_KEY is refused without it, and
the machine paths (/api, /agent, /v1) answer every error in JSON - a body over the limit with 413."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from tests.console.people import Person

ROOT = Path(__file__).resolve().parents[3]
BIG = b"x" * (20 * 2**20)


def _settings(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("DEBUG", "SECRET_KEY")}
    code = "import django.conf as c; c.settings.DEBUG; print('DEBUG', c.settings.DEBUG)"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**clean, "DJANGO_SETTINGS_MODULE": "console.settings", **env})


def test_debug_is_off_unless_asked_for() -> None:
    out = _settings({"SECRET_KEY": "k" * 50})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "DEBUG False"
    assert _settings({"DEBUG": "1"}).stdout.strip() == "DEBUG True"  # make run's demo: the dev key is fine


@pytest.mark.parametrize("env", [{}, {"SECRET_KEY": "dev-only-insecure-key-flexpipe"}, {"DEBUG": "0"}])
def test_without_debug_the_settings_refuse_a_missing_or_default_secret_key(env: dict[str, str]) -> None:
    out = _settings(env)
    assert out.returncode != 0
    assert "SECRET_KEY must be set, and not to the development default, when DEBUG is off" in out.stderr


@pytest.mark.django_db
@pytest.mark.parametrize("debug", [False, True])
def test_a_body_over_the_limit_is_a_json_413_on_the_api(operator: Person, settings: Any, debug: bool) -> None:
    settings.DEBUG = debug
    resp = operator.api().post("/api/v1/deployments/chat/emergency", BIG, content_type="application/json")
    assert resp.status_code == 413
    assert resp["Content-Type"] == "application/json"
    assert resp.json() == {"detail": f"body: {len(BIG)} bytes is over the limit of 2621440 bytes",
                           "code": "body_too_large"}


@pytest.mark.django_db
def test_a_body_over_the_limit_is_an_openai_413_on_the_gateway(operator: Person, settings: Any) -> None:
    settings.DEBUG = True
    resp = operator.api().post("/v1/completions", BIG, content_type="application/json")
    assert resp.status_code == 413
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "body_too_large"
    assert "over the limit" in err["message"]


@pytest.mark.django_db
def test_a_body_just_under_the_limit_is_read_as_usual(operator: Person) -> None:
    body = b'{"reason": "' + b"r" * 400 + b'"}'
    resp = operator.api().post("/api/v1/deployments/nope/emergency", body, content_type="application/json")
    assert resp.status_code == 404 and resp["Content-Type"] == "application/json"


@pytest.mark.django_db
@pytest.mark.parametrize("debug", [False, True])
def test_an_unknown_api_path_is_a_json_404_even_with_debug(viewer: Person, settings: Any, debug: bool) -> None:
    settings.DEBUG = debug
    resp = viewer.api().get("/api/v1/no-such-thing")
    assert resp.status_code == 404 and resp["Content-Type"] == "application/json"
    assert resp.json() == {"detail": "Not Found: /api/v1/no-such-thing"}
    resp = viewer.api().get("/v1/no-such-thing")
    assert resp.status_code == 404 and resp.json()["error"]["type"] == "not_found_error"


@pytest.mark.django_db
def test_pages_keep_their_html_errors(viewer: Person) -> None:
    resp = viewer.browser().get("/deployments/no-such-deployment/")
    assert resp.status_code == 404 and resp["Content-Type"].startswith("text/html")


@pytest.mark.django_db
def test_an_agent_report_over_the_limit_is_a_json_413() -> None:
    resp = Client().post("/agent/v1/report", BIG, content_type="application/json",
                         headers={"Authorization": "Bearer fpa_x"})
    assert resp.status_code == 413 and resp.json()["code"] == "body_too_large"
