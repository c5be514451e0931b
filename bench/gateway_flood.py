"""Does a flood of OpenAI streams move the agent API's latency? (issue 19: at most 20% at 100 streams)

    python -m bench.gateway_flood [--streams 100] [--seconds 10] [--rounds 2] [--rate 5] [--pin] [--json PATH]

Real processes, as `make run` starts them: the console (daphne console.asgi, FLEXPIPE_PROCESS=console),
the agent API (daphne console.agent_asgi) and the gateway (daphne console.gateway.asgi) against one database (DATABASE_URL: a PostgreSQL
database the bench may migrate and write; `make test`'s PostgreSQL when it answers) and Redis; the
plans are the simulated fleet's data plane (agents.sim.dataserver: FleetSim's timing, stepped at
wall-clock pace on a thread of this process). Simulated agents (`--agents`, 8 GPUs each) report over
HTTP to the agent API's process at `--rate` reports/s in all, each report timed.

Phases, `--seconds` each, repeated `--rounds` times in this order so drift hits both alike:
    quiet     reports only
    apart     reports, and --streams clients each streaming completions back to back from the
              gateway's process (the architecture now: the agents report to their own process)
    together  the same flood sent to a console that serves /v1 itself (FLEXPIPE_PROCESS=all, and
              the agents reporting to it: every process before issue 19), its reports timed the same way
Printed: report p50/p99 per phase, and p99(apart)/p99(quiet) - the target is <= 1.2 - and
p99(together)/p99(quiet) for comparison. The machine's cores are shared by every process here
(the flood's clients and the simulator too): on a 2-core machine the gateway's CPU competes with
the console's even in separate processes, which the ratio includes. `--pin` puts the console's and
the agent API's processes and the agents' threads on the first core and everything of the flood (the gateway's
process, its clients, the simulator) on the others: the gateway on cores of its own, as on
another host.

`Stack` (the processes and the simulated engine) is what tests/console/gateway/test_process.py
starts too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
DEPLOYMENT = "chat"
MODEL = "Llama-3-8B"
NODE = "a1"
PROMPT = "the quick brown fox jumps over the lazy dog"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- the simulated engine ------------------------------------------------------------------------------


class SimEngine:
    """One deployment's plan on the simulated fleet's data plane, stepped at wall-clock pace.

    Clear `running` and the simulated time stands still (open streams wait, tokens stop); set it
    and time goes on from where it stood.
    """

    def __init__(self, tokenizer_dir: Path, *, speed: float = 1.0) -> None:
        from agents.sim.dataserver import SimDataPlane
        from agents.sim.fleet import FleetSim, SimOptions
        from agents.sim.scenario import parse_scenario

        scenario = parse_scenario({
            "name": "flood", "seed": 3, "duration_s": 86400,
            "nodes": [{"id": NODE, "gpu": "H100-SXM", "gpus": 8, "nvlink": True, "rack": "A"}],
            "network": {"intra_rack_gbps": 400, "inter_rack_gbps": 100},
            "models": [{"deployment": DEPLOYMENT, "model": MODEL, "slo": {"ttft_ms": 2000, "tpot_ms": 100},
                        "baseline": {"tp": 1, "nodes": [NODE]}}],
            # nothing arrives from the scenario: only what the gateway sends
            "workload": [{"deployment": DEPLOYMENT, "arrival": "poisson", "rate_rps": 0.0,
                          "prompt_tokens": {"dist": "fixed", "value": 16},
                          "output_tokens": {"dist": "fixed", "value": 32}}],
            "events": [],
        })
        self.sim = FleetSim(scenario, options=SimOptions(max_run_rounds=4))
        self.plan = self.sim.baseline_plan(DEPLOYMENT)
        engine = self.sim.launch(DEPLOYMENT, self.plan, accepting=True, ready_in_s=0.0)
        self.sim.set_routing(DEPLOYMENT, {engine.engine_id: 1.0}, 1)
        self.plane = SimDataPlane(self.sim, str(tokenizer_dir))
        self.server = self.plane.serve()
        self.speed = speed
        self.running = threading.Event()
        self.running.set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sim-engine", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return self.server.address

    def _loop(self) -> None:
        last = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            if self.running.is_set():
                self.sim.advance_to(self.sim.now_s + (now - last) * self.speed)
                self.plane.pump()
            last = now
            self._stop.wait(0.005)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.plane.close()


# -- the processes -------------------------------------------------------------------------------------


@dataclass
class Proc:
    name: str
    app: str  # module:application for daphne
    env: dict[str, str]
    log_dir: Path
    port: int = field(default_factory=free_port)
    popen: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def access_log(self) -> Path:
        return self.log_dir / f"{self.name}-access.log"

    def start(self, timeout_s: float = 60.0) -> None:
        self.starts += 1
        out = (self.log_dir / f"{self.name}-{self.starts}.log").open("wb")
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(self.port), "--access-log",
             str(self.access_log), self.app], cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT)
        out.close()  # the child has it
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.popen.poll() is None, f"{self.name} exited:\n{self.log_tail()}"
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"{self.name} did not answer /healthz in {timeout_s:g} s\n{self.log_tail()}"
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: no drain, no goodbye (a crash)."""
        if self.popen is not None and self.popen.poll() is None:
            os.kill(self.popen.pid, signal.SIGKILL)
            self.popen.wait(30)
        self.popen = None

    def log_tail(self) -> str:
        path = self.log_dir / f"{self.name}-{self.starts}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def paths_served(self) -> list[str]:
        """The request paths in this process's access log (daphne writes a line per finished request)."""
        if not self.access_log.exists():
            return []
        return [line.split('"')[1].split(" ", 1)[1] for line in self.access_log.read_text().splitlines()
                if line.count('"') >= 2 and " " in line.split('"')[1]]


