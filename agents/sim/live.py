"""The live simulated fleet: one agent per scenario node, over real HTTP with real tokens.

It advances the scenario on wall-clock time x `time_scale`, applies its events to the
simulated cluster (agents.sim.cluster), and has each node's agent register, report, long-poll
its commands and acknowledge them - the controller drives it exactly as it drives real agents.

What runs is what the controller commanded: the agents and engines are an
agents.sim.memory_fleet.MemoryFleet, which executes agent protocol v1's transition commands
with modelled durations (weights over the host link, KV over the node link at the capped
bandwidth, replay as a prefill on the target - scheduler.costmodel) and serves requests on the
prepared plans. The scenario's workload arrives at a gateway that routes by the controller's
routing tables (GET /agent/v1/routing); nothing is served before the first transition brings a
plan up. A GPU holds the memory its plans reserved; utilisation follows their batches. GPUs held
by another tenant show that tenant's memory use, drawn per GPU from the seed; a preemption or a
failure breaks the plans on those GPUs at once (their sequences wait, KV lost, for the
controller to replay them elsewhere).

Faults (tests, demos - not part of the scenario format): `--fault NODE:KIND:ACTION[:TIMES]`
makes the next TIMES commands of KIND (a command kind or `*`) on NODE fail, hang (never
answered), or lose the command's GPUs half way (`lose_gpus`); tests call `fleet.fleet.inject`.
"""

from __future__ import annotations

import logging
import math
import queue
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import httpx

from agents.client import AgentClient, ControllerError
from agents.protocol import (
    Ack,
    Command,
    GpuInfo,
    GpuReport,
    LinkReport,
    RegisterRequest,
    Report,
    SchemaError,
    check_payload,
    parse_report,
)
from agents.sim.cluster import TENANT, SimCluster
from agents.sim.memory_fleet import Fault, MemoryFleet
from agents.sim.scenario import DistSpec, Scenario, WorkloadSpec
from scheduler.hardware import gpu_spec
from scheduler.invariants import EventLog
from scheduler.topology import GpuState, LinkState, NodeState, Snapshot
from scheduler.transition import CommandIntent, CommandKind, CommandStatus, Route, RoutingState, Step

log = logging.getLogger("agents.sim")

AGENT_VERSION = "sim-2"
IDLE_MEM_BYTES = 600 * 2**20  # a CUDA context with nothing loaded holds about this much
FAULT_ACTIONS = ("fail", "hang", "lose_gpus")


# --- the cluster as a snapshot ---------------------------------------------------------------------
def tenant_fractions(scenario: Scenario) -> dict[tuple[str, int], float]:
    """Another tenant's memory use per GPU: fixed per GPU for the whole run, drawn from the seed."""
    rng = random.Random(scenario.seed ^ 0x5EED)
    return {(n.id, i): rng.uniform(0.55, 0.95) for n in scenario.all_nodes() for i in range(n.gpus)}


def sim_snapshot(cluster: SimCluster, now_s: float, used_extra: Mapping[str, int]) -> Snapshot:
    """What the agents of `cluster` report at `now_s`: every GPU ours and idle (plus `used_extra`
    bytes) - which GPUs another tenant holds is the fleet model's business (MemoryFleet.lost)."""
    nodes, gpus = [], []
    for node in sorted(cluster.nodes.values(), key=lambda n: n.id):
        nodes.append(NodeState(node.id, node.spec.rack, True, now_s))
        for g in node.gpus:
            total = gpu_spec(g.model).mem_bytes
            gpus.append(GpuState(g.uuid, node.id, g.index, g.model, total,
                                 min(total, IDLE_MEM_BYTES + used_extra.get(g.uuid, 0)),
                                 nvlink_group=g.nvlink_group, last_seen_s=now_s))
    ids = [n.id for n in nodes]
    links = tuple(LinkState(a, b, cluster.link_gbps(a, b)) for i, a in enumerate(ids) for b in ids[i + 1:])
    return Snapshot(now_s=now_s, nodes=tuple(nodes), gpus=tuple(gpus), links=links)


# --- the scenario's load -------------------------------------------------------------------------
def sample_tokens(dist: DistSpec | None, rng: random.Random, default: int) -> int:
    if dist is None:
        return default
    if dist.dist == "fixed":
        return max(1, int(dist.value or default))
    if dist.dist == "uniform":
        return rng.randint(max(1, dist.min or 1), max(1, dist.max or default))
    mean, sigma = float(dist.mean or default), float(dist.sigma or 0.0)
    mu = math.log(max(mean, 1.0)) - sigma * sigma / 2
    value = int(rng.lognormvariate(mu, sigma))
    return max(1, min(value, dist.max or value))


