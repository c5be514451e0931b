"""The console under a fleet of agents: report latency, push delay and coverage, CPU per process.

    python -m bench.control_plane [--agents 50,200,1000] [--gpus-per-agent 8] [--interval-s 15]
                                  [--step-s 45] [--changed-gpus 1] [--no-dashboard] [--one-process]
                                  [--agent-processes 1] [--json OUT]

It starts the console the way `make run` does - daphne for the console (console.asgi), daphne for
the agent API (console.agent_asgi: the agents report there; --one-process sends them to the
console's process instead, as before the agent API had its own; --agent-processes N runs N of them
on the one listening socket the bench binds, the kernel spreading the connections), a Celery worker (threads) and
beat, on PostgreSQL when one answers at 127.0.0.1:5432 (a fresh database, flexpipe_bench_cp or
$FLEXPIPE_BENCH_DB, dropped first; SQLite otherwise) and Redis
(scripts/services.py; FLEXPIPE_CHANNEL_PREFIX and FLEXPIPE_QUEUE keep two benches apart) - and drives
simulated agents against it over HTTP from this process, as agent protocol v1 says
(agents/protocol/): each agent enrolls with the join token, holds one long poll
(GET /agent/v1/commands?wait=...) at all times, and sends a full report of its GPUs every
--interval-s (the seed's 15 s; not compressed: the step runs --step-s of real time instead). A
report changes --changed-gpus of its GPUs (GPU 0's memory carries a marker), the rest repeat.
One dashboard is subscribed, as an open Overview page and heatmap are: /ws/gearbox/ and
/ws/cluster/ (bench/_ws.py, a logged-in superuser's session).

The agent counts are steps of one run: the fleet grows to each count (new agents enroll), then
is measured for --step-s. Per step:

    report_p50_ms / report_p99_ms   POST /agent/v1/report, sent to answered (this process's clock)
    report_max_ms_by_second         the slowest report sent in each second of the step (stalls)
    errors                          reports, registrations and polls that failed (non-2xx or no answer)
    enroll_s                        how long the step's new agents took to enroll (8 at a time)
    push_p99_ms / push_coverage     a report's marker seen on /ws/cluster/: delay from sending the
                                    report; coverage = reports whose marker (or a later one of the
                                    same GPU: a coalesced push) arrived by the end of the step + 5 s
    gearbox_messages / gearbox_bytes   what the Overview socket received in the step
    cpu                             each process's CPU over the step, as a fraction of one core
                                    (/proc/<pid>/stat; the bench's own agents included: they share
                                    the machine's cores with the console; postgres and redis-server:
                                    every process of that name on the machine, together)
    wal_bytes_per_report            PostgreSQL WAL written per report accepted (pg_current_wal_lsn)

No deployment is loaded: the agents run no plans, so commands stay empty and the gear ticks have
nothing to decide - what is measured is ingestion, polls and push. Printed as a table and written
as JSON (`steps.<N>.report_p99_ms`, `.push_p99_ms`, `.push_coverage`, `.errors`, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agents.protocol import GpuInfo, GpuReport, RegisterRequest, Report
from bench._http import Connection, HttpError
from bench._ws import Websocket, WebsocketClosed

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
DB_NAME = os.environ.get("FLEXPIPE_BENCH_DB", "flexpipe_bench_cp")  # another name: two benches on one server
GIB = 1024**3
MEM_TOTAL = 80 * GIB  # an H100 SXM's 80 GB (scheduler/hardware.py cites the datasheet)
POLL_WAIT_S = 25.0
PUSH_GRACE_S = 5.0


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


# -- the console's processes -------------------------------------------------------------------
def _services(env: dict[str, str]) -> tuple[str, str]:
    redis_url = subprocess.run([PY, "scripts/services.py", "redis"], cwd=ROOT, env=env, capture_output=True,
                               text=True, check=True).stdout.strip()
    pg = subprocess.run([PY, "scripts/services.py", "postgres"], cwd=ROOT, env={**env, "DATABASE_URL": ""},
                        capture_output=True, text=True, check=True).stdout.strip()
    if not pg:
        return redis_url, f"sqlite:///{tempfile.mkdtemp(prefix='fp-cp-')}/db.sqlite3"
    import psycopg

    with psycopg.connect(pg, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {DB_NAME}")
    return redis_url, pg.rsplit("/", 1)[0] + "/" + DB_NAME


def _free_port(env: dict[str, str], start: int | None = None) -> int:
    out = subprocess.run([PY, "scripts/services.py", "free-port", *([] if start is None else [str(start)])], cwd=ROOT, env=env, capture_output=True,
                         text=True, check=True).stdout
    return int(out.strip())


@dataclass
class Console:
    port: int  # the console's process: pages, websockets
    agent_port: int | None  # the agent API's own process; None: the agents report to the console's
    env: dict[str, str]
    agent_processes: int = 1  # they share one listening socket (the kernel spreads the connections)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def agents_at(self) -> int:
        return self.port if self.agent_port is None else self.agent_port

    def start(self, logdir: Path) -> None:
        bin_ = Path(PY).parent
        cmds = {
            "web": [str(bin_ / "daphne"), "-b", "127.0.0.1", "-p", str(self.port), "console.asgi:application"],
            "worker": [str(bin_ / "celery"), "-A", "console", "--quiet", "worker", "-P", "threads", "-c", "4",
                       "-Q", self.env.get("FLEXPIPE_QUEUE", "flexpipe"), "-l", "warning"],
            "beat": [str(bin_ / "celery"), "-A", "console", "--quiet", "beat", "-l", "warning",
                     "-s", str(logdir / "celerybeat-schedule")],
        }
        listener = None
        if self.agent_port is not None:
            listener = socket.create_server(("127.0.0.1", self.agent_port), backlog=1024)
            names = ["agents"] if self.agent_processes == 1 else [f"agents-{i}" for i in range(self.agent_processes)]
            for name in names:
                cmds[name] = [str(bin_ / "daphne"), "--fd", str(listener.fileno()), "console.agent_asgi:application"]
        for name, cmd in cmds.items():
            log = open(logdir / f"{name}.log", "wb")  # noqa: SIM115 - kept open for the process's life
            fds = (listener.fileno(),) if listener is not None and name.startswith("agents") else ()
            self.procs[name] = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                                start_new_session=True, pass_fds=fds)
        if listener is not None:
            listener.close()  # the agents' processes hold it now

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)

    def cpu_ticks(self) -> dict[str, float]:
        out = {name: _proc_cpu_s(p.pid) for name, p in self.procs.items()}
        out["bench (agents)"] = _proc_cpu_s(os.getpid())
        for server in ("postgres", "redis-server"):
            out[server] = sum(_proc_cpu_s(pid) for pid in _pids_named(server))
        return out


def _pids_named(comm: str) -> list[int]:
    """This machine's processes called `comm` (/proc/<pid>/comm): the database's and Redis's share of
    the cores. A backend that exits during the step takes its CPU with it: the pool's are kept."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == comm:
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def _proc_cpu_s(pid: int) -> float:
    """utime + stime of the process (its threads included), seconds."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _session_cookie(env: dict[str, str]) -> str:
    """A logged-in superuser's session, made in the console's database (the dashboard client's)."""
    os.environ.update({k: env[k] for k in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY", "DEBUG")})
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
    import django

    django.setup()
    from django.conf import settings
    from django.contrib.auth import BACKEND_SESSION_KEY, HASH_SESSION_KEY, SESSION_KEY, get_user_model
    from django.contrib.sessions.backends.db import SessionStore

    user, _ = get_user_model().objects.get_or_create(username="bench-viewer", defaults={"is_superuser": True})
    store = SessionStore()
    store[SESSION_KEY] = str(user.pk)
    store[BACKEND_SESSION_KEY] = "django.contrib.auth.backends.ModelBackend"
    store[HASH_SESSION_KEY] = user.get_session_auth_hash()
    store.create()
    from django.db import connections

    connections.close_all()
    return f"{settings.SESSION_COOKIE_NAME}={store.session_key}"


def _wal_lsn(db_url: str) -> int | None:
    if not db_url.startswith("postgres"):
        return None
    import psycopg

    try:
        with psycopg.connect(db_url) as conn:
            row = conn.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn").fetchone()
    except psycopg.OperationalError as exc:  # (a database out of connections says so in the step's errors)
        print(f"WAL position not read: {exc}", flush=True)
        return None
    return int(row[0]) if row else None


# -- the agents --------------------------------------------------------------------------------
@dataclass
class Stats:
    report_ms: list[float] = field(default_factory=list)
    report_at: list[float] = field(default_factory=list)  # when each of report_ms was sent (monotonic)
    errors: dict[str, int] = field(default_factory=dict)
    sent: dict[tuple[str, int], float] = field(default_factory=dict)  # (node, marker) -> when sent
    seen: dict[tuple[str, int], float] = field(default_factory=dict)  # (node, marker) -> when pushed
    latest_seen: dict[str, tuple[int, float]] = field(default_factory=dict)  # node -> (marker, when)
    gearbox_messages: int = 0
    gearbox_bytes: int = 0

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


def _marker_bytes(marker: int) -> int:
    return 10 * GIB + marker * 4096


class Agent:
    """One simulated agent: its own two connections (its long poll, its reports), as a real one."""

    def __init__(self, i: int, gpus: int, host: str, port: int, join_token: str) -> None:
        self.node_id = f"cp{i:05d}"
        self.join_token = join_token
        self.gpus = tuple(GpuInfo(uuid=f"GPU-cp{i:05d}-{g}", index=g, model="H100-SXM", mem_total_bytes=MEM_TOTAL,
                                  nvlink_group="nv0") for g in range(gpus))
        self.token, self.epoch, self.seq, self.marker = "", 0, 0, 0
        self.conn, self.poll_conn = Connection(host, port), Connection(host, port)

    async def enroll(self, stats: Stats) -> bool:
        req = RegisterRequest(node_id=self.node_id, hostname=self.node_id, agent_version="bench", gpus=self.gpus,
                              rack=f"r{int(self.node_id[2:]) // 32}", plans=())
        try:
            status, body = await self.conn.request("POST", "/agent/v1/register", body=req.to_dict(),
                                                   token=self.join_token)
        except HttpError:
            stats.error("register")
            return False
        if status not in (200, 201):
            stats.error(f"register {status}")
            return False
        self.token, self.epoch = body["agent_token"], body["epoch"]
        return True

    def _report(self, changed: int, rng: random.Random) -> Report:
        self.seq += 1
        self.marker += 1
        gpus = []
        for g in self.gpus:
            moving = g.index < changed
            used = _marker_bytes(self.marker) if g.index == 0 else (20 * GIB + (self.marker * 8192 if moving else 0))
            gpus.append(GpuReport(uuid=g.uuid, mem_used_bytes=used, mem_total_bytes=MEM_TOTAL,
                                  sm_util=round(rng.random(), 2) if moving else 0.0, temperature_c=40.0,
                                  healthy=True))
        return Report(node_id=self.node_id, epoch=self.epoch, seq=self.seq, gpus=tuple(gpus))

    async def report(self, stats: Stats, changed: int, rng: random.Random, measuring: bool) -> None:
        rep = self._report(changed, rng)
        t0 = time.monotonic()
        if measuring:
            stats.sent[(self.node_id, self.marker)] = t0
        try:
            status, _ = await self.conn.request("POST", "/agent/v1/report", body=rep.to_dict(), token=self.token)
        except HttpError:
            stats.error("report (no answer)")
            return
        if status != 200:
            stats.error(f"report {status}")
            return
        if measuring:
            stats.report_ms.append((time.monotonic() - t0) * 1000)
            stats.report_at.append(t0)

    async def poll_forever(self, stats: Stats) -> None:
        after = 0
        while True:
            try:
                status, body = await self.poll_conn.request(
                    "GET", f"/agent/v1/commands?after={after}&wait={POLL_WAIT_S:g}", token=self.token,
                    timeout=POLL_WAIT_S + 30)
            except HttpError:
                stats.error("poll (no answer)")
                await asyncio.sleep(1.0)
                continue
            if status != 200:
                stats.error(f"poll {status}")
                await asyncio.sleep(1.0)
                continue
            for cmd in body.get("commands", ()):
                after = max(after, int(cmd["id"]))

    async def report_forever(self, stats: Stats, interval_s: float, changed: int, state: dict[str, bool]) -> None:
        rng = random.Random(self.node_id)
        await asyncio.sleep(rng.uniform(0, interval_s))  # agents' phases spread over the interval
        while True:
            t = time.monotonic()
            await self.report(stats, changed, rng, state["measuring"])
            await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - t)))


