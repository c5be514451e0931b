"""The simulated fleet as a test's or a bench's world: a `FleetSim` built from a cluster
`scheduler.topology.Snapshot`, playing every node's agent through a command mailbox.

`SimWorld` is the one simulator (agents/sim/fleet.py: its engines, gateway, hand-overs and
cluster changes; agents/sim/simagents.py: agent protocol v1's transition commands) seen the way
a transition's surroundings see it:

* the cluster is the snapshot's - its nodes, racks, links (their bandwidth), GPU uuids ("a1-g0")
  and memory; GPUs it reports unhealthy are failed, unschedulable ones another tenant's;
* commands come from a `Mailbox` (`take(node)`, `ack(key, ...)`: scheduler.transition_memory's
  in-memory agents, or the console's AgentCommand rows) and are carried out by `SimAgents`;
* the gateway routes as the committed routing table says (`routing_fn`: weight > 0 and not
  frozen takes new requests, under the table's version as the lease), refuses a request at the
  door when that table has nowhere to send it, and fails one that waited `admit_timeout_s`
  with no serving plan;
* every request's life (agents/sim/seqlog.py) and every plan prepared, released or aborted goes
  to one `scheduler.invariants.EventLog`, stamped `start_s` later than the simulator's own clock
  (a world on the wall clock: its events merge in time order with the console's).

Time moves only in `advance_to`: the simulator runs up to then, and only then are the routing
table followed and the commands sent so far taken - what they do is stamped no earlier than
when they were sent. Deterministic: no wall clock is read, ties come from the seed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol

from agents.sim.cluster import FAILED, TENANT, US
from agents.sim.engine import PlanEngine
from agents.sim.faults import Fault
from agents.sim.fleet import FleetSim
from agents.sim.scenario import LinkSpec, NetworkSpec, NodeSpec, Scenario
from agents.sim.simagents import SimAgents, StallSample, engine_sequences
from scheduler.costmodel import Slo
from scheduler.invariants import EventLog, LogEvent
from scheduler.modelspec import ModelSpec, model_spec
from scheduler.plan import Plan
from scheduler.topology import Snapshot
from scheduler.transition import (
    DEFAULT_TRANSITION_CONFIG,
    CommandIntent,
    CommandStatus,
    RoutingState,
    TransitionConfig,
)

# a deployment seeded without an SLO (a test's, a bench's): a stated default, it only sets what
# the simulator's accounting counts as on time
DEFAULT_SLO = Slo(ttft_ms=2000.0, tpot_ms=100.0)
ADMIT_TIMEOUT_S = 120.0  # sim seconds a request may wait with no serving plan (the live fleet's too)


class Mailbox(Protocol):
    """Where the agents' commands come from and their answers go (scheduler.transition_memory.
    InMemoryAgents, or any mailbox of the same shape)."""

    def take(self, node_id: str) -> list[CommandIntent]: ...

    def ack(self, key: str, status: CommandStatus, detail: str = "",
            result: Mapping[str, object] | None = None) -> None: ...


def scenario_of(snapshot: Snapshot, *, name: str = "world", seed: int = 0) -> Scenario:
    """The scenario of a snapshot's cluster: its nodes (one GPU model each), racks and links, no
    deployments, no workload, no events (a world's changes are injected)."""
    nodes: list[NodeSpec] = []
    for n in snapshot.nodes:
        gpus = sorted((g for g in snapshot.gpus if g.node_id == n.id), key=lambda g: g.index)
        models = {g.model for g in gpus}
        if len(models) > 1:
            raise ValueError(f"snapshot.gpus: node {n.id} mixes GPU models {sorted(models)}; one per node")
        if [g.index for g in gpus] != list(range(len(gpus))):
            raise ValueError(f"snapshot.gpus: node {n.id}'s GPU indexes must be 0..{len(gpus) - 1}")
        if gpus:
            nodes.append(NodeSpec(n.id, gpus[0].model, len(gpus), any(g.nvlink_group for g in gpus), n.rack,
                                  len(gpus)))
    links = tuple(LinkSpec(lk.a, lk.b, lk.bw_gbps) for lk in snapshot.links)
    return Scenario(name=name, seed=seed, duration_s=0.0, time_scale=1.0, nodes=tuple(nodes),
                    network=NetworkSpec(snapshot.intra_rack_gbps, snapshot.inter_rack_gbps, links),
                    models=(), workload=())


@dataclass
class _Shifted(EventLog):
    """Another log's view, its events stamped `offset_s` later (the world's clock)."""

    inner: EventLog = field(default_factory=EventLog)
    offset_s: float = 0.0

    def add(self, event: LogEvent) -> None:
        self.inner.add(replace(event, t_s=event.t_s + self.offset_s))


class SimWorld:
    """A FleetSim over a snapshot's cluster, its agents fed by a mailbox (module docstring)."""

    def __init__(self, base: Snapshot, mailbox: Mailbox, routing_fn: Callable[[str], RoutingState],
                 log: EventLog, *, seed: int = 0, start_s: float = 0.0,
                 config: TransitionConfig = DEFAULT_TRANSITION_CONFIG,
                 admit_timeout_s: float = ADMIT_TIMEOUT_S) -> None:
        self.mailbox = mailbox
        self.routing_fn = routing_fn
        self.log = log
        self.start_s = start_s
        self.admit_timeout_s = admit_timeout_s
        self.sim = FleetSim(scenario_of(base, seed=seed), gpu_uuids={(g.node_id, g.index): g.uuid for g in base.gpus},
                            gpu_mem_bytes={g.uuid: g.mem_total_bytes for g in base.gpus})
        events = log if start_s == 0 else _Shifted(record_decodes=log.record_decodes, inner=log, offset_s=start_s)
        self.sim.events = self.events = events
        self.agents = SimAgents(self.sim, self._ack, config=config, log=events)
        self.sim.listener = self.agents.listener()
        self.dead: set[str] = set()  # nodes whose agent died (lose_node)
        self.rejected = 0  # requests refused at the door (the routing table had nowhere to send them)
        self._followed: dict[str, tuple[object, ...]] = {}  # deployment -> (version, engines) routed
        self.sim.set_gpu_owner([g.uuid for g in base.gpus if not g.healthy], FAILED)
        self.sim.set_gpu_owner([g.uuid for g in base.gpus if g.healthy and not g.schedulable], TENANT)

    # -- the world seen from outside ------------------------------------------------------------
    @property
    def now_s(self) -> float:
        return self.sim.now_s + self.start_s

    def snapshot(self) -> Snapshot:
        """The cluster as its agents report it: a node whose agent died is no longer schedulable."""
        snap = self.sim.snapshot()
        nodes = tuple(replace(n, schedulable=n.schedulable and n.id not in self.dead, last_seen_s=self.now_s)
                      for n in snap.nodes)
        return replace(snap, now_s=self.now_s, nodes=nodes,
                       gpus=tuple(replace(g, last_seen_s=self.now_s) for g in snap.gpus))

    @property
    def stalls(self) -> list[StallSample]:
        """Every hand-over done so far: how long each sequence stood still."""
        return self.agents.stalls

    def engine(self, deployment: str, plan_id: str) -> PlanEngine | None:
        """The plan's engine while it holds its GPUs (loading, serving, draining), else None."""
        return self.sim.engine_of(deployment, plan_id) if deployment in self.sim.deployments else None

    def sequences(self, deployment: str, plan_id: str) -> set[str]:
        """The ids of the requests the plan holds now (running, waiting, or landing on it)."""
        engine = self.engine(deployment, plan_id)
        return {str(req.rid) for req, _ in engine_sequences(engine)} if engine is not None else set()

    def live_plans(self) -> set[str]:
        """Plans that hold GPUs now (loading, serving or draining)."""
        return {e.plan.plan_id for e in self.sim.live.values()}

    def open_sequences(self) -> int:
        """Requests admitted that have neither finished nor failed."""
        return len(self.sim.in_system)

    # -- what happens to it ---------------------------------------------------------------------
    def add_deployment(self, deployment: str, model: ModelSpec, slo: Slo = DEFAULT_SLO) -> None:
        """A deployment these agents run (as if configured with it), for prepares that carry no
        model_spec or SLO of their own (the in-memory executor's)."""
        self.sim.add_deployment(deployment, model, slo)

    def seed_plan(self, plan: Plan, deployment: str, *, model: ModelSpec | None = None,
                  slo: Slo = DEFAULT_SLO) -> PlanEngine:
        """`plan` serves for `deployment` now, as if a past transition had prepared it; it takes
        requests as the routing table says."""
        self.add_deployment(deployment, model or model_spec(plan.model), slo)
        engine = self.sim.launch(deployment, plan, source="warm", accepting=False)
        for node in dict.fromkeys(self.sim.plan_nodes(plan)):
            self.events.add(LogEvent(self.sim.now_s, "plan_prepared", node=node, plan_id=plan.plan_id))
        self._follow()
        return engine

    def inject(self, fault: Fault) -> None:
        """Make the next matching commands misbehave (agents/sim/faults.py)."""
        self.agents.inject(fault)

    def lose_gpus(self, uuids: Sequence[str], how: Literal["tenant", "failed"] = "tenant") -> None:
        """Another tenant takes these GPUs (or they fail): the plans on them stop now."""
        self.sim.set_gpu_owner(uuids, TENANT if how == "tenant" else FAILED)

    def restore_gpus(self, uuids: Sequence[str]) -> None:
        """These GPUs are ours again."""
        self.sim.set_gpu_owner(uuids, US)

    def lose_node(self, node_id: str) -> None:
        """The node's agent dies: it answers nothing more, its node is no longer schedulable, and
        the sequences of the plans on its GPUs end with an explicit error."""
        self.dead.add(node_id)
        self.agents.lose_node(node_id)

    def submit(self, deployment: str, prompt_tokens: int, max_tokens: int) -> str | None:
        """Admit a request if the routing table has somewhere to send it: its id, else None."""
        table = self.routing_fn(deployment)
        if deployment not in self.sim.deployments or not any(r.weight > 0 and not r.frozen for r in table.routes):
            self.rejected += 1
            return None
        self._follow()
        return str(self.sim.submit(deployment, max(1, prompt_tokens), max(1, max_tokens)))

    def advance_to(self, t_s: float) -> None:
        """Run the simulator up to `t_s` (the world's clock), then follow the routing table and
        carry out the commands sent so far."""
        self.sim.advance_to(max(self.sim.now_s, t_s - self.start_s))
        self.sim.expire_pending(self.admit_timeout_s)
        self._follow()
        for node in sorted(self.sim.cluster.nodes):
            if node in self.dead:
                continue
            for cmd in self.mailbox.take(node):
                self.agents.execute(cmd)
        self._follow()

    # -- inside -------------------------------------------------------------------------------------
    def _follow(self) -> None:
        """The simulator routes as each deployment's committed table says (weight > 0, not frozen)."""
        for deployment in list(self.sim.deployments):
            table = self.routing_fn(deployment)
            weights: dict[int, float] = {}
            for route in table.routes:
                engine = self.sim.engine_of(deployment, route.plan_id)
                if engine is not None and route.weight > 0 and not route.frozen:
                    weights[engine.engine_id] = route.weight
            key = (table.version, tuple(sorted(weights.items())))
            if self._followed.get(deployment) != key:
                self._followed[deployment] = key
                self.sim.set_routing(deployment, weights, table.version)

    def _ack(self, cmd: CommandIntent, ok: bool, detail: str, result: Mapping[str, object]) -> None:
        self.mailbox.ack(cmd.key, "ok" if ok else "failed", detail, dict(result))


__all__ = ["ADMIT_TIMEOUT_S", "DEFAULT_SLO", "Mailbox", "SimWorld", "scenario_of"]