@dataclass
class Arrivals:
    """Poisson arrivals (or a trace) of one workload entry, drawn from a seeded generator."""

    spec: WorkloadSpec
    rng: random.Random
    next_s: float = 0.0
    trace_at: int = 0

    def due(self, until_s: float) -> list[tuple[float, int, int]]:
        """(time, prompt tokens, output tokens) of every arrival up to `until_s`."""
        out = []
        if self.spec.arrival == "trace":
            rows = self.spec.trace
            while self.trace_at < len(rows) and rows[self.trace_at].t_s <= until_s:
                r = rows[self.trace_at]
                out.append((r.t_s, r.prompt_tokens, r.output_tokens))
                self.trace_at += 1
            return out
        while True:
            rate = self.spec.rate_rps(self.next_s)
            if rate <= 0:
                self.next_s = max(self.next_s, until_s)
                return out
            t = self.next_s + self.rng.expovariate(rate)
            if t > until_s:
                return out
            self.next_s = t
            out.append((t, sample_tokens(self.spec.prompt_tokens, self.rng, 512),
                        sample_tokens(self.spec.output_tokens, self.rng, 128)))


# --- the wire side of the agents -------------------------------------------------------------------
class HttpMailbox:
    """MemoryFleet's mailbox over agent protocol v1: commands the agents pulled, acks to send."""

    def __init__(self) -> None:
        self.inbox: dict[str, list[CommandIntent]] = {}
        self.outbox: list[tuple[str, int, Ack]] = []  # (node, command id, ack)
        self.ids: dict[str, tuple[str, int]] = {}  # key -> (node, command id)
        self.lock = threading.Lock()

    def deliver(self, node_id: str, commands: Sequence[Command]) -> None:
        """Commands an agent pulled: valid ones go to the fleet, others are refused naming the field."""
        for c in commands:
            key = f"cmd-{c.id}"
            with self.lock:
                if key in self.ids:
                    continue
                self.ids[key] = (node_id, c.id)
            try:
                kind = CommandKind(c.kind)
                check_payload(c.kind, c.payload)
            except (ValueError, SchemaError) as exc:
                errors = exc.errors if isinstance(exc, SchemaError) else {"kind": str(exc)}
                self.ack(key, "failed", "; ".join(f"{k}: {v}" for k, v in errors.items()), {"reason": "failed"})
                continue
            step = Step(c.step) if c.step in {s.value for s in Step} else Step.PREPARE
            intent = CommandIntent(key, node_id, kind, dict(c.payload), c.deployment or "", c.transition_seq or 0,
                                   step, 1)
            with self.lock:
                self.inbox.setdefault(node_id, []).append(intent)

    def take(self, node_id: str) -> list[CommandIntent]:
        with self.lock:
            return self.inbox.pop(node_id, [])

    def ack(self, key: str, status: CommandStatus, detail: str = "", result: Mapping[str, object] | None = None
            ) -> None:
        with self.lock:
            node, cid = self.ids[key]
            self.outbox.append((node, cid, Ack(status=status, detail=detail[:2000], result=dict(result or {}))))

    def acks(self) -> list[tuple[str, int, Ack]]:
        with self.lock:
            out, self.outbox = self.outbox, []
        return out


@dataclass
class SimAgent:
    node_id: str
    client: AgentClient
    epoch: int = 0
    seq: int = 0
    last_report_wall: float = 0.0
    last_report_sim: float = 0.0
    dirty: bool = True
    after_command: int = 0
    rng: random.Random = field(default_factory=random.Random)
    poller: threading.Thread | None = None


def register_request(cluster: SimCluster, node_id: str) -> RegisterRequest:
    node = cluster.nodes[node_id]
    gpus = tuple(GpuInfo(g.uuid, g.index, g.model, gpu_spec(g.model).mem_bytes, g.nvlink_group)
                 for g in node.gpus)
    return RegisterRequest(node_id=node_id, hostname=f"{node_id}.sim", agent_version=AGENT_VERSION,
                           gpus=gpus, rack=node.spec.rack, backends=("sim",), data_addr=f"{node_id}.sim:7070")