class Stack:
    """The console's and the gateway's processes (and with `agent_process` the agent API's), and the
    simulated engine, for one database and Redis."""

    def __init__(self, folder: Path, *, database_url: str, redis_url: str, extra_env: dict[str, str] | None = None,
                 console_process: str = "console", speed: float = 1.0, agent_process: bool = False) -> None:
        from agents.engines.torch.weights import write_tokenizer

        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.enroll_token = "fpj_flood-" + os.urandom(8).hex()
        tokenizer = write_tokenizer(folder / "tokenizer", vocab_size=512, max_context=8192)
        self.engine = SimEngine(tokenizer, speed=speed)
        base = {**os.environ, "DJANGO_SETTINGS_MODULE": "console.settings", "DATABASE_URL": database_url,
                "REDIS_URL": redis_url, "FLEXPIPE_ENROLL_TOKEN": self.enroll_token,
                "FLEXPIPE_GATEWAY_TOKENIZERS": f"*={tokenizer}", "PYTHONPATH": str(ROOT), **(extra_env or {})}
        base.setdefault("SECRET_KEY", "bench-gateway-flood-" + os.urandom(16).hex())
        base.pop("FLEXPIPE_PROCESS", None)
        self.gateway = Proc("gateway", "console.gateway.asgi:application", base, folder)
        self.console = Proc("console", "console.asgi:application",
                            {**base, "FLEXPIPE_PROCESS": console_process, "FLEXPIPE_GATEWAY_URL": self.gateway.url},
                            folder)
        self.agents = Proc("agents", "console.agent_asgi:application", base, folder) if agent_process else None

    @property
    def procs(self) -> list[Proc]:
        return [p for p in (self.console, self.gateway, self.agents) if p is not None]

    @property
    def agent_url(self) -> str:
        """Where the agents report: the agent API's own process, or the console's."""
        return (self.agents or self.console).url

    def start(self) -> Stack:
        # all at once: each takes a few seconds to import Django and the apps
        with ThreadPoolExecutor(3) as pool:
            started = [pool.submit(p.start) for p in self.procs]
        try:
            for f in started:
                f.result()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        for p in self.procs:
            p.kill()
        self.engine.close()


# -- the rows the processes read (ORM, in this process) ------------------------------------------------


def seed(stack: Stack, agents: int = 1) -> tuple[str, list[Agent]]:
    """A viewer's API token, `agents` nodes registered over the agent API (Stack.agent_url) (the first is the
    plan's leader: its data address is the simulated engine's), and the deployment routed to the plan."""
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Group
    from django.utils import timezone

    from console.accounts.auth import new_api_token
    from console.gearbox.models import Deployment

    user = get_user_model().objects.create_user(f"flood-{os.urandom(4).hex()}")
    user.groups.add(Group.objects.get_or_create(name="viewer")[0])
    _, token = new_api_token(user, "bench")
    fleet = [Agent.enroll(stack, f"{NODE}" if i == 0 else f"r{i}", stack.engine.address if i == 0 else None)
             for i in range(agents)]
    now = timezone.now()
    Deployment.objects.create(name=DEPLOYMENT, model_name=MODEL, ttft_ms=2000.0, tpot_ms=100.0,
                              baseline_gear={"model": MODEL, "plans": [], "weights": []},
                              routing_version=1, routing=[route(stack)], created_at=now, updated_at=now)
    return token, fleet


