"""A Celery worker killed with SIGKILL at every step of a transition: the next worker resumes it.

Each test runs one transition on real worker processes (`celery worker -P solo`, started with
subprocess against this test's database and Redis queue). Before each worker starts, the test
arms one crash point (console/gearbox/crashpoints.py); the worker stops there, says so in
Redis, and the test kills it with SIGKILL by its PID. A new worker is started and the sweep is
sent (what beat does every FLEXPIPE_SWEEP_S): the transition must resume - or roll back - from
wherever the dead worker left it. The points are passed in order, one kill each, through the
whole transition; each test run takes one kind of point (`persisted`, `effected`, `completed`)
through every step, so every point the executor probes (scheduler.transition.crash_points(),
plus `prepare.partial` and `finish.persisted`) is a SIGKILL here. At the end: the transition is DONE (forward) or ROLLED_BACK (rollback), the
invariant checker is clean over the audit chain, the command rows and the agents' log, and no
GPU booking, routing entry or prepared plan is left over.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from django.db import connection

from agents.sim.faults import Fault
from console.celery import app
from console.fleet.models import AgentCommand
from console.gearbox.executor import build_executor
from console.gearbox.models import Deployment, GpuReservation, Transition
from scheduler.invariants import assert_clean
from scheduler.plan import Gear, Plan, Stage
from scheduler.transition import CRASH_WHERE, ROLLBACK_TABLE, TABLE
from tests.conftest import TEST_NAMESPACE, TEST_REDIS_URL, purge_tasks
from tests.console.gearbox.harness import (
    M8,
    SimAgents,
    django_log,
    enroll_fleet,
    gear,
    make_deployment,
    uuid,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[3]
KEY = f"{TEST_NAMESPACE}:crashpoint"
# Through Celery every step is crashed three times, as in memory (tests/scheduler/test_transition.py):
# saved as running with nothing done yet (persisted), with its effects issued but its outcome not
# saved (effected), and with its outcome saved but the next step not started (completed). One test
# run per kind of point keeps each run short enough that the sequences are still in flight when
# the move comes.
POLL_S = 0.05
SEQUENCE_TOKENS = 40_000


def database_url() -> str:
    s = connection.settings_dict
    if "sqlite" in s["ENGINE"]:
        return f"sqlite:///{s['NAME']}"
    auth = s["USER"] + (f":{s['PASSWORD']}" if s.get("PASSWORD") else "")
    return f"postgres://{auth}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"


class Workers:
    """Celery worker processes for this test, one consuming at a time, the next one warming up."""

    def __init__(self, tmp: Path) -> None:
        self.redis = redis.Redis.from_url(TEST_REDIS_URL)
        self.proc: subprocess.Popen[bytes] | None = None
        self.standby: tuple[subprocess.Popen[bytes], str] | None = None
        self.logs = tmp
        self.started = 0
        self.env = {**os.environ, "DJANGO_SETTINGS_MODULE": "console.settings", "DATABASE_URL": database_url(),
                    "REDIS_URL": TEST_REDIS_URL, "FLEXPIPE_QUEUE": app.conf.task_default_queue,
                    "FLEXPIPE_CHANNEL_PREFIX": TEST_NAMESPACE, "FLEXPIPE_CRASHPOINT_KEY": KEY,
                    "FLEXPIPE_CANARY_DWELL_S": "0.2", "FLEXPIPE_RETRY_BACKOFF_S": "0.2",
                    # step timeouts run on the wall clock: generous, or a loaded machine rolls a
                    # forward test back (tests/console/gearbox/conftest.py says the same in-process)
                    "FLEXPIPE_DRAIN_BUDGET_S": "1", "FLEXPIPE_STEP_TIMEOUT_S": "60", "FLEXPIPE_MOVE_TIMEOUT_S": "120",
                    "FLEXPIPE_PREPARE_TIMEOUT_S": "120", "PYTHONPATH": str(ROOT)}

    def _spawn(self) -> tuple[subprocess.Popen[bytes], str]:
        n = self.started + (2 if self.standby else 1)
        go = f"{KEY}:go:{n}:{time.monotonic_ns()}"
        out = open(self.logs / f"worker-{n}.log", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("standby_worker.py")), go,
                                 app.conf.task_default_queue, f"crash{n}-{TEST_NAMESPACE}@%h"],
                                cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT)
        return proc, go

    def start(self, armed: str | None) -> None:
        """Arm `armed` (or nothing), let the warmed-up worker consume, and warm up the next one."""
        self.redis.delete(KEY, f"{KEY}:reached")
        if armed:
            self.redis.set(KEY, armed)
        proc, go = self.standby or self._spawn()
        self.started += 1
        self.redis.rpush(go, 1)
        self.proc, self.standby = proc, None
        self.standby = self._spawn()

    def log_tail(self) -> str:
        logs = sorted(self.logs.glob("worker-*.log"), key=lambda p: p.stat().st_mtime)
        return "\n".join(p.name + ": " + p.read_text(errors="replace")[-1500:] for p in logs[-2:])

    def reached(self) -> str | None:
        raw = self.redis.get(f"{KEY}:reached")
        return raw.decode() if raw else None

    def kill(self) -> None:
        """SIGKILL by PID: no cleanup, no acks, no goodbye."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill()
        if self.standby is not None:
            self.standby[0].kill()
            self.standby[0].wait(timeout=30)
            self.standby = None
        self.redis.delete(KEY, f"{KEY}:reached")


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Workers]:
    w = Workers(tmp_path)
    purge_tasks()  # no stale task from earlier tests runs here
    try:
        yield w
    finally:
        w.stop()


