"""Fine-tune and batch jobs on the inference pool: what a job holds, when it yields, what it keeps.

Seed 004 section 2.1: a fine-tune job submitted beside the inference deployments fills GPU memory
and the serving cluster "avalanches", because the autoscaler does not know the operation. Section
5.2 ("pit five": fine-tune jobs preempting inference) gives the fix this module carries: every
workload has a priority, fine-tune at 1 (the lowest), inference at 10, and the scheduler serves
the higher first. The seed says no more; the rules below are ours.

The rules (pure: no clock but the `now_s` each function is given, no I/O):

1. A job is QUEUED until enough free GPUs of its constraint (`gpu_model`, or any) exist; then it
   RUNNING on them, and books each one *whole*: MEM_FRACTION (0.92) of its memory (`booking_bytes`),
   so no plan fits beside it and invariant 4 holds while it runs.
2. Running, it does `len(gpus)` GPU-seconds of work per second, until `work_gpu_s` is done (DONE).
3. A deployment of higher priority that needs its GPUs asks it to yield (`ask_to_yield`): it
   stops and writes a checkpoint, which takes `checkpoint_s`; it must release within `grace_s`.
   When `checkpoint_s <= grace_s` it keeps all its progress and releases at `now + checkpoint_s`;
   otherwise the checkpoint does not finish in time, the job is stopped at `now + grace_s` and
   **the progress since its last checkpoint (its start or resume) is lost**. YIELDING until then.
4. Released (`release`), it is CHECKPOINTED: it holds nothing, and resumes from its checkpoint
   (rule 1 again, on any GPUs that fit) when enough are free. Losing a GPU to another tenant or a
   failure is a crash: CHECKPOINTED at once, the progress since the last checkpoint lost.
5. In a decision of the control loop (scheduler/control/loop.py), a job's GPUs are *takeable* by a
   deployment whose priority is above the job's (`takeable_gpus`), and blocked for anyone else;
   a job that is already yielding gives nothing more to take. Taking them costs the deployment the
   job's release time (`yield_s`) before its PREPARE can run there, and the job its progress, so
   the loop takes them only when nothing else will do (`decide_around_jobs`): it decides first
   without them, and only when that is no switch, again with them; a switch that takes them
   says which job, how many GPUs, and how long until they are free. (That wait is said, not
   priced in the gearbox's gain: PREPARE time is weighed against the horizon, the yield is not.)
6. A job that runs outside FlexPipe (the console's: it admits and books, a runner of its own
   trains) cannot be timed by `checkpoint_s`: asked to yield (`ask_runner_to_yield`), it is
   YIELDING with the deadline `now + grace_s`, and the checkpoint asked for holds its work up to
   the ask. Its runner's acknowledgement (`checkpointed`) releases it at once, keeping what the
   checkpoint holds; at the deadline without one (`expire`) it is released anyway and the work
   since its last checkpoint is lost. A runner may acknowledge a checkpoint while it runs, too:
   that is its new restart point (what a crash or a missed deadline falls back to).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from scheduler.gearbox import Decision, Outcome
from scheduler.plan import MEM_FRACTION
from scheduler.topology import Snapshot

JOB_PRIORITY = 1  # seed 004 section 5.2: fine-tune requests default to priority 1, the lowest
INFERENCE_PRIORITY = 10  # seed 004 section 5.2: inference requests at priority 10


class JobPhase(enum.StrEnum):
    QUEUED = "queued"  # waiting for its first GPUs
    RUNNING = "running"  # holds its GPUs and makes progress
    YIELDING = "yielding"  # asked to give its GPUs back: checkpointing, releases at `release_at_s`
    CHECKPOINTED = "checkpointed"  # released after a checkpoint (or a crash): waits for GPUs to resume
    DONE = "done"  # all its work is done; it holds nothing


HOLDING = frozenset({JobPhase.RUNNING, JobPhase.YIELDING})


@dataclass(frozen=True)
class Job:
    """A fine-tune or batch job as it was submitted."""

    name: str
    gpus: int  # GPUs it wants (all of them, or it does not run)
    work_gpu_s: float  # its total work, in GPU-seconds (gpus x the seconds it runs uninterrupted)
    gpu_model: str | None = None  # a GPU model of scheduler.hardware's catalog, or None: any
    priority: int = JOB_PRIORITY  # below the deployments that may take its GPUs
    grace_s: float = 30.0  # how long it may take to release its GPUs once asked
    checkpoint_s: float = 20.0  # how long writing its checkpoint takes
    arrive_s: float = 0.0  # when it is submitted

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name: required")
        if self.gpus < 1:
            raise ValueError(f"gpus: must be >= 1; got {self.gpus}")
        if not self.work_gpu_s > 0:
            raise ValueError(f"work_gpu_s: must be > 0; got {self.work_gpu_s}")
        for key in ("grace_s", "checkpoint_s", "arrive_s"):
            if not getattr(self, key) >= 0:
                raise ValueError(f"{key}: must be >= 0; got {getattr(self, key)}")

    @property
    def yield_s(self) -> float:
        """Rule 3: from the ask to the release."""
        return min(self.checkpoint_s, self.grace_s)

    @property
    def loses_on_yield(self) -> bool:
        """Rule 3: its checkpoint does not fit in its grace time (a yield loses the work since the last one)."""
        return self.checkpoint_s > self.grace_s


@dataclass(frozen=True)
class JobState:
    """A job now. Progress is `saved_gpu_s` (checkpointed) plus what it did since `since_s` while it runs."""

    job: Job
    phase: JobPhase = JobPhase.QUEUED
    gpu_uuids: tuple[str, ...] = ()  # what it holds (RUNNING, YIELDING)
    booked_bytes: Mapping[str, int] = field(default_factory=dict)  # GPU uuid -> bytes it books there
    saved_gpu_s: float = 0.0  # work in its last checkpoint
    since_s: float = 0.0  # RUNNING: when it (re)started from `saved_gpu_s`
    release_at_s: float | None = None  # YIELDING: when its GPUs are free
    yield_keeps_gpu_s: float = 0.0  # YIELDING: what the checkpoint it writes holds
    taken_by: str = ""  # YIELDING: the deployment that asked
    yields: int = 0  # times it was asked to yield
    lost_gpu_s: float = 0.0  # work lost so far (yields past grace, crashes)
    done_s: float | None = None  # DONE: when

    @property
    def name(self) -> str:
        return self.job.name

    def progress_gpu_s(self, now_s: float) -> float:
        """Work done by `now_s` (rule 2): a yielding job stopped making progress when it was asked."""
        if self.phase is JobPhase.RUNNING:
            return min(self.job.work_gpu_s, self.saved_gpu_s + len(self.gpu_uuids) * max(0.0, now_s - self.since_s))
        if self.phase is JobPhase.DONE:
            return self.job.work_gpu_s
        return self.saved_gpu_s if self.phase is not JobPhase.YIELDING else self.yield_keeps_gpu_s

    def done_at_s(self) -> float | None:
        """When a RUNNING job finishes if nothing stops it."""
        if self.phase is not JobPhase.RUNNING:
            return None
        return self.since_s + (self.job.work_gpu_s - self.saved_gpu_s) / len(self.gpu_uuids)


def booking_bytes(total_bytes: int) -> int:
    """Rule 1: a job books a GPU whole - MEM_FRACTION of it (invariant 4's limit, DESIGN.md)."""
    return int(MEM_FRACTION * total_bytes)


def pick_gpus(job: Job, free: Sequence[tuple[str, str, str]]) -> tuple[str, ...] | None:
    """Rule 1: `job.gpus` of the `free` (uuid, node id, GPU model) that meet its constraint, the
    fewest nodes first (a job's ranks talk: one node beats two); None when not enough are free."""
    fit = [g for g in free if job.gpu_model is None or g[2] == job.gpu_model]
    if len(fit) < job.gpus:
        return None
    by_node: dict[str, list[str]] = {}
    for uuid, node, _ in sorted(fit, key=lambda g: (g[1], g[0])):
        by_node.setdefault(node, []).append(uuid)
    out: list[str] = []
    for node in sorted(by_node, key=lambda n: (-len(by_node[n]), n)):
        out += by_node[node][:job.gpus - len(out)]
        if len(out) == job.gpus:
            break
    return tuple(out)


def start(state: JobState, gpu_uuids: Sequence[str], total_bytes: Mapping[str, int], now_s: float,
          used_bytes: Mapping[str, int] | None = None) -> JobState:
    """Rule 1 (or 4: a resume from its checkpoint): it runs on `gpu_uuids`, booking each whole - up
    to MEM_FRACTION beside what the GPU holds already (`used_bytes`: an idle CUDA context)."""
    used = used_bytes or {}
    if state.phase not in (JobPhase.QUEUED, JobPhase.CHECKPOINTED):
        raise ValueError(f"phase: job {state.name} is {state.phase.value}; only a queued or checkpointed job starts")
    if len(gpu_uuids) != state.job.gpus:
        raise ValueError(f"gpus: job {state.name} wants {state.job.gpus} GPUs; got {len(gpu_uuids)}")
    return replace(state, phase=JobPhase.RUNNING, gpu_uuids=tuple(gpu_uuids), since_s=now_s,
                   booked_bytes={u: max(0, booking_bytes(total_bytes[u]) - used.get(u, 0)) for u in gpu_uuids})


def finish(state: JobState, now_s: float) -> JobState:
    """Rule 2: its work is done; it releases its GPUs."""
    return replace(state, phase=JobPhase.DONE, gpu_uuids=(), booked_bytes={}, saved_gpu_s=state.job.work_gpu_s,
                   done_s=now_s)


def ask_to_yield(state: JobState, now_s: float, by: str) -> JobState:
    """Rule 3: a RUNNING job stops and checkpoints; YIELDING until `release_at_s`. Asking a job that
    is already yielding changes nothing (it is on its way out)."""
    if state.phase is JobPhase.YIELDING:
        return state
    if state.phase is not JobPhase.RUNNING:
        raise ValueError(f"phase: job {state.name} is {state.phase.value}; only a running job yields")
    job = state.job
    now = state.progress_gpu_s(now_s)
    keeps = state.saved_gpu_s if job.loses_on_yield else now
    return replace(state, phase=JobPhase.YIELDING, release_at_s=now_s + job.yield_s, yield_keeps_gpu_s=keeps,
                   taken_by=by, yields=state.yields + 1, lost_gpu_s=state.lost_gpu_s + (now - keeps))


def release(state: JobState) -> JobState:
    """Rule 4: a yielding job gives its GPUs back, its checkpoint written (or not: rule 3)."""
    if state.phase is not JobPhase.YIELDING:
        raise ValueError(f"phase: job {state.name} is {state.phase.value}; only a yielding job releases")
    return replace(state, phase=JobPhase.CHECKPOINTED, gpu_uuids=(), booked_bytes={},
                   saved_gpu_s=state.yield_keeps_gpu_s, release_at_s=None, taken_by="")


def ask_runner_to_yield(state: JobState, now_s: float, by: str) -> JobState:
    """Rule 6: an external runner's job stops and checkpoints; YIELDING until its runner acknowledges
    (`checkpointed`) or `release_at_s` (now + grace_s: `expire`). Asking again changes nothing."""
    if state.phase is JobPhase.YIELDING:
        return state
    if state.phase is not JobPhase.RUNNING:
        raise ValueError(f"phase: job {state.name} is {state.phase.value}; only a running job yields")
    return replace(state, phase=JobPhase.YIELDING, release_at_s=now_s + state.job.grace_s,
                   yield_keeps_gpu_s=state.progress_gpu_s(now_s), taken_by=by, yields=state.yields + 1)


def checkpointed(state: JobState, now_s: float, gpu_s: float | None = None) -> JobState:
    """Rule 6: its runner wrote a checkpoint holding `gpu_s` of work (None: all it did by now; a
    yielding job's, what it did by the ask). Running, the checkpoint is its new restart point (and
    all its work: it is DONE); yielding, it releases at once (rule 4), keeping it."""
    if state.phase not in HOLDING:
        raise ValueError(f"phase: job {state.name} is {state.phase.value}; only a running or yielding job "
                         "checkpoints")
    kept = state.progress_gpu_s(now_s) if gpu_s is None else gpu_s
    if not state.saved_gpu_s <= kept <= state.job.work_gpu_s:
        raise ValueError(f"progress_gpu_s: must be from {state.saved_gpu_s:g} (its last checkpoint) to "
                         f"{state.job.work_gpu_s:g} (its work); got {kept:g}")
    if state.phase is JobPhase.YIELDING:
        return release(replace(state, yield_keeps_gpu_s=kept))
    if kept >= state.job.work_gpu_s:
        return finish(state, now_s)
    return replace(state, saved_gpu_s=kept, since_s=now_s)


def expire(state: JobState, now_s: float) -> JobState:
    """Rule 6: its grace time is over and no checkpoint was acknowledged: released anyway, the work
    since its last checkpoint lost. Before the deadline, or not yielding: unchanged."""
    if state.phase is not JobPhase.YIELDING or state.release_at_s is None or now_s < state.release_at_s:
        return state
    lost = max(0.0, state.yield_keeps_gpu_s - state.saved_gpu_s)
    return release(replace(state, yield_keeps_gpu_s=state.saved_gpu_s, lost_gpu_s=state.lost_gpu_s + lost))


def crash(state: JobState, now_s: float) -> JobState:
    """Rule 4: it lost a GPU (another tenant, a failure): back to its last checkpoint, holding nothing."""
    if state.phase not in HOLDING:
        return state
    kept = state.saved_gpu_s
    lost = max(0.0, state.progress_gpu_s(now_s) - kept) if state.phase is JobPhase.RUNNING else 0.0
    return replace(state, phase=JobPhase.CHECKPOINTED, gpu_uuids=(), booked_bytes={}, release_at_s=None,
                   taken_by="", lost_gpu_s=state.lost_gpu_s + lost + (
                       state.yield_keeps_gpu_s - kept if state.phase is JobPhase.YIELDING else 0.0))


def takeable_gpus(jobs: Iterable[JobState], priority: int) -> frozenset[str]:
    """Rule 5: the job GPUs a deployment of `priority` may take (running jobs of lower priority)."""
    return frozenset(u for j in jobs if j.phase is JobPhase.RUNNING and j.job.priority < priority
                     for u in j.gpu_uuids)


def job_gpus(jobs: Iterable[JobState]) -> frozenset[str]:
    """Every GPU a job holds now."""
    return frozenset(u for j in jobs if j.phase in HOLDING for u in j.gpu_uuids)


def decision_view(snapshot: Snapshot, jobs: Sequence[JobState], priority: int, *, take: bool) -> Snapshot:
    """The snapshot a deployment of `priority` decides on (rule 5): job GPUs unschedulable, except -
    with `take` - those it may take, shown as free (their job's booking removed)."""
    held = job_gpus(jobs)
    if not held:
        return snapshot
    free = takeable_gpus(jobs, priority) if take else frozenset()
    booked: dict[str, int] = {}
    for j in jobs:
        for u, b in j.booked_bytes.items():
            booked[u] = booked.get(u, 0) + b
    gpus = []
    for g in snapshot.gpus:
        if g.uuid in free:
            g = replace(g, mem_used_bytes=max(0, g.mem_used_bytes - booked.get(g.uuid, 0)))
        elif g.uuid in held:
            g = replace(g, schedulable=False)
        gpus.append(g)
    return replace(snapshot, gpus=tuple(gpus))


def taken_from(jobs: Iterable[JobState], gpu_uuids: Iterable[str]) -> list[tuple[str, int, float]]:
    """The jobs a target on `gpu_uuids` takes GPUs from: (job, GPUs taken, its release time)."""
    want = set(gpu_uuids)
    return [(j.name, len(want.intersection(j.gpu_uuids)), j.job.yield_s) for j in jobs
            if j.phase is JobPhase.RUNNING and want.intersection(j.gpu_uuids)]


def decide_around_jobs(decide: Callable[[Snapshot], Decision], snapshot: Snapshot, jobs: Sequence[JobState],
                       priority: int) -> Decision:
    """Rule 5 for one decision of a deployment of `priority`: `decide` (the gearbox, on a snapshot)
    without the job GPUs; when that is no switch and some are takeable, again with them."""
    if not jobs:
        return decide(snapshot)
    first = decide(decision_view(snapshot, jobs, priority, take=False))
    if first.outcome is Outcome.SWITCH or not takeable_gpus(jobs, priority):
        return first
    second = decide(decision_view(snapshot, jobs, priority, take=True))
    if second.outcome not in (Outcome.SWITCH, Outcome.ADVISE) or second.target is None:
        return first
    said = [f"takes {n} GPU(s) from job {name} (priority below {priority}): they are free after its checkpoint,"
            f" {wait:g} s" for name, n, wait in taken_from(jobs, second.target.gpu_uuids)]
    return replace(second, reasons=(*second.reasons, *said))


__all__ = [
    "HOLDING", "INFERENCE_PRIORITY", "JOB_PRIORITY", "Job", "JobPhase", "JobState", "ask_runner_to_yield",
    "ask_to_yield", "booking_bytes", "checkpointed", "crash", "decide_around_jobs", "decision_view", "expire",
    "finish", "job_gpus", "pick_gpus", "release", "start", "takeable_gpus", "taken_from",
]
