"""The console's half of fine-tune and batch jobs: admit, ask to yield, free, resume.

Kueue-style admission: the console does not train anything. It books free GPUs for a job, says
where it runs, and takes them back when inference needs them; the job's runner, outside
FlexPipe, reads its job through /api/v1/jobs and acknowledges its checkpoints. The rules are
scheduler/pool/jobs.py's (priorities 1 and 10, seed 004 section 5.2; rule 6 for a runner the
console does not time); this module carries them out on the Job rows, each change under the
row's lock and audited in the same transaction (console/audit/chain.py).

Once per tick (console/gearbox/ticks.py), in this order:

1. `settle`, before the decisions: a running job whose work is done by the account (its GPUs
   times the seconds it held them, rule 2) is DONE; one that lost a GPU (failed, gone, another
   tenant's) falls back to its last checkpoint (rule 4); a yielding job past its deadline is
   freed anyway, the work since its last checkpoint lost - the audit entry says how much.
2. `job_states` is what the control loop observes (FleetState.jobs): their GPUs are
   unschedulable, except that a deployment of higher priority may take a running job's when
   nothing else will do (`decide_around_jobs`, the loop's).
3. `in_the_way` (console/gearbox/control.py, persisting a step): a transition whose target lands
   on a job's GPUs is not started - no PREPARE books beside a job (invariant 4); the jobs are
   asked to yield (`do_ask_to_yield`: YIELDING, deadline now + grace_s) and the decision's note
   says so. The deployment switches at a later tick, once the GPUs are free.
4. `admit`, after the decisions: queued and checkpointed jobs go, highest priority then oldest
   first, onto GPUs that are healthy, schedulable and held by nobody - no deployment's gear,
   transition or booking (this tick's included: inference decides first) and no other job. A
   checkpointed job resumes from its checkpoint.

Between ticks, `do_checkpointed` is the runner's acknowledgement (POST
/api/v1/jobs/<name>/checkpointed): a yielding job's GPUs are free at once, its checkpoint kept;
a running job's checkpoint becomes its restart point.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from django.db import transaction
from django.utils import timezone

from console.audit.chain import record
from console.fleet.actions import Rejected
from console.fleet.models import Gpu
from console.gearbox.actions import GEARBOX, _who, held_gpus
from console.gearbox.models import GpuReservation, Job
from scheduler.pool import jobs as J
from scheduler.topology import Snapshot

HOLDING = (Job.RUNNING, Job.YIELDING)
WAITING = (Job.QUEUED, Job.CHECKPOINTED)


def _ts(at: datetime | None) -> float | None:
    return at.timestamp() if at is not None else None


def _dt(t: float | None) -> datetime | None:
    return datetime.fromtimestamp(t, UTC) if t is not None else None


def to_state(row: Job, totals: Mapping[str, int] | None = None) -> J.JobState:
    """The row as scheduler.pool.jobs sees it; a GPU of known size (`totals`) is booked whole (rule 1)."""
    spec = J.Job(row.name, row.gpus, row.work_gpu_s, row.gpu_model or None, row.priority, row.grace_s,
                 row.checkpoint_s, arrive_s=row.created_at.timestamp())
    phase = J.JobPhase(row.state)
    gpus = tuple(str(u) for u in row.gpu_uuids) if phase in J.HOLDING else ()
    return J.JobState(spec, phase, gpus, {u: J.booking_bytes(totals[u]) for u in gpus if u in (totals or {})},
                      saved_gpu_s=row.saved_gpu_s, since_s=_ts(row.running_since) or 0.0,
                      release_at_s=_ts(row.yield_by) if phase is J.JobPhase.YIELDING else None,
                      yield_keeps_gpu_s=row.progress_gpu_s if phase is J.JobPhase.YIELDING else 0.0,
                      taken_by=row.taken_by, yields=row.yields, lost_gpu_s=row.lost_gpu_s, done_s=_ts(row.done_at))


def _fields(state: J.JobState, now_s: float) -> dict[str, Any]:
    running, yielding = state.phase is J.JobPhase.RUNNING, state.phase is J.JobPhase.YIELDING
    return {"state": state.phase.value, "gpu_uuids": list(state.gpu_uuids), "saved_gpu_s": state.saved_gpu_s,
            "progress_gpu_s": state.progress_gpu_s(now_s), "running_since": _dt(state.since_s) if running else None,
            "yield_by": _dt(state.release_at_s) if yielding else None, "taken_by": state.taken_by if yielding else "",
            "yields": state.yields, "lost_gpu_s": state.lost_gpu_s, "done_at": _dt(state.done_s)}


def _audited(f: Mapping[str, Any]) -> dict[str, Any]:
    return {k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in f.items()
            if k in ("state", "gpu_uuids", "saved_gpu_s", "progress_gpu_s", "yield_by", "taken_by", "lost_gpu_s")}


def _change(name: str, now: datetime, actor: str, user: Any,
            step: Callable[[J.JobState], tuple[J.JobState, str, str] | None]) -> tuple[Job | None, bool]:
    """Lock the job, take one step of the rules on it; store and audit what changed. `step` returns
    (the new state, the audit event's name, its summary), or None: nothing to do. (The row, whether
    it changed); no row: it was deleted meanwhile (nothing holds anything)."""
    with transaction.atomic():
        row = Job.objects.select_for_update().filter(name=name).first()
        if row is None:
            return None, False
        done = step(to_state(row))
        if done is None:
            return row, False
        new, event, summary = done
        before, after = _fields(to_state(row), now.timestamp()), _fields(new, now.timestamp())
        for k, v in after.items():
            setattr(row, k, v)
        row.updated_at = now
        row.save(update_fields=[*after, "updated_at"])
        record(f"gearbox.job_{event}", actor=actor, user=user, at=now, summary=f"job {name}: {summary}",
               deployment=new.taken_by if new.phase is J.JobPhase.YIELDING else "",
               before=_audited(before), after=_audited(after))
    return row, True


def _gpus(uuids: Sequence[str]) -> str:
    return f"{len(uuids)} GPU(s) ({', '.join(uuids[:8])}{', ...' if len(uuids) > 8 else ''})"


# --- the tick -------------------------------------------------------------------------------------
def settle(snapshot: Snapshot, now: datetime) -> list[str]:
    """Step 1 (module docstring): jobs done, jobs that lost a GPU, deadlines passed. What changed."""
    t = now.timestamp()
    usable = {g.uuid for g in snapshot.gpus if g.healthy and g.schedulable}
    out = []

    def step(s: J.JobState) -> tuple[J.JobState, str, str] | None:
        lost = [u for u in s.gpu_uuids if u not in usable]
        if s.phase in J.HOLDING and lost:
            c = J.crash(s, t)
            return c, "crashed", (f"lost {_gpus(lost)}: back to its last checkpoint ({c.saved_gpu_s:g} GPU-s), "
                                  f"{c.lost_gpu_s - s.lost_gpu_s:g} GPU-s of work lost; it waits for GPUs")
        if s.phase is J.JobPhase.RUNNING and (at := s.done_at_s()) is not None and at <= t:
            return J.finish(s, at), "done", f"its work is done ({s.job.work_gpu_s:g} GPU-s): {_gpus(s.gpu_uuids)} free"
        if s.phase is J.JobPhase.YIELDING and (e := J.expire(s, t)) is not s:
            return e, "released_at_deadline", (
                f"no checkpoint acknowledged by its deadline (grace {s.job.grace_s:g} s): {_gpus(s.gpu_uuids)} "
                f"freed anyway for {s.taken_by}; {e.lost_gpu_s - s.lost_gpu_s:g} GPU-s of work since its last "
                f"checkpoint ({e.saved_gpu_s:g} GPU-s) lost")
        return None

    for name in Job.objects.filter(state__in=HOLDING).order_by("name").values_list("name", flat=True):
        row, changed = _change(name, now, GEARBOX, None, step)
        if row is not None and changed:
            out.append(f"{name}:{row.state}")
    return out


def job_states(snapshot: Snapshot) -> tuple[J.JobState, ...]:
    """Step 2: the jobs that hold GPUs, as the control loop observes them (FleetState.jobs)."""
    totals = {g.uuid: g.mem_total_bytes for g in snapshot.gpus}
    return tuple(to_state(r, totals) for r in Job.objects.filter(state__in=HOLDING).order_by("name"))


def in_the_way(jobs: Iterable[J.JobState], gpu_uuids: Iterable[str]) -> list[J.JobState]:
    """Step 3: the jobs holding any of these GPUs (a transition onto them waits for their release)."""
    want = set(gpu_uuids)
    return [j for j in jobs if j.phase in J.HOLDING and want.intersection(j.gpu_uuids)]


def do_ask_to_yield(jobs: Iterable[J.JobState], *, by: str, now: datetime, actor: str = GEARBOX) -> str:
    """Step 3: ask each job to yield its GPUs to deployment `by` (rule 6; one already yielding keeps
    its deadline). The sentence a decision's note carries."""
    said = []
    for j in jobs:
        def step(s: J.JobState) -> tuple[J.JobState, str, str] | None:
            if s.phase is not J.JobPhase.RUNNING:
                return None
            y = J.ask_runner_to_yield(s, now.timestamp(), by=by)
            return y, "yield_requested", (
                f"asked to yield {_gpus(s.gpu_uuids)} to deployment {by} (priority above its {s.job.priority}): "
                f"checkpoint and release by {_dt(y.release_at_s):%H:%M:%S} UTC (grace {s.job.grace_s:g} s), "
                f"or they are freed then and the work since its last checkpoint is lost")
        row, _ = _change(j.name, now, actor, None, step)
        if row is not None and row.yield_by is not None:
            said.append(f"job {j.name} ({len(row.gpu_uuids)} GPU(s), by {row.yield_by:%H:%M:%S} UTC)")
    return ("not started: waits for " + ", ".join(said) + " to checkpoint and release its GPUs") if said else ""