def sweep() -> None:
    app.send_task("transitions.sweep", queue=app.conf.task_default_queue)


def two_node_gear() -> Gear:
    """A PP2 plan over b1 and a1 (GPUs the baseline does not use): prepare sends two commands."""
    half = M8.num_layers // 2
    plan = Plan(M8.name, "colocated", (Stage(0, half, (uuid("b1", 0), uuid("b1", 1))),
                                       Stage(half, M8.num_layers, (uuid("a1", 4), uuid("a1", 5)))),
                kv_reserve_tokens=200_000)
    return Gear(M8.name, (plan,), (1.0,))


def busy_switch(agents: SimAgents, target: Gear | None = None) -> int:
    """chat runs on a1 with sequences in flight; a switch to `target` (b1's GPUs 0-3) is created.
    Returns its seq."""
    ex = build_executor()
    ex.start("chat", gear("a1", [0, 1]))
    deadline = time.monotonic() + 120
    while Transition.objects.get(seq=1).active:
        assert time.monotonic() < deadline
        ex.advance("chat")
        agents.run()
        time.sleep(0.01)
    # 40,000 tokens x ~9 ms (the cost model's decode round of 24 sequences on TP2): the sequences
    # stay in flight for ~6 minutes of the wall clock, so they are
    # still there to be moved however long a loaded machine takes to boot each Celery worker; once
    # the transition has ended, finish_and_check simulates what is left of them at once
    for i in range(24):
        agents.fleet.submit("chat", 300 + 120 * i, SEQUENCE_TOKENS)
    agents.run(0.05)
    rec = ex.start("chat", target or gear("b1", [0, 1, 2, 3]))
    assert rec is not None
    return rec.seq


def crash_through(points: list[str], workers: Workers, agents: SimAgents, seq: int) -> list[str]:
    """Run the transition on successive workers, killing each at the next point. Returns the points hit."""
    hit = []
    for point in points:
        workers.start(point)
        sweep()
        deadline = time.monotonic() + 180
        last_sweep = time.monotonic()
        while True:
            agents.run()
            reached = workers.reached()
            if reached:
                where, pid = reached.split("|")
                assert where == point and workers.proc is not None and int(pid) == workers.proc.pid
                workers.kill()
                hit.append(point)
                break
            row = Transition.objects.get(deployment__name="chat", seq=seq)
            # finish.persisted comes after the transition's last save: it has ended by then
            assert row.active or point.startswith("finish."), (
                f"the transition ended ({row.phase}) without passing {point}")
            assert workers.proc is not None and workers.proc.poll() is None, (
                "the worker died by itself: " + workers.log_tail())
            assert time.monotonic() < deadline, f"{point} not reached within 180 s (at {row.phase}/{row.step})"
            if time.monotonic() - last_sweep > 1.0:  # beat's sweep
                sweep()
                last_sweep = time.monotonic()
            time.sleep(POLL_S)
    return hit