def parse_fault(text: str) -> Fault:
    """NODE:KIND:ACTION[:TIMES] (module docstring); ValueError naming the bad part."""
    parts = text.split(":")
    if len(parts) not in (3, 4):
        raise ValueError(f"--fault {text!r}: expected NODE:KIND:ACTION[:TIMES]")
    node, kind, action = parts[:3]
    if kind != "*" and kind not in {k.value for k in CommandKind}:
        raise ValueError(f"--fault {text!r}: KIND must be a command kind or '*'; got {kind!r}")
    if action not in FAULT_ACTIONS:
        raise ValueError(f"--fault {text!r}: ACTION must be one of {', '.join(FAULT_ACTIONS)}; got {action!r}")
    times = 1
    if len(parts) == 4:
        if not parts[3].isdigit() or int(parts[3]) < 1:
            raise ValueError(f"--fault {text!r}: TIMES must be an integer >= 1")
        times = int(parts[3])
    return Fault(node=node, kind=kind, action=action, times=times)  # type: ignore[arg-type]


class LiveFleet:
    """Runs every node's agent against one controller (module docstring)."""

    def __init__(self, scenario: Scenario, controller: str, join_token: str, *,
                 report_interval_s: float | None = None, time_scale: float | None = None,
                 faults: Sequence[Fault] = (), long_poll_s: float | None = 10.0,
                 clock: Callable[[], float] = time.monotonic, routing_every_s: float = 0.5) -> None:
        self.scenario = scenario
        self.controller = controller
        self.join_token = join_token
        self.time_scale = time_scale or scenario.time_scale
        self.clock = clock
        self.cluster = SimCluster(scenario, random.Random(scenario.seed))
        self.tenant_fraction = tenant_fractions(scenario)
        self.agents: dict[str, SimAgent] = {}
        self.report_interval_s = report_interval_s
        self.long_poll_s = long_poll_s  # None: poll without waiting on every pass (tests)
        self.routing_every_s = routing_every_s
        self.t0 = clock()
        self.log = EventLog(record_decodes=False)
        self.mailbox = HttpMailbox()
        self.routes: dict[str, RoutingState] = {}
        self._routes_wall = -math.inf
        self.fleet = MemoryFleet(sim_snapshot(self.cluster, 0.0, {}), self.mailbox, self._routing, self.log,
                                 rng=random.Random(scenario.seed ^ 0xF1EE7), max_dt_s=0.1)
        for f in faults:
            self.fleet.inject(f)
        self.fleet.lose_gpus(self._not_ours(), "tenant")
        self.arrivals = [Arrivals(w, random.Random(f"{scenario.seed}/load/{i}")) for i, w in
                         enumerate(scenario.workload)]
        self._stop = threading.Event()
        self._pulled: queue.Queue[tuple[str, list[Command]]] = queue.Queue()

    # -- time ------------------------------------------------------------------------------------
    def sim_time_s(self) -> float:
        return (self.clock() - self.t0) * self.time_scale

    def _routing(self, deployment: str) -> RoutingState:
        return self.routes.get(deployment, RoutingState(deployment, 0, ()))

    def _not_ours(self) -> list[str]:
        return [g.uuid for n in self.cluster.nodes.values() for g in n.gpus if g.owner == TENANT]

    def _failed(self) -> list[str]:
        return [g.uuid for n in self.cluster.nodes.values() for g in n.gpus if g.owner == "failed"]

    def _agent(self, node_id: str) -> SimAgent:
        agent = self.agents.get(node_id)
        if agent is None:
            agent = SimAgent(node_id, AgentClient(self.controller, self.join_token),
                             rng=random.Random(f"{self.scenario.seed}/{node_id}"))
            self.agents[node_id] = agent
        return agent

    def register(self, agent: SimAgent) -> None:
        resp = agent.client.register(register_request(self.cluster, agent.node_id))
        agent.epoch, agent.seq, agent.dirty = resp.epoch, 0, True
        if self.report_interval_s is None:
            self.report_interval_s = resp.report_interval_s
        log.info("%s registered (epoch %d)", agent.node_id, agent.epoch)
        if self.long_poll_s is not None and agent.poller is None:
            agent.poller = threading.Thread(target=self._poll_loop, args=(agent,), name=f"poll-{agent.node_id}",
                                            daemon=True)
            agent.poller.start()

    def step(self) -> None:
        """One pass: scenario events, the load, commands in, serving, acks out, reports."""
        now_s = self.sim_time_s()
        for change in self.cluster.advance_to(now_s):
            log.info("t=%6.0fs %s", change.at_s, change.text)
            if change.node in self.agents:
                self.agents[change.node].dirty = True
        self._sync_cluster()
        for gone in [n for n in self.agents if n not in self.cluster.nodes]:
            agent = self.agents.pop(gone)
            agent.client.close()  # a node that left stops reporting
            self.fleet.lose_node(gone)
        wall = self.clock()
        for node_id in sorted(self.cluster.nodes):
            agent = self._agent(node_id)
            try:
                if agent.epoch == 0:
                    self.register(agent)
                if self.long_poll_s is None:
                    self._pulled.put((node_id, agent.client.pull_commands(agent.after_command, 0.0)))
            except ControllerError as exc:
                self._recover(agent, exc)
            except httpx.HTTPError as exc:
                log.warning("%s: controller unreachable (%s)", node_id, exc.__class__.__name__)
                agent.dirty = True
        self._take_pulled()
        if wall - self._routes_wall >= self.routing_every_s:
            self._fetch_routing()
        for dep, prompt, output in self._due_requests(now_s):
            self.fleet.submit(dep, prompt, output)
        self.fleet.advance_to(now_s)
        self._send_acks()
        interval = self.report_interval_s or 15.0
        for node_id in sorted(self.cluster.nodes):
            agent = self.agents[node_id]
            if agent.epoch == 0:
                continue
            try:
                if agent.dirty or wall - agent.last_report_wall >= interval:
                    self.report(agent, now_s)
            except ControllerError as exc:
                self._recover(agent, exc)
            except httpx.HTTPError as exc:
                log.warning("%s: controller unreachable (%s)", node_id, exc.__class__.__name__)
                agent.dirty = True

    def _sync_cluster(self) -> None:
        """Mirror the scenario's ownership changes into the fleet model (preemptions break plans)."""
        base_nodes = {n.id for n in self.fleet.base.nodes}
        if set(self.cluster.nodes) - base_nodes:
            self.fleet.set_base(sim_snapshot(self.cluster, self.sim_time_s(), {}))
        tenant, failed = set(self._not_ours()), set(self._failed())
        back = [u for u in self.fleet.lost if u not in tenant and u not in failed]
        if back:
            self.fleet.restore_gpus(back)
        new_tenant = [u for u in tenant if self.fleet.lost.get(u) != "tenant"]
        new_failed = [u for u in failed if self.fleet.lost.get(u) != "failed"]
        if new_tenant:
            self.fleet.lose_gpus(new_tenant, "tenant")
        if new_failed:
            self.fleet.lose_gpus(new_failed, "failed")

    def _due_requests(self, now_s: float) -> list[tuple[str, int, int]]:
        out = []
        for arr in self.arrivals:
            for _, prompt, output in arr.due(now_s):
                out.append((arr.spec.deployment, prompt, output))
        return out

    # -- commands ----------------------------------------------------------------------------------
    def _poll_loop(self, agent: SimAgent) -> None:
        """Long-poll one agent's commands on its own connection until the fleet stops."""
        client = AgentClient(self.controller, agent.client.token)
        after = agent.after_command
        try:
            while not self._stop.is_set():
                client.token = agent.client.token
                try:
                    cmds = client.pull_commands(after, self.long_poll_s or 0.0)
                except (ControllerError, httpx.HTTPError) as exc:
                    if self._stop.is_set():
                        return
                    log.debug("%s: command poll failed (%s)", agent.node_id, exc)
                    self._stop.wait(1.0)
                    continue
                if cmds:
                    after = max(after, max(c.id for c in cmds))
                    self._pulled.put((agent.node_id, cmds))
        finally:
            client.close()

    def _take_pulled(self) -> None:
        while True:
            try:
                node_id, cmds = self._pulled.get_nowait()
            except queue.Empty:
                return
            if cmds:
                agent = self.agents.get(node_id)
                if agent is not None:
                    agent.after_command = max(agent.after_command, max(c.id for c in cmds))
                for c in cmds:
                    log.info("%s <- %s %s (%s #%s %s)", node_id, c.id, c.kind, c.deployment, c.transition_seq, c.step)
                self.mailbox.deliver(node_id, cmds)

    def _send_acks(self) -> None:
        for node_id, cid, ack in self.mailbox.acks():
            agent = self.agents.get(node_id)
            if agent is None:
                continue
            try:
                agent.client.ack(cid, ack)
                agent.dirty = True  # what a command did (memory reserved or freed) is reported at once
                log.info("%s -> ack %s %s %s", node_id, cid, ack.status, ack.detail[:80])
            except ControllerError as exc:
                log.warning("%s: ack of command %s refused: %s", node_id, cid, exc)
            except httpx.HTTPError as exc:
                log.warning("%s: ack of command %s not delivered (%s); keeping it", node_id, cid,
                            exc.__class__.__name__)
                self.mailbox.outbox.append((node_id, cid, ack))

    def _fetch_routing(self) -> None:
        agent = next((a for a in self.agents.values() if a.epoch), None)
        if agent is None:
            return
        try:
            body = agent.client.routing()
        except (ControllerError, httpx.HTTPError) as exc:
            log.debug("routing tables not fetched: %s", exc)
            return
        self._routes_wall = self.clock()
        for d in body.get("deployments", []):
            try:
                routes = tuple(Route.from_dict(r, f"{d['name']}.routes[{i}]") for i, r in enumerate(d["routes"]))
            except (KeyError, ValueError) as exc:
                log.warning("routing table of %s unreadable: %s", d.get("name"), exc)
                continue
            self.routes[d["name"]] = RoutingState(d["name"], int(d["version"]), routes)

    # -- reports -----------------------------------------------------------------------------------
    def report(self, agent: SimAgent, now_s: float) -> None:
        agent.seq += 1
        node_id = agent.node_id
        interval = max(1e-3, now_s - agent.last_report_sim) if agent.last_report_sim else (
            self.report_interval_s or 15.0) * self.time_scale
        body = Report(
            node_id=node_id,
            epoch=agent.epoch,
            seq=agent.seq,
            gpus=tuple(self.gpu_reports(node_id, agent.rng)),
            links=tuple(LinkReport(peer, bw) for peer, bw in self.cluster.links_of(node_id)),
        ).to_dict()
        body["engines"] = self.fleet.engine_reports(node_id, interval)
        agent.client.report(parse_report(body))
        agent.dirty = False
        agent.last_report_wall = self.clock()
        agent.last_report_sim = now_s

    def gpu_reports(self, node_id: str, rng: random.Random) -> list[GpuReport]:
        snap = self.fleet.snapshot()
        busy: dict[str, float] = {}
        for inst in self.fleet.nodes[node_id].instances.values() if node_id in self.fleet.nodes else ():
            if inst.state in ("ready", "frozen", "draining"):
                leader = next((i for n in self.fleet.nodes.values() for i in n.instances.values()
                               if i.leader and i.plan.plan_id == inst.plan.plan_id), None)
                load = min(1.0, len(leader.seqs) / 64.0) if leader else 0.0
                for u in inst.reserved:
                    busy[u] = max(busy.get(u, 0.0), 0.1 + 0.85 * load)
        reports: list[GpuReport] = []
        for g in self.cluster.nodes[node_id].gpus:
            total = gpu_spec(g.model).mem_bytes
            state = snap.gpu_by_uuid.get(g.uuid)
            if g.owner == TENANT:
                used, util = int(self.tenant_fraction[(node_id, g.index)] * total), rng.uniform(0.3, 0.9)
            else:
                used = state.mem_used_bytes if state is not None else IDLE_MEM_BYTES
                util = min(1.0, max(0.0, busy.get(g.uuid, 0.0) + (rng.uniform(-0.04, 0.04) if g.uuid in busy else 0)))
            reports.append(GpuReport(
                uuid=g.uuid, mem_used_bytes=min(total, used), mem_total_bytes=total, sm_util=round(util, 3),
                temperature_c=round(32.0 + 50.0 * util, 1), healthy=g.owner != "failed", allocatable=g.owner != TENANT,
                xid_errors=g.xid_errors, ecc_errors=g.ecc_errors))
        return reports

    def _recover(self, agent: SimAgent, exc: ControllerError) -> None:
        if exc.status == 401:
            # The controller forgot us (a fresh database): enroll again with the join token.
            log.warning("%s: %s; enrolling again", agent.node_id, exc)
            agent.client.token = self.join_token
            agent.epoch = 0
        elif exc.status == 409:
            log.warning("%s: %s; registering again", agent.node_id, exc)
            agent.epoch = 0
        else:
            log.error("%s: %s", agent.node_id, exc)

    def close(self) -> None:
        self._stop.set()
        for agent in self.agents.values():
            agent.client.close()
        for agent in self.agents.values():
            if agent.poller is not None:
                agent.poller.join(timeout=(self.long_poll_s or 0.0) + 12.0)


def wait_for_controller(url: str, timeout_s: float) -> None:
    """Block until the controller answers /healthz (make run starts the web server alongside)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url.rstrip("/") + "/healthz", timeout=2).status_code == 200:
                return
        except (OSError, httpx.HTTPError):
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"controller at {url} did not answer within {timeout_s:g} s")
        time.sleep(0.5)


__all__ = ["Arrivals", "HttpMailbox", "IDLE_MEM_BYTES", "LiveFleet", "parse_fault", "register_request",
           "sample_tokens", "sim_snapshot", "tenant_fractions", "wait_for_controller"]
