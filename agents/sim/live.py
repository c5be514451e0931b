"""The live simulated fleet: one agent per scenario node, over real HTTP with real tokens.

It runs the same discrete-event simulator as `bench.replay` - agents.sim.fleet.FleetSim, whose
agents.sim.engine.PlanEngine batches continuously with chunked prefill, pages KV and preempts by
recompute, pipelines stages and hands prefill off to decode, with step times from
scheduler.costmodel - advanced on every pass to sim time = (wall - t0) x `time_scale`. The
scenario's events (its cluster) and its workload (arrivals) come from that FleetSim; each
node's agent registers, reports, long-polls its commands and acknowledges them, so the
controller drives it exactly as it drives real agents.

What runs is what the controller commanded: agent protocol v1's transition commands go to
agents.sim.executor.SimAgents, which carries them out on FleetSim's engines with modelled
durations (weights over the host link, KV over the node link at the capped bandwidth, replay as
a prefill on the target) and answers each when it is done; the answer goes back over HTTP with
the result the controller's executor reads (scheduler/transition/). FleetSim routes each
deployment's requests as the controller's routing tables say (GET /agent/v1/routing: weight > 0
and not frozen), each weight times the global correction's live multiplier for the plan
(`apply_hints`: agents/sim/hints.py, which also sets the plan's batch-token threshold).
Nothing is served before the first transition brings a plan up: requests wait
in their deployment's queue and end with an explicit error after `admit_timeout_s` there.

Reports: a GPU holds the memory its plans reserved (weights plus the KV reserve an engine
allocates when it starts, as vLLM does), its utilisation is the share of the interval its plans
ran rounds; GPUs held by another tenant show that tenant's memory use, drawn per GPU from the
seed. The report of a plan's first node carries the plan's engine metrics from its PlanEngine
(running and waiting requests, tokens/s, TTFT and TPOT percentiles, KV usage, arrivals and
finishes over the interval: agents.protocol.EngineReport). A preemption or a failure stops the
plans on those GPUs at once; their requests go back to the router (KV lost, recomputed). Every
registration and report lists the plans the node runs (FleetSim.plans_on): the controller replaces
a plan that stopped, even when its GPUs came back before it moved off them.

Faults (tests, demos - not part of the scenario format): `--fault NODE:KIND:ACTION[:TIMES]`
makes the next TIMES commands of KIND (a command kind or `*`) on NODE fail, hang (never
answered), or lose the command's GPUs half way (`lose_gpus`: the plans on them crash, the GPUs
stay ours); tests call `fleet.inject`.
"""

from __future__ import annotations

import logging
import math
import queue
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import httpx

from agents.client import AgentClient, ControllerError
from agents.protocol import (
    NODE_KINDS,
    Ack,
    Command,
    GpuInfo,
    GpuReport,
    LinkReport,
    NodeCommandKind,
    RegisterRequest,
    Report,
    SchemaError,
    check_payload,
    parse_report,
)
from agents.sim.cluster import FAILED, TENANT, SimCluster
from agents.sim.dataserver import SimDataPlane
from agents.sim.executor import SimAgents
from agents.sim.faults import FAULT_ACTIONS, Fault
from agents.sim.fleet import DEFAULT_OPTIONS, IDLE_MEM_BYTES, FleetSim, SimOptions
from agents.sim.scenario import Scenario
from agents.sim.workload import build_workload
from agents.sim.world import ADMIT_TIMEOUT_S  # a request waits this long with no plan to take it
from scheduler.hardware import gpu_spec
from scheduler.invariants import EventLog
from scheduler.topology import GpuState, LinkState, NodeState, Snapshot
from scheduler.transition import (
    CommandIntent,
    CommandKind,
    CommandStatus,
    Route,
    RoutingState,
    Step,
)

log = logging.getLogger("agents.sim")