def finish_and_check(workers: Workers, agents: SimAgents, seq: int) -> Transition:
    workers.start(None)
    sweep()
    deadline = time.monotonic() + 180
    last_sweep = time.monotonic()
    while Transition.objects.get(deployment__name="chat", seq=seq).active:
        assert time.monotonic() < deadline
        agents.run()
        if time.monotonic() - last_sweep > 1.0:
            sweep()
            last_sweep = time.monotonic()
        time.sleep(POLL_S)
    workers.stop()
    # Nothing else moves now (no worker, the transition ended): the rest of every sequence is
    # simulated at once instead of waited for on the wall clock - each still finishes exactly once,
    # on the plan that owns it, and the checker below sees every event in time order.
    agents.run_out()
    assert agents.fleet.open_sequences() == 0
    assert_clean(django_log("chat", agents.log))
    row = Transition.objects.get(deployment__name="chat", seq=seq)
    dep = Deployment.objects.get(name="chat")
    current = {r["plan_id"] for r in dep.routing}
    assert set(GpuReservation.objects.values_list("plan_id", flat=True)) == current
    assert agents.fleet.live_plans() == current
    return row


@pytest.mark.parametrize("where", CRASH_WHERE)
def test_a_worker_killed_at_every_forward_step_still_brings_the_switch_to_its_end(workers: Workers,
                                                                                  where: str) -> None:
    enroll_fleet()
    make_deployment()
    agents = SimAgents()
    seq = busy_switch(agents)
    points = [f"{d.step.value}.{where}" for d in TABLE]
    hit = crash_through(points, workers, agents, seq)
    assert hit == points and workers.started == len(points)
    row = finish_and_check(workers, agents, seq)
    assert row.phase == "done" and row.error == ""
    assert row.seqs_migrated + row.seqs_replayed > 0  # the move the worker died in had sequences to move
    assert Deployment.objects.get(name="chat").current_gear == gear("b1", [0, 1, 2, 3]).to_dict()


@pytest.mark.parametrize("where", CRASH_WHERE)
def test_a_worker_killed_at_every_rollback_step_still_rolls_the_switch_back(workers: Workers, where: str) -> None:
    enroll_fleet()
    make_deployment()
    agents = SimAgents()
    seq = busy_switch(agents)
    # the move fails on every attempt (the first and two retries): the switch must roll back
    agents.fleet.inject(Fault(node="a1", kind="move_sequences", action="fail", times=3))
    points = [f"{d.step.value}.{where}" for d in ROLLBACK_TABLE]
    hit = crash_through(points, workers, agents, seq)
    assert hit == points
    row = finish_and_check(workers, agents, seq)
    assert row.phase == "rolled_back" and "move" in row.error
    assert Deployment.objects.get(name="chat").current_gear == gear("a1", [0, 1]).to_dict()


def test_a_worker_killed_between_two_prepare_commands_and_after_the_last_save_still_ends_the_switch(
        workers: Workers) -> None:
    enroll_fleet()
    make_deployment()
    agents = SimAgents()
    target = two_node_gear()
    seq = busy_switch(agents, target)
    # prepare.partial: one node of the new plan was told to prepare, the other not yet;
    # finish.persisted: the transition is saved DONE, but the tick that follows an end never sent
    points = ["prepare.partial", "finish.persisted"]
    hit = crash_through(points, workers, agents, seq)
    assert hit == points
    row = finish_and_check(workers, agents, seq)
    assert row.phase == "done" and row.error == ""
    prepares = [s for s in row.steps.all() if s.step == "prepare"]
    assert len(prepares) == 1 and len(prepares[0].commands) == 2  # one attempt, one command per node
    issued = AgentCommand.objects.filter(deployment="chat", transition_seq=seq, kind="prepare_plan")
    assert sorted(issued.values_list("node__node_id", flat=True)) == ["a1", "b1"]  # the re-run issued no other
    assert Deployment.objects.get(name="chat").current_gear == target.to_dict()
