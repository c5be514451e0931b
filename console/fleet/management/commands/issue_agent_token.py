"""Issue (or rotate) the token of one node's agent: for clusters that keep enrollment closed, and the
operator's approval to re-enroll a node that is enrolled already (console.fleet.actions)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from agents.protocol import NODE_ID_RE
from console.audit.chain import actor_of
from console.fleet.actions import do_issue_agent_token


class Command(BaseCommand):
    help = "Print a new agent token for NODE_ID; the node's agent registers with it."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("node_id")

    def handle(self, *args: Any, node_id: str, **options: Any) -> None:
        if not NODE_ID_RE.match(node_id):
            raise CommandError("node_id: 1-64 letters, digits, '.', '_' or '-'")
        _, token = do_issue_agent_token(node_id, actor=actor_of(system="manage.py issue_agent_token"),
                                        now=timezone.now())
        self.stdout.write(token)
