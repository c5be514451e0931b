"""Ask the agents to measure their links again now (probe_links; console/fleet/links.py)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from console.fleet.links import do_request_link_probes
from console.fleet.models import Node


class Command(BaseCommand):
    help = "Every named node (default: all) measures its links to every other node now."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("node_ids", nargs="*", help="nodes to ask (default: every node with a data address)")

    def handle(self, *args: Any, node_ids: list[str], **options: Any) -> None:
        unknown = sorted(set(node_ids) - set(Node.objects.values_list("node_id", flat=True)))
        if unknown:
            raise CommandError(f"node_ids: unknown node(s) {', '.join(unknown)}")
        asked = do_request_link_probes(node_ids or None, now=timezone.now(), actor="system:manage")
        self.stdout.write(f"asked {len(asked)} node(s): {', '.join(asked) or 'none (no node has a data address)'}")
