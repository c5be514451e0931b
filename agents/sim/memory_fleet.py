"""A simulated fleet that obeys agent protocol v1's transition commands, on a virtual clock.

One `MemoryFleet` plays every node's agent and engines, and a gateway in front of them:

* **Agents** execute `prepare_plan`, `abort_plan`, `freeze_plan`, `thaw_plan`,
  `move_sequences` and `release_plan` (agents/protocol.py) with modelled durations, and refuse
  a `prepare_plan` as the real daemon does - a plan that would book more than 92% of a GPU
  beside what holds it, or one the node's engine cannot run: weight
  loading, KV migration over the link at the capped bandwidth, replay (re-prefill) on the
  target plan. A command is answered once, when it is done; a command with a key it has seen
  is not run twice. A model is sized by the shape its `prepare_plan` carries (`model_spec`: the
  one the controller booked it with), or by `models` (the catalog) for a prepare without one.
* **Engines** (one per prepared plan, on its leader: the node of its first stage) batch
  sequences continuously: each running sequence gains a token per decode iteration, whose
  length the `Timing` gives for the batch. A sequence holds a lease (plan_id, routing
  version): a hand-over pauses it at the end of its decode iteration (idle ones at once),
  moves it, and the target accepts it only with a newer lease.
* **The gateway** admits requests and routes each with the one request router
  (scheduler.router, as console/gateway does) among the routing table's plans that can take it
  now (not frozen, weight > 0, prepared on their leader); when no plan accepts it holds the
  request and tries again, and fails it explicitly after `admit_timeout_s`.

Everything it does goes to an `EventLog`, so `scheduler.invariants.check` can verify
invariants 1-2 over it (and 3 with the in-memory ports' log). Faults - a command that fails,
hangs, or loses its GPUs half way - are injected with `agents.sim.faults.Fault`, which
`agents.sim.executor.SimAgents` (on FleetSim) applies the same way. Deterministic: time is injected, randomness comes from the seeded `rng`.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol

from agents.protocol import prepare_shape
from agents.shadow_check import tokenizer_problem
from agents.sim.faults import Fault, lost_gpus, take_fault, through_fault
from agents.sim.simagents import StallSample
from scheduler.booking import REFUSAL_REASON, plan_memory, refuse_booking
from scheduler.capabilities import plan_refusals
from scheduler.costmodel import DEFAULT_EFFICIENCY, Efficiency, PlanProfile, kv_route
from scheduler.invariants import EventLog, LogEvent
from scheduler.modelspec import ModelSpec, model_spec
from scheduler.plan import Plan
from scheduler.router import PlanFacts, PlanLoad, Pool, Router, RouteRequest, RoutingPolicy, plan_facts
from scheduler.topology import Snapshot
from scheduler.transition import CommandIntent, CommandKind, CommandStatus, Route, RoutingState

MAX_RUNNING_SEQS = 256
WARMUP_S = 1.0  # stated: CUDA graph capture and a first batch on a freshly loaded plan


class Mailbox(Protocol):
    """Where the agents' commands come from and their answers go (scheduler.transition_memory.
    InMemoryAgents in memory, or any mailbox of the same shape)."""

    def take(self, node_id: str) -> list[CommandIntent]: ...

    def ack(self, key: str, status: CommandStatus, detail: str = "",
            result: Mapping[str, object] | None = None) -> None: ...


# --- timing --------------------------------------------------------------------------------------
class Timing(Protocol):
    """How long things take in the simulated fleet."""

    def prepare_s(self, plan: Plan, node_id: str) -> float: ...

    def decode_step_s(self, plan: Plan, running: int, context_tokens: int) -> float: ...

    def prefill_s(self, plan: Plan, tokens: int) -> float: ...

    def kv_bytes(self, src: Plan, dst: Plan, context_tokens: int) -> int: ...

    def migrate_s(self, src: Plan, dst: Plan, context_tokens: int, bw_cap_bytes_per_s: float) -> float: ...


@dataclass(frozen=True)
class FixedTiming:
    """Constant durations, for tests that care about order, not speed."""

    prepare: float = 1.0
    decode_step: float = 0.02
    prefill_per_token: float = 1e-4
    kv_bytes_per_token: int = 131072
    migrate_per_token: float = 2e-5

    def prepare_s(self, plan: Plan, node_id: str) -> float:
        return self.prepare

    def decode_step_s(self, plan: Plan, running: int, context_tokens: int) -> float:
        return self.decode_step

    def prefill_s(self, plan: Plan, tokens: int) -> float:
        return tokens * self.prefill_per_token

    def kv_bytes(self, src: Plan, dst: Plan, context_tokens: int) -> int:
        return context_tokens * self.kv_bytes_per_token

    def migrate_s(self, src: Plan, dst: Plan, context_tokens: int, bw_cap_bytes_per_s: float) -> float:
        t = context_tokens * self.migrate_per_token
        if bw_cap_bytes_per_s > 0:
            t = max(t, self.kv_bytes(src, dst, context_tokens) / bw_cap_bytes_per_s)
        return t


class CostModelTiming:
    """Durations from scheduler.costmodel on the fleet's snapshot (the roofline model)."""

    def __init__(self, snapshot_fn: Callable[[], Snapshot], *, models: Callable[[str], ModelSpec] = model_spec,
                 eff: Efficiency = DEFAULT_EFFICIENCY, warmup_s: float = WARMUP_S) -> None:
        self.snapshot_fn = snapshot_fn
        self.models = models
        self.eff = eff
        self.warmup_s = warmup_s
        self._profiles: dict[str, PlanProfile] = {}

    def profile(self, plan: Plan) -> PlanProfile:
        hit = self._profiles.get(plan.plan_id)
        if hit is None:
            hit = PlanProfile.build(plan, self.models(plan.model), self.snapshot_fn(), self.eff)
            self._profiles[plan.plan_id] = hit
        return hit

    def prepare_s(self, plan: Plan, node_id: str) -> float:
        """Weights from host memory over each GPU's host link (in parallel), then a warm-up."""
        model = self.models(plan.model)
        snap = self.snapshot_fn()
        worst = 0.0
        for st in plan.all_stages:
            shard = -(-model.stage_weight_bytes(st.layer_start, st.layer_end) // st.tp)
            for u in st.gpu_uuids:
                g = snap.gpu_by_uuid.get(u)
                if g is None or g.node_id != node_id:
                    continue
                bw = snap.spec_of(u).host_link_bytes_per_s * self.eff.link_efficiency
                worst = max(worst, shard / bw)
        return worst + self.warmup_s

    def decode_step_s(self, plan: Plan, running: int, context_tokens: int) -> float:
        return self.profile(plan).pipeline("decode").decode_step_s(max(1, running), max(1, context_tokens))

    def prefill_s(self, plan: Plan, tokens: int) -> float:
        return self.profile(plan).pipeline("prefill").prefill_time_s(max(1, tokens))

    def _route(self, src: Plan, dst: Plan) -> tuple[float, float, int]:
        snap = self.snapshot_fn()
        model = self.models(src.model)
        s = src.decode_stages if src.mode == "disaggregated" else src.stages
        d = dst.decode_stages if dst.mode == "disaggregated" else dst.stages
        r = kv_route(s, d, model, snap, self.eff)
        return r.latency_s, r.s_per_token, r.bytes_per_token

    def kv_bytes(self, src: Plan, dst: Plan, context_tokens: int) -> int:
        return self._route(src, dst)[2] * context_tokens

    def migrate_s(self, src: Plan, dst: Plan, context_tokens: int, bw_cap_bytes_per_s: float) -> float:
        latency, s_per_token, bytes_per_token = self._route(src, dst)
        if bytes_per_token == 0:
            return 0.0
        per_token = s_per_token
        if bw_cap_bytes_per_s > 0:
            per_token = max(per_token, bytes_per_token / bw_cap_bytes_per_s)
        return latency + context_tokens * per_token


# --- state -------------------------------------------------------------------------------------
SeqState = Literal["queued", "waiting", "prefill", "running", "pausing", "paused", "done"]


@dataclass
class SimSeq:
    """One request's sequence."""

    seq_id: str
    deployment: str
    prompt_tokens: int
    max_tokens: int
    admitted_s: float
    generated: float = 0.0  # tokens generated (fractional inside an iteration)
    plan_id: str = ""  # its owner (lease)
    lease: int = -1  # routing version of its lease
    state: SeqState = "queued"
    ready_s: float = 0.0  # prefill/replay done at (state prefill)
    kv_lost: bool = False
    keep: bool = False  # told to finish where it is
    first_token_s: float | None = None
    last_progress_s: float = 0.0
    paused_s: float | None = None
    boundary: str = ""  # where it was paused for a hand-over: decode_end | idle

    @property
    def context_tokens(self) -> int:
        return self.prompt_tokens + int(self.generated)


InstanceState = Literal["preparing", "ready", "frozen", "draining", "broken", "released", "aborted"]


@dataclass
class Instance:
    """A plan on one node (the leader's instance also runs its engine and holds its sequences)."""

    plan: Plan
    node: str
    leader: bool
    state: InstanceState
    ready_s: float
    reserved: dict[str, int] = field(default_factory=dict)
    deployment: str = ""  # whose plan it is: commands for another deployment's plan leave it alone
    seqs: dict[str, SimSeq] = field(default_factory=dict)
    prefill_free_s: float = 0.0
    # counters for engine reports, reset by `engine_reports`
    arrivals: int = 0
    finished: int = 0
    tokens: float = 0.0
    prompt_sum: int = 0
    output_sum: int = 0
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)