async def _watch(port: int, path: str, cookie: str, stats: Stats, gearbox: bool) -> None:
    while True:
        try:
            ws = await Websocket.connect("127.0.0.1", port, path, cookie=cookie)
        except (OSError, ConnectionError):
            stats.error(f"websocket {path} (connect)")
            await asyncio.sleep(1.0)
            continue
        try:
            while True:
                before = ws.bytes_received
                msg = await ws.recv_json()
                now = time.monotonic()
                await ws.ack()
                if gearbox:
                    stats.gearbox_messages += 1
                    stats.gearbox_bytes += ws.bytes_received - before
                    continue
                for g in msg.get("gpus") or ():
                    if g.get("index") != 0:
                        continue
                    marker = (int(g.get("mem_used_bytes") or 0) - 10 * GIB) // 4096
                    key = (str(g.get("node_id")), marker)
                    stats.seen.setdefault(key, now)
                    prev = stats.latest_seen.get(key[0])
                    if prev is None or prev[0] < marker:
                        stats.latest_seen[key[0]] = (marker, now)
        except WebsocketClosed as exc:
            stats.error(f"websocket {path} (closed {exc.code})")
            await asyncio.sleep(0.5)


def _push_figures(stats: Stats, until: float) -> tuple[float | None, float | None]:
    """push p99 (ms) and coverage over the reports sent while measuring."""
    if not stats.sent:
        return None, None
    delays, covered = [], 0
    for (node, marker), t_sent in stats.sent.items():
        t_seen = stats.seen.get((node, marker))
        if t_seen is not None and t_seen <= until:
            delays.append((t_seen - t_sent) * 1000)
            covered += 1
            continue
        latest = stats.latest_seen.get(node)
        if latest is not None and latest[0] > marker and latest[1] <= until:
            covered += 1  # a later state of the same GPU arrived: a coalesced push still shows the last state
            delays.append((latest[1] - t_sent) * 1000)
    return _pct(delays, 0.99), covered / len(stats.sent)


