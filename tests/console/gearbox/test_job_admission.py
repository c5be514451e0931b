"""The console runs API jobs (console/gearbox/admission.py): the tick admits a queued job onto free
GPUs and the heatmap shows it; a priority-10 deployment that needs them makes it yield; its
runner's ack frees them at once, no ack frees them at the grace deadline (the work since its last
checkpoint lost, said in the audit); it resumes when GPUs fit again. Time is the tick's `now`."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from console.audit.models import AuditEntry
from console.gearbox import present, ticks
from console.gearbox.models import Decision, Deployment, GpuReservation, Job, Transition
from scheduler.plan import Gear
from tests.console.gearbox.harness import SimAgents, enroll_fleet, gear, make_deployment, uuid
from tests.console.gearbox.test_gearbox_actions import drive
from tests.console.people import Person

pytestmark = pytest.mark.django_db

A1 = [uuid("a1", i) for i in range(4)]
B1 = [uuid("b1", i) for i in range(4)]


def submit(client: Client, **over: Any) -> Any:
    body = {"name": "ft", "gpus": 4, "work_gpu_s": 4 * 3600, "grace_s": 30, **over}
    return client.post("/api/v1/jobs", json.dumps(body), content_type="application/json")


def ack(client: Client, body: Any, name: str = "ft") -> Any:
    return client.post(f"/api/v1/jobs/{name}/checkpointed", json.dumps(body), content_type="application/json")


def job() -> Job:
    return Job.objects.get(name="ft")


def events(kind: str) -> list[AuditEntry]:
    return list(AuditEntry.objects.filter(event_type=f"gearbox.job_{kind}").order_by("seq"))


def running_then_wanted(operator: Person) -> datetime:
    """A 4-GPU node whose GPUs a job holds, then a priority-10 deployment whose baseline needs two of
    them: its tick asks the job to yield. The time of that tick."""
    enroll_fleet({"a1": "A"}, gpus=4)
    assert submit(operator.api()).status_code == 201
    t0 = timezone.now()
    assert ticks.tick(now=t0)["jobs"] == ["ft:running"]
    make_deployment("chat", baseline=gear("a1", [0, 1]))
    Deployment.objects.filter(name="chat").update(priority=10)
    t1 = t0 + timedelta(seconds=10)
    out = ticks.tick(now=t1)
    assert out["started"] == [], out  # no PREPARE books beside the job
    j = job()
    assert (j.state, j.taken_by, j.yield_by, j.yields) == (Job.YIELDING, "chat", t1 + timedelta(seconds=30), 1)
    assert j.progress_gpu_s == pytest.approx(4 * 10)  # the checkpoint asked for holds its work up to the ask
    note = Decision.objects.filter(deployment__name="chat").order_by("-id").first()
    assert note is not None and "waits for job ft" in note.note, note.note if note else None
    said = events("yield_requested")[0].summary
    assert said.startswith("job ft: asked to yield 4 GPU(s)") and "to deployment chat (priority above its 1)" in said
    assert present.gpu_holders([], {})[A1[0]] == [{"job": "ft", "role": "yielding"}]
    return t1


def test_a_queued_job_is_admitted_onto_free_gpus_at_the_next_tick_and_shown_on_the_heatmap(operator: Person,
                                                                                          viewer: Person) -> None:
    enroll_fleet({"a1": "A"}, gpus=8)
    assert submit(operator.api()).status_code == 201
    assert submit(operator.api(), name="big", gpus=16).status_code == 201  # more than the pool: it waits
    t0 = timezone.now()
    out = ticks.tick(now=t0)
    assert out["jobs"] == ["ft:running"], out
    j = job()
    assert (j.state, j.gpu_uuids, j.running_since) == (Job.RUNNING, A1, t0)
    assert Job.objects.get(name="big").state == Job.QUEUED
    holders = present.overview_state()["holders"]
    assert all(holders[u] == [{"job": "ft", "role": "job"}] for u in A1) and uuid("a1", 4) not in holders
    got = viewer.api().get("/api/v1/jobs/ft").json()
    assert (got["state"], got["gpu_uuids"], got["yield_by"]) == ("running", A1, None)
    assert [e.summary for e in events("admitted")] == [f"job ft: admitted on 4 GPU(s) ({', '.join(A1)}): it runs "
                                                        "there until done or asked to yield"]
    # a deployment of priority 0 may not take them: it plans beside them, on the free half
    make_deployment("chat", baseline=gear("a1", [0, 1]))
    ticks.tick(now=t0 + timedelta(seconds=1))
    assert job().state == Job.RUNNING
    t = Transition.objects.filter(deployment__name="chat").first()
    assert t is None or not set(Gear.from_dict(t.to_gear).gpu_uuids) & set(A1)


def test_the_runners_ack_frees_the_gpus_at_once_and_the_job_resumes_when_gpus_fit(operator: Person) -> None:
    t1 = running_then_wanted(operator)
    resp = ack(operator.api(), {})
    assert resp.status_code == 200, resp.json()
    j = job()
    assert (j.state, j.gpu_uuids, j.saved_gpu_s, j.lost_gpu_s) == (Job.CHECKPOINTED, [], pytest.approx(40), 0.0)
    assert resp.json()["checkpoint_gpu_s"] == pytest.approx(40)
    assert "free at once for chat" in events("checkpointed")[0].summary
    agents = SimAgents()
    out = ticks.tick(now=t1 + timedelta(seconds=1))  # well inside the grace time
    assert out["started"] == ["chat#1"] and "jobs" not in out, out  # 2 GPUs left: the job does not fit
    row = drive(agents, "chat")
    assert row.phase == "done", row.error
    assert set(GpuReservation.objects.values_list("gpu_uuid", flat=True)) == set(A1[:2])
    # GPUs come back (a node joins): it resumes from its checkpoint there
    enroll_fleet({"b1": "B"}, gpus=4)
    assert ticks.tick(now=t1 + timedelta(seconds=2))["jobs"] == ["ft:running"]
    j = job()
    assert (j.state, j.gpu_uuids, j.saved_gpu_s) == (Job.RUNNING, B1, pytest.approx(40))
    assert "resumed from its checkpoint (40 GPU-s)" in events("resumed")[0].summary


def test_without_an_ack_the_gpus_are_freed_at_the_grace_deadline_and_the_work_since_the_checkpoint_lost(
        operator: Person) -> None:
    t1 = running_then_wanted(operator)
    out = ticks.tick(now=t1 + timedelta(seconds=29))
    assert job().state == Job.YIELDING and out["started"] == []
    out = ticks.tick(now=t1 + timedelta(seconds=30))
    assert out["started"] == ["chat#1"] and out["jobs"] == ["ft:checkpointed"], out
    j = job()
    assert (j.state, j.gpu_uuids, j.saved_gpu_s, j.lost_gpu_s) == (Job.CHECKPOINTED, [], 0.0, pytest.approx(40))
    said = events("released_at_deadline")[0].summary
    assert "freed anyway for chat" in said and "40 GPU-s of work since its last checkpoint (0 GPU-s) lost" in said
    enroll_fleet({"b1": "B"}, gpus=4)
    assert ticks.tick(now=t1 + timedelta(seconds=31))["jobs"] == ["ft:running"]
    assert job().gpu_uuids == B1


@pytest.mark.parametrize(("body", "field", "words"), [
    ({"progress_gpu_s": "lots"}, "progress_gpu_s", "a number"),
    ({"progress_gpu_s": -1}, "progress_gpu_s", "from 0"),
    ({"progress_gpu_s": 1e9}, "progress_gpu_s", "its work"),
    ({"colour": "red"}, "colour", "unknown field"),
    ([1], "non_field_errors", "JSON object"),
])
def test_bad_input_to_the_ack_is_a_400_naming_the_field_and_changes_nothing(operator: Person, body: Any,
                                                                         field: str, words: str) -> None:
    running_then_wanted(operator)
    before = (Job.objects.values().get(name="ft"), AuditEntry.objects.count())
    resp = ack(operator.api(), body)
    assert resp.status_code == 400, resp.json()
    assert field in resp.json() and words in resp.json()[field][0], resp.json()
    assert (Job.objects.values().get(name="ft"), AuditEntry.objects.count()) == before


def test_an_ack_needs_an_operator_or_the_runner_and_a_job_that_holds_gpus(operator: Person, viewer: Person) -> None:
    enroll_fleet({"a1": "A"}, gpus=4)
    assert submit(operator.api(), gpus=8).status_code == 201  # it does not fit: queued
    ticks.tick(now=timezone.now())
    assert ack(viewer.api(), {}).status_code == 403
    resp = ack(operator.api(), {})
    assert resp.status_code == 409 and "queued" in resp.json()["state"][0]
    assert ack(operator.api(), {}, name="nope").status_code == 404
    assert job().state == Job.QUEUED and not events("checkpointed")


def test_a_job_is_done_when_its_work_is_and_falls_back_to_its_checkpoint_when_it_loses_a_gpu(
        operator: Person) -> None:
    rep = enroll_fleet({"a1": "A"}, gpus=4)
    assert submit(operator.api(), work_gpu_s=4 * 100).status_code == 201
    assert submit(operator.api(), name="next", gpus=2, work_gpu_s=2 * 1000).status_code == 201
    t0 = timezone.now()
    assert ticks.tick(now=t0)["jobs"] == ["ft:running"]  # the oldest first; "next" does not fit beside it
    assert ack(operator.api(), {"progress_gpu_s": 100}).status_code == 200  # a checkpoint while it runs
    assert (job().state, job().saved_gpu_s) == (Job.RUNNING, 100.0)
    # 4 GPUs x 100 s is its work: done, and its GPUs go to the next job in the same tick
    out = ticks.tick(now=t0 + timedelta(seconds=100))
    assert out["jobs"] == ["ft:done", "next:running"], out
    assert (job().state, job().gpu_uuids) == (Job.DONE, []) and len(events("done")) == 1
    # another tenant takes one of next's GPUs: it crashes back to its checkpoint (none yet: all lost)
    rep.gone.add(Job.objects.get(name="next").gpu_uuids[0])
    rep.report("a1", 4)
    out = ticks.tick(now=t0 + timedelta(seconds=110))
    nxt = Job.objects.get(name="next")
    assert nxt.state == Job.RUNNING and out["jobs"] == ["next:checkpointed", "next:running"], out
    assert nxt.lost_gpu_s == pytest.approx(2 * 10) and "lost 1 GPU(s)" in events("crashed")[0].summary


def as_runner(token: str) -> Client:
    return Client(HTTP_AUTHORIZATION=f"Bearer {token}")


def test_a_jobs_runner_token_reads_and_acks_its_own_job_and_nothing_else(operator: Person) -> None:
    enroll_fleet({"a1": "A"}, gpus=4)
    made = submit(operator.api())
    token = made.json()["runner_token"]
    assert made.status_code == 201 and token.startswith("fpr_")
    assert "runner_token" not in operator.api().get("/api/v1/jobs/ft").json()  # shown once
    other = submit(operator.api(), name="other", gpus=8).json()["runner_token"]
    ticks.tick(now=timezone.now())
    assert job().state == Job.RUNNING
    runner = as_runner(token)

    assert runner.get("/api/v1/jobs/ft").json()["gpu_uuids"] == A1
    resp = ack(runner, {"progress_gpu_s": 5})
    assert resp.status_code == 200, resp.json()
    assert job().saved_gpu_s == 5 and events("checkpointed")[-1].actor == "runner:ft"
    # another job's runner, and a runner anywhere but its own job: refused, nothing changes
    assert ack(as_runner(other), {"progress_gpu_s": 6}).status_code == 403
    assert as_runner(other).get("/api/v1/jobs/ft").status_code == 403
    assert runner.get("/api/v1/jobs").status_code == 403  # the list is a viewer's
    assert runner.delete("/api/v1/jobs/ft").status_code == 403
    assert runner.get("/api/v1/deployments").status_code == 401  # no credential outside /api/v1/jobs
    assert ack(as_runner("fpr_" + "x" * 43), {}).status_code == 401
    assert job().saved_gpu_s == 5 and Job.objects.filter(name="ft").exists()


def test_an_operator_issues_a_new_runner_token_and_the_old_one_stops_working(operator: Person,
                                                                             viewer: Person) -> None:
    old = submit(operator.api()).json()["runner_token"]
    assert viewer.api().post("/api/v1/jobs/ft/runner-token").status_code == 403
    assert as_runner(old).post("/api/v1/jobs/ft/runner-token").status_code == 403  # a runner cannot renew itself
    resp = operator.api().post("/api/v1/jobs/ft/runner-token")
    assert resp.status_code == 200, resp.json()
    new = resp.json()["runner_token"]
    assert new != old and as_runner(new).get("/api/v1/jobs/ft").status_code == 200
    assert as_runner(old).get("/api/v1/jobs/ft").status_code == 401
    assert len(events("runner_token_issued")) == 1
