"""Fine-tune and batch jobs in the simulator: the scenario's `jobs:` on the same GPUs as the plans.

The rules are scheduler/pool/jobs.py's (seed 004 sections 2.1 and 5.2); this module carries them
out on FleetSim's clock and memory. A job starts on free GPUs of ours (nothing booked there, its
GPU model if it names one) when it arrives and whenever GPUs come free (a plan released, a GPU
back, another job done); it books each GPU whole - 0.92 of its memory, under the footprint key of
the job - so the agents' PREPARE check (scheduler.booking) refuses any plan beside it, and the
snapshot shows it. `reclaim_from_jobs` is what a simulated agent calls when a PREPARE lands on job
GPUs for a deployment of higher priority: each such job is asked to yield, and the PREPARE runs
after the latest release (SimAgents defers it: invariant 4 holds at every moment, the job's
booking is gone before the plan's is made). A job that loses a GPU to another tenant or a failure
crashes back to its checkpoint.

Accounting: `jobs_summary()` - GPU-hours the jobs held (apart from the plans' `gpu_hours_held`),
GPUs reclaimed from jobs, and per job its progress, state, yields and lost work.

A mixin of FleetSim (agents/sim/fleet.py); with no jobs in the scenario nothing here schedules
an event, so a run without jobs is the run it always was.
"""

# mypy: disable-error-code="misc"
# (its methods take `self: FleetSim`, as agents/sim/churn.py explains)

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from agents.sim.cluster import US
from agents.sim.engine import Event
from agents.sim.reports import IDLE_MEM_BYTES
from scheduler.invariants import LogEvent
from scheduler.pool import jobs as J

if TYPE_CHECKING:
    from agents.sim.fleet import FleetSim
    from agents.sim.simagents import SimAgents
    from scheduler.plan import Plan
    from scheduler.transition import CommandIntent


