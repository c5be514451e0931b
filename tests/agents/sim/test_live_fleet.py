"""The simulated fleet against a real console over real HTTP (pytest-django's live server)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from agents.sim.live import LiveFleet
from agents.sim.scenario import load_scenario
from console.fleet.models import Gpu, Node

ROOT = Path(__file__).resolve().parents[3]
JOIN = "fpj_fleet-test"
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def fleet(live_server: Any, settings: Any) -> Any:
    settings.FLEXPIPE_ENROLL_TOKEN = JOIN
    f = LiveFleet(load_scenario(ROOT / "scenarios" / "demo.yaml"), live_server.url, JOIN, report_interval_s=3600)
    yield f
    f.close()


def test_every_node_enrolls_with_its_own_token_and_reports(fleet: LiveFleet) -> None:
    fleet.step()
    assert sorted(Node.objects.values_list("node_id", flat=True)) == ["a100-b", "h100-a", "l40s-c"]
    assert len({a.client.token for a in fleet.agents.values()}) == 3  # one token per agent, none the join token
    assert JOIN not in {a.client.token for a in fleet.agents.values()}
    assert Gpu.objects.count() == 16 and not Gpu.objects.filter(updated_at=None).exists()
    # l40s-c has one GPU held by another tenant from the start; the baselines load h100-a.
    assert Gpu.objects.filter(node__node_id="l40s-c", allocatable=False).count() == 1
    busy = Gpu.objects.filter(node__node_id="h100-a", sm_util__gt=0).count()
    assert busy == 6  # chat-8b on 2 GPUs and summarize-70b on 4


def test_a_scenario_event_reaches_the_console_at_once(fleet: LiveFleet) -> None:
    fleet.step()
    fleet.t0 = time.monotonic() - 50  # 50 simulated seconds later: past the preemption at 45 s
    fleet.step()
    held = Gpu.objects.filter(node__node_id="h100-a", allocatable=False)
    assert held.count() == 4
    assert Node.objects.get(node_id="h100-a").last_seq == 2


def test_it_enrolls_again_when_the_console_forgets_it(fleet: LiveFleet) -> None:
    fleet.step()
    Node.objects.all().delete()  # a fresh database behind the same URL
    fleet.agents["h100-a"].dirty = True
    fleet.step()  # the report is refused (401): the agent drops its token
    fleet.step()  # ... and enrolls again with the join token
    assert Node.objects.filter(node_id="h100-a").exists()