AGENT_VERSION = "sim-3"
LOOKAHEAD_S = 60.0  # sim seconds of workload fed ahead of the clock once the scenario runs out
LIVE_RUN_ROUNDS = 4  # with a data plane: the longest analytic run of identical rounds (tokens stream, not burst)


# --- the cluster as a snapshot ---------------------------------------------------------------------
def sim_snapshot(cluster: SimCluster, now_s: float, used_extra: Mapping[str, int]) -> Snapshot:
    """What the agents of `cluster` report at `now_s`: every GPU ours and idle (plus `used_extra`
    bytes), whoever holds it (manage.py load_scenario_deployments places the baselines on it)."""
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


# --- the wire side of the agents -------------------------------------------------------------------
class HttpMailbox:
    """Agent protocol v1 on the fleet's side: commands the agents pulled, acks to send."""

    def __init__(self, links_of: Callable[[str], list[tuple[str, float]]] | None = None,
                 hints_to: Callable[[str, Mapping[str, object]], tuple[str, dict[str, object]]] | None = None
                 ) -> None:
        self.links_of = links_of  # node -> (peer, Gb/s): what a simulated link probe measures
        self.hints_to = hints_to  # (node, apply_hints payload) -> ack (detail, result): FleetSim.apply_hints
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
                check_payload(c.kind, c.payload)
            except SchemaError as exc:  # an unknown kind too, named "kind"
                self.ack(key, "failed", "; ".join(f"{k}: {v}" for k, v in exc.errors.items()), {"reason": "failed"})
                continue
            if c.kind == NodeCommandKind.PROBE_LINKS.value and self.links_of is not None:
                # a simulated probe measures the scenario's links (degradations included), as they are
                wanted = set(c.payload.get("peers") or {})
                got = [{"peer": p, "bw_gbps": bw, "measured_at": round(time.time(), 3), "method": "simulated"}
                       for p, bw in self.links_of(node_id) if p in wanted]
                self.ack(key, "ok", f"links measured: {len(got)} peer(s)", {"links": got})
                continue
            if c.kind == NodeCommandKind.APPLY_HINTS.value and self.hints_to is not None:
                detail, result = self.hints_to(node_id, c.payload)
                self.ack(key, "ok", detail, result)
                continue
            if c.kind in NODE_KINDS:
                # A simulated node holds no weights: nothing to hash (the registry records the failed check).
                self.ack(key, "failed", f"{c.kind}: model {c.payload.get('name')!r}: simulated node {node_id} holds "
                         "no weights to hash; ask a node that runs a real engine", {"reason": "failed"})
                continue
            kind = CommandKind(c.kind)
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


def register_request(cluster: SimCluster, node_id: str, data_addr: str | None = None,
                     plans: Sequence[str] = ()) -> RegisterRequest:
    """What a simulated node registers with: its GPUs, the plans it runs (FleetSim.plans_on), and
    the data plane's address when the fleet serves one (agents/sim/dataserver.py; every node
    shares it), else a name nothing answers at."""
    node = cluster.nodes[node_id]
    gpus = tuple(GpuInfo(g.uuid, g.index, g.model, gpu_spec(g.model).mem_bytes, g.nvlink_group)
                 for g in node.gpus)
    return RegisterRequest(node_id=node_id, hostname=f"{node_id}.sim", agent_version=AGENT_VERSION,
                           gpus=gpus, rack=node.spec.rack, backends=("sim",),
                           data_addr=data_addr or f"{node_id}.sim:7070", plans=tuple(sorted(plans)))


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
    return Fault(node=node, kind=kind, action=action, times=times)


