"""Whole transitions through the Django ports, with simulated agents answering through the fleet's actions."""

from __future__ import annotations

import time
from typing import Any

import pytest
from django.db import IntegrityError, transaction
from django.utils import timezone

from console.audit.chain import verify_chain
from console.audit.models import AuditEntry
from console.fleet.models import AgentCommand
from console.gearbox.executor import build_executor
from console.gearbox.models import Deployment, GpuReservation, Transition, TransitionStep
from scheduler.invariants import assert_clean
from scheduler.transition import Kind, Phase
from tests.console.gearbox.harness import SimAgents, django_log, enroll_fleet, gear, make_deployment

pytestmark = pytest.mark.django_db


def drive(agents: SimAgents, name: str, *, max_s: float = 30.0) -> Transition:
    ex = build_executor()
    deadline = time.monotonic() + max_s
    while time.monotonic() < deadline:
        out = ex.advance(name)
        agents.run()
        if out.record is None or not out.record.active:
            break
        time.sleep(0.01)
    row = Transition.objects.filter(deployment__name=name).order_by("-seq").first()
    assert row is not None and not row.active, f"still {row.phase if row else None}/{row.step if row else None}"
    return row


def test_the_first_transition_brings_the_baseline_up_with_every_step_audited() -> None:
    enroll_fleet()
    dep = make_deployment()
    agents = SimAgents()
    rec = build_executor().start("chat", gear("a1", [0, 1]), kind=Kind.AUTO)
    assert rec is not None
    row = drive(agents, "chat")
    assert row.phase == "done" and row.error == ""
    dep.refresh_from_db()
    assert dep.current_gear == gear("a1", [0, 1]).to_dict()
    assert dep.routing_version == 1 and dep.routing[0]["weight"] == 1.0
    assert set(GpuReservation.objects.values_list("gpu_uuid", flat=True)) == {"GPU-a1-0", "GPU-a1-1"}
    steps = list(TransitionStep.objects.filter(transition=row).values_list("step", "state"))
    assert [s for s, _ in steps] == ["reserve", "prepare", "canary", "flip", "freeze", "move", "unroute", "release",
                                     "unreserve"]
    assert {state for _, state in steps} == {"ok"}
    events = set(AuditEntry.objects.filter(deployment="chat", transition_seq=row.seq).values_list("event_type",
                                                                                                  flat=True))
    assert {"gearbox.transition_created", "gearbox.transition_step_started", "gearbox.transition_step_ok",
            "gearbox.transition_phase", "gearbox.transition_finished", "gearbox.routing_committed"} <= events
    assert verify_chain().ok
    assert_clean(django_log("chat", agents.log), complete=False)


def test_a_switch_under_load_moves_the_sequences_and_keeps_the_invariants() -> None:
    enroll_fleet()
    make_deployment()
    agents = SimAgents()
    build_executor().start("chat", gear("a1", [0, 1]))
    drive(agents, "chat")
    for i in range(40):  # long enough to be in flight when the move comes, however loaded the machine
        agents.fleet.submit("chat", 200 + 50 * i, 4000)
    agents.run(0.05)
    row = Transition.objects.get(seq=1)
    assert build_executor().start("chat", gear("b1", [0, 1, 2, 3])) is not None
    row = drive(agents, "chat")
    assert row.seq == 2 and row.phase == "done"
    assert row.seqs_migrated + row.seqs_replayed + row.seqs_finished >= 1
    assert set(GpuReservation.objects.values_list("gpu_uuid", flat=True)) == {f"GPU-b1-{i}" for i in range(4)}
    # keys: one command per (seq, step, attempt, node, plan); none issued twice
    keys = list(AgentCommand.objects.values_list("key", flat=True))
    assert len(keys) == len(set(keys))
    deadline = time.monotonic() + 120
    while agents.fleet.open_sequences() and time.monotonic() < deadline:
        agents.run(5.0)  # the transition is over: let simulated time run ahead of the wall clock
    assert_clean(django_log("chat", agents.log))


def test_the_database_refuses_a_second_active_transition_whatever_the_code_does() -> None:
    enroll_fleet()
    dep = make_deployment()
    now = timezone.now()
    fields = {"deployment": dep, "kind": "auto", "to_gear": {}, "record": {}, "actor": "test", "created_at": now,
              "updated_at": now}
    Transition.objects.create(seq=1, phase="prepare", **fields)
    with pytest.raises(IntegrityError), transaction.atomic():
        Transition.objects.create(seq=2, phase="switch", **fields)
    Transition.objects.create(seq=3, phase="done", **fields)  # finished ones are not limited


