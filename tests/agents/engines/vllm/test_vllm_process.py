"""Stopping a server process tree: SIGTERM, SIGKILL after the grace, and children that left the group.

A plain Python process stands in for vLLM here because the case needs a server that ignores
SIGTERM and a child that escapes the process group, which vLLM does not do on purpose."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from agents.engines.vllm.process import ServerProcess, alive, descendants

STUBBORN = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
# One child stays in our group; one calls setsid() and leaves it, as a daemonising helper would.
stay = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
leave = subprocess.Popen([sys.executable, "-c", "import os, time; os.setsid(); time.sleep(600)"])
print("children", stay.pid, leave.pid, flush=True)
time.sleep(600)
"""


def _children(log: Path) -> tuple[int, int]:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if line.startswith("children "):
                a, b = line.split()[1:]
                return int(a), int(b)
        time.sleep(0.05)
    raise AssertionError(f"the test server never started its children: {log.read_text()}")


def test_stop_kills_a_tree_that_ignores_sigterm_and_one_that_left_the_group(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    proc = ServerProcess.spawn([sys.executable, "-c", STUBBORN], env={"PATH": "/usr/bin:/bin"},
                               base_url="http://127.0.0.1:9", log_path=log)
    stay, leave = _children(log)
    deadline = time.monotonic() + 60
    while {stay, leave} - descendants(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.note_tree()
    assert {stay, leave} <= set(proc.tree)
    code = proc.stop(grace_s=0.5)
    assert code == -9  # SIGTERM was ignored: SIGKILL after the grace
    assert proc.leftovers() == set()
    assert not alive(stay) and not alive(leave) and not alive(proc.pid)
    assert log.read_text().startswith("\n=== flexpipe: starting ")
    assert proc.log_tail(1) == [f"children {stay} {leave}"]


def test_stop_on_an_exited_server_returns_its_status(tmp_path: Path) -> None:
    proc = ServerProcess.spawn([sys.executable, "-c", "raise SystemExit(3)"], env={}, base_url="http://127.0.0.1:9",
                               log_path=tmp_path / "s.log")
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.stop(grace_s=0.1) == 3
    assert proc.leftovers() == set()
