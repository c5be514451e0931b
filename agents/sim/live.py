"""The live simulated fleet: one agent per scenario node, over real HTTP with real tokens.

It advances the scenario on wall-clock time x `time_scale`, applies its events to the
simulated cluster (agents.sim.cluster), and has each node's agent register and report what it
would see: which GPUs are ours, healthy and allocatable, their memory and utilisation, and the
bandwidth to its peers. An agent reports at once when its node changed, else every interval.

Load model (until plans are commanded by the controller): each deployment runs its baseline
plan on the GPUs of its scenario nodes. A plan GPU holds its stage's weights plus the KV cache
its share of the current load keeps busy; utilisation follows the arrival rate against the
deployment's peak. A plan that lost a GPU stops (a static plan cannot reshape itself), so its
other GPUs fall idle until the GPUs come back. GPUs held by another tenant show that tenant's
memory use, drawn per GPU from the seed.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field

import httpx

from agents.client import AgentClient, ControllerError
from agents.protocol import GpuInfo, GpuReport, LinkReport, RegisterRequest, Report
from agents.sim.cluster import TENANT, SimCluster
from agents.sim.scenario import ModelDeploymentSpec, Scenario, baseline_stage_nodes
from scheduler.hardware import gpu_spec
from scheduler.modelspec import model_spec

log = logging.getLogger("agents.sim")

AGENT_VERSION = "sim-1"
IDLE_MEM_BYTES = 600 * 2**20  # a CUDA context with nothing loaded holds about this much
KV_RESERVE_FRACTION = 0.90  # like vLLM's gpu_memory_utilization: the KV pool fills up to here


@dataclass
class PlacedStage:
    node_id: str
    gpu_indexes: tuple[int, ...]
    weight_bytes_per_gpu: int


@dataclass
class PlacedPlan:
    deployment: ModelDeploymentSpec
    stages: list[PlacedStage]
    peak_rps: float
    running: bool = True


@dataclass
class SimAgent:
    node_id: str
    client: AgentClient
    epoch: int = 0
    seq: int = 0
    last_report_wall: float = 0.0
    dirty: bool = True
    after_command: int = 0
    rng: random.Random = field(default_factory=random.Random)


def place_baselines(scenario: Scenario, cluster: SimCluster) -> list[PlacedPlan]:
    """Each deployment's baseline plan on the first free GPUs of its nodes, in pipeline order."""
    plans: list[PlacedPlan] = []
    taken: dict[str, set[int]] = {}
    for dep in scenario.models:
        base = dep.baseline
        free = {n: len([g for g in cluster.our_gpus(n) if g.index not in taken.get(n, set())])
                for n in base.nodes}
        stage_nodes = baseline_stage_nodes(base, free)
        if stage_nodes is None:
            log.warning("%s: baseline does not fit on %s", dep.deployment, ", ".join(base.nodes))
            continue
        model = model_spec(dep.model)
        per_stage = [model.num_layers // base.pp + (1 if i < model.num_layers % base.pp else 0)
                     for i in range(base.pp)]
        stages: list[PlacedStage] = []
        start = 0
        for node_id, n_layers in zip(stage_nodes, per_stage, strict=True):
            used = taken.setdefault(node_id, set())
            idx = tuple(g.index for g in cluster.our_gpus(node_id) if g.index not in used)[: base.tp]
            used.update(idx)
            stage_bytes = model.stage_weight_bytes(start, start + n_layers)
            stages.append(PlacedStage(node_id, idx, stage_bytes // base.tp))
            start += n_layers
        peak = max((w.max_rate_rps() for w in scenario.workload if w.deployment == dep.deployment), default=1.0)
        plans.append(PlacedPlan(dep, stages, max(peak, 1e-9)))
    return plans


class LoadModel:
    """Memory and utilisation of every GPU at a simulated time (see the module docstring)."""

    def __init__(self, scenario: Scenario, cluster: SimCluster) -> None:
        self.scenario = scenario
        self.cluster = cluster
        self.plans = place_baselines(scenario, cluster)
        seed_rng = random.Random(scenario.seed ^ 0x5EED)
        # Another tenant's memory use per GPU: fixed per GPU for the whole run.
        self.tenant_fraction = {
            (n.id, i): seed_rng.uniform(0.55, 0.95) for n in scenario.all_nodes() for i in range(n.gpus)
        }

    def gpu_load(self, t_s: float) -> dict[tuple[str, int], tuple[float, float]]:
        """(node, index) -> (memory used fraction, sm utilisation) for every plan GPU now running."""
        out: dict[tuple[str, int], tuple[float, float]] = {}
        for plan in self.plans:
            gpus = [(s.node_id, i) for s in plan.stages for i in s.gpu_indexes]
            plan.running = all(self._ours(n, i) for n, i in gpus)
            if not plan.running:
                continue
            rate = sum(w.rate_rps(t_s) for w in self.scenario.workload if w.deployment == plan.deployment.deployment)
            load = min(1.0, rate / plan.peak_rps)
            for stage in plan.stages:
                for i in stage.gpu_indexes:
                    total = gpu_spec(self.cluster.nodes[stage.node_id].spec.gpu).mem_bytes
                    weights = min(1.0, stage.weight_bytes_per_gpu / total)
                    kv = max(0.0, KV_RESERVE_FRACTION - weights) * (0.25 + 0.75 * load)
                    out[(stage.node_id, i)] = (min(1.0, weights + kv), 0.1 + 0.85 * load)
        return out

    def _ours(self, node_id: str, index: int) -> bool:
        node = self.cluster.nodes.get(node_id)
        return node is not None and node.gpus[index].ours


def gpu_reports(cluster: SimCluster, load: dict[tuple[str, int], tuple[float, float]], node_id: str,
                tenant_fraction: dict[tuple[str, int], float], rng: random.Random) -> list[GpuReport]:
    reports: list[GpuReport] = []
    for g in cluster.nodes[node_id].gpus:
        total = gpu_spec(g.model).mem_bytes
        if g.owner == TENANT:
            used_frac, util = tenant_fraction[(node_id, g.index)], rng.uniform(0.3, 0.9)
        elif (node_id, g.index) in load:
            used_frac, util = load[(node_id, g.index)]
            util = min(1.0, max(0.0, util + rng.uniform(-0.04, 0.04)))
        else:
            used_frac, util = IDLE_MEM_BYTES / total, 0.0
        reports.append(GpuReport(
            uuid=g.uuid,
            mem_used_bytes=min(total, int(used_frac * total)),
            mem_total_bytes=total,
            sm_util=round(util, 3),
            temperature_c=round(32.0 + 50.0 * util, 1),
            healthy=g.owner != "failed",
            allocatable=g.owner != TENANT,
            xid_errors=g.xid_errors,
            ecc_errors=g.ecc_errors,
        ))
    return reports


def register_request(cluster: SimCluster, node_id: str) -> RegisterRequest:
    node = cluster.nodes[node_id]
    gpus = tuple(GpuInfo(g.uuid, g.index, g.model, gpu_spec(g.model).mem_bytes, g.nvlink_group)
                 for g in node.gpus)
    return RegisterRequest(node_id=node_id, hostname=f"{node_id}.sim", agent_version=AGENT_VERSION,
                           gpus=gpus, rack=node.spec.rack, backends=("sim",))


class LiveFleet:
    """Runs every node's agent against one controller."""

    def __init__(self, scenario: Scenario, controller: str, join_token: str, *,
                 report_interval_s: float | None = None, time_scale: float | None = None) -> None:
        self.scenario = scenario
        self.controller = controller
        self.join_token = join_token
        self.time_scale = time_scale or scenario.time_scale
        self.cluster = SimCluster(scenario, random.Random(scenario.seed))
        self.load = LoadModel(scenario, self.cluster)
        self.agents: dict[str, SimAgent] = {}
        self.report_interval_s = report_interval_s
        self.t0 = time.monotonic()

    def sim_time_s(self) -> float:
        return (time.monotonic() - self.t0) * self.time_scale

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

    def step(self) -> None:
        """One pass: advance the scenario, then let every due agent register or report."""
        now_s = self.sim_time_s()
        for change in self.cluster.advance_to(now_s):
            log.info("t=%6.0fs %s", change.at_s, change.text)
            if change.node in self.agents:
                self.agents[change.node].dirty = True
        for gone in [n for n in self.agents if n not in self.cluster.nodes]:
            self.agents.pop(gone).client.close()  # a node that left stops reporting
        load = self.load.gpu_load(now_s)
        wall = time.monotonic()
        for node_id in sorted(self.cluster.nodes):
            agent = self._agent(node_id)
            try:
                if agent.epoch == 0:
                    self.register(agent)
                interval = self.report_interval_s or 15.0
                if agent.dirty or wall - agent.last_report_wall >= interval:
                    self.report(agent, load)
            except ControllerError as exc:
                self._recover(agent, exc)
            except httpx.HTTPError as exc:
                # The controller is restarting or unreachable: try again on the next pass.
                log.warning("%s: controller unreachable (%s)", node_id, exc.__class__.__name__)
                agent.dirty = True

    def report(self, agent: SimAgent, load: dict[tuple[str, int], tuple[float, float]]) -> None:
        agent.seq += 1
        node_id = agent.node_id
        report = Report(
            node_id=node_id,
            epoch=agent.epoch,
            seq=agent.seq,
            gpus=tuple(gpu_reports(self.cluster, load, node_id, self.load.tenant_fraction, agent.rng)),
            links=tuple(LinkReport(peer, bw) for peer, bw in self.cluster.links_of(node_id)),
        )
        agent.client.report(report)
        agent.dirty = False
        agent.last_report_wall = time.monotonic()

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
        for agent in self.agents.values():
            agent.client.close()


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
