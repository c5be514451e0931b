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
    f = LiveFleet(load_scenario(ROOT / "scenarios" / "demo.yaml"), live_server.url, JOIN, report_interval_s=3600,
                  long_poll_s=None)
    yield f
    f.close()


def test_every_node_enrolls_with_its_own_token_and_reports(fleet: LiveFleet) -> None:
    fleet.step()
    assert sorted(Node.objects.values_list("node_id", flat=True)) == ["a100-b", "h100-a", "l40s-c"]
    assert len({a.client.token for a in fleet.agents.values()}) == 3  # one token per agent, none the join token
    assert JOIN not in {a.client.token for a in fleet.agents.values()}
    assert Gpu.objects.count() == 16 and not Gpu.objects.filter(updated_at=None).exists()
    # l40s-c has one GPU held by another tenant from the start; nothing of ours runs before the
    # controller commands it (tests/console/gearbox/test_end_to_end.py brings the baselines up)
    assert Gpu.objects.filter(node__node_id="l40s-c", allocatable=False).count() == 1
    assert Gpu.objects.filter(node__node_id="h100-a", sm_util__gt=0).count() == 0


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


def test_a_fault_flag_names_what_is_wrong() -> None:
    from agents.sim.live import parse_fault

    f = parse_fault("h100-a:prepare_plan:hang:2")
    assert (f.node, f.kind, f.action, f.times) == ("h100-a", "prepare_plan", "hang", 2)
    for bad, word in (("h100-a:reboot:fail", "KIND"), ("h100-a:*:explode", "ACTION"), ("x:*:fail:0", "TIMES"),
                      ("x:fail", "expected")):
        with pytest.raises(ValueError, match=word):
            parse_fault(bad)


def test_a_command_with_a_bad_payload_is_refused_naming_the_field() -> None:
    from agents.protocol import Command
    from agents.sim.live import HttpMailbox

    box = HttpMailbox()
    box.deliver("h100-a", [Command(7, "freeze_plan", {"plan_id": "p-1", "deployment": "d", "routing_version": -1}),
                           Command(8, "teleport", {})])
    acks = {cid: ack for _, cid, ack in box.acks()}
    assert acks[7].status == "failed" and "payload.routing_version" in acks[7].detail
    assert acks[8].status == "failed" and "kind" in acks[8].detail
    assert box.take("h100-a") == []
