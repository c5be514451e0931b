"""The plans of one deployment as the router sees them: what each plan is (`PlanFacts`, rebuilt
when the routing table or the fleet changes) and how loaded it is (set before each decision).

`Pool` keeps both as arrays, one slot per plan, so that every plugin scores all plans with a
handful of vector operations: a decision over 64 plans costs what one over 8 costs (the router's
budget is tens of microseconds; a Python loop over 64 plans per plugin would spend it alone).

Facts come from the same cost model the planner and the simulator use (`scheduler.costmodel`):
`plan_facts` fits each plan's step times at a few points (`StepModel`), so the router's
latency estimate is a few multiply-adds instead of a walk over the roofline per request.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from scheduler.costmodel import DEFAULT_EFFICIENCY, Efficiency, PipelineProfile, PlanProfile
from scheduler.hardware import GpuSpec
from scheduler.modelspec import ModelSpec
from scheduler.plan import MEM_FRACTION, Plan, Stage, stage_bytes_per_gpu
from scheduler.router import memory_bound, predicted_latency, topology_affinity
from scheduler.router._arrays import CHUNK_TOKENS, Bools, Floats
from scheduler.topology import Snapshot

__all__ = ["CHUNK_TOKENS", "Bools", "Floats", "GpuBudget", "PlanFacts", "PlanLoad", "Pool", "StepModel",
           "fit_step_model", "plan_facts"]
NO_PRIORITY_LIMIT = 1 << 30  # a plan that takes every priority class


@dataclass(frozen=True)
class StepModel:
    """A plan's step times as a few coefficients, fitted to the cost model (`fit_step_model`).

    prefill_s(new, cached) = fixed + per_token x new + per_token_ctx x new x (cached + new / 2)
        (the linear layers cost per token; attention per token per token of context)
    decode_step_s(seqs, ctx) = fixed + per_seq x seqs + per_seq_ctx x seqs x ctx
        (weights read once per step; each sequence's KV read once)
    """

    prefill_fixed_s: float
    prefill_s_per_token: float
    prefill_s_per_token_ctx: float
    decode_fixed_s: float
    decode_s_per_seq: float
    decode_s_per_seq_ctx: float
    handoff_fixed_s: float = 0.0  # disaggregated: moving the prompt's KV to the decode group
    handoff_s_per_token: float = 0.0

    def prefill_s(self, new_tokens: float, cached_tokens: float = 0.0) -> float:
        return (self.prefill_fixed_s + self.prefill_s_per_token * new_tokens
                + self.prefill_s_per_token_ctx * new_tokens * (cached_tokens + new_tokens / 2))

    def decode_step_s(self, seqs: float, context_tokens: float) -> float:
        return self.decode_fixed_s + self.decode_s_per_seq * seqs + self.decode_s_per_seq_ctx * seqs * context_tokens


_FITS: dict[tuple[object, ...], StepModel] = {}


def fit_step_model(profile: PlanProfile) -> StepModel:
    """`StepModel` of a plan: prefill fitted at 1k, 8k and 32k tokens, decode at 1 and 64
    sequences of 1k and 8k context (memoised by the pipelines' physics)."""
    pre, dec = profile.pipeline("prefill"), profile.pipeline("decode")
    handoff = profile.handoff
    key = (pre.signature, dec.signature, None if handoff is None else (handoff.latency_s, handoff.s_per_token))
    hit = _FITS.get(key)
    if hit is not None:
        return hit
    fit = _fit(pre, dec)
    if handoff is not None and math.isfinite(handoff.s_per_token):
        fit = StepModel(**{**fit.__dict__, "handoff_fixed_s": handoff.latency_s,
                           "handoff_s_per_token": handoff.s_per_token})
    if len(_FITS) > 4096:
        _FITS.clear()
    _FITS[key] = fit
    return fit


def _fit(pre: PipelineProfile, dec: PipelineProfile) -> StepModel:
    # prefill: t(n) = a + b n + c n^2 / 2 through three points (exact), each coefficient >= 0
    n1, n2, n3 = 1024.0, 8192.0, 32768.0
    t1, t2, t3 = (pre.prefill_time_s(int(n)) for n in (n1, n2, n3))
    u1 = dec.decode_step_s(1, 1024)
    u2 = dec.decode_step_s(64, 1024)
    u3 = dec.decode_step_s(64, 8192)
    if not all(math.isfinite(x) for x in (t1, t2, t3, u1, u2, u3)):
        # a plan the cost model cannot price (a stage pair with no link): infinitely slow
        return StepModel(math.inf, math.inf, 0.0, math.inf, 0.0, 0.0)
    # c from the curvature, b from the slope between the last two points, a from the first
    s12, s23 = (t2 - t1) / (n2 - n1), (t3 - t2) / (n3 - n2)
    c = max(0.0, (s23 - s12) / ((n3 - n1) / 2))
    b = max(0.0, s23 - c * (n2 + n3) / 2)
    a = max(0.0, t1 - b * n1 - c * n1 * n1 / 2)
    # decode: d(s, ctx) = d0 + d1 s + d2 s ctx
    d2 = max(0.0, (u3 - u2) / (64 * (8192 - 1024)))
    d1 = max(0.0, (u2 - u1 - d2 * (64 - 1) * 1024) / 63)
    d0 = max(0.0, u1 - d1 - d2 * 1024)
    return StepModel(a, b, c, d0, d1, d2)


@dataclass(frozen=True)
class GpuBudget:
    """What one GPU of a plan may hold (the memory bound's inputs, seed 003's formula)."""

    uuid: str
    limit_bytes: float  # MEM_FRACTION of the GPU, less this plan's weights and what others hold there
    kv_bytes_per_token: float  # this plan's KV per token on this GPU
    act_bytes_per_token: float  # transient activations per prompt token of a chunk on this GPU


@dataclass(frozen=True)
class PlanFacts:
    """One plan of the routing table, resolved against the fleet. Fields the router reads."""

    plan_id: str
    model: str
    gpu_model: str  # its (prefill) GPUs' model; the slowest one if mixed
    gpus: int  # GPUs it holds
    kv_capacity_tokens: int  # its KV reserve (what its engine admits against)
    flops_per_gpu: float  # dense BF16 peak of one of its GPUs (compute density)
    link_bytes_per_s: float  # slowest link inside its TP groups (NVLink vs PCIe), per direction
    budgets: tuple[GpuBudget, ...]  # one per GPU
    steps: StepModel
    weight: float = 1.0  # routing weight from the table (capacity share the gearbox intends)
    frozen: bool = False  # a switch froze it: admits nothing new
    routable: bool = True  # serving, and its leader can be reached
    priority_max: int | None = None  # the least urgent priority class it takes; None: every class
    host_kv_tokens: int = 0  # KV it can keep in host memory after GPU eviction (0: no host tier)
    # seconds to copy one token's KV back from its host tier (None: not known - a host hit counts
    # RouterConfig.host_tier_weight of a GPU hit; prefix_affinity.score)
    host_restore_s_per_token: float | None = None


def stage_act_bytes_per_token(stage: Stage, model: ModelSpec) -> float:
    """Activations one prompt token of a chunk holds on each GPU of a stage while a layer runs:
    the residual and the normed hidden state, Q/K/V, and the MLP's gate and up projections (the
    widest point of a layer), split over TP. vLLM sizes the same buffer by a profiling forward
    pass of max_num_batched_tokens (its gpu_memory_utilization accounting)."""
    tp = stage.tp
    per_rank = (model.q_dim + 2 * model.kv_dim + 2 * model.intermediate_size) / tp
    return float(model.dtype_bytes * (2 * model.hidden_size + per_rank))


def _link_bytes_per_s(stage: Stage, spec: GpuSpec, profile_path_bytes_per_s: float) -> float:
    if stage.tp > 1:
        return profile_path_bytes_per_s
    # one GPU: no TP ring; the card's own link is what a hand-off or a migration would use
    return spec.intra_link_bytes_per_s or spec.host_link_bytes_per_s


def plan_facts(plan: Plan, model: ModelSpec, snapshot: Snapshot, *, weight: float = 1.0, frozen: bool = False,
               routable: bool = True, priority_max: int | None = None, host_kv_tokens: int = 0,
               host_restore_s_per_token: float | None = None, profile: PlanProfile | None = None,
               eff: Efficiency = DEFAULT_EFFICIENCY) -> PlanFacts:
    """`PlanFacts` of a plan on `snapshot`. What other plans hold on its GPUs is the snapshot's
    used memory less this plan's own weights and KV reserve (the snapshot counts both)."""
    prof = profile or PlanProfile.build(plan, model, snapshot, eff)
    budgets: list[GpuBudget] = []
    for st in plan.all_stages:
        own = stage_bytes_per_gpu(st, model, plan.kv_reserve_tokens)
        weights = stage_bytes_per_gpu(st, model, 0)
        kvpt = st.num_layers * model.kv_bytes_per_token_per_layer / model.kv_shards(st.tp)
        act = stage_act_bytes_per_token(st, model)
        for u in st.gpu_uuids:
            g = snapshot.gpu_by_uuid[u]
            others = max(0, g.mem_used_bytes - own)
            budgets.append(GpuBudget(u, MEM_FRACTION * g.mem_total_bytes - weights - others, kvpt, act))
    stages = prof.pipeline("prefill").stages
    first = min(stages, key=lambda s: s.spec.bf16_flops)
    link = min(_link_bytes_per_s(st, sp.spec, sp.tp_path.bytes_per_s) for st, sp in zip(plan.stages, stages,
                                                                                          strict=True))
    return PlanFacts(
        plan_id=plan.plan_id, model=plan.model, gpu_model=first.spec.name, gpus=len(plan.gpu_uuids),
        kv_capacity_tokens=plan.kv_reserve_tokens, flops_per_gpu=first.spec.bf16_flops,
        link_bytes_per_s=link, budgets=tuple(budgets), steps=fit_step_model(prof), weight=weight, frozen=frozen,
        routable=routable, priority_max=priority_max, host_kv_tokens=host_kv_tokens,
        host_restore_s_per_token=host_restore_s_per_token)


@dataclass(frozen=True, slots=True)
class PlanLoad:
    """How loaded a plan is right now (what its engine last reported, or what the caller knows)."""

    running: int = 0  # sequences in its batch (prefilling or decoding)
    waiting: int = 0  # sequences queued for admission
    queued_tokens: int = 0  # prompt tokens still to prefill: queued and in-progress passes
    queued_low_tokens: int = 0  # of those, of low-priority requests (priority > 0)
    kv_used_tokens: int = 0  # KV tokens in use


class Pool:
    """The plans one decision chooses among (module docstring). Slot i is `facts[i]`.

    Static arrays come from the facts once; `set_loads` keeps the plans' load and the terms the
    plugins derive from it (KV room, queueing time...), so that a decision only combines arrays
    with the request's few numbers."""

    def __init__(self, facts: Sequence[PlanFacts], *, model: str | None = None,
                 prices: Mapping[str, float] | None = None) -> None:
        self.facts = tuple(facts)
        n = self.n = len(self.facts)
        self.ids = tuple(f.plan_id for f in self.facts)
        self.slot = {pid: i for i, pid in enumerate(self.ids)}
        self.model = model  # the deployment's model: a plan of another model is never a candidate
        f = self.facts
        self.weight: Floats = np.array([max(x.weight, 1e-9) for x in f], dtype=np.float64)
        # prefilter's static half: serves the model, not frozen, routable, weight > 0
        self.base_ok: Bools = np.array([(model is None or x.model == model) and not x.frozen and x.routable
                                        and x.weight > 0 for x in f], dtype=np.bool_)
        self.priority_max = np.array([NO_PRIORITY_LIMIT if x.priority_max is None else x.priority_max for x in f],
                                     dtype=np.int64)
        self.priority_limited = any(x.priority_max is not None for x in f)
        self.cap_tokens: Floats = memory_bound.token_capacity(f)
        self.steps = tuple(x.steps for x in f)
        self.pre_a: Floats = np.array([m.prefill_fixed_s + m.handoff_fixed_s for m in self.steps], dtype=np.float64)
        self.pre_b: Floats = np.array([m.prefill_s_per_token + m.handoff_s_per_token for m in self.steps],
                                      dtype=np.float64)
        self.pre_c: Floats = np.array([m.prefill_s_per_token_ctx for m in self.steps], dtype=np.float64)
        # the prefill of p uncached tokens as one product: [c / 2, b, a] . [p^2, p, 1]
        self.pre_poly: Floats = np.stack([self.pre_c / 2, self.pre_b, self.pre_a], axis=1) if n else np.zeros((0, 3))
        # (a plan the cost model cannot price has an infinite prefill; its TTFT says so already,
        # and its queueing and decode slowdown by chunks are left finite, so no 0 x inf is a NaN)
        self.pre_b_chunk: Floats = np.where(np.isfinite(self.pre_b), self.pre_b, 0.0)
        self.dec_0: Floats = np.array([m.decode_fixed_s for m in self.steps], dtype=np.float64)
        self.dec_1: Floats = np.array([m.decode_s_per_seq for m in self.steps], dtype=np.float64)
        self.dec_2: Floats = np.array([m.decode_s_per_seq_ctx for m in self.steps], dtype=np.float64)
        self.dense, self.cheap = topology_affinity.static_scores(f, prices)
        self.zeros: Floats = np.zeros(n)
        self.none: Bools = np.zeros(n, dtype=np.bool_)
        self.cache: dict[str, object] = {}  # per-pool memos of the plugins (e.g. the prefix index's bits)
        # load (set_load) and what the plugins derive from it
        self.running: Floats = np.zeros(n)
        self.waiting: Floats = np.zeros(n)
        self.queued_tokens: Floats = np.zeros(n)
        self.queued_low_tokens: Floats = np.zeros(n)
        self.kv_used: Floats = np.zeros(n)
        self.room: Floats = self.cap_tokens.copy()  # memory bound: KV tokens a new request may still take
        self.share: Floats = np.ones(n)  # predicted latency: prefill slowdown by the decodes it shares rounds with
        self.queue_s: Floats = np.zeros(n)  # ... wait for the work queued ahead of a normal request
        self.queue_all_s: Floats = np.zeros(n)  # ... and of a low-priority one (behind everything)
        self.tpot_base: Floats = np.zeros(n)  # ... decode step with one more sequence, before its own context
        self.chunk_room: Floats = np.full(n, float(CHUNK_TOKENS))  # ... prefill tokens a round still carries
        self.queue_sh: Floats = np.zeros(n)  # ... queue_s x share, queue_all_s x share (what a TTFT adds to
        self.queue_all_sh: Floats = np.zeros(n)  # the request's own prefill x share)
        self.queued_chunk_s: Floats = np.zeros(n)  # ... queued_tokens, chunk_room x pre_b_chunk (the TPOT's
        self.chunk_room_s: Floats = np.zeros(n)  # prefill chunks, in seconds)
        self.room_floor = math.inf  # memory bound: the least room of any plan (a request within it fits all)
        self.room_sorted: list[float] = []  # ... every plan's room, ascending: how many a request fits, by bisection
        self.load_rel: Floats = 1.0 / self.weight  # pick: (outstanding + 1) / weight
        # static, per routing-table version: what a decision would otherwise rebuild every time
        self.pre_c_half: Floats = self.pre_c / 2
        # ... as lists, for the few plans a prefix hits (predicted_latency.prefill_s), when every
        # plan is priced (an infinite per-token time turns a 0-token hit into a NaN on the arrays)
        self.pre_b_list: list[float] = self.pre_b.tolist()
        self.pre_c_half_list: list[float] = self.pre_c_half.tolist()
        self.host_restore_list: list[float | None] = [x.host_restore_s_per_token for x in f]  # prefix_affinity
        self.pre_b_finite = bool(np.isfinite(self.pre_b).all() and np.isfinite(self.pre_c_half).all())
        self.dense_minus_cheap: Floats = self.dense - self.cheap  # topology: cheap + longness x this
        self.all_true: Bools = np.ones(n, dtype=np.bool_)
        self.cap_floor = float(self.cap_tokens.min()) if n else math.inf  # a request within it fits every plan ever
        self.base_count = int(np.count_nonzero(self.base_ok))
        self.base_all = self.base_count == n
        self._derive()

    def set_load(self, i: int, load: PlanLoad) -> None:
        """One plan's load (the others keep theirs)."""
        self.running[i] = load.running
        self.waiting[i] = load.waiting
        self.queued_tokens[i] = load.queued_tokens
        self.queued_low_tokens[i] = load.queued_low_tokens
        self.kv_used[i] = load.kv_used_tokens
        self._derive()

    def set_loads(self, loads: Sequence[PlanLoad]) -> None:
        """Every plan's load, slot by slot."""
        if len(loads) != self.n:
            raise ValueError(f"loads: {len(loads)} given for {self.n} plans")
        self.set_load_columns([x.running for x in loads], [x.waiting for x in loads],
                              [x.queued_tokens for x in loads], [x.queued_low_tokens for x in loads],
                              [x.kv_used_tokens for x in loads])

    def set_load_columns(self, running: Sequence[float], waiting: Sequence[float], queued_tokens: Sequence[float],
                         queued_low_tokens: Sequence[float], kv_used_tokens: Sequence[float]) -> None:
        """Every plan's load as columns (PlanLoad's fields, one value per slot): the simulator's
        hot path, one vector update instead of one per plan."""
        self.running = np.array(running, dtype=np.float64)
        self.waiting = np.array(waiting, dtype=np.float64)
        self.queued_tokens = np.array(queued_tokens, dtype=np.float64)
        self.queued_low_tokens = np.array(queued_low_tokens, dtype=np.float64)
        self.kv_used = np.array(kv_used_tokens, dtype=np.float64)
        self._derive()

    def _derive(self) -> None:
        """The terms the plugins derive from the load alone, once per load update."""
        self.room = self.cap_tokens - self.kv_used
        self.room_sorted = np.sort(self.room).tolist()
        self.room_floor = self.room_sorted[0] if self.n else math.inf
        self.share, self.queue_s, self.queue_all_s, self.tpot_base = predicted_latency.load_terms(self)
        self.queue_sh = self.queue_s * self.share
        self.queue_all_sh = self.queue_all_s * self.share
        self.queued_chunk_s = self.queued_tokens * self.pre_b_chunk
        self.chunk_room_s = self.chunk_room * self.pre_b_chunk
        self.load_rel = (self.running + self.waiting + 1.0) / self.weight

    def load_of(self, i: int) -> PlanLoad:
        return PlanLoad(int(self.running[i]), int(self.waiting[i]), int(self.queued_tokens[i]),
                        int(self.queued_low_tokens[i]), int(self.kv_used[i]))

    def outstanding(self) -> Floats:
        """Requests each plan holds (running + waiting): what least-loaded balances."""
        out: Floats = self.running + self.waiting
        return out