def route(stack: Stack, *, frozen: bool = False) -> dict[str, Any]:
    plan = stack.engine.plan
    return {"plan_id": plan.plan_id, "plan": plan.to_dict(), "weight": 1.0, "frozen": frozen, "nodes": [NODE]}


class Agent:
    """A simulated agent of 8 H100s: registered with the join token, then reporting with its own."""

    def __init__(self, url: str, node_id: str, token: str, epoch: int, uuids: list[str]) -> None:
        self.url, self.node_id, self.token, self.epoch, self.uuids = url, node_id, token, epoch, uuids
        self.seq = 0

    @classmethod
    def enroll(cls, stack: Stack, node_id: str, data_addr: str | None) -> Agent:
        from agents.client import AgentClient
        from agents.protocol import GpuInfo, RegisterRequest

        uuids = ([stack.engine.sim.cluster.gpu_uuid(NODE, i) for i in range(8)] if node_id == NODE
                 else [f"GPU-{node_id}-{i}" for i in range(8)])
        req = RegisterRequest(node_id, f"{node_id}.sim", "bench", tuple(
            GpuInfo(u, i, "H100-SXM", 80 * 2**30, "nvl0") for i, u in enumerate(uuids)),
            rack="A", backends=("sim",), data_addr=data_addr or f"{node_id}.sim:7070")
        with AgentClient(stack.agent_url, stack.enroll_token) as client:
            resp = client.register(req)
            return cls(stack.agent_url, node_id, client.token, resp.epoch, uuids)

    def report_body(self) -> dict[str, Any]:
        from agents.protocol import GpuReport, Report

        self.seq += 1
        gpus = tuple(GpuReport(u, 20 * 2**30, 80 * 2**30, round(0.3 + 0.01 * (self.seq % 7), 2), 55.0, True)
                     for u in self.uuids)
        return Report(self.node_id, self.epoch, self.seq, gpus).to_dict()


# -- load ------------------------------------------------------------------------------------------------


async def stream_once(client: httpx.AsyncClient, url: str, token: str, max_tokens: int) -> tuple[int, int, str]:
    """One streaming completion: (HTTP status, tokens, finish_reason - or the error's code when refused)."""
    body = {"model": DEPLOYMENT, "prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    chunks, finish = 0, ""
    async with client.stream("POST", f"{url}/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {token}"}) as resp:
        if resp.status_code != 200:
            try:
                code = str(json.loads(await resp.aread())["error"]["code"])
            except (ValueError, KeyError, TypeError):
                code = "?"
            return resp.status_code, 0, code
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            msg = json.loads(line[6:])
            for choice in msg.get("choices", []):
                chunks += len(choice.get("token_ids") or [])
                finish = choice.get("finish_reason") or finish
    return 200, chunks, finish


@dataclass
class FloodResult:
    streams: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    tokens: int = 0
    incomplete: int = 0  # 200 but not every token, or no finish_reason
    refusals: dict[str, int] = field(default_factory=dict)  # "status code" -> count, e.g. "429 no_route"


def flood(url: str, token: str, concurrency: int, stop: threading.Event, *, max_tokens: int = 32,
          once: bool = False) -> FloodResult:
    """`concurrency` clients each streaming completions back to back until `stop` (or one each: `once`)."""
    out = FloodResult()

    async def client_loop(client: httpx.AsyncClient) -> None:
        while True:
            status, n, finish = await stream_once(client, url, token, max_tokens)
            out.streams += 1
            out.statuses[status] = out.statuses.get(status, 0) + 1
            out.tokens += n
            if status == 200 and (n != max_tokens or finish != "length"):
                out.incomplete += 1
            if status != 200:
                key = f"{status} {finish}"
                out.refusals[key] = out.refusals.get(key, 0) + 1
                await asyncio.sleep(0.2)  # a refusal: not a busy loop of them
            if once or stop.is_set():
                return

    async def main() -> None:
        limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))

    asyncio.run(main())
    return out


