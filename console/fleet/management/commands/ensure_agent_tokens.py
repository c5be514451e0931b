"""Give the local fleet of `make run` the tokens its agents would have kept.

The join token re-enrolls no node (DESIGN.md invariant 8), and an agent keeps its own token in a
file. A node this database knows whose agent has no such file - a database made before agents kept
their tokens, or a wiped .run/ - would be refused for good; `make run` is its operator, so it
issues that node a token (audited as fleet.agent_token_issued) and writes it where the agent looks.

    python manage.py ensure_agent_tokens SCENARIO DIR
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand
from django.utils import timezone

from agents.client import save_token
from agents.sim.scenario import load_scenario
from console.audit.chain import actor_of
from console.fleet.actions import do_issue_agent_token
from console.fleet.models import Node


class Command(BaseCommand):
    help = "Issue a token for each enrolled node of SCENARIO whose agent keeps none in DIR."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("scenario")
        parser.add_argument("dir")

    def handle(self, *args: Any, scenario: str, dir: str, **options: Any) -> None:
        folder = Path(dir)
        names = [n.id for n in load_scenario(scenario).nodes]
        for node_id in Node.objects.filter(node_id__in=names).values_list("node_id", flat=True):
            path = folder / f"{node_id}.token"
            if path.exists():
                continue
            _, token = do_issue_agent_token(node_id, actor=actor_of(system="make run"), now=timezone.now())
            save_token(path, token)
            self.stdout.write(f"issued a token for {node_id}'s agent: {path}")
