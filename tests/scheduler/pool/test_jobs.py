"""Fine-tune and batch jobs on the pool (scheduler/pool/jobs.py) and the loop taking their GPUs; no database."""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduler.control import ControlLoop, DeploymentState, FleetState
from scheduler.gearbox import Deployment, LoadSample, LoadWindow, Outcome
from scheduler.modelspec import model_spec
from scheduler.plan import MEM_FRACTION, Gear
from scheduler.pool import jobs as J
from scheduler.topology import Snapshot
from tests.scheduler.builders import CHAT_SLO, NodeSpec, make_fleet, one_plan_gear, tp_plan, with_gpus

M70 = model_spec("Llama-3-70B")
NOW = 1000.0
A2 = tuple(f"a2-g{i}" for i in range(8))


def tp8(node: str) -> Gear:
    return one_plan_gear(tp_plan(M70, [f"{node}-g{i}" for i in range(8)], kv_tokens=100_000))


def running_job(job: J.Job, gpus: tuple[str, ...], snap: Snapshot, at_s: float = NOW - 100) -> J.JobState:
    return J.start(J.JobState(job), gpus, {g.uuid: g.mem_total_bytes for g in snap.gpus}, at_s)


def booked(snap: Snapshot, job: J.JobState) -> Snapshot:
    """The snapshot as the agents report it while the job holds its GPUs."""
    return with_gpus(snap, **{u: {"mem_used_bytes": b} for u, b in job.booked_bytes.items()})


def chat(priority: int, current: Gear | None = None) -> DeploymentState:
    window = LoadWindow(tuple(LoadSample(NOW - 300 + 15 * i, 3.0, 512, 200, 0.8, 0.6) for i in range(21)))
    dep = Deployment(id="chat", model=M70.name, slo=CHAT_SLO, baseline=tp8("a2"), priority=priority)
    return DeploymentState(deployment=dep, current=current, load=window, model=M70)


def test_a_job_books_each_of_its_gpus_whole() -> None:
    snap = make_fleet([NodeSpec("a2")])
    job = running_job(J.Job("ft", gpus=8, work_gpu_s=8 * 3600), A2, snap)
    total = snap.gpu_by_uuid["a2-g0"].mem_total_bytes
    assert job.booked_bytes["a2-g0"] == int(MEM_FRACTION * total)
    assert J.job_gpus([job]) == frozenset(A2)


def test_pick_gpus_meets_the_model_constraint_on_the_fewest_nodes() -> None:
    free = [("x0", "b", "A100-80G"), ("x1", "b", "A100-80G"), ("y0", "a", "H100-SXM"), ("y1", "c", "A100-80G")]
    assert J.pick_gpus(J.Job("ft", 2, 10.0, gpu_model="A100-80G"), free) == ("x0", "x1")
    assert J.pick_gpus(J.Job("ft", 2, 10.0, gpu_model="H100-SXM"), free) is None
    assert J.pick_gpus(J.Job("ft", 4, 10.0), free) is not None


def test_it_rejects_a_job_that_cannot_be() -> None:
    with pytest.raises(ValueError, match="work_gpu_s"):
        J.Job("ft", 1, 0.0)
    with pytest.raises(ValueError, match="gpus"):
        J.Job("ft", 0, 10.0)


def test_a_priority_10_deployment_takes_the_gpus_of_a_priority_1_job_which_checkpoints_and_resumes() -> None:
    # chat's GPUs on a1 failed; the only others are a2's, which the job holds
    snap = make_fleet([NodeSpec("a1", down=tuple(range(8))), NodeSpec("a2")])
    job = running_job(J.Job("ft", gpus=8, work_gpu_s=8 * 1000, grace_s=30, checkpoint_s=20), A2, snap)
    loop = ControlLoop()
    loop.observe([chat(J.INFERENCE_PRIORITY, current=tp8("a1"))], FleetState(snapshot=booked(snap, job), jobs=(job,)))
    s = loop.step(NOW).steps[0]
    assert s.decision is not None and s.decision.outcome is Outcome.SWITCH
    assert s.start is not None and set(s.start.target.gpu_uuids) <= set(A2)
    assert any("from job ft" in r and "20 s" in r for r in s.decision.reasons)
    # the driver asks the job to yield: it checkpoints within its grace time and keeps its progress
    y = J.ask_to_yield(job, NOW, by="chat")
    assert y.phase is J.JobPhase.YIELDING and y.release_at_s == NOW + 20 and y.taken_by == "chat"
    assert y.progress_gpu_s(NOW + 10) == pytest.approx(8 * 100)  # it stopped when asked
    assert J.takeable_gpus([y], 10) == frozenset()  # on its way out: nothing more to take
    c = J.release(y)
    assert c.phase is J.JobPhase.CHECKPOINTED and c.gpu_uuids == () and c.lost_gpu_s == 0
    # GPUs come back: it resumes from its checkpoint and finishes the rest
    r = J.start(c, A2, {u: 80 * 2**30 for u in A2}, NOW + 500)
    assert r.progress_gpu_s(NOW + 500) == pytest.approx(800)
    assert r.done_at_s() == pytest.approx(NOW + 500 + (8000 - 800) / 8)