def admit(snapshot: Snapshot, now: datetime) -> list[str]:
    """Step 4: the waiting jobs that fit go onto free GPUs. What was admitted ('job:running')."""
    taken = set().union(*held_gpus().values(), *(r.gpu_uuids for r in Job.objects.filter(state__in=HOLDING)))
    nodes = snapshot.node_by_id
    gpus = {g.uuid: g for g in snapshot.gpus}
    free = [(g.uuid, g.node_id, g.model) for g in snapshot.gpus
            if g.healthy and g.schedulable and nodes[g.node_id].schedulable and g.uuid not in taken
            and g.mem_used_bytes <= g.mem_total_bytes - J.booking_bytes(g.mem_total_bytes)]
    out = []
    waiting = Job.objects.filter(state__in=WAITING).order_by("-priority", "created_at", "name")
    for name in waiting.values_list("name", flat=True):
        def step(s: J.JobState, free: list[tuple[str, str, str]] = free) -> tuple[J.JobState, str, str] | None:
            if s.phase not in (J.JobPhase.QUEUED, J.JobPhase.CHECKPOINTED):
                return None
            pick = J.pick_gpus(s.job, free)
            if pick is None:
                return None
            # the GPUs' rows, in one order, as a PREPARE's reservation takes them (ports.DjangoStore.reserve):
            # a booking made since `free` was read wins, the job waits
            list(Gpu.objects.select_for_update().filter(uuid__in=pick).order_by("uuid").values_list("pk", flat=True))
            if GpuReservation.objects.filter(gpu_uuid__in=pick).exists():
                return None
            new = J.start(s, pick, {u: gpus[u].mem_total_bytes for u in pick}, now.timestamp(),
                          used_bytes={u: gpus[u].mem_used_bytes for u in pick})
            if s.phase is J.JobPhase.QUEUED:
                return new, "admitted", f"admitted on {_gpus(pick)}: it runs there until done or asked to yield"
            return new, "resumed", f"resumed from its checkpoint ({s.saved_gpu_s:g} GPU-s) on {_gpus(pick)}"

        row, changed = _change(name, now, GEARBOX, None, step)
        if row is not None and changed:
            free = [g for g in free if g[0] not in row.gpu_uuids]
            out.append(f"{name}:{row.state}")
    return out


