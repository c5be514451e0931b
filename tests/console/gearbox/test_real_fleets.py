"""The console's tick under real-fleet rules: back-off after refused PREPAREs, staged switches that
go on once their first stage is done, the fragment history, latency-critical deployments, and the
links the planner assumes or measured (issue 13)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from agents.sim.faults import Fault
from console.audit.models import AuditEntry
from console.fleet.links import link_table
from console.fleet.models import BlockTrajectory, Node, NodeLink
from console.gearbox import ticks
from console.gearbox.actions import do_decide_gear, held_gpus
from console.gearbox.models import Decision, Deployment, Transition
from console.gearbox.snapshot import fleet_snapshot
from scheduler.gearbox import Trigger
from scheduler.plan import Gear
from tests.console.gearbox.harness import SimAgents, enroll_fleet, gear, make_deployment
from tests.console.gearbox.test_gearbox_actions import bring_up, drive

pytestmark = pytest.mark.django_db


def test_a_refused_prepare_puts_the_plan_on_back_off_and_the_next_decisions_say_until_when(operator: Any) -> None:
    rep = enroll_fleet()
    make_deployment("chat", baseline=gear("a1", [0, 1]))
    agents = SimAgents()
    bring_up(agents)
    # an operator's gear on b1, whose agent refuses every prepare (it lacks the weights, say)
    agents.fleet.inject(Fault("b1", "prepare_plan", "fail", times=100))
    from console.gearbox.actions import do_request_gear

    do_request_gear("chat", gear("b1", [0, 1, 2, 3]), actor=operator.user)
    assert drive(agents).phase == "rolled_back"
    for node in ("a1", "b1"):  # the agents report what the rollback left
        rep.report(node)
    dep = Deployment.objects.get(name="chat")
    from console.gearbox.actions import do_record_load
    from scheduler.gearbox import LoadSample

    t = timezone.now().timestamp()
    for i in range(5):  # load enough to want more than the baseline
        do_record_load(dep, LoadSample(t - 60 + 15 * i, 40.0, 512, 200))
    # the tick folds the refusal in; automatic decisions then wait, and say so
    out = do_decide_gear("chat", trigger=Trigger.PERIODIC, now=timezone.now(), base=fleet_snapshot(timezone.now()),
                         held=held_gpus())
    dep.refresh_from_db()
    assert dep.backoff["book"]["streak"] == 1 and dep.backoff["book"]["entries"]
    assert out.decision is not None and out.transition is None
    assert any("backing off until" in r for r in out.decision.reasons), out.decision.reasons
    # folding is idempotent: the same finished transitions count once
    do_decide_gear("chat", trigger=Trigger.PERIODIC, now=timezone.now(), base=fleet_snapshot(timezone.now()),
                   held=held_gpus())
    assert Deployment.objects.get(name="chat").backoff["book"]["streak"] == 1


def test_a_staged_switch_goes_on_to_its_second_stage_when_the_first_is_done() -> None:
    rep = enroll_fleet()
    make_deployment("chat", baseline=gear("a1", [0, 1]))
    agents = SimAgents()
    bring_up(agents)
    dep = Deployment.objects.get(name="chat")
    # as a decision that chose a staged path leaves it: the first stage (to b1) started, the
    # target (back on a1, reshaped) remembered
    target = gear("a1", [0, 1, 2, 3], kv=100_000)
    from console.gearbox.actions import _start
    from scheduler.transition import Kind

    first = _start(dep, gear("b1", [0, 1]), kind=Kind.AUTO, decision=None, actor="system:test")
    assert first is not None
    Deployment.objects.filter(pk=dep.pk).update(staged_gear=target.to_dict(), staged_seq=first.seq,
                                                staged_kind="auto")
    assert drive(agents).phase == "done"
    for node in ("a1", "b1"):  # the agents report what the first stage left
        rep.report(node)
    out = ticks.tick(trigger="ended", deployment="chat")
    assert out["started"] == ["chat#3"], out
    row = Transition.objects.get(deployment=dep, seq=3)
    assert Gear.from_dict(row.to_gear) == target and row.decision is not None
    assert row.decision.decision["stage"] == 2
    assert Deployment.objects.get(name="chat").staged_gear is None  # consumed
    assert drive(agents).phase == "done"


def test_every_tick_records_the_blocks_trajectories_and_a_shrink_lowers_their_stability() -> None:
    rep = enroll_fleet()
    make_deployment("chat", baseline=gear("a1", [0, 1]))
    ticks.tick()
    assert BlockTrajectory.objects.filter(block_id="a1/nvlnvl0").exists()
    rep.gone = {"GPU-a1-6", "GPU-a1-7"}  # another tenant takes two GPUs of a1's block
    rep.report("a1")
    ticks.tick()
    points = BlockTrajectory.objects.get(block_id="a1/nvlnvl0").points
    assert [n for _, n in points] == [8, 6]


def test_latency_critical_is_set_through_the_api_audited_and_shown_on_the_deployment_page(
        operator: Any, viewer: Any) -> None:
    enroll_fleet()
    make_deployment("chat", baseline=gear("a1", [0, 1]))
    assert viewer.api().post("/api/v1/deployments/chat/latency-critical", {"latency_critical": True},
                             content_type="application/json").status_code == 403
    client = operator.api()
    resp = client.post("/api/v1/deployments/chat/latency-critical", {"latency_critical": "maybe"},
                       content_type="application/json")
    assert resp.status_code == 400 and "latency_critical" in resp.json()
    assert not Deployment.objects.get(name="chat").latency_critical
    resp = client.post("/api/v1/deployments/chat/latency-critical", {"latency_critical": True},
                       content_type="application/json")
    assert resp.status_code == 200 and resp.json()["latency_critical"] is True
    assert AuditEntry.objects.filter(event_type="gearbox.latency_critical_set").count() == 1
    page = operator.browser().get("/deployments/chat/").content.decode()
    assert 'data-testid="latency-critical">yes<' in page and 'data-testid="blocks-table"' in page
    assert 'data-testid="latency-critical-toggle"' in page  # operators get the control
    assert 'latency-critical-toggle' not in viewer.browser().get("/deployments/chat/").content.decode()


def test_the_deployment_page_shows_the_stability_of_the_blocks_its_plans_use(viewer: Any) -> None:
    enroll_fleet()
    make_deployment("chat", baseline=gear("a1", [0, 1]))
    agents = SimAgents()
    bring_up(agents)
    page = viewer.browser().get("/deployments/chat/").content.decode()
    assert 'data-block="a1/nvlnvl0"' in page and ">1.00<" in page


def test_links_are_measured_or_assumed_and_the_overview_says_which(viewer: Any, settings: Any) -> None:
    settings.FLEXPIPE_INTRA_RACK_GBPS, settings.FLEXPIPE_INTER_RACK_GBPS = 25.0, 10.0
    enroll_fleet({"a1": "A", "a2": "A", "b1": "B"})
    now = timezone.now()
    a1 = Node.objects.get(node_id="a1")
    NodeLink.objects.create(node=a1, peer="a2", bw_gbps=180.0, latency_us=9.0, measured_at=now, method="dataplane-bulk")
    rows = {(r.a, r.b): r for r in link_table(now)}
    assert (rows[("a1", "a2")].source, rows[("a1", "a2")].bw_gbps) == ("measured", 180.0)
    assert (rows[("a1", "b1")].source, rows[("a1", "b1")].bw_gbps) == ("assumed", 10.0)
    assert (rows[("a2", "b1")].source, rows[("a2", "b1")].bw_gbps) == ("assumed", 10.0)
    snap = fleet_snapshot(now)
    assert snap.node_link_bytes_per_s("a1", "a2") == 180.0 * 1e9 / 8
    assert snap.node_link_bytes_per_s("a1", "b1") == 10.0 * 1e9 / 8  # the assumed rack default
    # an old measurement is aged out: the rack default again, marked so
    later = now + timedelta(seconds=settings.FLEXPIPE_LINK_MAX_AGE_S + 1)
    assert fleet_snapshot(later).node_link_bytes_per_s("a1", "a2") == 25.0 * 1e9 / 8
    assert {(r.a, r.b): r.source for r in link_table(later)}[("a1", "a2")] == "aged"
    page = viewer.browser().get("/").content.decode()
    assert 'data-pair="a1-a2" data-source="measured"' in page and 'data-pair="a1-b1" data-source="assumed"' in page


def test_registering_a_node_asks_it_and_the_others_to_probe_their_links() -> None:
    enroll_fleet({"a1": "A", "b1": "B"})
    from console.fleet.models import AgentCommand

    asked = sorted(AgentCommand.objects.filter(kind="probe_links").values_list("node__node_id", "payload"))
    assert [n for n, _ in asked] == ["a1", "b1"]
    assert dict(asked)["a1"] == {"peers": {"b1": "b1.test:7070"}}
    assert Decision.objects.count() == 0
