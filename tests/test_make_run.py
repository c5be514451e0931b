"""`make run`'s start script end to end: no Redis that answers, an empty checkout, each process
SIGKILLed in turn, then Ctrl-C.

It runs scripts/run.sh (what `make run` runs once the venv is there) in a copy of this checkout
with the project's venv linked in, so the SQLite database, .run/ and the private Redis it makes
are the copy's. supervisord (scripts/supervisord.conf) must restart each killed process - web,
agents, gateway, worker, beat, fleet - and the console serve again (DESIGN.md invariant 9), and the transitions in
flight end done or rolled back (invariant 3). Ctrl-C is a SIGINT to the whole process group, as a
terminal sends it; afterwards no process that the run started may be left, the private Redis
included.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOT_COPIED = {".git", ".venv", ".venv-vllm", ".run", "artifacts", "db.sqlite3", ".mypy_cache", ".ruff_cache",
              ".pytest_cache", "__pycache__", "staticfiles"}

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def descendants(root: int) -> set[int]:
    """root and every live process below it (supervisord puts each program in a process group of its own)."""
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            parent[int(stat.parent.name)] = int(fields[1])
    out, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        kids = [child for child, ppid in parent.items() if ppid == pid and child not in out]
        out.update(kids)
        frontier.extend(kids)
    return {pid for pid in out if pid in parent}


def supervised_pid(checkout: Path, name: str) -> int:
    out = subprocess.run(["scripts/supervisor.sh", "ctl", "pid", name], cwd=checkout, capture_output=True, text=True, timeout=30)
    return int(out.stdout.strip()) if out.stdout.strip().isdigit() else 0


def transitions(checkout: Path) -> list[tuple[str, int, str]]:
    """(deployment, seq, phase) of every transition in the run's SQLite database."""
    try:
        with sqlite3.connect(f"file:{checkout / '.run' / 'db-sim-demo.sqlite3'}?mode=ro", uri=True, timeout=5) as db:
            return list(db.execute("SELECT d.name, t.seq, t.phase FROM gearbox_transition t "
                                   "JOIN gearbox_deployment d ON d.id = t.deployment_id ORDER BY t.id"))
    except sqlite3.Error:
        return []


def alive(pid: int) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z"


def answers(url: str) -> int | None:
    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: object, **kwargs: object) -> None:
            return None

    try:
        with urllib.request.build_opener(NoRedirect).open(url, timeout=2) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def openai_calls(checkout: Path, port: int) -> tuple[Any, Any]:
    """A completion and a chat completion of the demo's chat-8b through the `openai` client, as the
    README shows them; retried while the first transitions bring the plans up (429: nothing routable)."""
    import openai

    token = (checkout / ".run" / "operator-token").read_text().strip()  # made by make run, as the README says
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=token, max_retries=0, timeout=30)
    deadline = time.monotonic() + 120
    while True:
        try:
            completion = client.completions.create(model="chat-8b", prompt="Hello", max_tokens=8,
                                                   extra_body={"ignore_eos": True})
            break
        except (openai.RateLimitError, openai.APIConnectionError):
            assert time.monotonic() < deadline, "the demo's gateway answered nothing but 429 for 120 s"
            time.sleep(1.0)
    chat = client.chat.completions.create(model="chat-8b", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=32)
    return completion, chat


ACTIVE = {"prepare", "switch", "cleanup", "rollback"}


def wait_until(cond: object, max_s: float, what: str, log: Path) -> float:
    """Seconds it took; fails with the run's log after max_s (generous: the machine may be loaded)."""
    t0 = time.monotonic()
    while not cond():  # type: ignore[operator]
        assert time.monotonic() - t0 < max_s, f"{what}: not within {max_s:g} s\n{log.read_text()[-6000:]}"
        time.sleep(0.1)
    return time.monotonic() - t0


