"""The discrete-event fleet simulator: a scenario's cluster, its deployments' plans and their
engines, the routing between them, on a virtual clock.

One event heap, ordered by (time, kind, sequence): cluster changes first at an instant, then
plans coming up, KV landing, arrivals, round boundaries, timers (`engine.KIND_*`). Handlers
return the events they create; the loop pushes them. The public methods below (the driver API)
push theirs directly, so a caller outside the loop - a replay policy, or the live fleet driven
by the console - can call them at any time between `advance_to` calls.

Driver API (what the live fleet and the replay policies use):

    sim = FleetSim(scenario)                      # cluster at t=0, no plans, no load
    sim.start_baselines()                         # each deployment's baseline plan, warm at t=0
    sim.feed(build_workload(scenario).arrivals)   # or sim.submit(deployment, prompt, output)
    handle = sim.add_plan("chat", plan)           # comes up after its modelled weight load
    sim.remove_plan("chat", plan_id)              # stops routing to it; its sequences move or finish
    sim.set_weights("chat", {plan_id: 0.7, ...})
    sim.advance_to(t_s)                           # run every event up to t_s
    sim.engine_reports()                          # per plan: EngineReport (agents.protocol) + nodes
    sim.gpu_load()                                # (node, gpu index) -> (memory fraction, utilisation)
    sim.snapshot()                                # scheduler.topology.Snapshot of the cluster now

For the live fleet (`python -m agents.sim`, driven by the console; agents/sim/live.py): build
one FleetSim from the scenario, `feed()` the scenario's workload (no baselines: the console's
first transitions bring the plans up), and on every pass `advance_to(wall-clock elapsed x
time_scale)` and `expire_pending()`. Ownership of every GPU is `sim.cluster` (the same
SimCluster the agents report today), new cluster changes are `sim.change_log[n:]`, what each GPU
holds and how busy it is is `gpu_load()`, and `engine_reports()` gives one EngineReport per plan
to attach to the report of the plan's first node. The console's transition commands
(prepare_plan, freeze_plan, move_sequences, release_plan, abort_plan, thaw_plan) are carried out
by `agents.sim.executor.SimAgents(sim, ack)` - build a `scheduler.transition.CommandIntent` from
each protocol Command and `ack` it back over HTTP; routing weights come from `set_routing()`,
per-node engine metrics from `engine_reports(leader=node)`, and every request's life - admitted,
owned by a plan under a lease, paused, handed over, returned, finished, failed - goes to `events`
(an EventLog) when it is set (agents/sim/seqlog.py: invariants 1-2).

Losses: a plan that loses a GPU (preempted, failed, node gone) stops at once, as a real engine
crashes when one of its ranks disappears; its memory is freed, and its requests go back to the
deployment's router to be recomputed elsewhere (their KV was on those GPUs). Requests that no
serving plan can take wait in the deployment's queue: nothing admitted is ever dropped.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from agents.protocol import EngineReport
from agents.sim import seqlog
from agents.sim.buckets import LengthBuckets
from agents.sim.cluster import FAILED, TENANT, US, Change, SimCluster
from agents.sim.engine import (
    KIND_ARRIVAL,
    KIND_CLUSTER,
    KIND_READY,
    KIND_TIMER,
    MAX_RUN_ROUNDS,
    Event,
    Pipe,
    PlanEngine,
    Request,
)
from agents.sim.metrics import Recorder, SwitchRecord, check_conservation
from agents.sim.scenario import BaselineSpec, ModelDeploymentSpec, Scenario, baseline_stage_nodes
from agents.sim.workload import Arrival
from scheduler.booking import REFUSAL_REASON, plan_memory, refuse_booking
from scheduler.costmodel import (
    COLD_START_S,
    DEFAULT_EFFICIENCY,
    Efficiency,
    KvRoute,
    PlanProfile,
    Slo,
    Workload,
    kv_route,
    max_kv_tokens,
    migrate_or_replay,
    switch_cost,
)
from scheduler.gearbox import LoadSample
from scheduler.hardware import gpu_spec
from scheduler.invariants import EventLog, LogEvent
from scheduler.modelspec import ModelSpec, model_spec
from scheduler.plan import Gear, Plan, Stage
from scheduler.refusal import Refused
from scheduler.router import (
    BLOCK_TOKENS,
    Decision,
    PlanFacts,
    Pool,
    RouteRequest,
    RoutingPolicy,
    make_router,
    plan_facts,
)
from scheduler.topology import GpuState, LinkState, NodeState, Snapshot

IDLE_MEM_BYTES = 600 * 2**20  # a CUDA context with nothing loaded (as agents/sim/live.py reports)
LoadSource = Literal["warm", "host", "disk"]
RetireMode = Literal["drain", "move", "stop", "free"]


@dataclass(frozen=True)
class SimOptions:
    """Knobs of the simulated fleet; defaults are stated assumptions, not fits."""

    bin_s: float = 60.0  # resolution of the time series
    report_delay_s: float = 1.0  # agents report a change at once; the controller acts this much later
    stay_tokens: int = 32  # at a gear change, sequences this close to done finish on the old plan
    drain_limit_s: float = 7 * 86400.0  # after duration_s, requests still in the system get this long
    disk_cold_start_s: float = COLD_START_S  # a plan started from disk (a restarted pod) also starts its process
    max_run_rounds: int = MAX_RUN_ROUNDS  # longest analytic run of identical rounds (1: simulate each round)
    prefix_block_tokens: int = BLOCK_TOKENS  # the engines' prefix cache block (a trace's hash block); 0: none
    length_buckets: LengthBuckets | None = None  # batching split by prompt length (agents/sim/buckets.py); None: FCFS


DEFAULT_OPTIONS = SimOptions()


class SimListener(Protocol):
    """What a policy hears from the simulator (all optional to act on)."""

    def on_cluster_change(self, sim: FleetSim, t: float, changes: Sequence[Change],
                          broke: Mapping[str, Sequence[PlanEngine]]) -> None: ...

    def on_ready(self, sim: FleetSim, t: float, engine: PlanEngine) -> None: ...

    def on_released(self, sim: FleetSim, t: float, engine: PlanEngine) -> None:
        """The engine no longer holds GPUs: released after a drain, stopped, or lost with its GPUs."""
        ...


class _Silent:
    def on_cluster_change(self, sim: FleetSim, t: float, changes: Sequence[Change],
                          broke: Mapping[str, Sequence[PlanEngine]]) -> None:
        return None

    def on_ready(self, sim: FleetSim, t: float, engine: PlanEngine) -> None:
        return None

    def on_released(self, sim: FleetSim, t: float, engine: PlanEngine) -> None:
        return None


class EngineHost(Protocol):
    """What engines call back into (FleetSim implements it)."""

    max_run_rounds: int  # longest analytic run of identical rounds
    prefix_block_tokens: int  # the prefix cache's block size (0: engines keep no prefix cache)
    length_buckets: LengthBuckets | None  # batching split by prompt length; None: one FCFS queue

    def tokens(self, engine: PlanEngine, t0: float, t1: float, n: int) -> None: ...

    def first_token(self, req: Request, t: float) -> None: ...

    def finished(self, req: Request, t: float) -> list[Event]: ...

    def failed(self, req: Request, t: float, reason: str) -> list[Event]: ...

    def pipe_idle(self, engine: PlanEngine, t: float) -> list[Event]: ...

    def owns(self, req: Request, engine: PlanEngine) -> None: ...


@dataclass
class DeploymentRuntime:
    """One deployment inside the simulator."""

    spec: ModelDeploymentSpec
    model: ModelSpec
    slo: Slo
    index: int
    engines: list[PlanEngine] = field(default_factory=list)  # loading or serving (incl. draining)
    pending: deque[Request] = field(default_factory=deque)  # admitted, no serving plan to take them yet
    routing_version: int = 0  # version of the routing table it follows (set_routing): leases carry it
    baseline: Plan | None = None
    pool: Pool | None = None  # the router's view of its serving plans (rebuilt when they change)
    pool_key: tuple[object, ...] = ()
    # load since the last sample (for the gearbox's LoadWindow)
    win_arrivals: int = 0
    win_prompt: float = 0.0
    win_prompt_sq: float = 0.0
    win_finished: int = 0
    win_output: float = 0.0
    win_output_sq: float = 0.0
    win_since_s: float = 0.0
    last_output_mean: float = 0.0

    @property
    def name(self) -> str:
        return self.spec.deployment

    def routed(self) -> list[PlanEngine]:
        return [e for e in self.engines if e.accepting]


@dataclass(frozen=True)
class PlanMetrics:
    """One plan's engine metrics over the last report interval, and where it runs."""

    deployment: str
    node_ids: tuple[str, ...]  # nodes hosting its GPUs, in stage order (the agents that report it)
    report: EngineReport  # agents.protocol's shape


