"""scripts/services.py: how `make run` and `make test` find a Redis, or start their own under .run/.

The script runs as `make run` runs it (a subprocess of the project's Python), from a copy placed in
a temporary checkout, so its private Redis lives in that checkout's .run/ and never in this one's.
The Redis it starts is a real `redis-server` (Debian's package, as on a fresh machine after the
script installed it).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.conftest import TEST_REDIS_URL

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "services.py"


@pytest.fixture
def checkout(tmp_path: Path) -> Iterator[Path]:
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts" / "services.py")
    yield tmp_path
    # whatever a test left running is stopped, by the script's own pid file
    pid_file = tmp_path / ".run" / "redis.pid"
    if pid_file.exists():
        subprocess.run([sys.executable, str(tmp_path / "scripts" / "services.py"), "stop-redis"], check=False)


def services(checkout: Path, *args: str, redis_url: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    if redis_url is not None:
        env["REDIS_URL"] = redis_url
    return subprocess.run([sys.executable, str(checkout / "scripts" / "services.py"), *args], env=env,
                          capture_output=True, text=True, timeout=60, check=False)


def dead_url() -> str:
    """A Redis URL on a port where nothing listens (bound and released just now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"redis://127.0.0.1:{port}/0"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped) counts as gone
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(") ", 1)[1][0] != "Z"


def test_a_redis_url_that_answers_is_used_as_it_is_and_nothing_is_started(checkout: Path) -> None:
    out = services(checkout, "redis", redis_url=TEST_REDIS_URL)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == TEST_REDIS_URL
    assert not (checkout / ".run" / "redis.pid").exists()


@pytest.mark.skipif(not shutil.which("redis-server"), reason="needs Debian's redis-server (the script installs it)")
def test_without_a_redis_that_answers_it_starts_one_under_run_reuses_it_and_stops_it(checkout: Path) -> None:
    unreachable = dead_url()
    first = services(checkout, "redis", redis_url=unreachable)
    assert first.returncode == 0, first.stderr
    assert "does not answer; falling back" in first.stderr  # the newcomer is told why
    url = first.stdout.strip()
    assert url != unreachable and url.startswith("redis://127.0.0.1:")
    assert redis.Redis.from_url(url, socket_timeout=2).ping()
    run = checkout / ".run"
    pid = int((run / "redis.pid").read_text())
    assert (run / "redis.port").read_text().strip() == url.rsplit(":", 1)[1].split("/")[0]
    assert pid_alive(pid)

    # A second `make run` finds the same Redis alive and starts no other.
    again = services(checkout, "redis", redis_url=None)
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == url
    assert int((run / "redis.pid").read_text()) == pid

    # `make stop`
    assert services(checkout, "stop-redis", redis_url=None).returncode == 0
    for _ in range(50):
        if not pid_alive(pid):
            break
        subprocess.run(["sleep", "0.1"], check=True)
    assert not pid_alive(pid)
    assert not (run / "redis.pid").exists() and not (run / "redis.port").exists()


def test_tests_prefer_the_machines_standard_redis(checkout: Path) -> None:
    standard = "redis://127.0.0.1:6379/0"
    try:
        redis.Redis.from_url(standard, socket_timeout=1).ping()
    except (redis.RedisError, OSError):
        pytest.fail("this test needs the machine's Redis at 127.0.0.1:6379 (CI has it)")
    out = services(checkout, "redis", "--prefer-standard", redis_url=dead_url())
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == standard
    assert not (checkout / ".run" / "redis.pid").exists()


def test_free_port_keeps_the_preferred_port_when_free_and_picks_another_when_taken(checkout: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert services(checkout, "free-port", str(port), redis_url=None).stdout.strip() == str(port)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        other = services(checkout, "free-port", str(port), redis_url=None).stdout.strip()
    assert other.isdigit() and int(other) != port


def test_an_unknown_command_is_refused_by_name(checkout: Path) -> None:
    out = services(checkout, "start-everything", redis_url=None)
    assert out.returncode == 2 and "unknown command 'start-everything'" in out.stderr
