"""Create the demo operator once: credentials from the environment, or a generated password.

FLEXPIPE_OPERATOR_USER (default "operator") and FLEXPIPE_OPERATOR_PASSWORD. Without a password
in the environment one is generated, printed this once and kept in .run/operator-password
(mode 0600) so a newcomer who missed the line can still log in.
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


class Command(BaseCommand):
    help = "Create the demo operator (idempotent)."

    def handle(self, *args: Any, **options: Any) -> None:
        username = os.environ.get("FLEXPIPE_OPERATOR_USER", "operator")
        password = os.environ.get("FLEXPIPE_OPERATOR_PASSWORD", "")
        User = get_user_model()
        user = User.objects.filter(username=username).first()
        if user is not None:
            if password and not user.check_password(password):
                user.set_password(password)
                user.save(update_fields=["password"])
                self.stdout.write(f"demo operator {username!r}: password reset from FLEXPIPE_OPERATOR_PASSWORD")
            else:
                self.stdout.write(f"demo operator {username!r} exists (password in .run/operator-password "
                                  "unless you set FLEXPIPE_OPERATOR_PASSWORD)")
            return
        generated = not password
        password = password or secrets.token_urlsafe(12)
        user = User.objects.create_user(username=username, password=password, is_staff=True)
        group, _ = Group.objects.get_or_create(name="operator")
        user.groups.add(group)
        if generated:
            run_dir = Path(settings.BASE_DIR) / ".run"
            run_dir.mkdir(exist_ok=True)
            secret = run_dir / "operator-password"
            secret.write_text(password + "\n")
            secret.chmod(0o600)
            self.stdout.write(self.style.SUCCESS(
                f"demo operator created: user {username!r}, password {password!r} (also in {secret})"))
        else:
            self.stdout.write(self.style.SUCCESS(f"demo operator {username!r} created with FLEXPIPE_OPERATOR_PASSWORD"))