def report_loop(agents: list[Agent], rate_rps: float, stop: threading.Event) -> tuple[list[float], dict[int, int]]:
    """Each agent reports on its own thread at `rate_rps / len(agents)` until `stop` (open loop: a slow
    answer does not lower the offered rate, unless one agent's report outlasts its interval): each
    report's latency (s) and the count per status (0: no answer)."""
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    lock = threading.Lock()
    interval_s = len(agents) / rate_rps

    def one_agent(agent: Agent, offset_s: float) -> None:
        pin("console")
        with httpx.Client(timeout=30) as client:
            next_s = time.monotonic() + offset_s
            while not stop.wait(max(0.0, next_s - time.monotonic())):
                body = agent.report_body()
                t0 = time.monotonic()
                try:
                    status = client.post(f"{agent.url}/agent/v1/report", json=body,
                                         headers={"Authorization": f"Bearer {agent.token}"}).status_code
                except httpx.HTTPError:
                    status = 0
                with lock:
                    latencies.append(time.monotonic() - t0)
                    statuses[status] = statuses.get(status, 0) + 1
                next_s += interval_s

    threads = [threading.Thread(target=one_agent, args=(a, i * interval_s / len(agents)), daemon=True)
               for i, a in enumerate(agents)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies, statuses


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- the bench -------------------------------------------------------------------------------------------

# --pin: the console's side (its process, the agents' threads) on the first core, the flood's side
# (the gateway's process, the streaming clients, the simulated engine) on the others - as if the
# gateway ran on cores of its own. Linux only (sched_setaffinity on a thread's native id).
_PINS: dict[str, set[int]] = {}


def pin(side: str, pid: int = 0) -> None:
    """Put `pid` (0: the calling thread) on `side`'s cores, when --pin set them."""
    cores = _PINS.get(side)
    if cores:
        os.sched_setaffinity(pid or threading.get_native_id(), cores)



@contextmanager
def _django(database_url: str) -> Iterator[None]:
    os.environ["DATABASE_URL"] = database_url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
    os.environ.setdefault("SECRET_KEY", "bench-gateway-flood-" + os.urandom(16).hex())
    import logging

    import django

    django.setup()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=ROOT, check=True,
                   env=os.environ.copy())
    yield


def _clear() -> None:
    from console.accounts.models import ApiToken
    from console.fleet.models import Node
    from console.gearbox.models import Deployment

    Deployment.objects.filter(name=DEPLOYMENT).delete()
    Node.objects.filter(hostname__endswith=".sim", agent_version="bench").delete()
    ApiToken.objects.filter(name="bench").delete()