# --- the runner ------------------------------------------------------------------------------------
def check_checkpointed(row: Job, body: object) -> float | None:
    """The ack's body, checked: {"progress_gpu_s": the work its checkpoint holds} (optional: all it
    did, by the console's account). Rejected(400) naming the field, 409 for a job not holding GPUs."""
    if not isinstance(body, dict):
        raise Rejected(400, {"non_field_errors": "the body must be a JSON object"})
    errors = {str(k)[:100]: "unknown field; expected progress_gpu_s" for k in body if k != "progress_gpu_s"}
    value = body.get("progress_gpu_s")
    low, high = row.saved_gpu_s, row.work_gpu_s
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value != value
                              or not low <= value <= high):
        errors["progress_gpu_s"] = (f"must be a number from {low:g} (its last checkpoint) to {high:g} (its work); "
                                    f"got {str(value)[:40]!r}")
    if errors:
        raise Rejected(400, errors)
    if row.state not in HOLDING:
        raise Rejected(409, {"state": f"job {row.name} is {row.state}: only a running or yielding job checkpoints"})
    return float(value) if value is not None else None


def do_checkpointed(name: str, body: object, *, actor: Any, now: datetime | None = None) -> Job:
    """The runner's acknowledgement of a checkpoint (module docstring). 404, 400 naming the field,
    409 for a job that holds nothing; nothing changes then."""
    who, user = _who(actor)
    now = now or timezone.now()
    row = Job.objects.filter(name=name).first()
    if row is None:
        raise Rejected(404, {"name": f"no job {name!r}"})
    gpu_s = check_checkpointed(row, body)
    freed: list[str] = []

    def step(s: J.JobState) -> tuple[J.JobState, str, str] | None:
        if s.phase not in J.HOLDING:
            raise Rejected(409, {"state": f"job {name} is {s.phase.value}: only a running or yielding job checkpoints"})
        try:
            new = J.checkpointed(s, now.timestamp(), gpu_s)
        except ValueError as exc:
            key, _, why = str(exc).partition(": ")
            raise Rejected(400, {key: why}) from None
        if s.phase is J.JobPhase.YIELDING:
            freed.extend(s.gpu_uuids)
            return new, "checkpointed", (f"its runner acknowledged a checkpoint of {new.saved_gpu_s:g} GPU-s: "
                                         f"{_gpus(s.gpu_uuids)} free at once for {s.taken_by}; it waits to resume")
        if new.phase is J.JobPhase.DONE:
            return new, "done", f"its runner's checkpoint holds all its work: {_gpus(s.gpu_uuids)} free"
        return new, "checkpointed", f"its runner acknowledged a checkpoint of {new.saved_gpu_s:g} GPU-s (it runs on)"

    out, _ = _change(name, now, who, user, step)
    if out is None:
        raise Rejected(404, {"name": f"no job {name!r}"})
    if freed:  # GPUs came free: a topology event, decided at once (as a report that frees GPUs)
        from console.gearbox import coalesce, tasks

        transaction.on_commit(lambda: coalesce.request_tick(tasks.tick, trigger="topology"))
    return out


__all__ = ["admit", "do_ask_to_yield", "do_checkpointed", "in_the_way", "job_states", "settle", "to_state"]
