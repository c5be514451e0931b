"""One plan's serving engine, simulated: `PlanEngine` holds the plan's pipes (agents/sim/pipe.py:
rounds, batching, KV, preemption), its state (loading, serving, dead, released), its routing
weight and its report counters, and moves sequences in and out: a routed request, a preempted one
requeued, a prefill/decode hand-off, a sequence whose KV is on its way, a stop. It re-exports the
event vocabulary (agents/sim/events.py) and `Pipe`, so the simulator imports them from here.

Disaggregated plans have two pipes: the prefill pipe only runs prompt chunks; a finished prompt
hands its KV to the decode pipe over the plan's KV route (`PlanProfile.kv_handoff_s`, one
transfer at a time on that route), and its first token is counted when the hand-off lands, as
the cost model counts it in TTFT.

Each round's batch-token threshold is the local loop's (agents/sim/hints.py: LocalHints), the
engine's own `MAX_BATCHED_TOKENS` per micro-batch unless a global correction hint scales it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Literal, Protocol

from agents.sim.events import (
    KIND_ARRIVAL,
    KIND_BOUNDARY,
    KIND_CLUSTER,
    KIND_LAND,
    KIND_READY,
    KIND_TIMER,
    Event,
)
from agents.sim.hints import LocalHints
from agents.sim.pipe import MAX_RUN_ROUNDS, Pipe
from agents.sim.request import Request
from scheduler.costmodel import MAX_BATCHED_TOKENS, PlanProfile
from scheduler.modelspec import ModelSpec
from scheduler.plan import Plan

if TYPE_CHECKING:
    from agents.sim.fleet import EngineHost

BUSY_WINDOW_S = 5.0  # the window a co-tenant's busy fraction is measured over (`busy_fraction`)


class BusySource(Protocol):
    """What shares a GPU with an engine: another engine, or a job that holds it whole."""

    def busy_fraction(self, t: float) -> float: ...


class AlwaysBusy:
    """A holder whose kernels never stop (a fine-tune job's training loop)."""

    def busy_fraction(self, t: float) -> float:
        return 1.0


ALWAYS_BUSY = AlwaysBusy()

EngineState = Literal["loading", "serving", "dead", "released"]

__all__ = ["ALWAYS_BUSY", "BUSY_WINDOW_S", "KIND_ARRIVAL", "KIND_BOUNDARY", "KIND_CLUSTER", "KIND_LAND", "KIND_READY", "KIND_TIMER", "MAX_RUN_ROUNDS",
           "BusySource", "Event", "Pipe", "PlanEngine", "Request"]


class PlanEngine:
    """One plan of one deployment: its pipes, its state and its counters."""

    def __init__(self, engine_id: int, deployment: str, plan: Plan, profile: PlanProfile, model: ModelSpec,
                 host: EngineHost, *, state: EngineState = "loading", ready_s: float = 0.0) -> None:
        self.engine_id = engine_id
        self.deployment = deployment
        self.plan = plan
        self.profile = profile
        self.model = model
        self.host = host
        self.state: EngineState = state
        self.ready_s = ready_s
        self.accepting = False  # in the routing table
        self.weight = 1.0  # routing weight
        self.release_when_empty = False  # draining: released when its last sequence leaves
        # how much longer its rounds take than alone: 1 + the busy fractions of the other plans on
        # its most contended GPU (`update_share`; 1: it has its GPUs to itself)
        self.share = 1.0
        # for each of its GPUs that other plans hold too, those plans (FleetSim._reshare): two
        # deployments that fit in its memory, or an old and a new plan of a gear change
        self.co_tenants: tuple[tuple[BusySource, ...], ...] = ()
        self._busy_mark = (0.0, 0.0)  # (t, busy seconds by then): where its busy window began
        self._busy_fraction = 0.0  # the busy share of its last whole window
        self.started_s = 0.0  # when it began serving
        self.launched_s = 0.0  # when it began holding its GPUs (loading)
        kv_cap = plan.kv_reserve_tokens
        if plan.mode == "disaggregated":
            self.prefill = Pipe(self, "prefill", profile.pipeline("prefill"), kv_cap,
                                _kv_bytes(plan.stages, model), _gpus(plan.stages))
            self.decode = Pipe(self, "decode", profile.pipeline("decode"), kv_cap,
                               _kv_bytes(plan.decode_stages, model), _gpus(plan.decode_stages))
            self.pipes: tuple[Pipe, ...] = (self.prefill, self.decode)
        else:
            self.prefill = self.decode = Pipe(self, "both", profile.pipeline("prefill"), kv_cap,
                                              _kv_bytes(plan.stages, model), _gpus(plan.stages))
            self.pipes = (self.prefill,)
        self.local = LocalHints(MAX_BATCHED_TOKENS)  # the local loop's view of the global correction
        self.handoff_free_s = 0.0  # disaggregated: the KV route is busy until then
        self.in_flight: dict[int, Request] = {}  # hand-offs and migrations on their way here
        self.weight_bytes = sum(-(-model.stage_weight_bytes(s.layer_start, s.layer_end) // s.tp) * s.tp
                                for s in plan.all_stages)
        # report counters (reset by each report)
        self.rep_tokens = 0
        self.rep_finished = 0
        self.rep_violations = 0  # of those, SLO misses (EngineReport.slo_violations)
        self.rep_arrivals = 0
        self.rep_ttft: list[float] = []
        self.rep_tpot: list[float] = []
        self.rep_prompt: list[int] = []
        self.rep_output: list[int] = []
        self.rep_since_s = 0.0

    # --- time-slicing a shared GPU ------------------------------------------------------------
    def busy_s(self, t: float) -> float:
        """Seconds it has run rounds by t (its busiest pipe), the round in flight counted so far."""
        return max(p.busy_s + (max(0.0, t - p.t0) if p.busy else 0.0) for p in self.pipes)

    def busy_fraction(self, t: float) -> float:
        """The share of its last whole busy window it ran rounds in: from the last time it was
        asked, by a co-tenant or by its own round starts (`update_share`), at least BUSY_WINDOW_S
        before, to t. So an engine that was idle and starts working measures from then."""
        t0, b0 = self._busy_mark
        if t - t0 >= BUSY_WINDOW_S:
            b = self.busy_s(t)
            self._busy_fraction = min(1.0, max(0.0, (b - b0) / (t - t0)))
            self._busy_mark = (t, b)
        return self._busy_fraction

    def update_share(self, t: float) -> None:
        """Set `share` for a round starting at t (a round in flight keeps the share it began with).

        CUDA time-slices a GPU among the contexts that have work queued: a context with no kernels
        waiting takes no slice (NVIDIA GPU Operator docs, "Time-Slicing GPUs in Kubernetes": the
        workloads on an oversubscribed GPU interleave with one another). So a round is slowed by
        the plans that are busy beside it, not by every plan that holds memory there: by 1 + the
        fraction of its recent time each other plan on that GPU spent running rounds, its expected
        slowdown over the round (a mean-field figure: two plans busy 30% of the time slow each
        other by 1.3x; two always busy, 2x, as N busy contexts each wait their turn). The
        fractions are measured under the sharing itself, so they settle where both agree."""
        self.busy_fraction(t)  # its own window restarts when it starts working after a pause
        if self.co_tenants:
            self.share = max(1.0 + sum(o.busy_fraction(t) for o in group) for group in self.co_tenants)

    def batch_tokens(self, t: float) -> int:
        """The batch-token threshold per micro-batch of a round starting at t (module docstring)."""
        return self.local.batch_tokens(self.deployment, self.plan.plan_id, t, self.host.local_loop_s)

    @property
    def load(self) -> int:
        """Sequences it holds or has on their way (what the router balances)."""
        first = self.pipes[0]
        n = len(first.waiting) + len(first.running) + len(self.in_flight)
        if len(self.pipes) > 1:
            second = self.pipes[1]
            n += len(second.waiting) + len(second.running)
        return n

    def empty(self) -> bool:
        return not self.in_flight and all(p.empty() for p in self.pipes)

    def route_load(self) -> tuple[int, int, int, int, int]:
        """Its load as the router reads it (what its engine report says, exactly), as the fields
        of scheduler.router.PlanLoad in order: running, waiting, queued prompt tokens (and of
        low-priority requests), KV tokens in use. A tuple: the router's pool takes columns."""
        first = self.pipes[0]
        running = len(first.running) + len(self.in_flight)
        waiting = len(first.waiting)
        kv_used = first.kv_used
        if len(self.pipes) > 1:
            second = self.pipes[1]
            running += len(second.running)
            waiting += len(second.waiting)
            kv_used = max(kv_used, second.kv_used)
        tokens, low = first.prefill_left()
        return running, waiting, tokens, low, kv_used

    def submit(self, req: Request, t: float) -> list[Event]:
        """A request routed here: a prefill pass (or straight to decoding when its KV is here)."""
        self.host.owns(req, self)
        pipe = self.decode if req.has_kv else self.prefill
        return pipe.enqueue(req, t)

    def requeue_front(self, pipe: Pipe, req: Request, t: float) -> list[Event]:
        """A preempted sequence: it recomputes on this plan before anything newer."""
        target = self.prefill
        req.pipe = target
        target.waiting.appendleft(req)
        return target.poke(t) if target is not pipe else []

    def hand_off(self, req: Request, t: float) -> list[Event]:
        """Disaggregated: a finished prompt's KV travels to the decode pipe, one transfer at a
        time on the plan's KV route; its first token counts when it lands (costmodel's TTFT)."""
        start = max(t, self.handoff_free_s)
        self.handoff_free_s = start + self.profile.kv_handoff_s(req.need)
        return self.expect(req, self.handoff_free_s)

    def expect(self, req: Request, land_s: float) -> list[Event]:
        """A sequence whose KV is on its way here (hand-off or migration) lands at `land_s`."""
        self.host.owns(req, self)
        req.pipe = None
        req.engine_id = self.engine_id
        req.paused_until = land_s
        self.in_flight[req.rid] = req
        return [(land_s, KIND_LAND, self.on_land, req)]

    def on_land(self, t: float, arg: object) -> list[Event]:
        req = arg
        assert isinstance(req, Request)  # noqa: S101 - events carry what their handler expects
        if self.in_flight.pop(req.rid, None) is None:
            return []  # the engine stopped meanwhile: the request was handed back then
        if req.first_token_s is None:
            req.first_token_s = t
            self.host.first_token(req, t)
        return self.decode.enqueue(req, t)

    def start(self, t: float) -> list[Event]:
        """Loading is over: serve what is queued."""
        self.state = "serving"
        self.started_s = t
        out: list[Event] = []
        for pipe in self.pipes:
            out += pipe.poke(t)
        return out

    def stop(self, t: float, keep_kv: bool = False) -> tuple[list[Request], list[Event]]:
        """Stop at once (GPUs lost, or a free move): every sequence leaves, hand-offs in flight
        too; rounds completed by t are credited. Returns the requests and the events that the
        credited rounds produced (finishes)."""
        events: list[Event] = []
        for pipe in self.pipes:
            events += pipe.settle(t)
        reqs: list[Request] = []
        for pipe in self.pipes:
            reqs += pipe.evict(keep_kv)
        for req in self.in_flight.values():
            req.engine_id = 0
            if not keep_kv:
                req.drop_kv()
            reqs.append(req)
        self.in_flight = {}
        self.state = "dead"
        self.accepting = False
        return reqs, events

    def memory_bytes_in_use(self) -> float:
        """Weights plus the KV actually held now (not the reserve)."""
        return self.weight_bytes + sum(p.kv_used * p.kv_bytes_per_token for p in self.pipes)


def _kv_bytes(stages: Iterable[object], model: ModelSpec) -> float:
    """KV bytes one token takes over every GPU of a pipeline (replicated where TP > KV heads)."""
    total = 0.0
    for st in stages:
        layers = st.layer_end - st.layer_start  # type: ignore[attr-defined]
        tp = st.tp  # type: ignore[attr-defined]
        total += layers * model.kv_bytes_per_token_per_layer * tp / model.kv_shards(tp)
    return total


def _gpus(stages: Iterable[object]) -> int:
    return sum(st.tp for st in stages)  # type: ignore[attr-defined]