def phase(stack: Stack, agents: list[Agent], token: str, *, seconds: float, rate_rps: float,
          streams: int, flood_url: str | None) -> dict[str, Any]:
    stop = threading.Event()
    box: dict[str, FloodResult] = {}
    flooder = None
    if flood_url is not None:
        def flooding() -> None:
            pin("flood")
            box["r"] = flood(flood_url, token, streams, stop)

        flooder = threading.Thread(target=flooding)
        flooder.start()
        time.sleep(1.0)  # the flood at full concurrency before reports are timed
    timer = threading.Timer(seconds, stop.set)
    timer.start()
    latencies, statuses = report_loop(agents, rate_rps, stop)
    if flooder is not None:
        flooder.join(120)
    result = box.get("r")
    return {"reports": len(latencies), "report_statuses": statuses,
            "report_p50_ms": 1e3 * pct(latencies, 0.5), "report_p99_ms": 1e3 * pct(latencies, 0.99),
            "latencies_ms": [1e3 * x for x in latencies],
            "streams": result.streams if result else 0, "stream_statuses": result.statuses if result else {},
            "refusals": result.refusals if result else {},
            "stream_tokens": result.tokens if result else 0, "incomplete": result.incomplete if result else 0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=100, help="concurrent streaming clients (100)")
    ap.add_argument("--seconds", type=float, default=10.0, help="length of each phase (10)")
    ap.add_argument("--rounds", type=int, default=2, help="times each phase runs, interleaved (2)")
    ap.add_argument("--rate", type=float, default=5.0,
                    help="agent reports per second, all agents (5: below what one loaded console process takes)")
    ap.add_argument("--agents", type=int, default=5, help="simulated agents reporting, one thread each (5)")
    ap.add_argument("--database-url", default=os.environ.get("DATABASE_URL", ""),
                    help="a PostgreSQL database the bench may migrate and write (default $DATABASE_URL)")
    ap.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    ap.add_argument("--pin", action="store_true",
                    help="the console and the agents on core 0, the gateway, its clients and the simulator on the rest")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.pin:
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < 2:
            ap.error("--pin: needs 2 cores or more")
        _PINS.update(console={cores[0]}, flood=set(cores[1:]))  # the processes it started are stopped on the way out
    if not args.database_url.startswith("postgres"):
        ap.error("--database-url: a PostgreSQL URL is needed (SQLite serialises the writers: it would measure its lock)")

    results: dict[str, list[dict[str, Any]]] = {"quiet": [], "apart": [], "together": []}
    with _django(args.database_url), tempfile.TemporaryDirectory(prefix="gateway-flood-") as tmp:
        prefix = "flood-" + os.urandom(4).hex()
        # no worker takes its ticks; the flood's arrivals all fit the gateway's CPU queue (no 429 gateway_busy)
        env = {"FLEXPIPE_CHANNEL_PREFIX": prefix, "FLEXPIPE_QUEUE": prefix,
               "FLEXPIPE_GATEWAY_CPU_QUEUE": str(max(16, 2 * args.streams))}
        for where in ("apart", "together"):
            _clear()
            stack = Stack(Path(tmp) / where, database_url=args.database_url, redis_url=args.redis_url,
                          extra_env=env, console_process="console" if where == "apart" else "all",
                          agent_process=where == "apart")
            try:
                stack.start()
                if args.pin:
                    assert stack.console.popen is not None and stack.gateway.popen is not None
                    pin("console", stack.console.popen.pid)
                    if stack.agents is not None and stack.agents.popen is not None:
                        pin("console", stack.agents.popen.pid)
                    pin("flood", stack.gateway.popen.pid)
                    for thread in (stack.engine._thread, stack.engine.server._thread):  # the data server's
                        if thread is not None and thread.native_id:                  # handlers inherit it
                            pin("flood", thread.native_id)
                    pin("flood")  # this thread, and the flood's thread it starts
                token, agents = seed(stack, args.agents)
                target = stack.gateway.url if where == "apart" else stack.console.url
                for n in range(args.rounds):
                    for name, url in (("quiet", None), (where, target)):
                        res = phase(stack, agents, token, seconds=args.seconds, rate_rps=args.rate,
                                    streams=args.streams, flood_url=url)
                        res["round"], res["stack"] = n, where
                        results[name].append(res)
                        print(f"{where:>8} round {n} {name:>8}: reports {res['reports']:4d} "
                              f"p50 {res['report_p50_ms']:7.1f} ms p99 {res['report_p99_ms']:7.1f} ms "
                              f"{res['report_statuses']}; streams {res['streams']} {res['stream_statuses']} "
                              f"incomplete {res['incomplete']} {res['refusals'] or ''}", flush=True)
                console_v1 = [p for p in stack.console.paths_served() if p.startswith("/v1")]
                print(f"{where:>8}: /v1 requests served by the console's process: {len(console_v1)}")
            finally:
                stack.close()
                _clear()

    def pooled(name: str, stack: str | None = None) -> list[float]:
        return [x for r in results[name] if stack is None or r["stack"] == stack for x in r["latencies_ms"]]

    summary: dict[str, Any] = {}
    for name, stack_name in (("quiet_apart", "apart"), ("quiet_together", "together")):
        summary[f"{name}_p99_ms"] = pct(pooled("quiet", stack_name), 0.99)
    summary["apart_p99_ms"] = pct(pooled("apart"), 0.99)
    summary["together_p99_ms"] = pct(pooled("together"), 0.99)
    summary["apart_ratio"] = summary["apart_p99_ms"] / summary["quiet_apart_p99_ms"]
    summary["together_ratio"] = summary["together_p99_ms"] / summary["quiet_together_p99_ms"]
    summary.update(streams=args.streams, rate_rps=args.rate, seconds=args.seconds, rounds=args.rounds,
                   cores=os.cpu_count(), pinned=args.pin)
    print(f"\nreport p99 under a flood of {args.streams} streams, against quiet (target <= 1.2):")
    print(f"  gateway in its own process:      {summary['apart_p99_ms']:7.1f} ms / {summary['quiet_apart_p99_ms']:.1f} ms"
          f" = {summary['apart_ratio']:.2f}x")
    print(f"  gateway in the console process:  {summary['together_p99_ms']:7.1f} ms / "
          f"{summary['quiet_together_p99_ms']:.1f} ms = {summary['together_ratio']:.2f}x")
    if args.json:
        for rows in results.values():
            for row in rows:
                row.pop("latencies_ms")
        args.json.write_text(json.dumps({"summary": summary, "phases": results}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