class LiveFleet:
    """Runs every node's agent against one controller, on FleetSim (module docstring)."""

    def __init__(self, scenario: Scenario, controller: str, join_token: str, *,
                 report_interval_s: float | None = None, time_scale: float | None = None,
                 faults: Sequence[Fault] = (), long_poll_s: float | None = 10.0,
                 clock: Callable[[], float] = time.monotonic, routing_every_s: float = 0.5,
                 admit_timeout_s: float = ADMIT_TIMEOUT_S, tokenizer: str | None = None,
                 data_host: str = "127.0.0.1", data_port: int = 0, token_dir: Path | None = None) -> None:
        self.scenario = scenario
        self.token_dir = token_dir  # each agent keeps its own token here once enrolled (agents.client)
        self.controller = controller
        self.join_token = join_token
        self.time_scale = time_scale or scenario.time_scale
        self.clock = clock
        self.admit_timeout_s = admit_timeout_s
        self.agents: dict[str, SimAgent] = {}
        self.report_interval_s = report_interval_s
        self.long_poll_s = long_poll_s  # None: poll without waiting on every pass (tests)
        self.routing_every_s = routing_every_s
        self.t0 = clock()
        # admissions, finishes and failures (FleetSim) and plans prepared or released (SimAgents):
        # what scheduler.invariants.check reads for invariant 1
        self.log = EventLog(record_decodes=False)
        self.mailbox = HttpMailbox(links_of=lambda node: self.cluster.links_of(node),
                                   hints_to=lambda node, payload: self.sim.apply_hints(
                                       node, payload, ttl_scale=self.time_scale))
        self.routes: dict[str, RoutingState] = {}
        self._routes_wall = -math.inf
        # the simulator: no plan runs and nothing is routed until the controller commands it. With a
        # data plane, rounds are simulated a few at a time (not in long analytic runs), so a stream's
        # tokens come out as the simulator makes them rather than in bursts
        self.sim = FleetSim(scenario, options=SimOptions(max_run_rounds=LIVE_RUN_ROUNDS) if tokenizer else DEFAULT_OPTIONS)
        self.sim.events = self.log
        self.cluster: SimCluster = self.sim.cluster
        self.executor = SimAgents(self.sim, self._answer, log=self.log, faults=faults)
        self.sim.listener = self.executor.listener()  # engines up or stopped: the agents answer
        self.sim.feed(build_workload(scenario).arrivals)
        self._periods_fed = 1  # the workload repeats after duration_s (_feed_ahead)
        self._changes_seen = 0  # cluster changes of sim.change_log already logged
        self._gpu_util: dict[tuple[str, int], float] = {}  # (node, index) -> utilisation at the last reports
        self._stop = threading.Event()
        self._pulled: queue.Queue[tuple[str, list[Command]]] = queue.Queue()
        # the data plane the gateway streams tokens from (agents/sim/dataserver.py): every node's data address
        self.data: SimDataPlane | None = None
        if tokenizer:
            self.data = SimDataPlane(self.sim, tokenizer)
            self.data.serve(data_host, data_port)

    # -- time ------------------------------------------------------------------------------------
    def sim_time_s(self) -> float:
        return (self.clock() - self.t0) * self.time_scale

    def inject(self, fault: Fault) -> None:
        """Make the next matching command misbehave (what --fault does; SimAgents applies it)."""
        self.executor.inject(fault)

    def _agent(self, node_id: str) -> SimAgent:
        agent = self.agents.get(node_id)
        if agent is None:
            token_file = self.token_dir / f"{node_id}.token" if self.token_dir is not None else None
            agent = SimAgent(node_id, AgentClient(self.controller, self.join_token, token_file=token_file),
                             rng=random.Random(f"{self.scenario.seed}/{node_id}"))
            self.agents[node_id] = agent
        return agent

    def register(self, agent: SimAgent) -> None:
        server = self.data.server if self.data is not None else None
        resp = agent.client.register(register_request(self.cluster, agent.node_id,
                                                      server.address if server is not None else None,
                                                      plans=self.sim.plans_on(agent.node_id)))
        agent.epoch, agent.seq, agent.dirty = resp.epoch, 0, True
        if self.report_interval_s is None:
            self.report_interval_s = resp.report_interval_s
        log.info("%s registered (epoch %d)", agent.node_id, agent.epoch)
        if self.long_poll_s is not None and agent.poller is None:
            agent.poller = threading.Thread(target=self._poll_loop, args=(agent,), name=f"poll-{agent.node_id}",
                                            daemon=True)
            agent.poller.start()

    def step(self) -> None:
        """One pass: the simulator up to now (events, arrivals, serving), commands in, routing,
        acks out, reports."""
        self._feed_ahead(self.sim_time_s())
        self.sim.advance_to(max(self.sim.now_s, self.sim_time_s()))
        if self.data is not None:
            self.data.pump()
        now_s = self.sim.now_s
        expired = self.sim.expire_pending(self.admit_timeout_s)
        if expired:
            log.warning("t=%6.0fs %d request(s) failed: no plan took them within %g s", now_s, expired,
                        self.admit_timeout_s)
        for change in self.sim.change_log[self._changes_seen:]:
            log.info("t=%6.0fs %s", change.at_s, change.text)
            if change.node in self.agents:
                self.agents[change.node].dirty = True
        self._changes_seen = len(self.sim.change_log)
        for gone in [n for n in self.agents if n not in self.cluster.nodes]:
            agent = self.agents.pop(gone)
            agent.client.close()  # a node that left stops reporting (FleetSim stopped its plans)
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
        if wall - self._routes_wall >= self.routing_every_s:
            self._fetch_routing()
        self._take_pulled()
        self._carry_out()
        self._follow_routing()
        self._send_acks()
        interval = self.report_interval_s or 15.0
        due = [n for n in sorted(self.cluster.nodes) if self.agents[n].epoch
               and (self.agents[n].dirty or wall - self.agents[n].last_report_wall >= interval)]
        if due:
            # utilisation since the previous reports, once for every report of this pass
            self._gpu_util = {k: util for k, (_, util) in self.sim.gpu_load().items()}
        for node_id in due:
            agent = self.agents[node_id]
            try:
                self.report(agent, now_s)
            except ControllerError as exc:
                self._recover(agent, exc)
            except httpx.HTTPError as exc:
                log.warning("%s: controller unreachable (%s)", node_id, exc.__class__.__name__)
                agent.dirty = True

    def _feed_ahead(self, until_s: float) -> None:
        """A live fleet outlives its scenario: past duration_s the workload starts over (a fresh
        draw from the seed for each period, the same rates shifted by whole periods), so a
        console left running keeps seeing load. The events happen once."""
        period = self.scenario.duration_s
        while period > 0 and until_s + LOOKAHEAD_S >= self._periods_fed * period:
            k = self._periods_fed
            again = build_workload(replace(self.scenario, seed=self.scenario.seed + 7919 * k))
            self.sim.feed_more([replace(a, t_s=a.t_s + k * period) for a in again.arrivals])
            self._periods_fed += 1

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

    def _carry_out(self) -> None:
        """Hand every command the agents pulled to the simulated agents (a node that left answers
        nothing: the controller sees it gone)."""
        for node_id in sorted(self.cluster.nodes):
            for cmd in self.mailbox.take(node_id):
                self._execute(cmd)

    def _execute(self, cmd: CommandIntent) -> None:
        if cmd.kind in (CommandKind.FREEZE_PLAN, CommandKind.THAW_PLAN) and cmd.deployment_id in self.sim.deployments:
            # the table that froze (or thaws) the plan was committed before this command: follow
            # it first, so that routing does not undo what the command does
            self._fetch_routing()
            self._follow_routing()
        self.executor.execute(cmd)  # faults, idempotency, answered once: SimAgents

    def _answer(self, cmd: CommandIntent, ok: bool, detail: str, result: Mapping[str, object]) -> None:
        """SimAgents' ack, out over HTTP on the next pass."""
        if not ok:
            log.warning("%s: %s %s failed: %s", cmd.node_id, cmd.key, cmd.kind.value, detail[:80])
        self.mailbox.ack(cmd.key, "ok" if ok else "failed", detail, dict(result))

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

    # -- routing -----------------------------------------------------------------------------------
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

    def _follow_routing(self) -> None:
        """FleetSim routes as the controller's tables say: a plan with weight > 0, not frozen,
        takes new requests (executor.TransitionDriver._follow_routing does the same in memory).
        Compared with what FleetSim routes now, not with the last table: an engine that came up
        (or was relaunched) after its table arrived joins, and one the fleet stopped routing to
        comes back when the table says so."""
        for name, table in self.routes.items():
            if name not in self.sim.deployments:
                continue  # a deployment this scenario does not serve
            want: dict[int, float] = {}
            for route in table.routes:
                engine = self.sim.engine_of(name, route.plan_id)
                if engine is not None and route.weight > 0 and not route.frozen:
                    # times the global correction's live multiplier for the plan (agents/sim/hints.py)
                    want[engine.engine_id] = max(float(route.weight) * self.sim.hinted_weight(name, route.plan_id),
                                                 1e-9)
            now = {e.engine_id: e.weight for e in self.sim.plans(name) if e.accepting}
            if now != want or self.sim.deployments[name].routing_version != table.version:
                self.sim.set_routing(name, want, table.version)  # the version: what new leases carry

    # -- reports -----------------------------------------------------------------------------------
    def report(self, agent: SimAgent, now_s: float) -> None:
        agent.seq += 1
        node_id = agent.node_id
        body = Report(
            node_id=node_id,
            epoch=agent.epoch,
            seq=agent.seq,
            gpus=tuple(self.gpu_reports(node_id, agent.rng)),
            links=tuple(LinkReport(peer, bw, measured_at=round(time.time(), 3), method="simulated")
                        for peer, bw in self.cluster.links_of(node_id)),
            # what runs on its GPUs: a plan a failure stopped is not listed, even once they are back
            plans=tuple(sorted(self.sim.plans_on(node_id))),
        ).to_dict()
        # the plans this node leads, from their PlanEngines, since this node's previous report
        body["engines"] = [asdict(m.report) for m in self.sim.engine_reports(leader=node_id)]
        agent.client.report(parse_report(body))
        agent.dirty = False
        agent.last_report_wall = self.clock()
        agent.last_report_sim = now_s

    def gpu_reports(self, node_id: str, rng: random.Random) -> list[GpuReport]:
        snap = self.sim.snapshot()
        reports: list[GpuReport] = []
        for g in self.cluster.nodes[node_id].gpus:
            total = gpu_spec(g.model).mem_bytes
            state = snap.gpu_by_uuid.get(g.uuid)
            if g.owner == TENANT:
                used, util = int(self.sim.tenant_fraction[(node_id, g.index)] * total), rng.uniform(0.3, 0.9)
            else:
                # weights plus KV reserve of the plans on it (FleetSim's footprint), or an idle context
                used = state.mem_used_bytes if state is not None and state.schedulable else IDLE_MEM_BYTES
                util = self._gpu_util.get((node_id, g.index), 0.0) if g.owner != FAILED else 0.0
            reports.append(GpuReport(
                uuid=g.uuid, mem_used_bytes=min(total, used), mem_total_bytes=total, sm_util=round(util, 3),
                temperature_c=round(32.0 + 50.0 * util, 1), healthy=g.owner != FAILED, allocatable=g.owner != TENANT,
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

    @property
    def streaming(self) -> bool:
        """The gateway has a stream open on the data plane (the caller steps more often meanwhile)."""
        return self.data is not None and self.data.streaming

    def close(self) -> None:
        self._stop.set()
        if self.data is not None:
            self.data.close()
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


__all__ = ["ADMIT_TIMEOUT_S", "HttpMailbox", "IDLE_MEM_BYTES", "LiveFleet", "parse_fault", "register_request",
           "sim_snapshot", "wait_for_controller"]
