"""One vLLM server process: start it in its own process group, watch it, stop it without orphans.

vLLM's OpenAI server is a tree: the API server, its EngineCore process, and one worker per
GPU rank (plus a multiprocessing resource tracker). Killing only the top leaves the rest
holding GPU memory. So the server starts in a new session (its own process group), and stop
signals the whole group, then sweeps any descendant that left the group, then reaps.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx


def _proc_stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, ppid, pgrp, start time in clock ticks) of a process from /proc; None when gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name is in parentheses and may hold spaces: split after the last ')'.
    # Fields after it, per proc(5): state(3) ppid(4) pgrp(5) ... starttime(22).
    fields = raw[raw.rindex(")") + 2:].split()
    return fields[0], int(fields[1]), int(fields[2]), int(fields[19])


def _all_pids() -> list[int]:
    try:
        return [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return []


def descendants(pid: int) -> set[int]:
    """Every live (non-zombie) process below `pid` (Linux /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for p in _all_pids():
        st = _proc_stat(p)
        if st is not None and st[0] != "Z":
            children.setdefault(st[1], []).append(p)
    out: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def still_running(pid: int, start_ticks: int) -> bool:
    """The process `pid` that started at `start_ticks` is alive (not a later one reusing the pid)."""
    st = _proc_stat(pid)
    return st is not None and st[0] != "Z" and st[3] == start_ticks


def alive(pid: int) -> bool:
    """The process exists and is not a zombie waiting to be reaped."""
    st = _proc_stat(pid)
    if st is not None:
        return st[0] != "Z"
    if not Path("/proc").is_dir():  # not Linux: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return False


def group_members(pgid: int) -> set[int]:
    """Live processes of a process group."""
    out = set()
    for p in _all_pids():
        st = _proc_stat(p)
        if st is not None and st[2] == pgid and st[0] != "Z":
            out.add(p)
    return out


class ServerProcess:
    """A started vLLM server. Construct with `ServerProcess.spawn(...)`."""

    def __init__(self, popen: subprocess.Popen[bytes], base_url: str, log_path: Path) -> None:
        self._popen = popen
        self.pid = popen.pid
        self.base_url = base_url
        self.log_path = log_path
        # Every process seen under it, with its start time (for the orphan sweep): a pid is only
        # signalled while it still names the same process, never a later one that reused it.
        self.tree: dict[int, int] = {}

    @classmethod
    def spawn(cls, argv: list[str], env: dict[str, str], base_url: str, log_path: Path,
              cwd: str | None = None) -> ServerProcess:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            log.write(f"\n=== flexpipe: starting {' '.join(argv)}\n".encode())
            log.flush()
            popen = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        return cls(popen, base_url, log_path)

    def poll(self) -> int | None:
        """The exit status once the server process ended (negative: killed by that signal)."""
        return self._popen.poll()

    def note_tree(self) -> None:
        """Remember the processes under the server, so stop() finds them even if they re-parent."""
        if self.poll() is None:
            for pid in descendants(self.pid):
                st = _proc_stat(pid)
                if st is not None:
                    self.tree.setdefault(pid, st[3])

    def healthy(self, client: httpx.Client, timeout_s: float = 5.0) -> bool:
        try:
            return client.get(f"{self.base_url}/health", timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, client: httpx.Client, timeout_s: float,
                   stop_waiting: Callable[[], bool] = lambda: False, poll_s: float = 0.25) -> str | None:
        """Wait until /health answers 200. Returns None when ready, else why not (one line)."""
        deadline = time.monotonic() + timeout_s
        while True:
            code = self.poll()
            if code is not None:
                return f"exited with status {code} while starting"
            self.note_tree()
            if self.healthy(client, timeout_s=min(5.0, max(poll_s, 0.5))):
                self.note_tree()
                return None
            if stop_waiting():
                return "stopped while starting"
            if time.monotonic() >= deadline:
                return f"not ready after {timeout_s:.0f} s"
            time.sleep(poll_s)

    def stop(self, grace_s: float = 20.0) -> int | None:
        """SIGTERM the group, SIGKILL it after `grace_s`, sweep strays; returns the exit status.

        Invariant on return: no process of this server's tree is left alive.
        """
        self.note_tree()
        pgid = self.pid  # start_new_session made the server its group's leader
        self._signal_group(pgid, signal.SIGTERM)
        try:
            self._popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        # The top may be gone while its children still shut down; give them the same grace.
        deadline = time.monotonic() + grace_s
        while (group_members(pgid) or self._strays()) and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.poll() is None or group_members(pgid):
            self._signal_group(pgid, signal.SIGKILL)
        for pid in self._strays():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        code = self._popen.wait()
        deadline = time.monotonic() + 10.0
        while (group_members(pgid) or self._strays()) and time.monotonic() < deadline:
            time.sleep(0.05)  # SIGKILL is not instant: wait for the kernel to tear them down
        return code

    def kill(self) -> None:
        """SIGKILL the server's top process only, as a crash would (tests, fault injection)."""
        self.note_tree()
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _strays(self) -> set[int]:
        return {pid for pid, started in self.tree.items() if still_running(pid, started)}

    @staticmethod
    def _signal_group(pgid: int, sig: signal.Signals) -> None:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def leftovers(self) -> set[int]:
        """Processes of this server still alive (after stop(): must be empty)."""
        return group_members(self.pid) | self._strays() | ({self.pid} if alive(self.pid) else set())

    def log_tail(self, lines: int = 20) -> list[str]:
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                size = fh.tell()
                fh.seek(max(size - 64 * 1024, 0))
                text = fh.read().decode(errors="replace")
        except OSError:
            return []
        return [ln for ln in text.splitlines() if ln.strip()][-lines:]