async def _run(args: argparse.Namespace, console: Console, cookie: str, db_url: str) -> dict[str, Any]:
    counts = [int(n) for n in args.agents.split(",")]
    stats, state = Stats(), {"measuring": False}
    tasks: list[asyncio.Task[None]] = []
    agents: list[Agent] = []
    out: dict[str, Any] = {}
    try:
        await _steps(args, console, cookie, db_url, counts, stats, state, tasks, agents, out)
    finally:
        await _cancel_all(tasks)
    return out


async def _cancel_all(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel the agents' tasks, again until they end: Python 3.11's asyncio.wait_for swallows a
    cancellation that lands as its inner request completes (bpo-42130, fixed in 3.12), and that agent reported on."""
    pending = set(tasks)
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=1.0)


async def _wait_healthy(port: int) -> None:
    for _ in range(600):
        try:
            probe = Connection("127.0.0.1", port)
            answered = (await probe.request("GET", "/healthz"))[0] == 200
            probe.close()
            if answered:
                return
        except HttpError:
            pass
        await asyncio.sleep(0.2)
    raise SystemExit(f"the process on :{port} did not answer /healthz")


async def _steps(args: argparse.Namespace, console: Console, cookie: str, db_url: str,
                 counts: list[int], stats: Stats, state: dict[str, bool], tasks: list[asyncio.Task[None]],
                 agents: list[Agent], out: dict[str, Any]) -> None:
    for port in dict.fromkeys((console.port, console.agents_at)):
        await _wait_healthy(port)
    if not args.no_dashboard:
        tasks.append(asyncio.ensure_future(_watch(console.port, "/ws/gearbox/", cookie, stats, True)))
        tasks.append(asyncio.ensure_future(_watch(console.port, "/ws/cluster/", cookie, stats, False)))
    for n in counts:
        new = [Agent(i, args.gpus_per_agent, "127.0.0.1", console.agents_at, console.env["FLEXPIPE_ENROLL_TOKEN"])
               for i in range(len(agents), n)]
        sem = asyncio.Semaphore(8)

        async def enroll(a: Agent, sem: asyncio.Semaphore = sem) -> None:
            async with sem:
                if not await a.enroll(stats):
                    return
            # each agent polls as soon as it has registered, as agents.node does: polls started
            # together once the whole step had enrolled were answered together every wait, a
            # burst no fleet that joins over time makes
            agents.append(a)
            tasks.append(asyncio.ensure_future(a.poll_forever(stats)))
            tasks.append(asyncio.ensure_future(a.report_forever(stats, args.interval_s, args.changed_gpus,
                                                                state)))

        enroll0 = time.monotonic()
        await asyncio.gather(*(enroll(a) for a in new))
        enroll_s = time.monotonic() - enroll0
        print(f"{len(new)} agents enrolled in {enroll_s:.1f} s; measuring in {args.interval_s:g} s", flush=True)
        await asyncio.sleep(args.interval_s)  # every agent has reported once: the step starts settled
        for kept in (stats.report_ms, stats.report_at, stats.sent, stats.seen, stats.errors):
            kept.clear()
        stats.gearbox_messages = stats.gearbox_bytes = 0
        cpu0, wall0, wal0 = console.cpu_ticks(), time.monotonic(), _wal_lsn(db_url)
        state["measuring"] = True
        await asyncio.sleep(args.step_s)
        state["measuring"] = False
        wall = time.monotonic() - wall0
        cpu1, wal1 = console.cpu_ticks(), _wal_lsn(db_url)
        await asyncio.sleep(PUSH_GRACE_S)
        push_p99, coverage = _push_figures(stats, time.monotonic())
        reports = len(stats.report_ms)
        step = {
            "agents": len(agents), "gpus": len(agents) * args.gpus_per_agent, "reports": reports,
            "enroll_s": round(enroll_s, 2),  # the new agents' registrations, 8 at a time
            "report_p50_ms": _pct(stats.report_ms, 0.5), "report_p99_ms": _pct(stats.report_ms, 0.99),
            "report_mean_ms": statistics.fmean(stats.report_ms) if stats.report_ms else None,
            "report_max_ms_by_second": _max_by_second(stats.report_ms, stats.report_at, wall0, args.step_s),
            "errors": sum(stats.errors.values()), "error_kinds": dict(stats.errors),
            "push_p99_ms": push_p99, "push_coverage": coverage,
            "gearbox_messages": stats.gearbox_messages, "gearbox_bytes": stats.gearbox_bytes,
            "cpu": {k: round((cpu1[k] - cpu0[k]) / wall, 3) for k in cpu1},
            "wal_bytes_per_report": ((wal1 - wal0) / reports) if wal0 is not None and wal1 is not None
            and reports else None,
        }
        out[str(n)] = step
        _print_step(step)


def _max_by_second(ms: list[float], at: list[float], start: float, step_s: float) -> list[float]:
    """The slowest report sent in each second of the step: a stall shows as a few seconds far above
    the rest, a report cost that grows with the load as every second rising together."""
    worst = [0.0] * max(1, int(step_s))
    for latency, t in zip(ms, at, strict=True):
        i = min(len(worst) - 1, max(0, int(t - start)))
        worst[i] = max(worst[i], round(latency, 1))
    return worst


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _print_step(s: dict[str, Any]) -> None:
    cpu = ", ".join(f"{k} {v:.0%}" for k, v in s["cpu"].items())
    print(f"{s['agents']:>5} agents ({s['gpus']} GPUs): {s['reports']} reports, p50 {_fmt(s['report_p50_ms'], '.1f')}"
          f" / p99 {_fmt(s['report_p99_ms'], '.1f')} ms; errors {s['errors']} {s['error_kinds'] or ''}; push p99 "
          f"{_fmt(s['push_p99_ms'], '.0f')} ms, coverage {_fmt(s['push_coverage'], '.1%')}; Overview socket "
          f"{s['gearbox_messages']} messages / {s['gearbox_bytes'] / 1e6:.1f} MB; WAL/report "
          f"{_fmt(s['wal_bytes_per_report'], '.0f')} B; CPU {cpu}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--agents", default="50,200,1000", help="agent counts, one step each (comma separated)")
    ap.add_argument("--gpus-per-agent", type=int, default=8)
    ap.add_argument("--interval-s", type=float, default=15.0, help="report interval (seed 000: 15-30 s)")
    ap.add_argument("--step-s", type=float, default=45.0, help="measured time per step")
    ap.add_argument("--changed-gpus", type=int, default=1, help="GPUs whose state changes in each report")
    ap.add_argument("--no-dashboard", action="store_true", help="no websocket client subscribed")
    ap.add_argument("--agent-processes", type=int, default=1,
                    help="agent API processes sharing one listening socket (default 1)")
    ap.add_argument("--one-process", action="store_true",
                    help="the agents report to the console's process (no agent API process of its own)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    if not 1 <= args.changed_gpus <= args.gpus_per_agent:
        ap.error("--changed-gpus: must be between 1 and --gpus-per-agent")
    if args.agent_processes < 1 or (args.one_process and args.agent_processes != 1):
        ap.error("--agent-processes: must be 1 or more, and 1 with --one-process (no agent API process then)")
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "console.settings", "DEBUG": "0", "ALLOWED_HOSTS": "*",
           "SECRET_KEY": "bench-" + secrets.token_hex(24), "FLEXPIPE_ENROLL_TOKEN": "fpj_" + secrets.token_urlsafe(18),
           "FLEXPIPE_REPORT_INTERVAL_S": str(args.interval_s),
           # A channel prefix and a queue of this run's own: a dashboard socket left in a group by an
           # earlier run on the same Redis made every push of this one try its full queue first.
           "FLEXPIPE_CHANNEL_PREFIX": os.environ.get("FLEXPIPE_CHANNEL_PREFIX") or "bench-cp-" + secrets.token_hex(4),
           "FLEXPIPE_QUEUE": os.environ.get("FLEXPIPE_QUEUE") or "bench-cp-" + secrets.token_hex(4)}
    redis_url, db_url = _services(env)
    env.update(REDIS_URL=redis_url, DATABASE_URL=db_url)
    subprocess.run([PY, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=ROOT, env=env, check=True)
    cookie = _session_cookie(env)
    logdir = Path(tempfile.mkdtemp(prefix="fp-cp-logs-"))
    port = _free_port(env)
    console = Console(port=port, agent_port=None if args.one_process else _free_port(env, port + 1), env=env,
                      agent_processes=args.agent_processes)
    print(f"console on :{console.port}, agent API on :{console.agents_at}, database {db_url.rsplit('/', 1)[-1]}, redis {redis_url}; logs {logdir}",
          flush=True)
    console.start(logdir)
    try:
        steps = asyncio.run(_run(args, console, cookie, db_url))
    finally:
        console.stop()
    report = {"bench": "control_plane", "interval_s": args.interval_s, "step_s": args.step_s,
              "gpus_per_agent": args.gpus_per_agent, "changed_gpus": args.changed_gpus,
              "dashboard": not args.no_dashboard,
              "agent_api": "console's process" if args.one_process else "own process", "database": "postgresql" if db_url.startswith("postgres")
              else "sqlite", "cores": os.cpu_count(), "steps": steps}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
