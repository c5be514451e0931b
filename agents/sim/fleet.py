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

For a test's or a bench's world - a FleetSim over a cluster `Snapshot` (its GPU uuids), its
agents fed by a command mailbox, routing as the committed table says: agents/sim/world.py.

Losses: a plan that loses a GPU (preempted, failed, node gone) stops at once, as a real engine
crashes when one of its ranks disappears; its memory is freed, and its requests go back to the
deployment's router to be recomputed elsewhere (their KV was on those GPUs). Requests that no
serving plan can take wait in the deployment's queue: nothing admitted is ever dropped.

One class, FleetSim, over five modules, one concept each: this one (the event loop, plans and
their memory, baselines), agents/sim/gateway.py (arrivals, routing, the deployments' queues, the
engines' call-backs), handover.py (taking a plan out of service, its sequences' hand-over),
churn.py (cluster changes and the plans they break), reports.py (what the agents report, the
accounting), hints.py (the engines' local hint loop) and jobs.py (fine-tune and batch jobs on the
same GPUs); each of the others is a mixin whose methods run on FleetSim's state.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from agents.sim.baselines import Baselines
from agents.sim.churn import Churn
from agents.sim.cluster import US, Change, SimCluster
from agents.sim.engine import (
    ALWAYS_BUSY,
    KIND_READY,
    KIND_TIMER,
    MAX_RUN_ROUNDS,
    BusySource,
    Event,
    Pipe,
    PlanEngine,
    Request,
)
from agents.sim.gateway import DeploymentRuntime, Gateway
from agents.sim.handover import Handover, RetireMode
from agents.sim.hints import Hinting
from agents.sim.jobs import Jobs
from agents.sim.kvtiers import KvTierOptions, KvTiers, TierView
from agents.sim.metrics import Recorder, check_conservation
from agents.sim.reports import IDLE_MEM_BYTES, Reports
from agents.sim.scenario import BaselineSpec, ModelDeploymentSpec, Scenario
from agents.sim.workload import Arrival
from scheduler.booking import REFUSAL_REASON, plan_memory, refuse_booking
from scheduler.buckets import LengthBuckets
from scheduler.control.correction import LOCAL_LOOP_S, HintBook
from scheduler.costmodel import (
    COLD_START_S,
    DEFAULT_EFFICIENCY,
    Efficiency,
    KvRoute,
    PlanProfile,
    Slo,
    Workload,
    switch_cost,
)
from scheduler.hardware import gpu_spec
from scheduler.invariants import EventLog, LogEvent
from scheduler.modelspec import ModelSpec, model_spec
from scheduler.plan import Gear, Plan
from scheduler.pool.sharing import MAX_MODELS_PER_GPU
from scheduler.refusal import Refused
from scheduler.router import (
    BLOCK_TOKENS,
    PlanFacts,
    RoutingPolicy,
    make_router,
)
from scheduler.router.spillover import SpillWatch
from scheduler.topology import LinkState, Snapshot

LoadSource = Literal["warm", "host", "disk"]


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
    length_buckets: LengthBuckets | None = None  # batching split by prompt length (scheduler/buckets.py); None: FCFS
    local_loop_s: float = LOCAL_LOOP_S  # how often an engine's local loop reads its hints (agents/sim/hints.py)
    kv_tiers: KvTierOptions | None = None  # GPU -> host -> SSD KV tiers (agents/sim/kvtiers.py); None: off


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
    local_loop_s: float  # the engines' local loop period (sim seconds)

    def tokens(self, engine: PlanEngine, t0: float, t1: float, n: int) -> None: ...

    def first_token(self, req: Request, t: float) -> None: ...

    def finished(self, req: Request, t: float) -> list[Event]: ...

    def failed(self, req: Request, t: float, reason: str) -> list[Event]: ...

    def pipe_idle(self, engine: PlanEngine, t: float) -> list[Event]: ...

    def owns(self, req: Request, engine: PlanEngine) -> None: ...

    @property
    def log_decodes(self) -> bool: ...

    def decoded(self, req: Request, engine: PlanEngine, t: float) -> None: ...

    def tier_view(self, pipe: Pipe) -> TierView | None:
        """The pipe's view of its node's KV tiers (agents/sim/kvtiers.py); None: tiers off."""
        ...