def test_a_stale_executor_cannot_issue_commands_for_a_step_that_moved_on() -> None:
    from scheduler.transition import StaleGuard

    enroll_fleet()
    make_deployment()
    SimAgents()
    ex = build_executor()
    ex.start("chat", gear("a1", [0, 1]))
    ex.advance("chat")
    stale = ex.store.active("chat")
    assert stale is not None and stale.current is not None
    assert ex.store.request_abort("chat", stale.seq, "test")  # bumps the version under the stale copy
    with pytest.raises(StaleGuard):
        ex.agents.send(stale.current.intent.commands, stale.guard())
    with pytest.raises(StaleGuard):
        ex.routing.commit("chat", 0, (), stale.guard())
    assert Deployment.objects.get(name="chat").routing_version == 0


def test_a_booking_of_another_deployments_gpu_is_refused_and_rolled_back_on_exclusive_gpus(settings: Any) -> None:
    settings.FLEXPIPE_MAX_MODELS_PER_GPU = 1
    enroll_fleet()
    make_deployment("chat")
    make_deployment("other", baseline=gear("a1", [2, 3]))
    agents = SimAgents()
    build_executor().start("other", gear("a1", [2, 3]))
    drive(agents, "other")
    build_executor().start("chat", gear("a1", [2, 3]))
    row = drive(agents, "chat")
    assert row.phase == Phase.ROLLED_BACK.value and "booked by deployment other" in row.error
    assert Deployment.objects.get(name="other").current_gear == gear("a1", [2, 3]).to_dict()
    assert_clean(django_log("chat", agents.log), complete=False)


def test_a_gpu_booked_by_max_models_per_gpu_deployments_refuses_a_third_with_the_reason() -> None:
    enroll_fleet()
    make_deployment("chat")
    now = timezone.now()
    target = gear("a1", [2, 3])
    for name in ("other", "third"):  # two deployments already share a1's GPUs 2 and 3 (seed 004 4.2: 2 per GPU)
        dep = make_deployment(name, baseline=target)
        for u in target.gpu_uuids:
            GpuReservation.objects.create(gpu_uuid=u, deployment=dep, plan_id=f"p-{name}", mem_bytes=2**30,
                                          transition_seq=1, created_at=now)
    agents = SimAgents()
    build_executor().start("chat", target)
    row = drive(agents, "chat")
    assert row.phase == Phase.ROLLED_BACK.value
    assert "booked by deployments other, third: at most 2 deployments share a GPU" in row.error
    assert not GpuReservation.objects.filter(deployment__name="chat", gpu_uuid__in=target.gpu_uuids).exists()


def test_prepare_names_the_version_the_deployment_serves_not_the_newest_registered() -> None:
    from console.fleet.models import AgentCommand
    from console.registry.models import ModelVersion

    enroll_fleet()
    dep = make_deployment()
    now = timezone.now()
    common = {"name": "Llama-3-8B", "engine": "vllm", "architecture": "Llama-3-8B", "weights_uri": "/w",
              "tokenizer": "/models/llama/tokenizer.json", "max_context": 8192, "min_gpu_mem_bytes": 1,
              "warmup_tokens": 8, "registered_by": "user:alice"}
    served = ModelVersion.objects.create(version="1", sha256="a" * 64, status="verified", registered_at=now,
                                         **common)
    dep.model_version = served
    dep.save(update_fields=["model_version"])
    # registered later and verified: still nothing that serves changes until it is rolled out
    ModelVersion.objects.create(version="2", sha256="b" * 64, status="verified", registered_at=now, **common)
    ex = build_executor()
    ex.start("chat", gear("a1", [0, 1]))
    ex.advance("chat")
    prepare = AgentCommand.objects.get(kind="prepare_plan")
    assert prepare.payload["weights_sha256"] == "a" * 64
    assert prepare.payload["model_version"] == {"id": served.pk, "version": "1",
                                                "tokenizer": "/models/llama/tokenizer.json", "warmup_tokens": 8,
                                                "max_context": 8192}


def test_a_deployment_without_a_version_prepares_without_a_digest_whatever_the_registry_holds() -> None:
    from console.fleet.models import AgentCommand
    from console.registry.models import ModelVersion

    enroll_fleet()
    make_deployment()
    ModelVersion.objects.create(name="Llama-3-8B", version="1", sha256="b" * 64, status="verified",
                                engine="vllm", architecture="Llama-3-8B", weights_uri="hf://org/llama/w",
                                tokenizer="tok", max_context=8192, min_gpu_mem_bytes=1, warmup_tokens=8,
                                registered_by="user:alice", registered_at=timezone.now())
    ex = build_executor()
    ex.start("chat", gear("a1", [0, 1]))
    ex.advance("chat")
    payload = AgentCommand.objects.get(kind="prepare_plan").payload
    assert payload["weights_sha256"] is None and "model_version" not in payload
