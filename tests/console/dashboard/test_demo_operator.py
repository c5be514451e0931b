"""manage.py ensure_demo_operator: the login `make run` hands a newcomer (credentials from env or printed once)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import authenticate, get_user_model
from django.core.management import call_command

from console.accounts.roles import OPERATOR, has_role

pytestmark = pytest.mark.django_db


def run() -> str:
    out = io.StringIO()
    call_command("ensure_demo_operator", stdout=out)
    return out.getvalue()


@pytest.fixture
def base_dir(tmp_path: Path, settings: Any, monkeypatch: pytest.MonkeyPatch) -> Path:
    settings.BASE_DIR = tmp_path  # .run/operator-password lands here, not in the checkout
    monkeypatch.delenv("FLEXPIPE_OPERATOR_USER", raising=False)
    monkeypatch.delenv("FLEXPIPE_OPERATOR_PASSWORD", raising=False)
    return tmp_path


def test_without_a_password_in_the_env_one_is_generated_printed_once_and_kept_private(base_dir: Path) -> None:
    first = run()
    secret = base_dir / ".run" / "operator-password"
    password = secret.read_text().strip()
    assert len(password) >= 12
    assert f"password {password!r}" in first and "user 'operator'" in first
    assert secret.stat().st_mode & 0o777 == 0o600
    user = authenticate(username="operator", password=password)
    assert user is not None and has_role(user, OPERATOR)

    second = run()  # the next `make run`: the password is not printed again, nor changed
    assert password not in second and "exists" in second
    assert get_user_model().objects.filter(username="operator").count() == 1
    assert authenticate(username="operator", password=password) is not None


def test_credentials_from_the_env_are_used_and_nothing_is_written(base_dir: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEXPIPE_OPERATOR_USER", "ops")
    monkeypatch.setenv("FLEXPIPE_OPERATOR_PASSWORD", "from-the-env-1")
    out = run()
    assert "from-the-env-1" not in out and "'ops' created" in out
    assert not (base_dir / ".run" / "operator-password").exists()
    assert authenticate(username="ops", password="from-the-env-1") is not None

    # a new password in the env replaces the old one on the next run
    monkeypatch.setenv("FLEXPIPE_OPERATOR_PASSWORD", "changed-in-env-2")
    assert "password reset" in run()
    assert authenticate(username="ops", password="changed-in-env-2") is not None
    assert authenticate(username="ops", password="from-the-env-1") is None
