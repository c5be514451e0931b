"""The jobs API's writes: create and delete a fine-tune or batch job (`Job`; the rules are
scheduler/pool/jobs.py's, seed 004 sections 2.1 and 5.2). Operators only; every field is checked
before anything is stored - a bad one is a Rejected(400) naming it and the reason - and each write
is audited in the same transaction. Running them - admission, yields, checkpoints - is
console/gearbox/admission.py's."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db import IntegrityError, transaction
from django.utils import timezone

from console.audit.chain import record
from console.fleet.actions import Rejected
from console.gearbox.actions import _who
from console.gearbox.admission import to_state
from console.gearbox.lifecycle import NEW_NAME_RE
from console.gearbox.models import Job
from console.gearbox.runner import new_runner_token
from scheduler.hardware import known_gpus
from scheduler.pool.jobs import JOB_PRIORITY
from scheduler.pool.jobs import Job as JobSpec

MAX_GRACE_S = 300.0  # a yield plus the plan's load must end inside the PREPARE timeout (600 s, transition config)
MAX_GPUS = 512


def _number(errors: dict[str, str], key: str, value: object, *, low: float, strict: bool = False,
            high: float | None = None) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:  # (NaN)
        errors[key] = f"must be a number; got {str(value)[:40]!r}"
        return None
    if (value <= low if strict else value < low) or (high is not None and value > high):
        bound = f"> {low:g}" if strict else f">= {low:g}"
        errors[key] = f"must be {bound}" + (f" and <= {high:g}" if high is not None else "") + f"; got {value}"
        return None
    return float(value)


def check_job(*, name: object, gpus: object, work_gpu_s: object, gpu_model: object = "", priority: object = JOB_PRIORITY,
              grace_s: object = 30.0, checkpoint_s: object = 20.0) -> dict[str, Any]:
    """The job's fields, checked all at once: Rejected(400, {field: reason}) when any is wrong."""
    errors: dict[str, str] = {}
    if not isinstance(name, str) or not NEW_NAME_RE.fullmatch(name):
        errors["name"] = ("must be 1 to 64 letters, digits, '.', '_' or '-', starting with a letter or a digit; "
                          f"got {str(name)[:80]!r}")
    if isinstance(gpus, bool) or not isinstance(gpus, int) or not 1 <= gpus <= MAX_GPUS:
        errors["gpus"] = f"must be a whole number from 1 to {MAX_GPUS}; got {str(gpus)[:40]!r}"
    if not isinstance(gpu_model, str) or (gpu_model and gpu_model not in known_gpus()):
        errors["gpu_model"] = f"must be a GPU of the catalog ({', '.join(sorted(known_gpus()))}) or \"\" for any; " \
                              f"got {str(gpu_model)[:40]!r}"
    if isinstance(priority, bool) or not isinstance(priority, int) or not -1000 <= priority <= 1000:
        errors["priority"] = f"must be a whole number from -1000 to 1000; got {str(priority)[:40]!r}"
    work = _number(errors, "work_gpu_s", work_gpu_s, low=0.0, strict=True, high=1e12)
    grace = _number(errors, "grace_s", grace_s, low=0.0, high=MAX_GRACE_S)
    checkpoint = _number(errors, "checkpoint_s", checkpoint_s, low=0.0, high=1e6)
    if errors:
        raise Rejected(400, errors)
    values = {"name": name, "gpus": gpus, "work_gpu_s": work, "gpu_model": gpu_model, "priority": priority,
              "grace_s": grace, "checkpoint_s": checkpoint}
    JobSpec(name, gpus, work, gpu_model or None, priority, grace, checkpoint)  # type: ignore[arg-type]
    return values


def do_create_job(*, actor: Any, **fields: object) -> tuple[Job, str]:
    """A new job, QUEUED until enough GPUs are free, and its runner's token (shown once: the job
    keeps its hash; console/gearbox/runner.py). 400 naming a bad field, 409 for a taken name;
    nothing stored either way."""
    who, user = _who(actor)
    values = check_job(**fields)  # type: ignore[arg-type]
    now = timezone.now()
    token, digest = new_runner_token()
    job = Job(created_by=user, created_at=now, updated_at=now, runner_token_hash=digest, **values)
    with transaction.atomic():
        try:
            with transaction.atomic():
                job.save(force_insert=True)
        except IntegrityError:
            raise Rejected(409, {"name": f"a job {values['name']!r} exists already"}) from None
        record("gearbox.job_created", actor=who, user=user, at=now,
               summary=f"job {job.name}: {job.gpus} x {job.gpu_model or 'any GPU'}, {job.work_gpu_s:g} GPU-s, "
                       f"priority {job.priority}, grace {job.grace_s:g} s", after=values)
    return job, token


def do_delete_job(job: Job, *, actor: Any) -> None:
    """Delete a job: its GPUs are free at the next tick (its runner, reading it gone, stops)."""
    who, user = _who(actor)
    with transaction.atomic():
        before = {"state": job.state, "progress_gpu_s": job.progress_gpu_s, "gpu_uuids": job.gpu_uuids}
        Job.objects.filter(pk=job.pk).delete()
        record("gearbox.job_deleted", actor=who, user=user, at=timezone.now(), before=before,
               summary=f"job {job.name} deleted ({job.state}, {job.progress_gpu_s / job.work_gpu_s:.0%} done)")


def job_payload(job: Job, now: datetime | None = None) -> dict[str, Any]:
    """What the API shows, and what a job's runner reads: where it runs, whether to yield (and by
    when), its checkpoint and its progress by the console's account at `now`."""
    done = to_state(job).progress_gpu_s((now or timezone.now()).timestamp())

    def iso(at: datetime | None) -> str | None:
        return at.isoformat() if at is not None else None

    return {"name": job.name, "gpus": job.gpus, "gpu_model": job.gpu_model, "priority": job.priority,
            "grace_s": job.grace_s, "checkpoint_s": job.checkpoint_s, "work_gpu_s": job.work_gpu_s,
            "progress_gpu_s": round(done, 3), "progress": round(done / job.work_gpu_s, 4),
            "state": job.state, "gpu_uuids": list(job.gpu_uuids), "yields": job.yields,
            "checkpoint_gpu_s": job.saved_gpu_s, "lost_gpu_s": round(job.lost_gpu_s, 3),
            "running_since": iso(job.running_since), "yield_by": iso(job.yield_by), "yield_to": job.taken_by or None,
            "done_at": iso(job.done_at),
            "created_by": job.created_by.username if job.created_by else None,
            "created_at": job.created_at.isoformat()}


__all__ = ["check_job", "do_create_job", "do_delete_job", "job_payload"]