@pytest.mark.skipif(not shutil.which("redis-server"), reason="needs Debian's redis-server (run.sh installs it)")
def test_it_starts_everything_restarts_what_is_killed_and_ctrl_c_leaves_nothing_running(tmp_path: Path) -> None:
    checkout = tmp_path / "flexpipe"
    shutil.copytree(ROOT, checkout, ignore=lambda d, names: [n for n in names if n in NOT_COPIED])
    (checkout / ".venv").symlink_to((ROOT / ".venv").resolve())
    with socket.socket() as s:  # a port where no Redis answers
        s.bind(("127.0.0.1", 0))
        dead_redis = f"redis://127.0.0.1:{s.getsockname()[1]}/0"
    port, gateway_port, agent_port = free_port(), free_port(), free_port()
    env = {k: v for k, v in os.environ.items()
           if k not in {"DATABASE_URL", "FLEXPIPE_OPERATOR_PASSWORD", "FLEXPIPE_ENROLL_TOKEN", "DJANGO_SETTINGS_MODULE"}}
    env.update(REDIS_URL=dead_redis, FLEXPIPE_PORT=str(port), FLEXPIPE_GATEWAY_PORT=str(gateway_port),
               FLEXPIPE_AGENT_PORT=str(agent_port))
    log = (tmp_path / "run.log").open("w+")
    proc = subprocess.Popen(["scripts/run.sh"], cwd=checkout, env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while answers(f"http://127.0.0.1:{port}/") is None:
            assert proc.poll() is None, (tmp_path / "run.log").read_text()
            assert time.monotonic() < deadline, "the console did not answer in 180 s"
            time.sleep(0.5)
        assert answers(f"http://127.0.0.1:{port}/") == 302  # to the login page
        assert answers(f"http://127.0.0.1:{port}/login/") == 200
        # wait until the fleet has registered, so its process is one of those checked below
        deadline = time.monotonic() + 60
        while "registered (epoch" not in (tmp_path / "run.log").read_text():
            assert time.monotonic() < deadline, (tmp_path / "run.log").read_text()
            time.sleep(0.5)

        # the default demo serves the OpenAI API: the simulated engines answer through the real gateway,
        # in its own process on its own port; the console's /v1 says where it is
        completion, chat = openai_calls(checkout, gateway_port)
        assert completion.usage.completion_tokens == 8 and completion.choices[0].finish_reason == "length"
        assert completion.choices[0].text.strip() and completion.usage.prompt_tokens > 0
        assert chat.choices[0].message.content and chat.usage.completion_tokens > 0

        printed = (tmp_path / "run.log").read_text()
        assert f"http://127.0.0.1:{port}/" in printed
        assert f"OpenAI gateway:    http://127.0.0.1:{gateway_port}/v1" in printed
        assert answers(f"http://127.0.0.1:{port}/v1/models") == 421
        # the fleet reports to the agent API's own process, which serves nothing of the console
        assert f"Agent API:         http://127.0.0.1:{agent_port}/agent/v1" in printed
        assert "POST /agent/v1/report" in (checkout / ".run" / "agents-access.log").read_text()
        assert answers(f"http://127.0.0.1:{agent_port}/healthz") == 200
        assert answers(f"http://127.0.0.1:{agent_port}/login/") == 404
        assert "Debug:             on, for this demo only" in printed
        # its own database: another scenario or engine would get another (a clean slate, nothing asked)
        assert (checkout / ".run" / "db-sim-demo.sqlite3").is_file() and not (checkout / "db.sqlite3").exists()
        admin_password = (checkout / ".run" / "admin-password").read_text().strip()
        assert re.search(rf"user 'admin', password '{re.escape(admin_password)}'", printed)
        password = (checkout / ".run" / "operator-password").read_text().strip()
        assert re.search(rf"user 'operator', password '{re.escape(password)}'", printed)
        assert f"REDIS_URL={dead_redis} does not answer" in printed
        redis_pid = int((checkout / ".run" / "redis.pid").read_text())
        run_log = tmp_path / "run.log"

        # Each process SIGKILLed in turn (the worker first, while the first transitions run):
        # supervisord starts it again and the console serves again.
        wait_until(lambda: transitions(checkout), 120, "a first transition", run_log)
        in_flight = [(d, seq) for d, seq, phase in transitions(checkout) if phase in ACTIVE]
        took: dict[str, float] = {}
        for name in ("worker", "web", "agents", "gateway", "beat", "fleet"):
            old = supervised_pid(checkout, name)
            assert old > 0, name
            os.kill(old, signal.SIGKILL)
            def back(name: str = name, old: int = old) -> bool:
                return (supervised_pid(checkout, name) not in (0, old)
                        and answers(f"http://127.0.0.1:{port}/healthz") == 200
                        and answers(f"http://127.0.0.1:{gateway_port}/healthz") == 200
                        and answers(f"http://127.0.0.1:{agent_port}/healthz") == 200)
            took[name] = wait_until(back, 90, f"{name} restarted and the console serving", run_log)
        print("\nSIGKILL -> restarted and /healthz 200: " + ", ".join(f"{n} {t:.1f} s" for n, t in took.items()))
        supervisor_log = (checkout / ".run" / "supervisord.log").read_text()
        for name in took:
            assert f"exited: {name} (terminated by SIGKILL; not expected)" in supervisor_log, supervisor_log
        # what was in flight resumed or rolled back: nothing stays half done
        wait_until(lambda: not [t for t in transitions(checkout) if t[2] in ACTIVE], 180,
                   "every transition ended", run_log)
        ended = {(d, seq): phase for d, seq, phase in transitions(checkout)}
        assert all(ended[t] in ("done", "rolled_back") for t in in_flight), (in_flight, ended)
        assert "done" in ended.values(), ended

        started = descendants(proc.pid) | {redis_pid}
        assert len(started) >= 9, started  # run.sh, supervisord, web, agents, gateway, worker, beat, fleet, the Redis

        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
        proc.wait(timeout=60)
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in started) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ") for pid in started if alive(pid)}
        assert left == {}, left
        # every process stopped on its own: supervisord never had to SIGKILL one (a pending long poll of an
        # agent used to hold daphne until its wait ran out)
        shutdown = (checkout / ".run" / "supervisord.log").read_text().split("received SIGINT", 1)
        assert len(shutdown) == 2 and "SIGKILL" not in shutdown[1], shutdown[-1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        pid_file = checkout / ".run" / "redis.pid"
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGTERM)
            except (ProcessLookupError, ValueError):
                pass
        log.close()
