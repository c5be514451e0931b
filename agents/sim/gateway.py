"""The simulator's gateway: requests arrive (a fed workload or `submit`), the one request router
(scheduler.router) picks a serving plan of their deployment or they wait in its queue, and the
engines call back as each request gets its first token, finishes, fails, changes owner or pauses
(the per-sequence log, agents/sim/seqlog.py). A mixin of FleetSim (agents/sim/fleet.py): its
methods run on the simulator's state."""

# mypy: disable-error-code="misc"
# (its methods take `self: FleetSim`, the class that mixes it in: mypy wants a self type to be a
# supertype of the mixin, which the simulator is not; everything else is checked as usual)

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from agents.sim import seqlog
from agents.sim.engine import KIND_ARRIVAL, KIND_TIMER, Event, Pipe, PlanEngine, Request
from agents.sim.kvtiers import TierView
from agents.sim.scenario import ModelDeploymentSpec
from agents.sim.workload import Arrival
from scheduler.costmodel import Slo
from scheduler.hardware import gpu_spec
from scheduler.invariants import LogEvent
from scheduler.modelspec import ModelSpec
from scheduler.plan import Plan
from scheduler.router import Decision, Pool, RouteRequest, plan_facts, spillover

if TYPE_CHECKING:
    from agents.sim.fleet import FleetSim


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