@dataclass
class Node:
    node_id: str
    alive: bool = True
    instances: dict[str, Instance] = field(default_factory=dict)
    link_busy: bool = False  # a migration holds its outgoing KV link (they go one at a time)


@dataclass
class _Job:
    cmd: CommandIntent
    started_s: float
    fault: Fault | None = None
    done: bool = False
    moves: list[dict[str, object]] = field(default_factory=list)
    results: list[dict[str, object]] = field(default_factory=list)
    active: int = 0  # moves in flight


class MemoryFleet:
    """Every agent, engine and the gateway of a simulated cluster (module docstring)."""

    def __init__(self, base: Snapshot, mailbox: Mailbox, routing_fn: Callable[[str], RoutingState],
                 log: EventLog, *, rng: random.Random, timing: Timing | None = None,
                 models: Callable[[str], ModelSpec] = model_spec, max_dt_s: float = 0.05,
                 admit_timeout_s: float = 120.0, stuck_timeout_s: float = 300.0, start_s: float = 0.0,
                 router: RoutingPolicy | None = None) -> None:
        self.base = base
        self.mailbox = mailbox
        self.routing_fn = routing_fn
        self.log = log
        self.rng = rng
        self.router: RoutingPolicy = router or Router(rng=rng)  # ties between equal plans drawn from `rng`
        self._facts: dict[str, PlanFacts] = {}  # plan id -> its router facts (plans are immutable)
        self._pools: dict[tuple[object, ...], Pool] = {}
        self._given = models  # a model's spec when no prepare carried one
        self._shapes: dict[str, ModelSpec] = {}  # model name -> the model_spec its prepares carry
        self.models: Callable[[str], ModelSpec] = self._model
        self.timing: Timing = timing or CostModelTiming(self.snapshot, models=self._model)
        self.max_dt_s = max_dt_s
        self.admit_timeout_s = admit_timeout_s
        self.stuck_timeout_s = stuck_timeout_s
        self.now_s = start_s
        self.nodes: dict[str, Node] = {n.id: Node(n.id) for n in base.nodes}
        self.lost: dict[str, str] = {}  # gpu uuid -> "tenant" | "failed"
        self.faults: list[Fault] = []
        self.jobs: dict[str, _Job] = {}
        self.queue: list[SimSeq] = []  # admitted by the gateway, no plan has taken them yet
        self.stalls: list[StallSample] = []
        self.rejected = 0  # requests refused at the door (nothing to route to)
        self.refused_prepares = 0  # PREPAREs refused: the engine cannot run the plan, or it does not fit
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._tie = itertools.count()
        self._ids = itertools.count(1)

    def _model(self, name: str) -> ModelSpec:
        shape = self._shapes.get(name)
        return shape if shape is not None else self._given(name)

    # -- the world seen from outside ------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        """The base snapshot with lost GPUs, dead nodes and our plans' memory applied."""
        used: dict[str, int] = {}
        for node in self.nodes.values():
            for inst in node.instances.values():
                if inst.state in ("preparing", "ready", "frozen", "draining", "broken"):
                    for u, b in inst.reserved.items():
                        used[u] = used.get(u, 0) + b
        gpus = []
        for g in self.base.gpus:
            lost = self.lost.get(g.uuid)
            gpus.append(replace(g, mem_used_bytes=min(g.mem_total_bytes, g.mem_used_bytes + used.get(g.uuid, 0)),
                                schedulable=g.schedulable and lost != "tenant", healthy=g.healthy and lost != "failed",
                                last_seen_s=self.now_s))
        nodes = tuple(replace(n, schedulable=n.schedulable and self.nodes[n.id].alive, last_seen_s=self.now_s)
                      for n in self.base.nodes if n.id in self.nodes)
        return replace(self.base, now_s=self.now_s, nodes=nodes, gpus=tuple(gpus))

    def seed_plan(self, plan: Plan, deployment: str = "") -> None:
        """Start `plan` as if a past transition had prepared it (a deployment already running)."""
        for node in self._plan_nodes(plan):
            inst = self._new_instance(plan, node)
            inst.deployment = deployment
            inst.state, inst.ready_s = "ready", self.now_s
            self.nodes[node].instances[plan.plan_id] = inst
            self.log.add(LogEvent(self.now_s, "plan_prepared", node=node, plan_id=plan.plan_id))

    def inject(self, fault: Fault) -> None:
        self.faults.append(fault)

    def set_base(self, base: Snapshot) -> None:
        """A new cluster shape (a node joined): nodes it names are added, known ones kept."""
        self.base = base
        for n in base.nodes:
            self.nodes.setdefault(n.id, Node(n.id))

    def lose_gpus(self, uuids: Sequence[str], how: Literal["tenant", "failed"] = "tenant") -> None:
        """Another tenant takes these GPUs (or they fail): plans on them break at once."""
        for u in uuids:
            self.lost[u] = how
        for node in self.nodes.values():
            for inst in node.instances.values():
                if inst.state in ("preparing", "ready", "frozen", "draining") and any(
                        u in self.lost for u in inst.plan.gpu_uuids):
                    self._break(inst)

    def restore_gpus(self, uuids: Sequence[str]) -> None:
        for u in uuids:
            self.lost.pop(u, None)

    def lose_node(self, node_id: str) -> None:
        """The node's agent dies: it answers nothing more; its sequences fail explicitly."""
        node = self.nodes[node_id]
        node.alive = False
        for inst in node.instances.values():
            for s in list(inst.seqs.values()):
                self._fail(s, inst, f"node {node_id} lost")
            inst.state = "broken"

    # -- the gateway ---------------------------------------------------------------------------
    def submit(self, deployment: str, prompt_tokens: int, max_tokens: int, seq_id: str | None = None) -> str | None:
        """Admit a request if the deployment has somewhere to route it; its id, or None (refused)."""
        table = self.routing_fn(deployment)
        if not any(r.weight > 0 and not r.frozen for r in table.routes):
            self.rejected += 1
            return None
        sid = seq_id or f"{deployment}-{next(self._ids)}"
        s = SimSeq(sid, deployment, max(1, prompt_tokens), max(1, max_tokens), self.now_s,
                   last_progress_s=self.now_s)
        self.log.add(LogEvent(self.now_s, "seq_admitted", deployment=deployment, seq_id=sid))
        if not self._route(s):
            self.queue.append(s)
        return sid

    def _route(self, s: SimSeq) -> bool:
        """Give `s` to the plan the router picks among those that can take it now; False when none."""
        table = self.routing_fn(s.deployment)
        ready: list[tuple[Route, Node, Instance]] = []
        for r in table.routes:
            if r.weight <= 0 or r.frozen or not r.nodes:
                continue
            node = self.nodes.get(r.nodes[0])
            inst = node.instances.get(r.plan_id) if node and node.alive else None
            if node is not None and inst is not None and inst.leader and inst.state == "ready":
                ready.append((r, node, inst))
        if not ready:
            return False
        pool = self._pool(table, ready)
        for i, (_, _, inst) in enumerate(ready):
            pool.set_load(i, _load(inst))
        decision = self.router.route(RouteRequest(s.prompt_tokens, s.max_tokens), pool, self.now_s)
        if decision.chosen is None:
            return False
        self.router.admitted(decision, decision.chosen)
        chosen, node, inst = ready[decision.chosen]
        s.plan_id, s.lease, s.state = chosen.plan_id, table.version, "waiting"
        inst.seqs[s.seq_id] = s
        inst.arrivals += 1
        inst.prompt_sum += s.prompt_tokens
        self.log.add(LogEvent(self.now_s, "seq_assigned", deployment=s.deployment, seq_id=s.seq_id,
                              plan_id=chosen.plan_id, version=table.version, node=node.node_id))
        return True

    def _pool(self, table: RoutingState, ready: Sequence[tuple[Route, Node, Instance]]) -> Pool:
        key = (table.deployment_id, table.version, tuple(r.plan_id for r, _, _ in ready))
        pool = self._pools.get(key)
        if pool is None:
            snap = self.snapshot()
            facts = []
            for r, _, _ in ready:
                f = self._facts.get(r.plan_id)
                if f is None:
                    f = self._facts[r.plan_id] = plan_facts(r.plan, self.models(r.plan.model), snap)
                facts.append(replace(f, weight=r.weight))
            if len(self._pools) > 256:
                self._pools.clear()
            pool = self._pools[key] = Pool(facts)
        return pool

    # -- time ----------------------------------------------------------------------------------
    def advance_to(self, t_s: float) -> None:
        """Run everything up to `t_s`: decode, timers, new commands, admissions. Commands are
        taken after time moved on, so what they do is stamped no earlier than when they came."""
        while self.now_s < t_s:
            nxt = self._timers[0][0] if self._timers else math.inf
            end = min(t_s, self.now_s + self.max_dt_s, max(nxt, self.now_s))
            self._decode(self.now_s, end)
            self.now_s = end
            while self._timers and self._timers[0][0] <= self.now_s:
                _, _, fn = heapq.heappop(self._timers)
                fn()
            self._admit()
            if end == t_s:
                break
        self._pull()  # commands sent up to now take effect now, not at an earlier sub-step
        self._admit()

    def _at(self, t_s: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._timers, (max(t_s, self.now_s), next(self._tie), fn))

    # -- engines -------------------------------------------------------------------------------
    def _leaders(self) -> list[Instance]:
        return [i for n in self.nodes.values() if n.alive for i in n.instances.values() if i.leader]

    def _decode(self, a: float, b: float) -> None:
        for inst in self._leaders():
            if inst.state not in ("ready", "frozen", "draining"):
                continue
            batch = [s for s in inst.seqs.values()
                     if s.state in ("running", "pausing") or (s.state == "prefill" and s.ready_s < b)]
            if not batch:
                continue
            ctx = sum(s.context_tokens for s in batch) // len(batch)
            step = max(1e-6, self.timing.decode_step_s(inst.plan, len(batch), ctx))
            for s in batch:
                start = a
                if s.state == "prefill":
                    start = max(a, s.ready_s)
                    s.state = "running"
                    s.first_token_s = s.ready_s if s.first_token_s is None else s.first_token_s
                gained = (b - start) / step
                if s.state == "pausing" and s.paused_s is not None:
                    gained = max(0.0, (min(b, s.paused_s) - start) / step)
                if gained <= 0:
                    continue
                before = s.generated
                s.generated = min(float(s.max_tokens), s.generated + gained)
                inst.tokens += s.generated - before
                done = s.generated >= s.max_tokens
                t_end = min(b, start + (s.max_tokens - before) * step) if done else b
                s.last_progress_s = t_end
                self.log.add(LogEvent(t_end, "seq_decoded", seq_id=s.seq_id, plan_id=inst.plan.plan_id,
                                      detail=f"{s.generated - before:.2f}"))
                if done:
                    self._finish(s, inst, t_end)
        self._check_stuck()

    def _finish(self, s: SimSeq, inst: Instance, t_s: float) -> None:
        s.state = "done"
        inst.seqs.pop(s.seq_id, None)
        inst.finished += 1
        inst.output_sum += s.max_tokens
        if s.first_token_s is not None:
            inst.ttft_s.append(s.first_token_s - s.admitted_s)
            if s.max_tokens > 1:
                inst.tpot_s.append((t_s - s.first_token_s) / (s.max_tokens - 1))
        self.log.add(LogEvent(max(t_s, 0.0), "seq_finished", seq_id=s.seq_id, plan_id=inst.plan.plan_id))

    def _fail(self, s: SimSeq, inst: Instance | None, why: str) -> None:
        s.state = "done"
        if inst is not None:
            inst.seqs.pop(s.seq_id, None)
        self.log.add(LogEvent(self.now_s, "seq_failed", seq_id=s.seq_id, plan_id=s.plan_id, detail=why))

    def _check_stuck(self) -> None:
        for s in list(self.queue):
            if self._route(s):
                self.queue.remove(s)
            elif self.now_s - s.admitted_s > self.admit_timeout_s:
                self.queue.remove(s)
                self._fail(s, None, f"no plan accepted it within {self.admit_timeout_s:.0f} s")
        for inst in self._leaders():
            if inst.state != "broken":
                continue
            for s in list(inst.seqs.values()):
                if s.state not in ("pausing", "paused") and self.now_s - s.last_progress_s > self.stuck_timeout_s:
                    self._fail(s, inst, f"stalled {self.stuck_timeout_s:.0f} s on a plan that lost its GPUs")

    def _admit(self) -> None:
        for inst in self._leaders():
            if inst.state not in ("ready", "frozen", "draining"):
                continue
            busy = [s for s in inst.seqs.values() if s.state in ("prefill", "running", "pausing", "paused")]
            kv = sum(s.prompt_tokens + s.max_tokens for s in busy)
            cap = max(1, inst.plan.kv_reserve_tokens)
            for s in sorted((s for s in inst.seqs.values() if s.state == "waiting"), key=lambda x: x.admitted_s):
                need = s.prompt_tokens + s.max_tokens
                if busy and (kv + need > cap or len(busy) >= MAX_RUNNING_SEQS):
                    break
                start = max(self.now_s, inst.prefill_free_s)
                s.ready_s = start + self.timing.prefill_s(inst.plan, s.context_tokens)
                inst.prefill_free_s = s.ready_s
                s.state = "prefill"
                busy.append(s)
                kv += need

    def _break(self, inst: Instance) -> None:
        inst.state = "broken"
        for s in inst.seqs.values():
            s.kv_lost = True
            if s.state in ("running", "prefill"):
                s.state = "waiting"  # a re-prepared plan prefills it again (replay)

    # -- commands ------------------------------------------------------------------------------
    def _pull(self) -> None:
        for node in self.nodes.values():
            if not node.alive:
                continue
            for cmd in self.mailbox.take(node.node_id):
                if cmd.key in self.jobs:
                    continue
                job = _Job(cmd, self.now_s, self._fault_for(cmd))
                self.jobs[cmd.key] = job
                self._start(job)

    def _fault_for(self, cmd: CommandIntent) -> Fault | None:
        return take_fault(self.faults, cmd)

    def _ack(self, job: _Job, status: Literal["ok", "failed"], detail: str = "",
             result: Mapping[str, object] | None = None) -> None:
        if job.done or not self.nodes[job.cmd.node_id].alive:
            return
        job.done = True
        answer = through_fault(job.fault, job.cmd, status == "ok", detail, result or {})
        if answer is None:
            return  # it hangs: never answered
        ok, detail, out = answer
        self.mailbox.ack(job.cmd.key, "ok" if ok else "failed", detail, out)

    def _start(self, job: _Job) -> None:
        cmd, p = job.cmd, job.cmd.payload
        plan_id = str(p.get("plan_id", ""))
        node = self.nodes[cmd.node_id]
        inst = node.instances.get(plan_id)
        owner = str(p.get("deployment", ""))
        if inst is not None and inst.deployment and owner and inst.deployment != owner \
                and inst.state not in ("released", "aborted"):
            if cmd.kind is CommandKind.PREPARE_PLAN:
                self._ack(job, "failed", f"plan {plan_id} runs for deployment {inst.deployment}",
                          {"reason": "conflict"})
            else:  # another deployment's plan with the same content: not ours to touch
                self._ack(job, "ok", result={"plan_id": plan_id, "noop": True, "sequences": [], "moved": []})
            return
        if cmd.kind is CommandKind.PREPARE_PLAN:
            problem = self._learn_shape(p)
            if problem is not None:
                self.refused_prepares += 1
                self._ack(job, "failed", problem, {"reason": "failed"})
                return
        if job.fault is not None and job.fault.action == "lose_gpus":
            self._at(self.now_s + 0.5 * self._duration(job), lambda: self._lose_for(job))
        kind = cmd.kind
        if kind is CommandKind.PREPARE_PLAN:
            self._prepare(job, node, inst)
        elif kind is CommandKind.ABORT_PLAN:
            self._abort(job, node, inst, str(p.get("reason", "aborted")),
                        float(p.get("drain_timeout_s", 0.0) or 0.0))  # type: ignore[arg-type]
        elif kind is CommandKind.FREEZE_PLAN:
            self._freeze(job, inst)
        elif kind is CommandKind.THAW_PLAN:
            if inst is not None and inst.state == "frozen":
                inst.state = "ready"
            self._ack(job, "ok", result={"plan_id": plan_id})
        elif kind is CommandKind.MOVE_SEQUENCES:
            self._move(job, inst)
        elif kind is CommandKind.RELEASE_PLAN:
            fallback = p.get("fallback")
            self._release(job, node, inst, float(p.get("drain_timeout_s", 30.0)),  # type: ignore[arg-type]
                          fallback if isinstance(fallback, dict) else None)

    def _learn_shape(self, payload: Mapping[str, object]) -> str | None:
        """Take the model_spec a prepare carries as its model's shape (agents/protocol.py); why the
        prepare is refused instead - a malformed spec, or none for a model `models` does not know -
        or None."""
        try:
            spec, _ = prepare_shape(payload)
        except ValueError as exc:
            return str(exc)
        name = str(payload.get("model", ""))
        if spec is None:
            if name in self._shapes:
                return None
            try:
                self._given(name)
            except ValueError as exc:
                return f"payload.model_spec: required for a model this agent does not know ({exc})"
            return None
        if spec.name != name:
            return f"payload.model_spec.name: {spec.name!r} is not the payload's model {name!r}"
        self._shapes[name] = spec
        return None

    def _duration(self, job: _Job) -> float:
        if job.cmd.kind is CommandKind.PREPARE_PLAN:
            plan = Plan.from_dict(job.cmd.payload["plan"])
            return self.timing.prepare_s(plan, job.cmd.node_id)
        return 0.2

    def _lose_for(self, job: _Job) -> None:
        plan_id = str(job.cmd.payload.get("plan_id", ""))
        inst = self.nodes[job.cmd.node_id].instances.get(plan_id)
        assert job.fault is not None  # noqa: S101 - only called for a lose_gpus fault
        node = job.cmd.node_id
        gpus = lost_gpus(job.fault, [u for u in (inst.plan.gpu_uuids if inst else ()) if self._node_of(u) == node],
                         [g.uuid for g in self.base.gpus if g.node_id == node])
        self.lose_gpus(gpus)
        if not job.done and job.cmd.kind is not CommandKind.MOVE_SEQUENCES:
            self._ack(job, "failed", f"preempted: {len(gpus)} GPU(s) of {job.cmd.node_id} taken",
                      {"reason": "preempted", "gpus": gpus})

    def _new_instance(self, plan: Plan, node: str) -> Instance:
        model = self.models(plan.model)
        mem = plan_memory(plan, model)
        mine = {u: b for u, b in mem.items() if self._node_of(u) == node}
        nodes = self._plan_nodes(plan)
        return Instance(plan, node, bool(nodes) and nodes[0] == node, "preparing", self.now_s, mine)

    def _prepare(self, job: _Job, node: Node, inst: Instance | None) -> None:
        plan = Plan.from_dict(job.cmd.payload["plan"])
        pid = plan.plan_id
        if inst is not None and inst.state in ("ready", "frozen"):
            self._ack(job, "ok", result={"plan_id": pid, "reserved_bytes": dict(inst.reserved), "load_s": 0.0})
            return
        if inst is not None and inst.state == "draining":
            self._ack(job, "failed", f"plan {pid} is being released", {"reason": "failed"})
            return
        lost = [u for u in plan.gpu_uuids if self._node_of(u) == node.node_id and u in self.lost]
        if lost:
            self._ack(job, "failed", f"preempted: GPU(s) {', '.join(lost)} are not ours",
                      {"reason": "preempted", "gpus": lost})
            return
        problem = tokenizer_problem(job.cmd.payload.get("model_version"), self.models(plan.model).vocab_size)
        if problem is not None:  # the shadow plan would not serve this version (agents/shadow_check.py)
            self._ack(job, "failed", problem, {"reason": "tokenizer"})
            return
        if inst is None or inst.state in ("broken", "released", "aborted"):
            fresh = self._new_instance(plan, node.node_id)
            refused = self._refusal(plan, fresh.reserved)
            if refused is not None:
                self.refused_prepares += 1
                self._ack(job, "failed", refused[0], refused[1])
                return
            keep = inst.seqs if inst is not None and inst.state == "broken" else {}
            inst = fresh
            inst.seqs = keep
            inst.deployment = str(job.cmd.payload.get("deployment", ""))
            node.instances[pid] = inst
        load_s = self.timing.prepare_s(plan, node.node_id)
        if inst.ready_s <= self.now_s or not any(j.cmd.kind is CommandKind.PREPARE_PLAN and not j.done
                                                 and j.cmd.payload.get("plan_id") == pid and j is not job
                                                 and j.cmd.node_id == node.node_id for j in self.jobs.values()):
            inst.ready_s = self.now_s + load_s  # a fresh load (no other prepare of it is under way)
        ready = inst.ready_s

        def done() -> None:
            cur = node.instances.get(pid)
            if cur is None or cur.state != "preparing":
                if cur is not None and cur.state == "ready":
                    self._ack(job, "ok", result={"plan_id": pid, "reserved_bytes": dict(cur.reserved),
                                                 "load_s": load_s})
                else:
                    self._ack(job, "failed", f"plan {pid} is {cur.state if cur else 'gone'}",
                              {"reason": "preempted" if cur is not None and cur.state == "broken" else "failed"})
                return
            if any(u in self.lost for u in cur.plan.gpu_uuids):
                self._break(cur)
                self._ack(job, "failed", "preempted while loading", {"reason": "preempted"})
                return
            cur.state = "ready"
            for s in cur.seqs.values():  # sequences kept across a re-prepare resume (replayed)
                s.kv_lost = False
            self.log.add(LogEvent(self.now_s, "plan_prepared", node=node.node_id, plan_id=pid))
            self._ack(job, "ok", result={"plan_id": pid, "reserved_bytes": dict(cur.reserved), "load_s": load_s})

        self._at(ready, done)

    def _refusal(self, plan: Plan, want: Mapping[str, int]) -> tuple[str, dict[str, object]] | None:
        """What this node's agent refuses a PREPARE with, as the real daemon does: an engine that
        cannot run the plan (scheduler.capabilities), or memory the plan would book beyond 92% of
        a GPU beside every plan that holds it (scheduler.booking); None when it can go ahead."""
        snap = self.snapshot()
        unsupported = plan_refusals(plan, snap)
        if unsupported:
            return "; ".join(unsupported), {"reason": "unsupported"}
        gpus = snap.gpu_by_uuid
        over = refuse_booking(want, {u: gpus[u].mem_used_bytes for u in want if u in gpus},
                              {u: gpus[u].mem_total_bytes for u in want if u in gpus})
        if over is not None:
            return over.message(), {"reason": REFUSAL_REASON, "gpus": [over.gpu]}
        return None

    def _abort(self, job: _Job, node: Node, inst: Instance | None, reason: str, drain_s: float) -> None:
        pid = str(job.cmd.payload.get("plan_id", ""))
        if inst is None or inst.state in ("released", "aborted"):
            self._ack(job, "ok", result={"plan_id": pid, "noop": True})
            return
        if inst.state in ("ready", "frozen", "preparing"):
            inst.state = "draining" if inst.state != "preparing" else "preparing"
        deadline = self.now_s + drain_s

        def poll() -> None:
            if inst.state in ("released", "aborted"):
                return
            if inst.seqs and inst.state == "draining" and self.now_s < deadline:
                self._at(self.now_s + 0.1, poll)  # sequences left to finish here finish first
                return
            failed = []
            for s in list(inst.seqs.values()):
                failed.append(s.seq_id)
                self._fail(s, inst, f"plan {pid} aborted: {reason}")
            inst.state = "aborted"
            self.log.add(LogEvent(self.now_s, "plan_aborted", node=node.node_id, plan_id=pid, detail=reason))
            self._ack(job, "ok", result={"plan_id": pid, "failed": failed})

        poll()

    def _freeze(self, job: _Job, inst: Instance | None) -> None:
        pid = str(job.cmd.payload.get("plan_id", ""))
        if inst is None or not inst.leader or inst.state in ("released", "aborted"):
            self._ack(job, "ok", result={"plan_id": pid, "sequences": []})
            return
        if inst.state in ("ready", "preparing"):
            inst.state = "frozen"
        # answered at the end of the current decode iteration: nothing is admitted after it; the
        # answer says how long an iteration takes now (the controller's finish-or-move estimate)
        batch = [s for s in inst.seqs.values() if s.state in ("running", "prefill", "pausing")]
        ctx = sum(s.context_tokens for s in batch) // len(batch) if batch else 512
        step = self.timing.decode_step_s(inst.plan, max(1, len(batch)), ctx)

        def done() -> None:
            seqs = [{"seq_id": s.seq_id, "context_tokens": s.context_tokens, "generated_tokens": int(s.generated),
                     "max_tokens": s.max_tokens,
                     # a prefill still queued is idle: it has no KV yet and decodes nothing
                     "state": "running" if s.state in ("running", "pausing") or (
                         s.state == "prefill" and s.ready_s <= self.now_s + step) else "waiting",
                     "kv_lost": s.kv_lost} for s in inst.seqs.values() if s.state != "done"]
            self._ack(job, "ok", result={"plan_id": pid, "sequences": seqs, "decode_step_s": step})

        self._at(self.now_s + step, done)

    def _release(self, job: _Job, node: Node, inst: Instance | None, drain_s: float,
                 fallback: Mapping[str, object] | None) -> None:
        pid = str(job.cmd.payload.get("plan_id", ""))
        if inst is None or inst.state in ("released", "aborted"):
            self._ack(job, "ok", result={"plan_id": pid, "noop": True})
            return
        if inst.state != "broken":
            inst.state = "draining"
        deadline = self.now_s + drain_s

        def poll() -> None:
            if inst.state not in ("draining", "broken"):
                return
            if inst.seqs and inst.state == "draining" and self.now_s < deadline:
                self._at(self.now_s + 0.1, poll)
                return
            failed, handed = [], []
            why = "lost its GPUs" if inst.state == "broken" else f"ran out of its {drain_s:.0f} s drain"
            for s in list(inst.seqs.values()):
                if fallback is not None and self._replay_to(inst, s, fallback):
                    handed.append(s.seq_id)
                else:
                    failed.append(s.seq_id)
                    self._fail(s, inst, f"plan {pid} {why} before it finished")
            inst.state = "released"
            freed = dict(inst.reserved)
            self.log.add(LogEvent(self.now_s, "plan_released", node=node.node_id, plan_id=pid))
            self._ack(job, "ok", result={"plan_id": pid, "freed_bytes": freed, "failed": failed,
                                         "handed_over": handed})

        poll()

    def _replay_to(self, src: Instance, s: SimSeq, target: Mapping[str, object]) -> bool:
        """Hand `s` over to `target` by replay, now (a releasing plan that cannot finish it)."""
        node = self.nodes.get(str(target.get("target_node", "")))
        dst = node.instances.get(str(target.get("target_plan", ""))) if node is not None and node.alive else None
        version = int(target.get("routing_version", 0))  # type: ignore[call-overload]
        if dst is None or not dst.leader or dst.state != "ready" or version <= s.lease:
            return False
        boundary = "decode_end" if s.state in ("running", "pausing") and src.state != "broken" else "idle"
        s.generated = float(round(s.generated)) if boundary == "decode_end" else s.generated
        self.log.add(LogEvent(self.now_s, "seq_paused", seq_id=s.seq_id, plan_id=src.plan.plan_id,
                              boundary=boundary))
        src.seqs.pop(s.seq_id, None)
        self.log.add(LogEvent(self.now_s, "seq_handover", seq_id=s.seq_id, plan_id=src.plan.plan_id,
                              to_plan=dst.plan.plan_id, version=version, boundary=boundary))
        start = max(self.now_s, dst.prefill_free_s)
        resume = start + self.timing.prefill_s(dst.plan, s.context_tokens)
        dst.prefill_free_s = resume
        self.stalls.append(StallSample(s.seq_id, "replay", s.context_tokens, resume - self.now_s, 0,
                                       s.context_tokens))
        s.plan_id, s.lease, s.kv_lost, s.paused_s = dst.plan.plan_id, version, False, None
        s.state, s.ready_s, s.last_progress_s = "prefill", resume, resume
        dst.seqs[s.seq_id] = s
        return True

    # -- moving sequences ----------------------------------------------------------------------
    def _move(self, job: _Job, inst: Instance | None) -> None:
        p = job.cmd.payload
        version = int(p.get("routing_version", 0))  # type: ignore[call-overload]
        raw = p.get("moves", [])
        moves = [dict(m) for m in raw if isinstance(m, dict)] if isinstance(raw, list) else []
        job.moves = sorted(moves, key=lambda m: bool(m.get("lazy", False)))  # stable: active first, then idle
        if inst is None:
            job.results = [{"seq_id": m.get("seq_id"), "action": m.get("action"), "outcome": "gone", "ok": True}
                           for m in moves]
            self._ack(job, "ok", result={"plan_id": p.get("plan_id"), "moved": job.results})
            return
        for m in job.moves:
            m["_version"] = version
        self._next_moves(job, inst)

    def _next_moves(self, job: _Job, src: Instance) -> None:
        """Start what can start: every finish and replay at once, migrations one at a time per link."""
        node = self.nodes[src.node]
        while job.moves:
            m = job.moves[0]
            action = str(m.get("action"))
            s = src.seqs.get(str(m.get("seq_id")))
            if s is None or s.state == "done":
                job.moves.pop(0)
                job.results.append({"seq_id": m.get("seq_id"), "action": action, "outcome": "gone", "ok": True})
                continue
            if action == "finish":
                job.moves.pop(0)
                s.keep = True
                job.results.append({"seq_id": s.seq_id, "action": "finish", "ok": True,
                                    "context_tokens": s.context_tokens})
                continue
            if action == "migrate":
                if node.link_busy:
                    break  # the migration on the link calls back when it is done
                node.link_busy = True
            job.moves.pop(0)
            job.active += 1
            self._pause_then(job, src, s, m)
        if not job.moves and job.active == 0 and not job.done:
            failed = [r for r in job.results if not r.get("ok", True)]
            result = {"plan_id": src.plan.plan_id, "moved": job.results}
            if failed:
                reason = "preempted" if any(r.get("reason") == "preempted" for r in failed) else "target_refused"
                self._ack(job, "failed", f"{len(failed)} sequence(s) could not be handed over: "
                                         f"{failed[0].get('error', '')}", {**result, "reason": reason})
            else:
                self._ack(job, "ok", result=result)

    def _pause_then(self, job: _Job, src: Instance, s: SimSeq, m: Mapping[str, object]) -> None:
        """Pause `s` at its safe boundary, then move it."""
        if s.state in ("running",) and src.state in ("ready", "frozen", "draining"):
            step = self.timing.decode_step_s(src.plan, max(1, len(src.seqs)), s.context_tokens)
            frac = s.generated - math.floor(s.generated)
            at = self.now_s + (1.0 - frac) * step if frac > 1e-9 else self.now_s
            s.state, s.paused_s = "pausing", at
            boundary = "decode_end"
        else:
            at, boundary = self.now_s, "idle"
            s.paused_s = at

        def paused() -> None:
            if s.state == "done" or s.plan_id != src.plan.plan_id:
                job.active -= 1
                if m.get("action") == "migrate":
                    self.nodes[src.node].link_busy = False
                job.results.append({"seq_id": s.seq_id, "action": m.get("action"), "outcome": "gone", "ok": True})
                self._next_moves(job, src)
                return
            s.boundary = boundary
            s.generated = float(round(s.generated)) if boundary == "decode_end" else s.generated
            s.state = "paused"
            s.paused_s = self.now_s
            self.log.add(LogEvent(self.now_s, "seq_paused", seq_id=s.seq_id, plan_id=src.plan.plan_id,
                                  boundary=boundary))
            self._transfer(job, src, s, m)

        self._at(at, paused)

    def _transfer(self, job: _Job, src: Instance, s: SimSeq, m: Mapping[str, object]) -> None:
        action = str(m.get("action"))
        target_plan, target_node = str(m.get("target_plan", "")), str(m.get("target_node", ""))
        dst_node = self.nodes.get(target_node)
        dst = dst_node.instances.get(target_plan) if dst_node is not None and dst_node.alive else None
        version = int(m.get("_version", 0))  # type: ignore[call-overload]
        cap = float(m.get("bw_cap_bytes_per_s", 0.0) or 0.0)  # type: ignore[arg-type]
        ctx = s.context_tokens
        if action == "migrate" and (s.kv_lost or src.state == "broken"):
            self._refuse(job, src, s, m, "its KV cache is lost; it can only be replayed", "preempted")
            return
        if dst is None or not dst.leader or dst.state != "ready":
            why = "preempted" if dst is not None and dst.state == "broken" else "target_refused"
            self._refuse(job, src, s, m, f"target plan {target_plan} on {target_node} is "
                                         f"{dst.state if dst else 'not there'}", why)
            return
        if version <= s.lease:
            self._refuse(job, src, s, m, f"lease version {version} is not newer than {s.lease}", "stale_lease")
            return
        kv_bytes = self.timing.kv_bytes(src.plan, dst.plan, ctx) if action == "migrate" else 0
        if action == "migrate":
            arrive = self.now_s + self.timing.migrate_s(src.plan, dst.plan, ctx, cap)
        else:
            arrive = self.now_s  # only the tokens travel (bytes: negligible)

        def handover() -> None:
            if action == "migrate":
                self.nodes[src.node].link_busy = False
            if dst.state != "ready":
                self._refuse(job, src, s, m, f"target plan {target_plan} became {dst.state}",
                             "preempted" if dst.state == "broken" else "target_refused")
                return
            src.seqs.pop(s.seq_id, None)
            self.log.add(LogEvent(self.now_s, "seq_handover", seq_id=s.seq_id, plan_id=src.plan.plan_id,
                                  to_plan=dst.plan.plan_id, version=version, boundary=s.boundary))
            s.plan_id, s.lease = dst.plan.plan_id, version
            dst.seqs[s.seq_id] = s
            if action == "migrate":
                resume = self.now_s
            else:
                start = max(self.now_s, dst.prefill_free_s)
                resume = start + self.timing.prefill_s(dst.plan, ctx)
                dst.prefill_free_s = resume
            s.kv_lost = False
            s.state, s.ready_s = "prefill", resume
            stall = resume - (s.paused_s if s.paused_s is not None else self.now_s)
            s.paused_s = None
            s.last_progress_s = resume
            self.stalls.append(StallSample(s.seq_id, action, ctx, stall, kv_bytes, ctx if action == "replay" else 0))
            job.results.append({"seq_id": s.seq_id, "action": action, "ok": True, "context_tokens": ctx,
                                "kv_bytes": kv_bytes, "replay_tokens": ctx if action == "replay" else 0,
                                "stall_s": stall})
            job.active -= 1
            self._next_moves(job, src)

        self._at(arrive, handover)

    def _refuse(self, job: _Job, src: Instance, s: SimSeq, m: Mapping[str, object], why: str, reason: str) -> None:
        """The hand-over did not happen: the sequence stays with its owner and goes on there."""
        if m.get("action") == "migrate":
            self.nodes[src.node].link_busy = False
        if s.state in ("paused", "pausing"):
            s.state = "running" if not s.kv_lost and src.state != "broken" else "waiting"
        s.paused_s = None
        job.results.append({"seq_id": s.seq_id, "action": m.get("action"), "ok": False, "error": why,
                            "reason": reason})
        job.active -= 1
        self._next_moves(job, src)

    # -- helpers ---------------------------------------------------------------------------------
    def _node_of(self, uuid: str) -> str:
        g = self.base.gpu_by_uuid.get(uuid)
        return g.node_id if g is not None else ""

    def _plan_nodes(self, plan: Plan) -> list[str]:
        out: list[str] = []
        for u in plan.gpu_uuids:
            n = self._node_of(u)
            if n and n not in out:
                out.append(n)
        return out

    def instances(self, plan_id: str) -> list[Instance]:
        return [n.instances[plan_id] for n in self.nodes.values() if plan_id in n.instances]

    def live_plans(self) -> set[str]:
        """Plans some node still holds (prepared, not released or aborted)."""
        return {pid for n in self.nodes.values() for pid, i in n.instances.items()
                if i.state not in ("released", "aborted")}

    def open_sequences(self) -> int:
        return len(self.queue) + sum(len(i.seqs) for i in self._leaders())

    def engine_reports(self, node_id: str, interval_s: float) -> list[dict[str, object]]:
        """EngineReport fields (agents/protocol.py) for the plans this node leads; resets counters."""
        out: list[dict[str, object]] = []
        node = self.nodes[node_id]
        for inst in node.instances.values():
            if not inst.leader or inst.state in ("released", "aborted"):
                continue
            running = sum(1 for s in inst.seqs.values() if s.state in ("running", "prefill", "pausing"))
            waiting = sum(1 for s in inst.seqs.values() if s.state in ("waiting", "paused"))
            kv = sum(s.context_tokens for s in inst.seqs.values())
            out.append({
                "plan_id": inst.plan.plan_id, "running": running, "waiting": waiting,
                "tokens_per_s": round(inst.tokens / interval_s, 3) if interval_s > 0 else 0.0,
                "kv_usage": round(min(1.0, kv / max(1, inst.plan.kv_reserve_tokens)), 4),
                "ttft_p50_ms": _pct(inst.ttft_s, 0.5), "ttft_p95_ms": _pct(inst.ttft_s, 0.95),
                "tpot_p50_ms": _pct(inst.tpot_s, 0.5), "tpot_p95_ms": _pct(inst.tpot_s, 0.95),
                "finished": inst.finished, "arrivals": inst.arrivals,
                "prompt_tokens_mean": round(inst.prompt_sum / inst.arrivals, 2) if inst.arrivals else None,
                "output_tokens_mean": round(inst.output_sum / inst.finished, 2) if inst.finished else None,
            })
            inst.arrivals = inst.finished = inst.prompt_sum = inst.output_sum = 0
            inst.tokens = 0.0
            inst.ttft_s, inst.tpot_s = [], []
        return out


def _load(inst: Instance) -> PlanLoad:
    """A plan's load as the router reads it, from its sequences."""
    running = waiting = queued = kv = 0
    for s in inst.seqs.values():
        if s.state in ("running", "prefill", "pausing"):
            running += 1
            kv += s.context_tokens
        elif s.state in ("waiting", "paused"):
            waiting += 1
            if s.state == "waiting":
                queued += s.context_tokens
    return PlanLoad(running, waiting, queued, 0, kv)


def _pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(1000.0 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


__all__ = ["CostModelTiming", "Fault", "FixedTiming", "Instance", "MemoryFleet", "SimSeq", "StallSample", "Timing"]