class FleetSim(Gateway, Handover, Churn, Reports, Hinting, Jobs, Baselines):
    """The simulator (module docstring). Deterministic: the scenario seed drives the cluster's
    draws; nothing reads a wall clock or a global random state."""

    def __init__(self, scenario: Scenario, *, options: SimOptions = DEFAULT_OPTIONS,
                 eff: Efficiency = DEFAULT_EFFICIENCY, listener: SimListener | None = None,
                 router: RoutingPolicy | None = None, gpu_uuids: Mapping[tuple[str, int], str] | None = None,
                 gpu_mem_bytes: Mapping[str, int] | None = None) -> None:
        self.scenario = scenario
        self.options = options
        self.eff = eff
        # `gpu_uuids`: (node, index) -> uuid, and `gpu_mem_bytes`: uuid -> memory, for a cluster
        # whose agents reported them already (a Snapshot's: agents/sim/world.py); the others
        # derive their uuids from the scenario and their memory from the hardware catalog
        self._gpu_mem = dict(gpu_mem_bytes or {})
        self.cluster = SimCluster(scenario, random.Random(scenario.seed), gpu_uuids)
        # another tenant's memory on the GPUs it holds, fixed per GPU (as agents/sim/live.py draws it)
        tenant_rng = random.Random(scenario.seed ^ 0x5EED)
        self.tenant_fraction = {(n.id, i): tenant_rng.uniform(0.55, 0.95)
                                for n in scenario.all_nodes() for i in range(n.gpus)}
        self.listener: SimListener = listener or _Silent()
        self.max_run_rounds = options.max_run_rounds
        self.prefix_block_tokens = options.prefix_block_tokens
        self.length_buckets = options.length_buckets
        self.local_loop_s = options.local_loop_s
        self.kv_tiers = None if options.kv_tiers is None else KvTiers(
            options.kv_tiers, {n.id: (n.host_kv_gib, n.ssd_kv_gib) for n in scenario.all_nodes()})
        self.hint_books: dict[str, HintBook] = {}  # node id -> the global correction's hints it holds
        # the one request router (scheduler.router), as the gateway runs it; a baseline in bench.route
        self.router: RoutingPolicy = router or make_router("flexpipe", seed=scenario.seed)
        spill = getattr(getattr(self.router, "config", None), "spill", None)  # a policy with KV spillover
        self.spill_watch = SpillWatch(spill) if spill is not None else None  # its timeouts (gateway.py)
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
        # deployments that may hold plans on one GPU (scheduler.pool.sharing; the policy sets its
        # loop's): the memory log carries it, so the invariant checker judges each booking by it
        self.max_models_per_gpu = MAX_MODELS_PER_GPU
        # every booking, for scheduler.invariants.check (invariant 4); a few per switch
        self.memory_log = EventLog(record_decodes=False)
        self._arrivals: Sequence[Arrival] = ()
        self._next_arrival = 0
        self._routes: dict[tuple[int, int], tuple[KvRoute, float]] = {}  # (src, dst) -> (route, busy until)
        self._ended_s: dict[int, float] = {}  # engine id -> when it stopped holding memory
        self._avail_t: float = 0.0
        self._avail_mem_byte_s: float = 0.0
        self._avail_flop: float = 0.0  # peak FLOPs of the GPUs we held, over time
        self._gpu_busy_mark: dict[int, float] = {}  # engine id -> busy seconds at the last gpu_load()
        self._gpu_load_t: float = 0.0
        self._links: tuple[LinkState, ...] | None = None
        # every GPU uuid the scenario can ever have -> (node, index): uuids derive from both
        self._gpu_home: dict[str, tuple[str, int]] = {self.cluster.gpu_uuid(n.id, i): (n.id, i)
                          for n in scenario.all_nodes() for i in range(n.gpus)}
        self._gpu_models = {self.cluster.gpu_uuid(n.id, i): n.gpu for n in scenario.all_nodes() for i in range(n.gpus)}
        self._push_cluster()
        self._push(scenario.duration_s, KIND_TIMER, self._mark_duration, None)
        self._init_jobs()  # the scenario's fine-tune and batch jobs (agents/sim/jobs.py)

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
        live fleet: one created in the console; agents/protocol/ prepare_plan). It has no scenario
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

    def booked_by_deployment(self) -> dict[str, dict[str, int]]:
        """deployment -> GPU -> bytes its plans hold there now (loading, serving or draining): what
        the control loop shares a GPU by (scheduler.pool.sharing)."""
        out: dict[str, dict[str, int]] = {}
        for engine_id, fp in self._footprint.items():
            engine = self.engines.get(engine_id)
            if engine is None:
                continue  # a fine-tune job's whole-GPU booking (agents/sim/jobs.py): no deployment shares it
            per = out.setdefault(engine.deployment, {})
            for u, b in fp.items():
                per[u] = per.get(u, 0) + b
        return out

    def _refuse(self, plan: Plan, want: Mapping[str, int]) -> None:
        """An agent's PREPARE check (scheduler.booking.refuse_booking, the real daemon's words):
        Refused (code out_of_memory) when the plan does not fit beside what its GPUs hold."""
        booked = self.booked_bytes()
        used = {u: booked.get(u, IDLE_MEM_BYTES) for u in want}
        total = {u: self.gpu_mem_bytes(u) for u in want}
        over = refuse_booking(want, used, total)
        if over is not None:
            self.refused_prepares += 1
            raise Refused(over.message(), REFUSAL_REASON, gpus=[over.gpu])

    def _booked_now(self, t: float, plan: Plan, fp: Mapping[str, int]) -> None:
        """Record what the GPUs of a plan hold after it booked them (the peak, and the events the
        invariant checker recomputes)."""
        booked = self.booked_bytes()
        by_dep = self.booked_by_deployment()
        gpus, holders = [], []
        for u in sorted(fp):
            total = self.gpu_mem_bytes(u)
            self.peak_booked_fraction = max(self.peak_booked_fraction, booked[u] / total)
            gpus.append((u, booked[u], total))
            holders.append((u, sum(1 for per in by_dep.values() if per.get(u)), self.max_models_per_gpu))
        self.memory_log.add(LogEvent(t, "mem_booked", plan_id=plan.plan_id, gpus=tuple(gpus), holders=tuple(holders)))

    def _gpu_model(self, uuid: str) -> str:
        return self._gpu_models[uuid]

    def gpu_mem_bytes(self, uuid: str) -> int:
        """A GPU's memory: what its agent reported (`gpu_mem_bytes`), else its catalog model's."""
        given = self._gpu_mem.get(uuid)
        return given if given is not None else gpu_spec(self._gpu_model(uuid)).mem_bytes

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

    def _reshare(self) -> None:
        """Who time-slices each engine's GPUs (`PlanEngine.update_share`): for each of its GPUs
        that others hold too (an engine, or a job that booked it whole), those others."""
        holders: dict[str, list[BusySource]] = {}
        for key, fp in self._footprint.items():
            holder: BusySource = self.live.get(key) or ALWAYS_BUSY
            for u in fp:
                holders.setdefault(u, []).append(holder)
        for engine in self.live.values():
            groups = tuple(tuple(h for h in holders.get(u, ()) if h is not engine) for u in engine.plan.gpu_uuids)
            groups = tuple(g for g in groups if g)
            if groups and not engine.co_tenants:
                self.shared_launches += 1
            engine.co_tenants = groups
            if not groups:
                engine.share = 1.0

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
        self._jobs_kick(t)  # a waiting job may start on what it freed
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
    def gpu_usable(self, uuid: str) -> bool:
        """The GPU is ours now (not another tenant's, not failed, its node present)."""
        return self._gpu_usable(uuid)

    def _gpu_usable(self, uuid: str) -> bool:
        g = self._gpus_by_uuid().get(uuid)
        return g is not None and g.owner == US

    def _gpus_by_uuid(self) -> dict[str, Any]:
        return {g.uuid: g for n in self.cluster.nodes.values() for g in n.gpus}

    def plan_nodes(self, plan: Plan) -> list[str]:
        return self._plan_nodes(plan)

    def _plan_nodes(self, plan: Plan) -> list[str]:
        """The node of each stage, in pipeline order (prefill stages, then decode stages)."""
        return [self._gpu_home[st.gpu_uuids[0]][0] for st in plan.all_stages]
