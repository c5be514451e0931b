"""Issue (or rotate) the token of one node's agent, for clusters that keep enrollment closed."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from agents.protocol import NODE_ID_RE
from console.fleet.actions import hash_token, new_agent_token
from console.fleet.models import Node


class Command(BaseCommand):
    help = "Print a new agent token for NODE_ID; the node's agent registers with it."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("node_id")

    def handle(self, *args: Any, node_id: str, **options: Any) -> None:
        if not NODE_ID_RE.match(node_id):
            raise CommandError("node_id: 1-64 letters, digits, '.', '_' or '-'")
        token = new_agent_token()
        node, created = Node.objects.get_or_create(
            node_id=node_id,
            defaults={"hostname": node_id, "agent_version": "", "token_hash": hash_token(token),
                      "registered_at": timezone.now()},
        )
        if not created:
            Node.objects.filter(pk=node.pk).update(token_hash=hash_token(token))
        self.stdout.write(token)