class Gateway:
    """Arrivals, routing and the deployment queues of FleetSim (module docstring)."""

    # ======================================================================================
    # arrivals
    # ======================================================================================
    def feed(self: FleetSim, arrivals: Sequence[Arrival]) -> None:
        """The workload to replay (time-ordered). One feed per simulator."""
        if self._arrivals:
            raise ValueError("feed: this simulator already has a workload")
        self._arrivals = arrivals
        self._next_arrival = 0
        if arrivals:
            self._push(arrivals[0].t_s, KIND_ARRIVAL, self._on_arrival, None)

    def feed_more(self: FleetSim, arrivals: Sequence[Arrival]) -> None:
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

    def _on_arrival(self: FleetSim, t: float, _: object) -> list[Event]:
        a = self._arrivals[self._next_arrival]
        self._next_arrival += 1
        out = self._admit(a.deployment, a.prompt_tokens, a.output_tokens, t, priority=a.priority,
                          deadline_s=a.deadline_s, blocks=a.blocks)
        if self._next_arrival < len(self._arrivals):
            out.append((self._arrivals[self._next_arrival].t_s, KIND_ARRIVAL, self._on_arrival, None))
        return out

    def submit(self: FleetSim, deployment: str, prompt_tokens: int, output_tokens: int, *, priority: int = 0,
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

    def submit_to(self: FleetSim, deployment: str, plan_id: str, prompt_tokens: int, output_tokens: int, *,
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

    def _admit(self: FleetSim, deployment: str, prompt: int, output: int, t: float, rid: int | None = None, *,
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
    def _route(self: FleetSim, dep: DeploymentRuntime, req: Request) -> tuple[PlanEngine | None, Decision | None]:
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
        self._routed_to(req, decision, slot)
        if decision.spilled_from is not None and self.spill_watch is not None:
            watched = self.spill_watch.spilled(req.rid, pool.ids[decision.spilled_from], pool.ids[slot], self.now_s)
            if watched is not None:  # its timer: still not admitted there by then -> re-routed, once
                self._push(watched.deadline_s, KIND_TIMER, self._on_spill_timeout, (req, engines[slot], req.preemptions))
        return engines[slot], decision

    def _routed_to(self: FleetSim, req: Request, decision: Decision, slot: int) -> None:
        self.router.admitted(decision, slot)
        req.predicted_ttft_s = decision.predicted_ttft_s(slot)
        req.routed_plan = decision.pool.ids[slot]

    def _on_spill_timeout(self: FleetSim, t: float, arg: object) -> list[Event]:
        """A spilled request's deadline (scheduler/router/spillover.py, the spillover timeout):
        admitted meanwhile - its prefill started, so it left the waiting queue, or it was preempted
        after that, or it left the plan - it is forgotten; still waiting, it is counted and goes
        where `spillover.reroute` says, from the router's fresh ranking."""
        assert isinstance(arg, tuple)  # noqa: S101 - events carry what their handler expects
        req, engine, preemptions = arg
        assert isinstance(req, Request) and isinstance(engine, PlanEngine)  # noqa: S101
        watch = self.spill_watch
        assert watch is not None  # noqa: S101 - only a watching simulator pushes these
        pipe = engine.prefill
        if (req.pipe is not pipe or req.rid in pipe.running or req.preemptions != preemptions
                or req.first_token_s is not None or req.error is not None or engine.state != "serving"):
            watch.admitted(req.rid)
            return []
        spilled = watch.expire(req.rid, t)
        if spilled is None:
            return []
        dep = self.deployments[req.deployment]
        engines = [e for e in dep.engines if e.accepting and e.state == "serving"]
        pool = self._pool(dep, engines)
        home, at = pool.slot.get(spilled.home), pool.slot.get(spilled.at)
        if home is None or at is None or len(engines) < 2:
            return []  # its first choice left the routing table (or only one plan serves): it keeps its place
        pool.set_load_columns(*zip(*(e.route_load() for e in engines), strict=True))
        assert isinstance(req.route_req, RouteRequest)  # noqa: S101 - made when it was first routed
        decision = self.router.route(req.route_req, pool, t)
        slot, _ = spillover.reroute(decision.order, spillover.kv_free(pool), home=home, waiting_at=at,
                                    high_priority=req.priority < 0, key=str(req.rid), config=watch.config)
        if slot == at:
            return []
        pipe.waiting.remove(req)  # it holds no KV yet: nothing it did there is lost
        req.pipe = None
        self._routed_to(req, decision, slot)
        return engines[slot].submit(req, t)

    def _pool(self: FleetSim, dep: DeploymentRuntime, engines: Sequence[PlanEngine]) -> Pool:
        key = tuple((e.engine_id, id(e.profile), e.weight) for e in engines)
        if dep.pool is None or key != dep.pool_key:
            snap = self.snapshot()
            facts = []
            for e, k in zip(engines, key, strict=True):
                f = self._facts.get(k)
                if f is None:
                    host_tokens, restore_s = self._tier_facts(e)
                    f = self._facts[k] = plan_facts(e.plan, e.model, snap, weight=e.weight, profile=e.profile,
                                                    host_kv_tokens=host_tokens, host_restore_s_per_token=restore_s)
                facts.append(f)
            dep.pool = Pool(facts, model=dep.model.name)
            dep.pool_key = key
        return dep.pool

    def _tier_facts(self: FleetSim, engine: PlanEngine) -> tuple[int, float | None]:
        """With KV tiers, what the router knows of the plan's host tier: its share of its node's
        host memory (by GPUs) in tokens and the restore time per token (the router's index keeps a
        host tier per plan; the node's is shared by its plans). (0, None): no host tier."""
        view = engine.pipes[0].tiers
        if view is None or not view.use_host:
            return 0, None
        node = view.tiers.node
        share = sum(self._gpu_home[u][0] == node for u in engine.plan.gpu_uuids) / self.scenario.node(node).gpus
        return int(view.tiers.host.capacity_bytes * share / engine.model.kv_bytes_per_token), view.host_s_per_token

    def dispatch(self: FleetSim, deployment: str, req: Request, t: float) -> list[Event]:
        """Route a request that left its plan (the router's choice, or the deployment's queue)."""
        return self._dispatch(self._dep(deployment), req, t)

    def _dispatch(self: FleetSim, dep: DeploymentRuntime, req: Request, t: float, new: bool = False) -> list[Event]:
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

    def _flush(self: FleetSim, dep: DeploymentRuntime, t: float) -> list[Event]:
        out: list[Event] = []
        while dep.pending and any(e.accepting and e.state == "serving" for e in dep.engines):
            out += self._dispatch(dep, dep.pending.popleft(), t)
        return out

    # ======================================================================================
    # EngineHost
    # ======================================================================================
    def tier_view(self: FleetSim, pipe: Pipe) -> TierView | None:
        """The pipe's view of its first GPU's node's KV tiers (agents/sim/kvtiers.py): host -> GPU
        over each of its GPUs' PCIe links, its recompute price per block from its cost model."""
        tiers, cache = self.kv_tiers, pipe.cache
        if tiers is None or cache is None:
            return None
        plan, model = pipe.engine.plan, pipe.engine.model
        uuids = [u for st in (plan.decode_stages if pipe.role == "decode" else plan.stages) for u in st.gpu_uuids]
        link = min(gpu_spec(self._gpu_model(u)).host_link_bytes_per_s for u in uuids)
        bt = cache.block_tokens
        recompute_s = pipe.prof.prefill_time_s(2 * bt) - pipe.prof.prefill_time_s(bt)  # one more block
        return TierView(tiers.node(self._gpu_home[uuids[0]][0]), model.name, bt, bt * model.kv_bytes_per_token,
                        pipe.kv_bytes_per_token, len(uuids) * link, recompute_s)

    def tokens(self: FleetSim, engine: PlanEngine, t0: float, t1: float, n: int) -> None:
        self.recorder.tokens(t0, t1, n)
        engine.rep_tokens += n

    def first_token(self: FleetSim, req: Request, t: float) -> None:
        """The router learns how late a first token came against its prediction (jitter), for
        requests that ran where it sent them (not moved, not recomputed elsewhere)."""
        if req.routed_plan and not req.migrations and not req.replays:
            self.router.first_token(req.routed_plan, t, t - req.arrival_s, req.predicted_ttft_s)

    def finished(self: FleetSim, req: Request, t: float) -> list[Event]:
        req.finish_s = t
        if self.spill_watch is not None:
            self.spill_watch.forget(req.rid)
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
            tpot = (t - first) / (req.output - 1) if req.output > 1 else None
            if tpot is not None:
                engine.rep_tpot.append(tpot)
            engine.rep_violations += dep.slo.missed(first - req.arrival_s, tpot)
            engine.rep_output.append(req.output)
        req.engine_id = 0
        return []

    def failed(self: FleetSim, req: Request, t: float, reason: str) -> list[Event]:
        self._fail(req, t, reason)
        return []

    def _fail(self: FleetSim, req: Request, t: float, reason: str) -> None:
        req.error = reason
        if self.spill_watch is not None:
            self.spill_watch.forget(req.rid)
        req.pipe = None
        self.in_system.pop(req.rid, None)
        self.recorder.failed.append((req.rid, req.deployment, t, reason))
        if self.events is not None:
            self.events.add(LogEvent(t, "seq_failed", deployment=req.deployment, seq_id=str(req.rid),
                                     detail=reason))

    def owns(self: FleetSim, req: Request, engine: PlanEngine) -> None:
        """`req` arrives on `engine`: the per-sequence log records who owns it (agents/sim/seqlog.py)."""
        if self.events is not None:
            seqlog.owns(self.events, req, engine, self.now_s, self._plan_nodes(engine.plan)[0])

    @property
    def log_decodes(self: FleetSim) -> bool:
        """The per-sequence log wants every decoding round (`EventLog.record_decodes`)."""
        return self.events is not None and self.events.record_decodes

    def decoded(self: FleetSim, req: Request, engine: PlanEngine, t: float) -> None:
        """`engine` ran decode rounds of `req` up to `t` (one event per credited run of rounds)."""
        if self.events is not None:
            self.events.add(LogEvent(t, "seq_decoded", deployment=req.deployment, seq_id=str(req.rid),
                                     plan_id=engine.plan.plan_id))

    def paused(self: FleetSim, req: Request, boundary: str) -> None:
        """`req` was taken off its pipe at a safe boundary (`decode_end` | `idle`) to be handed over."""
        if self.events is not None:
            seqlog.paused(self.events, req, self.now_s, boundary)

    def pipe_idle(self: FleetSim, engine: PlanEngine, t: float) -> list[Event]:
        if engine.release_when_empty and engine.empty() and engine.state == "serving":
            self._release(engine, t)
        return []


    def expire_pending(self: FleetSim, max_wait_s: float) -> int:
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
