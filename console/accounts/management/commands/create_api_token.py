"""Make an API token for a user and print it (it is shown this once)."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from console.accounts.auth import new_api_token


class Command(BaseCommand):
    help = "Print a new API token for USERNAME."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("username")
        parser.add_argument("--name", default="cli", help="what the token is for")

    def handle(self, *args: Any, username: str, name: str, **options: Any) -> None:
        user = get_user_model().objects.filter(username=username).first()
        if user is None:
            raise CommandError(f"username: no user {username!r}")
        _, token = new_api_token(user, name)
        self.stdout.write(token)
