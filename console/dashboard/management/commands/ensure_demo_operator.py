"""Create the demo's two logins once: an operator and an admin, credentials from the environment or generated.

    operator  FLEXPIPE_OPERATOR_USER (default "operator"), FLEXPIPE_OPERATOR_PASSWORD: steers the gears
    admin     FLEXPIPE_ADMIN_USER (default "admin"), FLEXPIPE_ADMIN_PASSWORD: also registers models, manages
              users (the Users page) and may use Django's /admin/ (staff and superuser)

Without a password in the environment one is generated, printed this once and kept in
.run/<role>-password (mode 0600) so a newcomer who missed the line can still log in; another
database of the same checkout (make run keeps one per engine and scenario) gets the same one. A
password set in the environment later replaces the stored one on the next run. The operator also gets an API
token (for scripts and the OpenAI gateway), kept in .run/operator-token.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.management.base import BaseCommand

from console.accounts.roles import ADMIN, OPERATOR, ROLES


class Command(BaseCommand):
    help = "Create the demo operator and admin (idempotent)."

    def handle(self, *args: Any, **options: Any) -> None:
        operator = os.environ.get("FLEXPIPE_OPERATOR_USER", "operator")
        self.ensure(OPERATOR, operator, os.environ.get("FLEXPIPE_OPERATOR_PASSWORD", ""))
        self.ensure(ADMIN, os.environ.get("FLEXPIPE_ADMIN_USER", "admin"), os.environ.get("FLEXPIPE_ADMIN_PASSWORD", ""))
        self.ensure_token(operator)

    def ensure_token(self, username: str) -> None:
        """The operator's API token for scripts and the OpenAI gateway, kept in .run/operator-token
        (0600): made once, valid in every database of the checkout."""
        from console.accounts.auth import TOKEN_PREFIX, hash_token
        from console.accounts.models import ApiToken

        path = Path(settings.BASE_DIR) / ".run" / "operator-token"
        token = path.read_text().strip() if path.is_file() else ""
        if not token.startswith(TOKEN_PREFIX):
            token = TOKEN_PREFIX + secrets.token_urlsafe(32)
            path.parent.mkdir(exist_ok=True)
            path.write_text(token + "\n")
            path.chmod(0o600)
        user = get_user_model().objects.get(username=username)
        if not ApiToken.objects.filter(token_hash=hash_token(token)).exists():
            from django.utils import timezone

            ApiToken.objects.create(user=user, name="make run", prefix=token[:10], token_hash=hash_token(token),
                                    created_at=timezone.now())
        self.stdout.write(f"demo API token of {username!r} in {path} (Authorization: Bearer ...)")

    @staticmethod
    def _grant(user: Any, role: str) -> None:
        user.groups.remove(*Group.objects.filter(name__in=ROLES))
        user.groups.add(Group.objects.get_or_create(name=role)[0])

    def ensure(self, role: str, username: str, password: str) -> None:
        User = get_user_model()
        user = User.objects.filter(username=username).first()
        what = f"demo {role}"
        if user is not None:
            if password and not user.check_password(password):
                user.set_password(password)
                user.save(update_fields=["password"])
                self.stdout.write(f"{what} {username!r}: password reset from FLEXPIPE_{role.upper()}_PASSWORD")
            else:
                self.stdout.write(f"{what} {username!r} exists (password in .run/{role}-password unless you set "
                                  f"FLEXPIPE_{role.upper()}_PASSWORD)")
            return
        secret = Path(settings.BASE_DIR) / ".run" / f"{role}-password"
        if not password and secret.is_file() and secret.read_text().strip():
            # another database of this checkout (make run keeps one per engine and scenario): the same
            # login works in each, so the password printed the first time stays the one to use
            password = secret.read_text().strip()
            User.objects.create_user(username=username, password=password, is_staff=True, is_superuser=role == ADMIN)
            self._grant(User.objects.get(username=username), role)
            self.stdout.write(self.style.SUCCESS(f"{what} created: user {username!r}, password in {secret}"))
            return
        generated = not password
        password = password or secrets.token_urlsafe(12)
        user = User.objects.create_user(username=username, password=password, is_staff=True,
                                        is_superuser=role == ADMIN)
        self._grant(user, role)
        if generated:
            secret.parent.mkdir(exist_ok=True)
            secret.write_text(password + "\n")
            secret.chmod(0o600)
            self.stdout.write(self.style.SUCCESS(
                f"{what} created: user {username!r}, password {password!r} (also in {secret})"))
        else:
            self.stdout.write(self.style.SUCCESS(f"{what} {username!r} created with FLEXPIPE_{role.upper()}_PASSWORD"))
