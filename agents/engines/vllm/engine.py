"""Supervise one vLLM OpenAI server for one plan: start, health, restart, metrics, drain, stop.

    engine = VllmEngine(spec)          # spec: VllmPlanSpec
    engine.start()                     # launch, wait for /health; a watchdog thread takes over
    engine.report()                    # EngineReport of the interval since the last report
    engine.drain(deadline_s=30)        # stop admitting, wait for running + waiting to reach 0
    engine.stop()                      # SIGTERM the process group, SIGKILL after the grace

The watchdog restarts a server that dies (or whose /health fails `unhealthy_checks` times in
a row while the process lives) after an exponential backoff, at most `max_restarts` times
within `window_s`; one more death makes the engine FAILED, with the exit status and the last
log lines in `status().failure` and a call to `on_failure`. A restarted server starts empty:
the requests it held are lost to it, and the gateway re-sends them (replay.py), since it
holds every in-flight sequence.

Admission: vLLM has no switch to refuse new requests, so "stop admitting" is this adapter's
`admitting` flag: requests that go through the adapter (replay, complete) check it, and the
agent reports it so the gateway stops routing here (the routing table's frozen flag).
"""

from __future__ import annotations

import atexit
import enum
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from agents.engines.vllm.metrics import VllmMetrics, engine_report, parse_metrics
from agents.engines.vllm.process import ServerProcess
from agents.engines.vllm.spec import VllmPlanSpec, build_command, build_env, default_vllm_python
from agents.protocol import EngineReport

# Engines with a server that may be running. vLLM servers run in their own session, so they
# would outlive an agent that exits without stopping them; at interpreter exit we stop them.
# (An agent killed with SIGKILL cannot do this: its servers keep running until stopped.)
_LIVE: weakref.WeakSet[VllmEngine] = weakref.WeakSet()


@atexit.register
def _stop_all_at_exit() -> None:
    for engine in list(_LIVE):
        engine.stop(grace_s=5.0)


