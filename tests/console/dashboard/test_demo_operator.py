"""manage.py ensure_demo_operator: the logins `make run` hands a newcomer - an operator and an admin -
credentials from the env or printed once."""

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
    monkeypatch.delenv("FLEXPIPE_ADMIN_USER", raising=False)
    monkeypatch.delenv("FLEXPIPE_ADMIN_PASSWORD", raising=False)
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


def test_a_newcomer_gets_an_admin_too_who_may_use_the_admin_site_and_the_users_page(base_dir: Path) -> None:
    from django.test import Client

    from console.accounts.roles import ADMIN

    out = run()
    password = (base_dir / ".run" / "admin-password").read_text().strip()
    assert f"demo admin created: user 'admin', password {password!r}" in out
    assert (base_dir / ".run" / "admin-password").stat().st_mode & 0o777 == 0o600
    admin = authenticate(username="admin", password=password)
    assert admin is not None and has_role(admin, ADMIN) and admin.is_superuser
    client = Client()
    assert client.login(username="admin", password=password)
    page = client.get("/admin/")
    assert page.status_code == 200 and "permission" not in page.content.decode().lower()
    assert client.get("/users/").status_code == 200
    operator = authenticate(username="operator", password=(base_dir / ".run" / "operator-password").read_text().strip())
    assert operator is not None and not has_role(operator, ADMIN)
    assert "admin" in run() and password not in run()  # the next run: exists, not printed again


def test_another_database_of_the_checkout_gets_the_same_logins(base_dir: Path) -> None:
    run()
    passwords = {r: (base_dir / ".run" / f"{r}-password").read_text().strip() for r in ("operator", "admin")}
    get_user_model().objects.all().delete()  # what a fresh database of another scenario holds
    out = run()
    assert all(p not in out for p in passwords.values()) and "password in" in out
    assert {r: (base_dir / ".run" / f"{r}-password").read_text().strip() for r in passwords} == passwords
    assert authenticate(username="operator", password=passwords["operator"]) is not None
    assert authenticate(username="admin", password=passwords["admin"]) is not None


def test_the_operator_gets_an_api_token_kept_for_every_database(base_dir: Path) -> None:
    from django.test import Client

    run()
    token = (base_dir / ".run" / "operator-token").read_text().strip()
    assert token.startswith("fpu_") and (base_dir / ".run" / "operator-token").stat().st_mode & 0o777 == 0o600
    me = Client(headers={"Authorization": f"Bearer {token}"}).get("/api/v1/me")
    assert me.status_code == 200 and me.json() == {"username": "operator", "role": "operator"}
    get_user_model().objects.all().delete()
    run()  # another database: the same token works there too
    assert (base_dir / ".run" / "operator-token").read_text().strip() == token
    assert Client(headers={"Authorization": f"Bearer {token}"}).get("/api/v1/me").status_code == 200