class FleetSim:
    """The simulator (module docstring). Deterministic: the scenario seed drives the cluster's
    draws; nothing reads a wall clock or a global random state."""

    def __init__(self, scenario: Scenario, *, options: SimOptions = DEFAULT_OPTIONS,
                 eff: Efficiency = DEFAULT_EFFICIENCY, listener: SimListener | None = None,
                 router: RoutingPolicy | None = None) -> None:
        self.scenario = scenario
        self.options = options
        self.eff = eff
        self.cluster = SimCluster(scenario, random.Random(scenario.seed))
        # another tenant's memory on the GPUs it holds, fixed per GPU (as agents/sim/live.py draws it)
        tenant_rng = random.Random(scenario.seed ^ 0x5EED)
        self.tenant_fraction = {(n.id, i): tenant_rng.uniform(0.55, 0.95)
                                for n in scenario.all_nodes() for i in range(n.gpus)}
        self.listener: SimListener = listener or _Silent()
        self.max_run_rounds = options.max_run_rounds
        self.prefix_block_tokens = options.prefix_block_tokens
        self.length_buckets = options.length_buckets
        # the one request router (scheduler.router), as the gateway runs it; a baseline in bench.route
        self.router: RoutingPolicy = router or make_router("flexpipe", seed=scenario.seed)
        self._facts: dict[tuple[int, int, float], PlanFacts] = {}  # (engine id, profile, weight) -> facts
        # a plan that loses a GPU: its sequences keep their KV (only the oracle, which moved
        # them away just before the loss it knew of, sets this)
        self.kv_survives_loss = False
        # the policy's control work still in flight (a gear change finishing its clean-up): the
        # drain runs on while it says so, so that no transition is cut off half-done
        self.control_busy: Callable[[], bool] | None = None
        # where every request's life goes as invariant 1-2 events (agents/sim/seqlog.py): the live
        # fleet's log, a test's, or a replay's CheckingLog (checked as it runs, nothing kept)
        self.events: EventLog | None = None
        self._pending_seen: dict[int, float] = {}  # request id -> first pass that saw it queued (expire_pending)
        self.now_s = 0.0
        self._heap: list[tuple[float, int, int, Callable[[float, Any], list[Event] | None], Any]] = []
        self._seq = itertools.count()
        self._engine_ids = itertools.count(1)
        self._rids = itertools.count()
        self.deployments: dict[str, DeploymentRuntime] = {}
        for i, m in enumerate(scenario.models):
            self.deployments[m.deployment] = DeploymentRuntime(
                m, model_spec(m.model), Slo(m.ttft_ms, m.tpot_ms), i)
        self.engines: dict[int, PlanEngine] = {}  # every engine ever made (accounting)
        self.live: dict[int, PlanEngine] = {}  # loading or serving
        self.in_system: dict[int, Request] = {}  # admitted, neither finished nor failed
        self.change_log: list[Change] = []  # every cluster change applied so far (the live fleet reads it)
        self.preemptions = 0  # KV preemptions (recompute) of the requests that finished
        self.shared_launches = 0  # times an engine started sharing a GPU with another one
        self.recorder = Recorder(list(self.deployments),
                                 {d: (r.slo.ttft_ms / 1e3, r.slo.tpot_ms / 1e3) for d, r in self.deployments.items()},
                                 scenario.duration_s, options.bin_s)
        self._snapshot: Snapshot | None = None
        self._footprint: dict[int, dict[str, int]] = {}  # engine id -> uuid -> bytes (weights + KV reserve)
        self.refused_prepares = 0  # PREPAREs refused because the plan would not fit beside what its GPUs hold
        self.peak_booked_fraction = 0.0  # the largest booked share of any GPU after any booking
        # every booking, for scheduler.invariants.check (invariant 4); a few per switch
        self.memory_log = EventLog(record_decodes=False)
        self._arrivals: Sequence[Arrival] = ()
        self._next_arrival = 0
        self._routes: dict[tuple[int, int], tuple[KvRoute, float]] = {}  # (src, dst) -> (route, busy until)
        self._ended_s: dict[int, float] = {}  # engine id -> when it stopped holding memory
        self._avail_t = 0.0
        self._avail_mem_byte_s = 0.0
        self._avail_flop = 0.0  # peak FLOPs of the GPUs we held, over time
        self._gpu_busy_mark: dict[int, float] = {}  # engine id -> busy seconds at the last gpu_load()
        self._gpu_load_t = 0.0
        self._links: tuple[LinkState, ...] | None = None
        # every GPU uuid the scenario can ever have -> (node, index): uuids derive from both
        self._gpu_home = {self.cluster.gpu_uuid(n.id, i): (n.id, i)
                          for n in scenario.all_nodes() for i in range(n.gpus)}
        self._gpu_models = {self.cluster.gpu_uuid(n.id, i): n.gpu for n in scenario.all_nodes() for i in range(n.gpus)}
        self._push_cluster()
        self._push(scenario.duration_s, KIND_TIMER, self._mark_duration, None)

    # ======================================================================================
    # the loop
    # ======================================================================================
    def _push(self, t: float, kind: int, fn: Callable[[float, Any], list[Event] | None], arg: Any) -> None:
        heapq.heappush(self._heap, (t, kind, next(self._seq), fn, arg))

    def push_events(self, events: Iterable[Event] | None) -> None:
        """Queue events made outside the loop (engine methods return them)."""
        self._push_all(events)

    def _push_all(self, events: Iterable[Event] | None) -> None:
        if events:
            for t, kind, fn, arg in events:
                heapq.heappush(self._heap, (t, kind, next(self._seq), fn, arg))

    def advance_to(self, t_s: float) -> None:
        """Run every event due at or before `t_s`; the clock ends at `t_s`."""
        self._run(t_s)
        self.now_s = max(self.now_s, t_s)

    def _run(self, t_s: float, until_empty: bool = False) -> None:
        """The event loop: events due at or before `t_s` in (time, kind, seq) order; with
        `until_empty`, stop as soon as no admitted request is left in the system."""
        heap = self._heap
        pop, push, seq = heapq.heappop, heapq.heappush, self._seq
        in_system = self.in_system
        while heap and heap[0][0] <= t_s:
            if until_empty and not in_system and (self.control_busy is None or not self.control_busy()):
                return
            t, _, _, fn, arg = pop(heap)
            self.now_s = t
            new = fn(t, arg)
            if new:
                for ev in new:
                    push(heap, (ev[0], ev[1], next(seq), ev[2], ev[3]))

    def call_at(self, t_s: float, fn: Callable[[float], None]) -> None:
        """A timer: `fn(t)` runs at `t_s` (after everything else due then)."""
        self._push(t_s, KIND_TIMER, lambda t, _: fn(t), None)

    def run_to_completion(self) -> None:
        """Run the scenario, then drain: no arrivals after duration_s; requests still in the
        system get `drain_limit_s` more, then end with an explicit error (never silently)."""
        self.advance_to(self.scenario.duration_s)
        self._run(self.scenario.duration_s + self.options.drain_limit_s, until_empty=True)
        for req in list(self.in_system.values()):
            self._fail(req, self.now_s, "not finished within the drain limit after the scenario ended"
                       " (no plan could serve it)")
        check_conservation(self.recorder, len(self.in_system))

    # ======================================================================================
    # arrivals
    # ======================================================================================
    def feed(self, arrivals: Sequence[Arrival]) -> None:
        """The workload to replay (time-ordered). One feed per simulator."""
        if self._arrivals:
            raise ValueError("feed: this simulator already has a workload")
        self._arrivals = arrivals
        self._next_arrival = 0
        if arrivals:
            self._push(arrivals[0].t_s, KIND_ARRIVAL, self._on_arrival, None)

    def feed_more(self, arrivals: Sequence[Arrival]) -> None:
        """More of the workload, after what was fed so far (the live fleet repeats its scenario's
        workload period after period; a replay feeds once)."""
        if not arrivals:
            return
        last = self._arrivals[-1].t_s if self._arrivals else -math.inf
        if arrivals[0].t_s < last:
            raise ValueError(f"feed_more: arrivals start at {arrivals[0].t_s:g} s, before the last fed ({last:g} s)")
        exhausted = self._next_arrival >= len(self._arrivals)
        self._arrivals = list(self._arrivals[self._next_arrival:]) + list(arrivals)
        self._next_arrival = 0
        if exhausted:
            self._push(max(self.now_s, self._arrivals[0].t_s), KIND_ARRIVAL, self._on_arrival, None)

    def _on_arrival(self, t: float, _: object) -> list[Event]:
        a = self._arrivals[self._next_arrival]
        self._next_arrival += 1
        out = self._admit(a.deployment, a.prompt_tokens, a.output_tokens, t, priority=a.priority,
                          deadline_s=a.deadline_s, blocks=a.blocks)
        if self._next_arrival < len(self._arrivals):
            out.append((self._arrivals[self._next_arrival].t_s, KIND_ARRIVAL, self._on_arrival, None))
        return out

    def submit(self, deployment: str, prompt_tokens: int, output_tokens: int, *, priority: int = 0,
               deadline_s: float | None = None, blocks: tuple[int, ...] = ()) -> int:
        """Admit one request now (the live fleet's entry); returns its id. `priority`, `deadline_s`
        and `blocks` as scheduler.router.RouteRequest takes them."""
        if deployment not in self.deployments:
            raise ValueError(f"deployment: unknown {deployment!r}; known: {', '.join(self.deployments)}")
        if prompt_tokens < 1 or output_tokens < 1:
            raise ValueError("prompt_tokens, output_tokens: must be >= 1")
        RouteRequest(prompt_tokens, output_tokens, priority, deadline_s)  # its errors name the field
        rid = next(self._rids)
        self._push_all(self._admit(deployment, prompt_tokens, output_tokens, self.now_s, rid=rid, priority=priority,
                                   deadline_s=deadline_s, blocks=blocks))
        return rid

    def submit_to(self, deployment: str, plan_id: str, prompt_tokens: int, output_tokens: int, *,
                  priority: int = 0) -> Request | None:
        """Admit one request now on the plan another router chose (the live fleet's data endpoint: the
        gateway routes); the request, or None when that plan takes nothing new (not serving, frozen)."""
        dep = self._dep(deployment)
        engine = next((e for e in dep.engines if e.plan.plan_id == plan_id and e.accepting and e.state == "serving"),
                      None)
        if engine is None or prompt_tokens < 1 or output_tokens < 1:
            return None
        rid = next(self._rids)
        self._push_all(self._admit(deployment, prompt_tokens, output_tokens, self.now_s, rid=rid, engine=engine,
                                   priority=priority))
        return self.in_system.get(rid)

    def _admit(self, deployment: str, prompt: int, output: int, t: float, rid: int | None = None, *,
               engine: PlanEngine | None = None, priority: int = 0, deadline_s: float | None = None,
               blocks: tuple[int, ...] = ()) -> list[Event]:
        dep = self.deployments[deployment]
        req = Request(next(self._rids) if rid is None else rid, deployment, t, prompt, output, priority=priority,
                      deadline_s=deadline_s, blocks=blocks)
        self.in_system[req.rid] = req
        self.recorder.admitted[dep.index] += 1
        if self.events is not None:
            self.events.add(LogEvent(t, "seq_admitted", deployment=deployment, seq_id=str(req.rid)))
        dep.win_arrivals += 1
        dep.win_prompt += prompt
        dep.win_prompt_sq += prompt * prompt
        if engine is not None:  # routed already (submit_to)
            engine.rep_arrivals += 1
            engine.rep_prompt.append(req.prompt)
            req.lease = max(req.lease, dep.routing_version)
            return engine.submit(req, t)
        return self._dispatch(dep, req, t, new=True)

    # ======================================================================================
    # routing
    # ======================================================================================
    def _route(self, dep: DeploymentRuntime, req: Request) -> tuple[PlanEngine | None, Decision | None]:
        """The router's choice among the deployment's serving plans in the routing table:
        (engine, decision), (None, decision) when no plan can ever hold the request, and
        (None, None) when none serves."""
        engines = [e for e in dep.engines if e.accepting and e.state == "serving"]
        if not engines:
            return None, None
        pool = self._pool(dep, engines)
        if len(engines) > 1:  # (one plan: the router takes it if it can ever hold the request, load aside)
            pool.set_load_columns(*zip(*(e.route_load() for e in engines), strict=True))
        rr = req.route_req
        if not isinstance(rr, RouteRequest):
            rr = req.route_req = RouteRequest(req.prompt, req.output, req.priority,
                                              None if req.deadline_at is None else req.deadline_at - req.arrival_s,
                                              req.blocks)
        decision = self.router.route(rr, pool, self.now_s)
        slot = decision.chosen
        if slot is None:
            return None, decision
        self.router.admitted(decision, slot)
        req.predicted_ttft_s = decision.predicted_ttft_s(slot)
        req.routed_plan = pool.ids[slot]
        return engines[slot], decision

    def _pool(self, dep: DeploymentRuntime, engines: Sequence[PlanEngine]) -> Pool:
        key = tuple((e.engine_id, id(e.profile), e.weight) for e in engines)
        if dep.pool is None or key != dep.pool_key:
            snap = self.snapshot()
            facts = []
            for e, k in zip(engines, key, strict=True):
                f = self._facts.get(k)
                if f is None:
                    f = self._facts[k] = plan_facts(e.plan, e.model, snap, weight=e.weight, profile=e.profile)
                facts.append(f)
            dep.pool = Pool(facts, model=dep.model.name)
            dep.pool_key = key
        return dep.pool

    def dispatch(self, deployment: str, req: Request, t: float) -> list[Event]:
        """Route a request that left its plan (the router's choice, or the deployment's queue)."""
        return self._dispatch(self._dep(deployment), req, t)

    def _dispatch(self, dep: DeploymentRuntime, req: Request, t: float, new: bool = False) -> list[Event]:
        engine, decision = self._route(dep, req)
        if engine is None:
            if decision is not None:  # no plan of the gear could ever hold it: it ends, explained
                reasons = "; ".join(f"{pid}: {decision.reason(i)}" for i, pid in enumerate(decision.pool.ids))
                self._fail(req, t, f"no plan of {dep.name} can hold it ({reasons})")
                return []
            req.pipe = None
            req.engine_id = 0
            dep.pending.append(req)
            if self.events is not None:
                seqlog.unowned(self.events, req, t)
            return []
        if new:
            engine.rep_arrivals += 1
            engine.rep_prompt.append(req.prompt)
        req.lease = max(req.lease, dep.routing_version)
        return engine.submit(req, t)

    def _flush(self, dep: DeploymentRuntime, t: float) -> list[Event]:
        out: list[Event] = []
        while dep.pending and any(e.accepting and e.state == "serving" for e in dep.engines):
            out += self._dispatch(dep, dep.pending.popleft(), t)
        return out

    # ======================================================================================
    # EngineHost
    # ======================================================================================
    def tokens(self, engine: PlanEngine, t0: float, t1: float, n: int) -> None:
        self.recorder.tokens(t0, t1, n)
        engine.rep_tokens += n

    def first_token(self, req: Request, t: float) -> None:
        """The router learns how late a first token came against its prediction (jitter), for
        requests that ran where it sent them (not moved, not recomputed elsewhere)."""
        if req.routed_plan and not req.migrations and not req.replays:
            self.router.first_token(req.routed_plan, t, t - req.arrival_s, req.predicted_ttft_s)

    def finished(self, req: Request, t: float) -> list[Event]:
        req.finish_s = t
        req.pipe = None
        del self.in_system[req.rid]
        engine = self.engines.get(req.engine_id)
        if self.events is not None:
            self.events.add(LogEvent(t, "seq_finished", deployment=req.deployment, seq_id=str(req.rid),
                                     plan_id=engine.plan.plan_id if engine is not None else ""))
        first = req.first_token_s if req.first_token_s is not None else t
        self.recorder.finished(req.deployment, req.arrival_s, first, t, req.output, req.replays, req.prompt)
        if isinstance(req.route_req, RouteRequest):  # what a learning router learns from
            self.router.finished(req.route_req, first - req.arrival_s,
                                 (t - first) / (req.output - 1) if req.output > 1 else None, t)
        self.preemptions += req.preemptions
        dep = self.deployments[req.deployment]
        dep.win_finished += 1
        dep.win_output += req.output
        dep.win_output_sq += req.output * req.output
        if engine is not None:
            engine.rep_finished += 1
            engine.rep_ttft.append(first - req.arrival_s)
            if req.output > 1:
                engine.rep_tpot.append((t - first) / (req.output - 1))
            engine.rep_output.append(req.output)
        req.engine_id = 0
        return []

    def failed(self, req: Request, t: float, reason: str) -> list[Event]:
        self._fail(req, t, reason)
        return []

    def _fail(self, req: Request, t: float, reason: str) -> None:
        req.error = reason
        req.pipe = None
        self.in_system.pop(req.rid, None)
        self.recorder.failed.append((req.rid, req.deployment, t, reason))
        if self.events is not None:
            self.events.add(LogEvent(t, "seq_failed", deployment=req.deployment, seq_id=str(req.rid),
                                     detail=reason))

    def owns(self, req: Request, engine: PlanEngine) -> None:
        """`req` arrives on `engine`: the per-sequence log records who owns it (agents/sim/seqlog.py)."""
        if self.events is not None:
            seqlog.owns(self.events, req, engine, self.now_s, self._plan_nodes(engine.plan)[0])

    def paused(self, req: Request, boundary: str) -> None:
        """`req` was taken off its pipe at a safe boundary (`decode_end` | `idle`) to be handed over."""
        if self.events is not None:
            seqlog.paused(self.events, req, self.now_s, boundary)

    def pipe_idle(self, engine: PlanEngine, t: float) -> list[Event]:
        if engine.release_when_empty and engine.empty() and engine.state == "serving":
            self._release(engine, t)
        return []

    # ======================================================================================
    # plans
    # ======================================================================================
    def plans(self, deployment: str) -> list[PlanEngine]:
        """The deployment's engines that hold GPUs now (loading, serving, draining)."""
        return list(self._dep(deployment).engines)

    def engine_of(self, deployment: str, plan_id: str) -> PlanEngine | None:
        for e in self._dep(deployment).engines:
            if e.plan.plan_id == plan_id:
                return e
        return None

    def gear_of(self, deployment: str) -> Gear | None:
        """The gear in the routing table now (serving or loading plans that take traffic)."""
        routed = self._dep(deployment).routed()
        if not routed:
            return None
        total = sum(e.weight for e in routed)
        return Gear(routed[0].plan.model, tuple(e.plan for e in routed),
                    tuple(round(e.weight / total, 6) for e in routed))

    def add_deployment(self, deployment: str, model: ModelSpec, slo: Slo, *, priority: int = 0) -> DeploymentRuntime:
        """A deployment the scenario does not list, from the shape and SLO a PREPARE carried (the
        live fleet: one created in the console; agents/protocol.py prepare_plan). It has no scenario
        baseline and no workload of its own: it serves what is submitted to it. The same one again
        is a no-op; the same name with another model is a ValueError naming `model_spec`."""
        dep = self.deployments.get(deployment)
        if dep is not None:
            if dep.model != model:
                raise ValueError(f"model_spec: deployment {deployment!r} runs {dep.model.name!r} with another shape "
                                 "here; a PREPARE cannot change it")
            return dep
        # (no scenario baseline: baseline_plan refuses it; the console chose and placed its gears)
        spec = ModelDeploymentSpec(deployment, model.name, slo.ttft_ms, slo.tpot_ms, priority, BaselineSpec(1, 1, ()))
        dep = DeploymentRuntime(spec, model, slo, len(self.deployments))
        self.deployments[deployment] = dep
        self.recorder.add_deployment(deployment, (slo.ttft_ms / 1e3, slo.tpot_ms / 1e3))
        return dep

    def _dep(self, deployment: str) -> DeploymentRuntime:
        try:
            return self.deployments[deployment]
        except KeyError:
            raise ValueError(f"deployment: unknown {deployment!r}; known: {', '.join(self.deployments)}") from None

    def load_time_s(self, deployment: str, plan: Plan, source: LoadSource) -> float:
        """How long `plan` takes to come up: its weights from host memory over each GPU's host
        link, or from disk per node (costmodel.switch_cost's PREPARE time; shards the
        deployment already holds in place cost nothing), plus a process start from disk."""
        if source == "warm":
            return 0.0
        dep = self._dep(deployment)
        current = [e.plan for e in dep.engines if e.state != "dead"]
        held = Gear(plan.model, tuple(current), tuple(1.0 / len(current) for _ in current)) if current else None
        cost = switch_cost(held, Gear(plan.model, (plan,), (1.0,)), dep.model, self.snapshot(),
                           Workload(0.0, 1.0, 1.0), weights_in_host_memory=source == "host", eff=self.eff)
        return cost.prepare_s + (self.options.disk_cold_start_s if source == "disk" else 0.0)

    def launch(self, deployment: str, plan: Plan, *, source: LoadSource = "host", accepting: bool = False,
               weight: float = 1.0, ready_in_s: float | None = None) -> PlanEngine:
        """PREPARE a plan: it holds its GPUs' memory at once and serves after its load time.
        `accepting`: it joins the routing table (takes traffic once it serves)."""
        dep = self._dep(deployment)
        if plan.model != dep.model.name:
            raise ValueError(f"plan.model: {plan.model!r} is not {deployment}'s model {dep.model.name!r}")
        if any(e.plan == plan for e in dep.engines):
            raise ValueError(f"plan: {plan.plan_id} already runs for {deployment}")
        lost = [u for u in plan.gpu_uuids if not self._gpu_usable(u)]
        if lost:
            raise ValueError(f"plan.gpus: {', '.join(lost[:3])} not usable now (taken, failed or gone)")
        fp = plan_memory(plan, dep.model)
        self._refuse(plan, fp)
        delay = self.load_time_s(deployment, plan, source) if ready_in_s is None else ready_in_s
        t = self.now_s
        profile = PlanProfile.build(plan, dep.model, self.snapshot(), self.eff)
        engine = PlanEngine(next(self._engine_ids), deployment, plan, profile, dep.model, self, ready_s=t + delay)
        engine.launched_s = t
        engine.accepting = accepting
        engine.weight = max(weight, 1e-9)
        self.engines[engine.engine_id] = engine
        self.live[engine.engine_id] = engine
        dep.engines.append(engine)
        self._footprint[engine.engine_id] = fp
        self._booked_now(t, plan, fp)
        self._reshare()
        self._snapshot = None
        if delay <= 0:
            self._push_all(self._on_ready(t, engine))
        else:
            self._push(t + delay, KIND_READY, self._on_ready, engine)
        return engine

    # -- memory (DESIGN.md invariant 4; scheduler.booking) --------------------------------------
    def booked_bytes(self) -> dict[str, int]:
        """GPU uuid -> bytes our plans hold there now (an idle CUDA context included), as the
        agents report it: every plan that holds the GPU, loading, serving or draining."""
        used: dict[str, int] = {}
        for fp in self._footprint.values():
            for u, b in fp.items():
                used[u] = used.get(u, 0) + b
        return {u: IDLE_MEM_BYTES + b for u, b in used.items()}

    def _refuse(self, plan: Plan, want: Mapping[str, int]) -> None:
        """An agent's PREPARE check (scheduler.booking.refuse_booking, the real daemon's words):
        Refused (code out_of_memory) when the plan does not fit beside what its GPUs hold."""
        booked = self.booked_bytes()
        used = {u: booked.get(u, IDLE_MEM_BYTES) for u in want}
        total = {u: gpu_spec(self._gpu_model(u)).mem_bytes for u in want}
        over = refuse_booking(want, used, total)
        if over is not None:
            self.refused_prepares += 1
            raise Refused(over.message(), REFUSAL_REASON, gpus=[over.gpu])

    def _booked_now(self, t: float, plan: Plan, fp: Mapping[str, int]) -> None:
        """Record what the GPUs of a plan hold after it booked them (the peak, and the events the
        invariant checker recomputes)."""
        booked = self.booked_bytes()
        gpus = []
        for u in sorted(fp):
            total = gpu_spec(self._gpu_model(u)).mem_bytes
            self.peak_booked_fraction = max(self.peak_booked_fraction, booked[u] / total)
            gpus.append((u, booked[u], total))
        self.memory_log.add(LogEvent(t, "mem_booked", plan_id=plan.plan_id, gpus=tuple(gpus)))

    def _gpu_model(self, uuid: str) -> str:
        return self._gpu_models[uuid]

    def _on_ready(self, t: float, arg: object) -> list[Event]:
        engine = arg
        assert isinstance(engine, PlanEngine)  # noqa: S101 - events carry what their handler expects
        if engine.state != "loading":
            return []  # stopped while loading
        out = engine.start(t)
        dep = self.deployments[engine.deployment]
        if engine.accepting:
            out += self._flush(dep, t)
            self._gear_changed(dep, t)
        self.listener.on_ready(self, t, engine)
        return out

    def set_routing(self, deployment: str, weights: Mapping[int, float], version: int | None = None) -> None:
        """The routing table of a deployment: engine id -> weight. Engines left out stop taking
        new requests (what they hold stays with them). `version`: the committed table's, which
        the leases of the requests routed from now on carry."""
        dep = self._dep(deployment)
        ids = {e.engine_id for e in dep.engines}
        unknown = [i for i in weights if i not in ids]
        if unknown:
            raise ValueError(f"weights: engines {unknown} are not plans of {deployment}")
        if version is not None:
            dep.routing_version = max(dep.routing_version, version)
        for e in dep.engines:
            e.accepting = e.engine_id in weights
            if e.accepting:
                e.weight = max(float(weights[e.engine_id]), 1e-9)
        self._push_all(self._flush(dep, self.now_s))
        routed = dep.routed()
        if routed and all(e.state == "serving" for e in routed):
            self._gear_changed(dep, self.now_s)

    def _gear_changed(self, dep: DeploymentRuntime, t: float, *, serving: bool = True) -> None:
        """Record what the deployment serves with now; `serving`: a new gear took traffic (it
        closes what earlier changes broke), else what a loss left of the gear."""
        routed = [e for e in dep.routed() if e.state == "serving"]
        shape = " + ".join(e.plan.shape() for e in routed) if routed else "none"
        gpus = sum(len(e.plan.gpu_uuids) for e in routed)
        if serving:
            self.recorder.gear_serving(dep.name, t, shape, gpus)
        else:
            self.recorder.gear_timeline.append((t, dep.name, shape, gpus))

    def retire(self, engine: PlanEngine, mode: RetireMode, record: SwitchRecord | None = None) -> None:
        """Take a plan out of service.

        * drain: no new requests; what it holds finishes there; released when empty.
        * move: no new requests; its queue moves at once to the routed plans, and at its next
          round boundary its sequences move too - each the cheaper of migrating its KV (along
          `costmodel.kv_route`, one at a time per route) or recomputing it on the new plan
          (`costmodel.migrate_or_replay`) - except those within `stay_tokens` of done, which
          finish where they are (seed 000 section 5.3).
        * stop: at once; KV dropped, everything recomputed elsewhere.
        * free: at once, and every sequence arrives on the routed plans with its KV, at no cost
          (the oracle's switch).
        """
        t = self.now_s
        dep = self.deployments[engine.deployment]
        engine.accepting = False
        if engine.state == "dead" or engine.engine_id not in self.live:
            return
        if mode in ("stop", "free") or engine.state == "loading":
            reqs, events = engine.stop(t, keep_kv=mode == "free")
            self._push_all(events)
            self._drop(engine, t)
            out: list[Event] = []
            for req in reqs:
                if mode != "free" and (req.generated or req.done):
                    req.replays += 1
                out += self._dispatch(dep, req, t)
            self._push_all(out)
            if record is not None:
                if mode == "free":
                    record.migrated += len(reqs)
                else:
                    record.replayed += len(reqs)
            return
        engine.release_when_empty = True
        out = []
        for pipe in engine.pipes:
            queued = list(pipe.waiting)
            pipe.waiting.clear()
            for req in queued:
                self.paused(req, "idle")
                out += self._dispatch(dep, req, t)
        if mode == "move":
            for pipe in engine.pipes:
                hand = self._hand_over_fn(dep, record)
                if pipe.busy:
                    pipe.handover = hand
                else:
                    out += hand(pipe, t)
        self._push_all(out)
        if engine.empty():
            self._release(engine, t)

    def _hand_over_fn(self, dep: DeploymentRuntime, record: SwitchRecord | None
                      ) -> Callable[[Pipe, float], list[Event]]:
        stay = self.options.stay_tokens

        def keep(req: Request) -> bool:
            return req.output - req.tokens_now() <= stay

        def hand(pipe: Pipe, t: float) -> list[Event]:
            out: list[Event] = []
            taken = pipe.take_running(keep)
            for req in taken:
                self.paused(req, "decode_end")  # the round in flight ended: a safe boundary
            queued = list(pipe.waiting)
            pipe.waiting.clear()
            for req in queued:
                self.paused(req, "idle")
            taken += queued
            if record is not None:
                record.stayed += len(pipe.running)
            for req in taken:
                out += self._move(dep, pipe.engine, req, t, record)
            return out

        return hand

    def _move(self, dep: DeploymentRuntime, src: PlanEngine, req: Request, t: float,
              record: SwitchRecord | None) -> list[Event]:
        """One sequence leaves `src` for a routed plan: KV migrated or recomputed, the cheaper."""
        dst, _ = self._route(dep, req)
        if dst is None or not req.has_kv:
            if req.has_kv:
                req.drop_kv()
            if req.generated or req.done:
                req.replays += 1
                if record is not None:
                    record.replayed += 1
            return self._dispatch(dep, req, t)
        key = (src.engine_id, dst.engine_id)
        hit = self._routes.get(key)
        if hit is None:
            src_stages = src.plan.decode_stages if src.plan.mode == "disaggregated" else src.plan.stages
            dst_stages = dst.plan.decode_stages if dst.plan.mode == "disaggregated" else dst.plan.stages
            hit = (kv_route(src_stages, dst_stages, dep.model, self.snapshot(), self.eff), t)
        route, free_s = hit
        move = migrate_or_replay(req.prompt + req.generated, route, dst.profile.pipeline("prefill"))
        if move.choice == "replay":
            req.drop_kv()
            req.replays += 1
            if record is not None:
                record.replayed += 1
            return dst.submit(req, t)
        start = max(t, free_s)
        land = start + move.migrate_s
        self._routes[key] = (route, land)
        req.migrations += 1
        if record is not None:
            record.migrated += 1
        return dst.expect(req, land)

    def _reshare(self) -> None:
        """Each engine's slowdown: how many engines hold memory on its busiest GPU. A round in
        flight keeps its time; the next one uses the new share."""
        holders: dict[str, int] = {}
        for fp in self._footprint.values():
            for u in fp:
                holders[u] = holders.get(u, 0) + 1
        for engine in self.live.values():
            share = float(max((holders.get(u, 1) for u in engine.plan.gpu_uuids), default=1))
            if share > 1 and engine.share == 1.0:
                self.shared_launches += 1
            engine.share = share

    def _release(self, engine: PlanEngine, t: float) -> None:
        engine.state = "released"
        self._drop(engine, t)

    def _drop(self, engine: PlanEngine, t: float) -> None:
        """The engine no longer holds GPU memory (released, stopped or lost): the listener hears."""
        dep = self.deployments[engine.deployment]
        if engine in dep.engines:
            dep.engines.remove(engine)
        self.live.pop(engine.engine_id, None)
        self._footprint.pop(engine.engine_id, None)
        self._ended_s[engine.engine_id] = t
        self.router.forget(engine.plan.plan_id)  # its prefix cache and its latency history went with it
        self._reshare()
        self._snapshot = None
        self.listener.on_released(self, t, engine)

    # -- the driver API in plan ids (what the console's commands name) ----------------------
    def add_plan(self, deployment: str, plan: Plan | Mapping[str, Any], *, weight: float = 1.0,
                 route: bool = True, source: LoadSource = "host") -> PlanEngine:
        """Start a commanded plan: it comes up after its modelled weight load, then takes
        traffic (with `route`) at `weight` relative to the others."""
        p = plan if isinstance(plan, Plan) else Plan.from_dict(plan, "plan")
        return self.launch(deployment, p, source=source, accepting=route, weight=weight)

    def remove_plan(self, deployment: str, plan_id: str, *, mode: RetireMode = "move") -> None:
        """Stop a plan: by default its sequences move to the other routed plans (or finish where
        they are when no other plan serves)."""
        engine = self.engine_of(deployment, plan_id)
        if engine is None:
            raise ValueError(f"plan_id: {plan_id!r} is not a running plan of {deployment}")
        if mode == "move" and not any(e is not engine and e.accepting and e.state == "serving"
                                      for e in self._dep(deployment).engines):
            mode = "drain"
        self.retire(engine, mode)

    def set_weights(self, deployment: str, weights: Mapping[str, float]) -> None:
        """Routing weights by plan id; plans not named stop taking new requests."""
        ids: dict[int, float] = {}
        for plan_id, w in weights.items():
            engine = self.engine_of(deployment, plan_id)
            if engine is None:
                raise ValueError(f"weights.{plan_id}: not a running plan of {deployment}")
            ids[engine.engine_id] = w
        self.set_routing(deployment, ids)

    # ======================================================================================
    # the cluster
    # ======================================================================================
    def _push_cluster(self) -> None:
        nxt = self.cluster.next_change_s()
        if nxt is not None:
            self._push(nxt, KIND_CLUSTER, self._on_cluster, None)

    def gpu_usable(self, uuid: str) -> bool:
        """The GPU is ours now (not another tenant's, not failed, its node present)."""
        return self._gpu_usable(uuid)

    def _gpu_usable(self, uuid: str) -> bool:
        g = self._gpus_by_uuid().get(uuid)
        return g is not None and g.owner == US

    def _gpus_by_uuid(self) -> dict[str, Any]:
        return {g.uuid: g for n in self.cluster.nodes.values() for g in n.gpus}

    def _account_availability(self, t: float) -> None:
        span = min(t, self.scenario.duration_s) - self._avail_t
        if span > 0:
            ours = [g for n in self.cluster.nodes.values() for g in n.gpus if g.owner == US]
            self._avail_mem_byte_s += span * sum(gpu_spec(g.model).mem_bytes for g in ours)
            self._avail_flop += span * sum(gpu_spec(g.model).bf16_flops for g in ours)
            self._avail_t = min(t, self.scenario.duration_s)

    def _on_cluster(self, t: float, _: object) -> list[Event]:
        self._account_availability(t)
        changes = self.cluster.advance_to(t)
        self.change_log.extend(changes)
        self._snapshot = None
        self._links = None
        gpus = self._gpus_by_uuid()
        out: list[Event] = []
        broke: dict[str, list[PlanEngine]] = {}
        broke_nodes: dict[str, set[str]] = {}  # node -> deployments whose serving plan it broke
        for engine in list(self.live.values()):
            gone = [u for u in engine.plan.gpu_uuids if u not in gpus or gpus[u].owner != US]
            if not gone:
                continue
            serving = engine.state == "serving"
            out += self._kill(engine, t)
            if serving:
                broke.setdefault(engine.deployment, []).append(engine)
                for u in gone:
                    broke_nodes.setdefault(self._gpu_home[u][0], set()).add(engine.deployment)
        if any(c.kind in ("degrade_link", "link_restored", "join", "leave") for c in changes):
            snap = self.snapshot()
            for engine in self.live.values():
                if len(set(self._plan_nodes(engine.plan))) > 1:
                    engine.profile = PlanProfile.build(engine.plan, engine.model, snap, self.eff)
                    for pipe, role in zip(engine.pipes, ("prefill", "decode"), strict=False):
                        pipe.prof = engine.profile.pipeline(role)  # type: ignore[arg-type]
                    self._routes = {k: v for k, v in self._routes.items() if engine.engine_id not in k}
        # each broken deployment is charged to the change that took its GPUs' node
        for c in changes:
            hit = sorted(broke_nodes.pop(c.node or "", set())) if c.kind in ("preempt", "fail", "leave") else []
            self.recorder.change(c.at_s, c.kind, c.node, c.text, hit)
        self.listener.on_cluster_change(self, t, changes, broke)
        self._push_cluster()
        return out

    def plan_nodes(self, plan: Plan) -> list[str]:
        return self._plan_nodes(plan)

    def _plan_nodes(self, plan: Plan) -> list[str]:
        """The node of each stage, in pipeline order (prefill stages, then decode stages)."""
        return [self._gpu_home[st.gpu_uuids[0]][0] for st in plan.all_stages]

    def _kill(self, engine: PlanEngine, t: float) -> list[Event]:
        """A plan lost a GPU: it stops now, its KV is gone, its requests are recomputed."""
        dep = self.deployments[engine.deployment]
        was_routed = engine.accepting
        reqs, out = engine.stop(t, keep_kv=self.kv_survives_loss)
        self._drop(engine, t)
        if was_routed:
            self._gear_changed(dep, t, serving=False)
        for req in reqs:
            if (req.generated or req.done) and not req.has_kv:
                req.replays += 1
            out += self._dispatch(dep, req, t)
        return out

    # ======================================================================================
    # what the controller sees
    # ======================================================================================
    def snapshot(self) -> Snapshot:
        """The cluster as agents would report it now: our plans' memory (weights + KV reserve)
        on their GPUs, other tenants' GPUs unschedulable, failed GPUs unhealthy."""
        if self._snapshot is not None and self._snapshot.now_s == self.now_s:
            return self._snapshot
        now = self.now_s
        used: dict[str, int] = {}
        for fp in self._footprint.values():
            for u, b in fp.items():
                used[u] = used.get(u, 0) + b
        nodes: list[NodeState] = []
        gpus: list[GpuState] = []
        for node_id in sorted(self.cluster.nodes):
            node = self.cluster.nodes[node_id]
            nodes.append(NodeState(id=node_id, rack=node.spec.rack, schedulable=True, last_seen_s=now))
            for g in node.gpus:
                total = gpu_spec(g.model).mem_bytes
                if g.owner == TENANT:
                    mem = int(self.tenant_fraction[(node_id, g.index)] * total)
                else:
                    mem = min(total, IDLE_MEM_BYTES + used.get(g.uuid, 0))
                gpus.append(GpuState(
                    uuid=g.uuid, node_id=node_id, index=g.index, model=g.model, mem_total_bytes=total,
                    mem_used_bytes=mem, healthy=g.owner != FAILED, schedulable=g.owner != TENANT,
                    nvlink_group=g.nvlink_group, xid_errors=g.xid_errors, ecc_errors=g.ecc_errors,
                    last_seen_s=now))
        net = self.scenario.network
        self._snapshot = Snapshot(
            now_s=now, nodes=tuple(nodes), gpus=tuple(gpus), links=self._link_states(),
            intra_rack_gbps=net.intra_rack_gbps, inter_rack_gbps=net.inter_rack_gbps)
        return self._snapshot

    def _link_states(self) -> tuple[LinkState, ...]:
        """Node pairs whose bandwidth differs from the rack rule (explicit links, degradations)."""
        if self._links is None:
            ids = sorted(self.cluster.nodes)
            net = self.scenario.network
            out = []
            for i, a in enumerate(ids):
                for b in ids[i + 1:]:
                    na, nb = self.cluster.nodes[a].spec, self.cluster.nodes[b].spec
                    default = net.intra_rack_gbps if na.rack == nb.rack else net.inter_rack_gbps
                    gbps = self.cluster.link_gbps(a, b)
                    if gbps != default:
                        out.append(LinkState(a=a, b=b, bw_gbps=gbps))
            self._links = tuple(out)
        return self._links

    def load_sample(self, deployment: str, t: float) -> LoadSample | None:
        """The deployment's load since the previous sample (what its agents' engine reports sum
        to): arrivals per second, prompt lengths of the arrivals, output lengths of the requests
        that finished. None for an empty interval."""
        dep = self._dep(deployment)
        span = t - dep.win_since_s
        if span <= 0:
            return None
        n, f = dep.win_arrivals, dep.win_finished
        prompt_mean = dep.win_prompt / n if n else 1.0
        if f:
            dep.last_output_mean = dep.win_output / f
        output_mean = dep.last_output_mean or _expected_output(self.scenario, deployment)
        sample = LoadSample(
            t_s=t, rate_rps=n / span, prompt_tokens_mean=max(1.0, prompt_mean),
            output_tokens_mean=max(1.0, output_mean),
            prompt_tokens_cv=_cv(n, dep.win_prompt, dep.win_prompt_sq, 1.0),
            output_tokens_cv=_cv(f, dep.win_output, dep.win_output_sq, 0.6),
            backlog=self.backlog(deployment),
        )
        dep.win_arrivals = dep.win_finished = 0
        dep.win_prompt = dep.win_prompt_sq = dep.win_output = dep.win_output_sq = 0.0
        dep.win_since_s = t
        return sample

    def backlog(self, deployment: str) -> int:
        """Requests of the deployment waiting for admission: in its plans' queues (what their
        engines report as waiting) and in its own queue while no plan can take them."""
        dep = self._dep(deployment)
        waiting = sum(len(p.waiting) for e in self.live.values() if e.deployment == deployment for p in e.pipes)
        return waiting + len(dep.pending)

    def engine_reports(self, leader: str | None = None) -> list[PlanMetrics]:
        """Per serving plan, its engine metrics since the previous call (agents.protocol's
        EngineReport), with the nodes that host it. With `leader`, only the plans whose first
        node that is - the live fleet's agents report at their own times, and each must reset
        only the counters of the plans it reports."""
        t = self.now_s
        out: list[PlanMetrics] = []
        for engine in sorted(self.live.values(), key=lambda e: e.engine_id):
            if engine.state != "serving":
                continue
            if leader is not None and self._plan_nodes(engine.plan)[0] != leader:
                continue
            span = t - max(engine.rep_since_s, engine.started_s)
            running = sum(len(p.running) for p in engine.pipes) + len(engine.in_flight)
            waiting = sum(len(p.waiting) for p in engine.pipes)
            kv = max(p.kv_used / p.kv_cap if p.kv_cap else 0.0 for p in engine.pipes)
            report = EngineReport(
                plan_id=engine.plan.plan_id, running=running, waiting=waiting,
                tokens_per_s=round(engine.rep_tokens / span, 3) if span > 0 else 0.0,
                kv_usage=round(min(1.0, kv), 4),
                ttft_p50_ms=_ms(engine.rep_ttft, 50), ttft_p95_ms=_ms(engine.rep_ttft, 95),
                tpot_p50_ms=_ms(engine.rep_tpot, 50), tpot_p95_ms=_ms(engine.rep_tpot, 95),
                finished=engine.rep_finished, arrivals=engine.rep_arrivals,
                prompt_tokens_mean=_mean(engine.rep_prompt), output_tokens_mean=_mean(engine.rep_output))
            nodes = tuple(dict.fromkeys(self._plan_nodes(engine.plan)))
            out.append(PlanMetrics(engine.deployment, nodes, report))
            engine.rep_tokens = engine.rep_finished = engine.rep_arrivals = 0
            engine.rep_ttft, engine.rep_tpot, engine.rep_prompt, engine.rep_output = [], [], [], []
            engine.rep_since_s = t
        return out

    def expire_pending(self, max_wait_s: float) -> int:
        """Fail, with an explicit error, the requests that have waited in a deployment's own
        queue (no serving plan routed) for more than `max_wait_s` since a call first saw them
        there; returns how many. The live fleet calls it on every pass: before the controller
        brings a plan up, or while a deployment has none, its requests must not wait forever
        (invariant 1: they end, with a reason). A replay never calls it: its drain ends them."""
        t = self.now_s
        queued: set[int] = set()
        expired = 0
        for dep in self.deployments.values():
            keep: deque[Request] = deque()
            for req in dep.pending:
                since = self._pending_seen.setdefault(req.rid, t)
                if t - since > max_wait_s:
                    self._fail(req, t, f"no plan of {dep.name} took it within {max_wait_s:g} s")
                    expired += 1
                else:
                    keep.append(req)
                    queued.add(req.rid)
            dep.pending = keep
        self._pending_seen = {rid: s for rid, s in self._pending_seen.items() if rid in queued}
        return expired

    def break_gpus(self, uuids: Iterable[str]) -> list[PlanEngine]:
        """Every plan holding one of these GPUs crashes now, as when a rank dies, though the GPUs
        stay ours (an injected fault, not a scenario event): its KV is gone and its requests go
        back to the router to be recomputed. Returns the engines that stopped."""
        hit = set(uuids)
        broken = [e for e in self.live.values() if hit.intersection(e.plan.gpu_uuids)]
        for engine in broken:
            self._push_all(self._kill(engine, self.now_s))
        return broken

    def gpu_load(self) -> dict[tuple[str, int], tuple[float, float]]:
        """(node, GPU index) -> (memory used fraction, utilisation) for every GPU of a plan (what
        agents/sim/live.py reports as SM utilisation). Utilisation is the share of the time
        since the previous call in which the plan ran rounds."""
        t = self.now_s
        span = t - self._gpu_load_t
        by_uuid = self._gpus_by_uuid()
        out: dict[tuple[str, int], tuple[float, float]] = {}
        for engine in self.live.values():
            busy = sum(p.busy_s for p in engine.pipes)
            prev = self._gpu_busy_mark.get(engine.engine_id, busy if engine.state != "serving" else 0.0)
            util = min(1.0, max(0.0, (busy - prev) / span)) if span > 0 else 0.0
            self._gpu_busy_mark[engine.engine_id] = busy
            for u, b in self._footprint.get(engine.engine_id, {}).items():
                g = by_uuid.get(u)
                if g is None:
                    continue
                total = gpu_spec(g.model).mem_bytes
                out[(g.node_id, g.index)] = (min(1.0, (IDLE_MEM_BYTES + b) / total), round(util, 3))
        self._gpu_load_t = t
        return out

    # ======================================================================================
    # baselines
    # ======================================================================================
    def baseline_plan(self, deployment: str, taken: Mapping[str, set[int]] | None = None) -> Plan:
        """The deployment's baseline plan on the GPUs that are ours now: its stages fill the
        listed nodes in order on their first free GPUs (as agents/sim/live.py places it), layers
        split evenly, KV reserve = all that fits under 92% of each GPU."""
        dep = self._dep(deployment)
        base = dep.spec.baseline
        if not base.nodes:
            raise ValueError(f"deployment: {deployment!r} has no scenario baseline (it came with a PREPARE)")
        taken = taken or {}
        free = {n: [g.index for g in self.cluster.our_gpus(n) if g.index not in taken.get(n, set())]
                for n in base.nodes}
        stage_nodes = baseline_stage_nodes(base, {n: len(v) for n, v in free.items()})
        path = f"models[{dep.index}].baseline"
        if stage_nodes is None:
            raise ValueError(f"{path}: {base.pp} stage(s) of tp={base.tp} do not fit on the free GPUs of"
                             f" {', '.join(base.nodes)} now")
        model = dep.model
        per_stage = [model.num_layers // base.pp + (1 if i < model.num_layers % base.pp else 0)
                     for i in range(base.pp)]
        used_here: dict[str, int] = {}
        stages: list[Stage] = []
        start = 0
        for node_id, n_layers in zip(stage_nodes, per_stage, strict=True):
            k = used_here.get(node_id, 0)
            idx = free[node_id][k:k + base.tp]
            used_here[node_id] = k + base.tp
            stages.append(Stage(start, start + n_layers, tuple(self.cluster.gpu_uuid(node_id, i) for i in idx)))
            start += n_layers
        kv = max_kv_tokens(stages, model, self.snapshot())
        if kv < model.max_context_tokens // 4:
            raise ValueError(f"{path}: tp={base.tp} x pp={base.pp} of {model.name} leaves {kv} tokens of KV cache"
                             f" on {', '.join(base.nodes)} (weights barely fit); raise tp or pp")
        return Plan(model.name, "colocated", tuple(stages), kv_reserve_tokens=kv)

    def start_baselines(self) -> dict[str, PlanEngine]:
        """Every deployment's baseline plan, warm and serving now (what runs before the scenario
        starts). Deployments are placed in file order, each on GPUs the earlier ones left."""
        taken: dict[str, set[int]] = {}
        out: dict[str, PlanEngine] = {}
        for name, dep in self.deployments.items():
            plan = self.baseline_plan(name, taken)
            dep.baseline = plan
            for u in plan.gpu_uuids:
                node, index = self._gpu_home[u]
                taken.setdefault(node, set()).add(index)
            out[name] = self.launch(name, plan, source="warm", accepting=True)
        return out

    # ======================================================================================
    # accounting
    # ======================================================================================
    def _mark_duration(self, t: float, _: object) -> list[Event]:
        """At duration_s: freeze the utilisation figures (the drain does not count)."""
        self._account_availability(t)
        flop = kv_byte_s = weight_byte_s = gpu_s = 0.0
        for engine in self.engines.values():
            per_token = float(engine.model.linear_flops_per_token)
            for pipe in engine.pipes:
                flop += pipe.tokens_done * per_token
                kv_byte_s += pipe.kv_token_s * pipe.kv_bytes_per_token
            up = engine.started_s if engine.state != "loading" else t
            end = min(self._ended_s.get(engine.engine_id, t), t)
            if engine.state in ("serving", "released", "dead") and end > up:
                weight_byte_s += engine.weight_bytes * (end - up)
            # GPUs held: from launch (memory is held while loading) to release, within [0, t]
            held_end = min(self._ended_s.get(engine.engine_id, t), t)
            gpu_s += len(engine.plan.gpu_uuids) * max(0.0, held_end - engine.launched_s)
        mem = (weight_byte_s + kv_byte_s) / self._avail_mem_byte_s if self._avail_mem_byte_s else 0.0
        compute = flop / self._avail_flop if self._avail_flop else 0.0
        self.recorder.util = (min(1.0, mem), min(1.0, compute))
        self.recorder.gpu_hours = gpu_s / 3600
        return []


def _cv(n: int, total: float, sq: float, default: float) -> float:
    if n < 2 or total <= 0:
        return default
    mean = total / n
    var = max(0.0, sq / n - mean * mean)
    return math.sqrt(var) / mean


def _ms(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    i = min(len(s) - 1, max(0, int(math.ceil(q / 100 * len(s))) - 1))
    return round(s[i] * 1e3, 3)


def _mean(values: list[int]) -> float | None:
    return round(sum(values) / len(values), 3) if values else None


def _expected_output(scenario: Scenario, deployment: str) -> float:
    for w in scenario.workload:
        if w.deployment == deployment:
            if w.output_tokens is not None:
                return max(1.0, w.output_tokens.expected())
            if w.trace:
                return sum(r.output_tokens for r in w.trace) / len(w.trace)
    return 128.0