class EngineState(enum.StrEnum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"  # ready, but not admitting: being emptied before a stop or a switch
    RESTARTING = "restarting"  # the server died; waiting out the backoff or starting again
    STOPPED = "stopped"
    FAILED = "failed"  # died more often than the restart policy allows; needs the controller


class EngineError(RuntimeError):
    """The engine cannot do what was asked; the message says why (one line, then log lines)."""


class NotAdmitting(EngineError):
    """The engine is draining or stopped and takes no new request."""


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 3  # restarts allowed within window_s; the next death is a failure
    window_s: float = 600.0
    backoff_initial_s: float = 1.0  # doubled per restart inside the window ...
    backoff_max_s: float = 30.0  # ... up to this
    unhealthy_checks: int = 3  # consecutive failed /health checks of a live process = dead
    startup_timeout_s: float = 900.0  # big models load for minutes

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts: must be >= 0; got {self.max_restarts}")
        for name in ("window_s", "backoff_max_s", "startup_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0; got {getattr(self, name)}")
        if self.backoff_initial_s < 0:
            raise ValueError(f"backoff_initial_s: must be >= 0; got {self.backoff_initial_s}")
        if self.unhealthy_checks < 1:
            raise ValueError(f"unhealthy_checks: must be >= 1; got {self.unhealthy_checks}")

    def backoff_s(self, recent_deaths: int) -> float:
        return min(self.backoff_initial_s * 2 ** max(recent_deaths - 1, 0), self.backoff_max_s)


@dataclass(frozen=True)
class EngineStatus:
    plan_id: str
    state: EngineState
    admitting: bool  # takes new requests now: serving, and not draining
    pid: int | None  # the API server's pid while one runs
    base_url: str
    restarts: int  # restarts so far (all time)
    last_exit_status: int | None  # of the last server that died (negative: killed by that signal)
    last_death: str | None  # why the last server was given up ("exited with status -9", "/health failed ...")
    failure: str | None  # why the engine is FAILED (or the last start failed), with log lines
    log_path: str


@dataclass(frozen=True)
class DrainResult:
    drained: bool  # True: no request open, running or waiting; False: the deadline came first
    running: int  # the engine's gauges at the last look
    waiting: int
    in_flight: int | None  # requests the API server still had open (/load); None without load tracking
    waited_s: float


class VllmEngine:
    """One plan's vLLM server under supervision. Thread-safe; one watchdog thread per engine."""

    def __init__(self, spec: VllmPlanSpec, *, python: str | None = None, log_dir: str | Path | None = None,
                 policy: RestartPolicy | None = None, health_interval_s: float = 2.0,
                 health_timeout_s: float = 5.0, on_failure: Callable[[EngineStatus], None] | None = None,
                 base_env: dict[str, str] | None = None, cwd: str | None = None) -> None:
        self.spec = spec
        self.python = python or default_vllm_python()
        self.policy = policy or RestartPolicy()
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.on_failure = on_failure
        self.argv = build_command(spec, self.python)
        self.env = build_env(spec, base_env)
        self._cwd = cwd
        log_root = Path(log_dir) if log_dir is not None else Path.cwd() / ".run" / "vllm"
        self.log_path = log_root / f"{spec.plan_id.replace(':', '_')}-{spec.port}.log"
        self._cv = threading.Condition()
        self._state = EngineState.STOPPED
        self._started = False
        self._stopping = False
        self._admitting = True
        self._proc: ServerProcess | None = None
        self._restarts = 0
        self._deaths: list[float] = []
        self._last_exit: int | None = None
        self._last_death: str | None = None
        self._failure: str | None = None
        self._thread: threading.Thread | None = None
        self._http = httpx.Client(timeout=httpx.Timeout(10.0, connect=2.0))
        self._metrics_lock = threading.Lock()
        self._last_metrics: VllmMetrics | None = None
        self._ready_at = 0.0

    # -- life cycle ---------------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        return self.spec.base_url

    def start(self, *, wait: bool = True, timeout_s: float | None = None) -> EngineStatus:
        """Launch the server and its watchdog; with `wait`, return once it serves (or raise)."""
        if not Path(self.python).exists():
            raise EngineError(f"python: vLLM's interpreter {self.python} does not exist; run "
                              "scripts/make-vllm-venv.sh or set FLEXPIPE_VLLM_PYTHON")
        with self._cv:
            if self._started:
                raise EngineError(f"plan {self.spec.plan_id}: already started")
            self._started = True
            self._state = EngineState.STARTING
        _LIVE.add(self)
        self._thread = threading.Thread(target=self._supervise, name=f"vllm-{self.spec.plan_id}", daemon=True)
        self._thread.start()
        if wait:
            return self.wait_ready(timeout_s if timeout_s is not None else self.policy.startup_timeout_s + 30)
        return self.status()

    def wait_ready(self, timeout_s: float) -> EngineStatus:
        """Block until the engine serves (READY or DRAINING); raise EngineError if it failed/stopped."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._state not in (EngineState.READY, EngineState.DRAINING):
                if self._state in (EngineState.FAILED, EngineState.STOPPED):
                    raise EngineError(f"plan {self.spec.plan_id}: {self._state.value}: {self._failure or ''}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EngineError(f"plan {self.spec.plan_id}: not ready after {timeout_s:.0f} s "
                                      f"(state {self._state.value})")
                self._cv.wait(min(left, 1.0))
        return self.status()

    def wait_restarts(self, at_least: int, timeout_s: float) -> EngineStatus:
        """Block until `restarts >= at_least` and the engine serves again (tests, tooling)."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._restarts < at_least:
                if self._state in (EngineState.FAILED, EngineState.STOPPED):
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EngineError(f"plan {self.spec.plan_id}: {self._restarts} restarts after {timeout_s:.0f} s")
                self._cv.wait(min(left, 1.0))
        return self.wait_ready(max(deadline - time.monotonic(), 0.1))

    def status(self) -> EngineStatus:
        with self._cv:
            proc = self._proc
            return EngineStatus(
                plan_id=self.spec.plan_id,
                state=self._state,
                admitting=self._admitting and self._state is EngineState.READY,
                pid=proc.pid if proc is not None and proc.poll() is None else None,
                base_url=self.base_url,
                restarts=self._restarts,
                last_exit_status=self._last_exit,
                last_death=self._last_death,
                failure=self._failure,
                log_path=str(self.log_path),
            )

    def stop(self, grace_s: float = 20.0) -> int | None:
        """Stop the server and the watchdog; no process of the server survives. Idempotent."""
        with self._cv:
            self._stopping = True
            self._admitting = False
            proc = self._proc
            if self._state != EngineState.FAILED:
                self._state = EngineState.STOPPED
            self._cv.notify_all()
        code = proc.stop(grace_s) if proc is not None else None
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=grace_s + 30)
        self._http.close()
        _LIVE.discard(self)
        return code

    def leftovers(self) -> set[int]:
        """Live processes of the current server (empty after stop(): no orphans)."""
        proc = self._proc
        return proc.leftovers() if proc is not None else set()

    def kill_server(self) -> int:
        """Fault injection: SIGKILL the API server process, as a crash would. Returns its pid."""
        proc = self._proc
        if proc is None:
            raise EngineError(f"plan {self.spec.plan_id}: no server to kill")
        proc.kill()
        return proc.pid

    # -- admission and drain --------------------------------------------------------------------
    @property
    def admitting(self) -> bool:
        return self.status().admitting

    def check_admission(self) -> None:
        st = self.status()
        if not st.admitting:
            raise NotAdmitting(f"plan {self.spec.plan_id} admits no new request ({st.state.value})")

    def drain(self, deadline_s: float, poll_s: float = 0.2) -> DrainResult:
        """Stop admitting, then wait until no request is open, running or waiting, or until
        `deadline_s` passes. Admission stays off afterwards (`resume()` undoes it, as a rollback does).

        Empty means both: the API server has no open request (/load, counted from arrival to the
        response's last byte) and the engine's gauges show nothing running or waiting. The gauges
        alone can trail the engine by a whole burst on a busy host.
        """
        started = time.monotonic()
        with self._cv:
            self._admitting = False
            if self._state == EngineState.READY:
                self._state = EngineState.DRAINING
            self._cv.notify_all()
        while True:
            m = self.scrape()
            open_requests = self.server_load()
            waited = time.monotonic() - started
            if m.running == 0 and m.waiting == 0 and not open_requests:
                return DrainResult(True, 0, 0, open_requests, waited)
            if waited >= deadline_s:
                return DrainResult(False, m.running, m.waiting, open_requests, waited)
            time.sleep(min(poll_s, max(deadline_s - waited, 0.0)))

    def server_load(self) -> int | None:
        """Requests the API server has open now (GET /load); None when load tracking is off."""
        if not self.spec.server_load_tracking:
            return None
        try:
            resp = self._http.get(f"{self.base_url}/load")
            resp.raise_for_status()
            return int(resp.json()["server_load"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            raise EngineError(f"plan {self.spec.plan_id}: /load unreadable: {exc}") from exc

    def resume(self) -> None:
        """Admit again after a drain (the rollback of a transition that drained this plan)."""
        with self._cv:
            self._admitting = True
            if self._state == EngineState.DRAINING:
                self._state = EngineState.READY
            self._cv.notify_all()

    # -- metrics ----------------------------------------------------------------------------------
    def scrape(self) -> VllmMetrics:
        """One read of the server's /metrics. Raises EngineError when it cannot be read."""
        try:
            resp = self._http.get(f"{self.base_url}/metrics")
            resp.raise_for_status()
        except httpx.HTTPError as exc:
            raise EngineError(f"plan {self.spec.plan_id}: /metrics unreadable: {exc}") from exc
        return parse_metrics(resp.text, at_s=time.monotonic())

    def report(self) -> EngineReport:
        """The EngineReport of the interval since the previous report (or since the server started)."""
        now = self.scrape()
        with self._metrics_lock:
            before = self._last_metrics or VllmMetrics.zero(self._ready_at)
            self._last_metrics = now
        return engine_report(self.spec.plan_id, before, now)

    # -- the watchdog -------------------------------------------------------------------------------
    def _supervise(self) -> None:
        """Thread body. Invariant: at most one server process of this engine is alive at a time;
        each one is fully stopped (whole tree) before the next is spawned."""
        try:
            self._supervise_loop()
        except Exception as exc:  # noqa: BLE001 - a supervisor must never die silently
            with self._cv:
                self._state = EngineState.FAILED
                self._admitting = False
                self._failure = f"the supervisor of plan {self.spec.plan_id} crashed: {type(exc).__name__}: {exc}"
                self._cv.notify_all()
            if self.on_failure is not None:
                self.on_failure(self.status())

    def _supervise_loop(self) -> None:
        first = True
        while True:
            with self._cv:
                if self._stopping:
                    return
                self._state = EngineState.STARTING if first else EngineState.RESTARTING
                try:
                    proc = ServerProcess.spawn(self.argv, self.env, self.base_url, self.log_path, cwd=self._cwd)
                except OSError as exc:
                    spawn_error = f"could not be started: {exc}"
                else:
                    spawn_error = None
                    self._proc = proc
                self._cv.notify_all()
            if spawn_error is not None:
                if not self._after_death(None, spawn_error, None):
                    return
                first = False
                continue
            why = proc.wait_ready(self._http, self.policy.startup_timeout_s, lambda: self._stopping)
            if why is None:
                with self._cv:
                    if self._stopping:
                        return
                    with self._metrics_lock:
                        self._last_metrics = None
                        self._ready_at = time.monotonic()
                    self._state = EngineState.READY if self._admitting else EngineState.DRAINING
                    self._failure = None
                    self._cv.notify_all()
                why = self._watch(proc)
                if why is None:
                    return  # stopping
            if self._stopping:
                return
            code = proc.stop(grace_s=5.0)  # whatever is left of it: no orphans before a restart
            if not self._after_death(proc, why, code):
                return
            first = False

    def _watch(self, proc: ServerProcess) -> str | None:
        """Watch a serving process; return why it is considered dead, or None when stopping."""
        failed_checks = 0
        client = httpx.Client(timeout=httpx.Timeout(self.health_timeout_s, connect=2.0))
        try:
            while True:
                with self._cv:
                    self._cv.wait(self.health_interval_s)
                    if self._stopping:
                        return None
                code = proc.poll()
                if code is not None:
                    return f"exited with status {code}"
                proc.note_tree()
                if proc.healthy(client, timeout_s=self.health_timeout_s):
                    failed_checks = 0
                    continue
                failed_checks += 1
                if failed_checks >= self.policy.unhealthy_checks:
                    return f"/health failed {failed_checks} times in a row"
        finally:
            client.close()

    def _after_death(self, proc: ServerProcess | None, why: str, code: int | None) -> bool:
        """Record a death; wait out the backoff. False when the engine is FAILED (or stopping)."""
        now = time.monotonic()
        tail = proc.log_tail(12) if proc is not None else []
        with self._cv:
            self._last_exit = code
            self._last_death = why
            self._deaths = [t for t in self._deaths if now - t < self.policy.window_s] + [now]
            recent = len(self._deaths)
            message = f"vLLM server of plan {self.spec.plan_id} {why}"
            if recent > self.policy.max_restarts:
                self._state = EngineState.FAILED
                self._admitting = False
                self._failure = (f"{message}; {recent} deaths within {self.policy.window_s:.0f} s "
                                 f"(restart policy allows {self.policy.max_restarts}); log {self.log_path}:\n"
                                 + "\n".join(tail))
                self._cv.notify_all()
                failed = True
            else:
                self._failure = f"{message}; restarting (#{self._restarts + 1})"
                self._state = EngineState.RESTARTING
                self._cv.notify_all()
                failed = False
        if failed:
            if self.on_failure is not None:
                self.on_failure(self.status())
            return False
        backoff_s = self.policy.backoff_s(recent)
        with self._cv:
            end = time.monotonic() + backoff_s
            while not self._stopping and time.monotonic() < end:
                self._cv.wait(end - time.monotonic())
            if self._stopping:
                return False
            self._restarts += 1
        return True