class Jobs:
    """FleetSim's jobs (module docstring)."""

    def _init_jobs(self: FleetSim) -> None:
        self.jobs: dict[str, J.JobState] = {j.name: J.JobState(j) for j in self.scenario.jobs}
        # footprint keys below every engine id (engine ids count up from 1)
        self._job_keys = {name: -(i + 1) for i, name in enumerate(self.jobs)}
        self._job_epoch = dict.fromkeys(self.jobs, 0)  # bumped at each start: stale timers do nothing
        self._job_holds: list[tuple[float, float | None, int, str]] = []  # (from, to, GPUs, job)
        self._job_kick_at: float | None = None
        self.gpus_reclaimed_from_jobs = 0
        for job in self.scenario.jobs:
            self.call_at(job.arrive_s, lambda t: self._jobs_try_start(t))

    # -- queries ---------------------------------------------------------------------------
    def job_states(self: FleetSim) -> tuple[J.JobState, ...]:
        """What the control loop observes (FleetState.jobs)."""
        return tuple(self.jobs.values())

    def job_of_gpu(self: FleetSim) -> dict[str, str]:
        """GPU uuid -> the job holding it now."""
        return {u: j.name for j in self.jobs.values() if j.phase in J.HOLDING for u in j.gpu_uuids}

    # -- starting, finishing -----------------------------------------------------------------
    def _jobs_kick(self: FleetSim, t: float) -> None:
        """GPUs may have come free: try the waiting jobs once, after what else happens at `t`."""
        if not self.jobs or self._job_kick_at == t:
            return
        if not any(j.phase in (J.JobPhase.QUEUED, J.JobPhase.CHECKPOINTED) and j.job.arrive_s <= t
                   for j in self.jobs.values()):
            return
        self._job_kick_at = t
        self.call_at(t, lambda now: self._jobs_try_start(now))

    def _jobs_try_start(self: FleetSim, t: float) -> None:
        self._job_kick_at = None
        booked = self.booked_bytes()
        free = [(g.uuid, g.node_id, g.model) for n in self.cluster.nodes.values() for g in n.gpus
                if g.owner == US and g.uuid not in booked]
        waiting = [j for j in self.jobs.values()
                   if j.phase in (J.JobPhase.QUEUED, J.JobPhase.CHECKPOINTED) and j.job.arrive_s <= t]
        for state in sorted(waiting, key=lambda j: (-j.job.priority, j.job.arrive_s, j.name)):
            gpus = J.pick_gpus(state.job, free)
            if gpus is None:
                continue
            free = [g for g in free if g[0] not in gpus]
            new = J.start(state, gpus, {u: self.gpu_mem_bytes(u) for u in gpus}, t,
                          used_bytes=dict.fromkeys(gpus, IDLE_MEM_BYTES))
            self._job_book(new, t)
            done = new.done_at_s()
            epoch = self._job_epoch[new.name] = self._job_epoch[new.name] + 1
            if done is not None:
                self.call_at(done, lambda now, name=new.name, e=epoch: self._job_done(name, e, now))

    def _job_done(self: FleetSim, name: str, epoch: int, t: float) -> None:
        state = self.jobs[name]
        if self._job_epoch[name] != epoch or state.phase is not J.JobPhase.RUNNING:
            return  # it yielded or crashed since this timer was set
        self._job_unbook(state, J.finish(state, t), t)

    def _job_book(self: FleetSim, state: J.JobState, t: float) -> None:
        self.jobs[state.name] = state
        self._footprint[self._job_keys[state.name]] = dict(state.booked_bytes)
        self._job_holds.append((t, None, len(state.gpu_uuids), state.name))
        self._snapshot = None
        self._reshare()  # plans on its GPUs now time-slice them with its training loop
        booked = self.booked_bytes()
        gpus = tuple((u, booked[u], self.gpu_mem_bytes(u)) for u in sorted(state.booked_bytes))
        for _, b, total in gpus:
            self.peak_booked_fraction = max(self.peak_booked_fraction, b / total)
        self.memory_log.add(LogEvent(t, "mem_booked", plan_id=f"job/{state.name}", gpus=gpus))

    def _job_unbook(self: FleetSim, old: J.JobState, new: J.JobState, t: float) -> None:
        """`old` held GPUs, `new` holds none: free its memory, close its hold, let others start."""
        self.jobs[new.name] = new
        self._footprint.pop(self._job_keys[new.name], None)
        self._reshare()
        for i, (t0, t1, n, name) in enumerate(self._job_holds):
            if name == new.name and t1 is None:
                self._job_holds[i] = (t0, t, n, name)
        self._snapshot = None
        self._jobs_kick(t)

    # -- taking GPUs back ----------------------------------------------------------------------
    def reclaim_from_jobs(self: FleetSim, uuids: Iterable[str], deployment: str) -> float | None:
        """A PREPARE of `deployment` lands on these GPUs: the jobs holding any of them are asked
        to yield (scheduler/pool/jobs.py rule 3). The time the last of them releases (the PREPARE
        runs then), now when no job holds them, or None when one of them is not below the
        deployment's priority (the PREPARE is refused as any overbooking is)."""
        want = set(uuids)
        hit = [j for j in self.jobs.values() if j.phase in J.HOLDING and want.intersection(j.gpu_uuids)]
        priority = self._dep(deployment).spec.priority
        if any(j.job.priority >= priority for j in hit):
            return None
        t = self.now_s
        release_at = t
        for state in hit:
            if state.phase is J.JobPhase.RUNNING:
                state = self.jobs[state.name] = J.ask_to_yield(state, t, by=deployment)
                assert state.release_at_s is not None  # noqa: S101 - a yielding job has one
                self.call_at(state.release_at_s, lambda now, name=state.name: self._job_released(name, now))
            release_at = max(release_at, state.release_at_s or t)
        return release_at

    def _job_released(self: FleetSim, name: str, t: float) -> None:
        state = self.jobs[name]
        if state.phase is not J.JobPhase.YIELDING:
            return  # it crashed while checkpointing
        self.gpus_reclaimed_from_jobs += len(state.gpu_uuids)
        # the deferred PREPARE was queued at the ask, after this release: it books before any job
        # kicked here starts (the kick runs after both)
        self._job_unbook(state, J.release(state), t)

    def _jobs_lost(self: FleetSim, t: float) -> list[Event]:
        """After a cluster change: a job on a GPU no longer ours crashes back to its checkpoint."""
        gpus = self._gpus_by_uuid()
        for state in list(self.jobs.values()):
            if state.phase in J.HOLDING and any(u not in gpus or gpus[u].owner != US for u in state.gpu_uuids):
                self._job_unbook(state, J.crash(state, t), t)
        self._jobs_kick(t)
        return []

    # -- accounting ---------------------------------------------------------------------------
    def jobs_summary(self: FleetSim) -> dict[str, Any]:
        end = self.scenario.duration_s
        gpu_s = sum(n * max(0.0, min(t1 if t1 is not None else end, end) - min(t0, end))
                    for t0, t1, n, _ in self._job_holds)
        t = min(self.now_s, end)
        per_job = {
            name: {"state": s.phase.value, "progress": round(s.progress_gpu_s(t) / s.job.work_gpu_s, 4),
                   "done_s": round(s.done_s, 3) if s.done_s is not None else None, "yields": s.yields,
                   "lost_gpu_s": round(s.lost_gpu_s, 3)}
            for name, s in self.jobs.items()}
        return {"gpus_reclaimed_from_jobs": self.gpus_reclaimed_from_jobs, "job_gpu_hours": round(gpu_s / 3600, 3),
                "jobs": per_job}


# --- the simulated agents' side (agents/sim/simagents.py) -----------------------------------------
def defer_for_jobs(agents: SimAgents, cmd: CommandIntent, plan: Plan) -> bool:
    """A PREPARE on GPUs that jobs hold, for a deployment of higher priority: the jobs are asked to
    yield and the PREPARE runs again once the last has released - never beside a job's booking.
    False: no job holds them, or one is not below the deployment's priority (the launch then
    refuses it for memory, as any overbooking)."""
    sim = agents.sim
    held = sim.job_of_gpu().keys() & set(plan.gpu_uuids) if sim.jobs else set()
    if not held:
        return False
    at = sim.reclaim_from_jobs(held, cmd.deployment_id)
    if at is None:
        return False
    agents._deferred[cmd.key] = cmd

    def again(now: float) -> None:
        if agents._deferred.pop(cmd.key, None) is not None:
            agents._prepare(cmd)

    sim.call_at(at, again)
    return True


def drop_deferred(agents: SimAgents, cmd: CommandIntent) -> None:
    """An abort or release of a plan whose PREPARE still waits for jobs: that PREPARE never runs (it
    is answered failed)."""
    pid = cmd.payload.get("plan_id")
    for key, c in list(agents._deferred.items()):
        if c.deployment_id == cmd.deployment_id and c.payload.get("plan_id") == pid:
            del agents._deferred[key]
            agents._ack(c, False, f"plan {pid} was called off before its GPUs came back from jobs",
                          {"reason": "failed"})
