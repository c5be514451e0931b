"""The simulated fleet against a real console over real HTTP (pytest-django's live server)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from agents.protocol import Command
from agents.sim.faults import Fault
from agents.sim.live import LiveFleet
from agents.sim.scenario import load_scenario
from console.fleet.models import Gpu, Node
from scheduler.modelspec import model_spec
from scheduler.plan import Plan
from scheduler.transition import node_stages, plan_memory

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
    from agents.sim.live import HttpMailbox

    box = HttpMailbox()
    box.deliver("h100-a", [Command(7, "freeze_plan", {"plan_id": "p-1", "deployment": "d", "routing_version": -1}),
                           Command(8, "teleport", {})])
    acks = {cid: ack for _, cid, ack in box.acks()}
    assert acks[7].status == "failed" and "payload.routing_version" in acks[7].detail
    assert acks[8].status == "failed" and "kind" in acks[8].detail
    assert box.take("h100-a") == []


def test_a_verify_weights_command_is_refused_by_a_simulated_node_that_holds_no_weights() -> None:
    from agents.sim.live import HttpMailbox

    box = HttpMailbox()
    box.deliver("h100-a", [Command(9, "verify_weights", {
        "model_version_id": 1, "name": "llama-3-8b", "version": "v1", "weights_uri": "hf://org/m/model.safetensors",
        "sha256": "ab" * 32, "engine": "vllm", "tokenizer": "hf://org/m/tokenizer.json"})])
    ((node, cid, ack),) = box.acks()
    assert (node, cid, ack.status, ack.result) == ("h100-a", 9, "failed", {"reason": "failed"})
    assert "'llama-3-8b'" in ack.detail and "no weights" in ack.detail
    assert box.take("h100-a") == []


def prepare(fleet: LiveFleet, cid: int, plan: Plan, node: str) -> Command:
    """A prepare_plan command as the controller's executor writes it (scheduler/transition.py)."""
    memory = plan_memory(plan, model_spec(plan.model))
    stages = node_stages(plan, node, fleet.sim.snapshot())
    return Command(cid, "prepare_plan", {
        "plan_id": plan.plan_id, "deployment": "chat-8b", "plan": plan.to_dict(), "model": plan.model,
        "weights_sha256": None, "role": "leader", "stages": stages, "peers": {},
        "reserve_bytes": {u: memory[u] for u in plan.gpu_uuids}}, deployment="chat-8b", transition_seq=1,
        step="prepare")


def test_injected_faults_strike_the_commands_the_simulator_carries_out(fleet: LiveFleet) -> None:
    fleet.step()
    plan = fleet.sim.baseline_plan("chat-8b")
    common = {"plan_id": plan.plan_id, "deployment": "chat-8b"}
    fleet.inject(Fault(node="h100-a", kind="prepare_plan", action="lose_gpus"))
    fleet.inject(Fault(node="h100-a", kind="freeze_plan", action="fail"))
    fleet.inject(Fault(node="h100-a", kind="thaw_plan", action="hang"))

    # lose_gpus: half way through the load the plan's GPUs crash it; the prepare fails "preempted"
    fleet.mailbox.deliver("h100-a", [prepare(fleet, 1, plan, "h100-a")])
    fleet._carry_out()
    engine = fleet.sim.engine_of("chat-8b", plan.plan_id)
    assert engine is not None and engine.state == "loading"
    fleet.sim.advance_to(engine.ready_s + 1.0)
    assert engine.engine_id not in fleet.sim.live  # it crashed: it holds no GPU and serves nothing
    acks = {cid: ack for _, cid, ack in fleet.mailbox.acks()}
    assert acks[1].status == "failed" and acks[1].result["reason"] == "preempted"

    # a clean prepare brings it up and says what it reserved on this node; freeze fails, thaw hangs
    fleet.mailbox.deliver("h100-a", [prepare(fleet, 2, plan, "h100-a")])
    fleet._carry_out()
    again = fleet.sim.engine_of("chat-8b", plan.plan_id)
    assert again is not None
    fleet.sim.advance_to(again.ready_s + 1.0)
    fleet.mailbox.deliver("h100-a", [Command(3, "freeze_plan", {**common, "routing_version": 1}, "chat-8b"),
                                     Command(4, "thaw_plan", dict(common), "chat-8b"),
                                     Command(5, "abort_plan", {"plan_id": "p-x", "deployment": "other"}, "other")])
    fleet._carry_out()
    acks = {cid: ack for _, cid, ack in fleet.mailbox.acks()}
    assert acks[2].status == "ok" and acks[2].result["reserved_bytes"] == plan_memory(plan, model_spec(plan.model))
    assert acks[3].status == "failed" and "injected failure" in acks[3].detail
    assert 4 not in acks  # hung: never answered
    assert acks[5].status == "ok" and acks[5].result["noop"]  # not a deployment of this fleet: nothing to undo


def test_the_workload_goes_on_after_the_scenario_ends(fleet: LiveFleet) -> None:
    fleet.step()
    end = fleet.scenario.duration_s
    fleet.t0 = time.monotonic() - (end + 120) / fleet.time_scale  # two simulated minutes past its end
    fleet.step()
    # nothing serves (no transition brought a plan up), so what arrived waits in the queues
    waiting = [r.arrival_s for d in fleet.sim.deployments.values() for r in d.pending]
    assert max(waiting) > end + 60
    assert min(waiting) < end  # the first period's arrivals are still there, in time order before them