def test_a_job_of_equal_or_higher_priority_keeps_its_gpus() -> None:
    snap = make_fleet([NodeSpec("a2")])
    job = running_job(J.Job("ft", gpus=8, work_gpu_s=8 * 1000, priority=10), A2, snap)
    loop = ControlLoop()
    loop.observe([chat(priority=10)], FleetState(snapshot=booked(snap, job), jobs=(job,)))
    s = loop.step(NOW).steps[0]
    assert s.start is None


def test_free_gpus_go_first_job_gpus_only_when_nothing_else_will_do() -> None:
    # chat's a1 failed; a2 is the job's, b1 is free
    snap = make_fleet([NodeSpec("a1", down=tuple(range(8))), NodeSpec("a2"), NodeSpec("b1", "A100-80G", rack="B")])
    job = running_job(J.Job("ft", gpus=8, work_gpu_s=8 * 1000), A2, snap)
    loop = ControlLoop()
    loop.observe([chat(10, current=tp8("a1"))], FleetState(snapshot=booked(snap, job), jobs=(job,)))
    s = loop.step(NOW).steps[0]
    assert s.start is not None and not set(s.start.target.gpu_uuids) & set(A2)
    assert s.decision is not None and not any("from job" in r for r in s.decision.reasons)


def test_a_yield_past_its_grace_time_loses_the_work_since_the_last_checkpoint() -> None:
    snap = make_fleet([NodeSpec("a2")])
    job = running_job(J.Job("ft", gpus=8, work_gpu_s=8 * 1000, grace_s=10, checkpoint_s=20), A2, snap, at_s=NOW - 100)
    y = J.ask_to_yield(job, NOW, by="chat")
    assert y.release_at_s == NOW + 10  # stopped at the end of its grace time
    assert y.lost_gpu_s == pytest.approx(800) and J.release(y).saved_gpu_s == 0.0


def test_a_crash_goes_back_to_the_last_checkpoint() -> None:
    snap = make_fleet([NodeSpec("a2")])
    job = replace(running_job(J.Job("ft", 8, 8000.0), A2, snap, at_s=NOW - 10), saved_gpu_s=400.0)
    c = J.crash(job, NOW)
    assert c.phase is J.JobPhase.CHECKPOINTED and c.saved_gpu_s == 400.0 and c.lost_gpu_s == pytest.approx(80)


def test_a_job_runs_to_done_and_holds_nothing() -> None:
    snap = make_fleet([NodeSpec("a2")])
    job = running_job(J.Job("ft", 8, 800.0), A2, snap, at_s=NOW)
    assert job.done_at_s() == NOW + 100
    d = J.finish(job, NOW + 100)
    assert d.phase is J.JobPhase.DONE and d.progress_gpu_s(NOW + 200) == 800.0 and J.job_gpus([d]) == frozenset()


def test_an_external_runner_yields_by_its_ack_or_loses_the_work_since_its_checkpoint_at_the_deadline() -> None:
    snap = make_fleet([NodeSpec("a2")])
    job = running_job(J.Job("ft", 8, 8 * 1000.0, grace_s=30, checkpoint_s=20), A2, snap, at_s=NOW - 100)
    # a checkpoint while it runs is its new restart point
    c = J.checkpointed(job, NOW - 50)
    assert (c.phase, c.saved_gpu_s, c.since_s) == (J.JobPhase.RUNNING, pytest.approx(400), NOW - 50)
    y = J.ask_runner_to_yield(c, NOW, by="chat")
    assert (y.phase, y.release_at_s, y.taken_by, y.yields) == (J.JobPhase.YIELDING, NOW + 30, "chat", 1)
    assert J.ask_runner_to_yield(y, NOW + 5, by="other") == y and J.expire(y, NOW + 29) == y
    # the ack releases at once, keeping the work up to the ask
    acked = J.checkpointed(y, NOW + 3)
    assert (acked.phase, acked.gpu_uuids, acked.saved_gpu_s, acked.lost_gpu_s) == \
        (J.JobPhase.CHECKPOINTED, (), pytest.approx(800), 0.0)
    # no ack: at the deadline it is released anyway, back to its checkpoint at NOW - 50
    gone = J.expire(y, NOW + 30)
    assert (gone.phase, gone.saved_gpu_s, gone.lost_gpu_s) == (J.JobPhase.CHECKPOINTED, pytest.approx(400),
                                                               pytest.approx(400))
    with pytest.raises(ValueError, match="progress_gpu_s"):
        J.checkpointed(y, NOW + 3, gpu_s=100.0)  # below its last checkpoint
    with pytest.raises(ValueError, match="phase"):
        J.checkpointed(gone, NOW + 31)
    assert J.checkpointed(job, NOW, gpu_s=8000.0).phase is J.JobPhase.DONE
