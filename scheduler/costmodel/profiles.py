"""One iteration of a plan: `Batch`, `IterationCost`, the per-stage and per-pipeline profiles,
the KV hand-off route (`KvRoute`), `PlanProfile`, their memos, and the convenience functions
that build a profile and ask it (step times, KV capacity)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from scheduler._lazy import content_id
from scheduler.capabilities import migrates_kv
from scheduler.collectives import CollectiveCurve
from scheduler.costmodel.kernels import DEFAULT_EFFICIENCY, MAX_BATCHED_TOKENS, Efficiency, _p_norm
from scheduler.costmodel.links import REDUCE_HBM_TOUCHES, Path, gpu_path, group_path, transfer_time_s
from scheduler.hardware import GpuSpec
from scheduler.modelspec import ModelSpec
from scheduler.plan import Plan, Stage, stage_bytes_per_gpu, usable_bytes
from scheduler.topology import Snapshot

Role = Literal["prefill", "decode"]


# --- one iteration -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Batch:
    """What one continuous-batching iteration processes."""

    prefill_tokens: int = 0  # new prompt tokens in this iteration (all chunks together)
    prefill_seqs: int = 0  # how many sequences those tokens belong to (>= 1 when prefill_tokens > 0)
    prefill_context_tokens: int = 0  # tokens of those sequences already in the KV cache (sum)
    decode_seqs: int = 0  # sequences generating one token each
    decode_context_tokens: int = 0  # sum of their context lengths (KV they read)

    def __post_init__(self) -> None:
        for name in ("prefill_tokens", "prefill_seqs", "prefill_context_tokens", "decode_seqs", "decode_context_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_seqs


@dataclass(frozen=True)
class IterationCost:
    """Time of one iteration through a pipeline, and where it goes."""

    latency_s: float  # the batch through every stage, hand-offs included
    interval_s: float  # steady spacing between batches in flight (slowest stage + its hand-off)
    stage_s: tuple[float, ...]  # per stage
    handoff_s: tuple[float, ...]  # per stage boundary (len = stages - 1)
    gemm_s: float  # matrix multiplies (incl. LM head), summed over stages
    attention_s: float  # attention kernels, summed over stages
    elementwise_s: float  # norms, rotary, activation, embedding
    allreduce_s: float  # TP all-reduces


@dataclass(frozen=True)
class StageProfile:
    """One stage resolved against a snapshot: what its time depends on."""

    layers: int  # number of layers
    tp: int  # TP degree
    spec: GpuSpec  # its GPUs' spec (the slowest, if mixed)
    tp_path: Path  # slowest link inside the TP group
    first: bool  # holds the embedding
    last: bool  # holds the final norm and LM head
    next_path: Path | None  # towards the next stage; None for the last
    tp_curve: CollectiveCurve | None = None  # a measured all-reduce of its TP group's node and size: used if set
    # how much longer its kernels take on GPUs other deployments time-slice: 1 / the least
    # `compute_share` of its GPUs (CUDA time-slicing runs one context at a time - NVIDIA GPU
    # Operator docs, "Time-Slicing GPUs in Kubernetes" - so each of N busy contexts waits its turn;
    # the simulator slows such engines the same way, agents/sim/fleet.py `_reshare`)
    slowdown: float = 1.0


class PipelineProfile:
    """A pipeline (list of stages) with everything resolved; `iteration` is pure arithmetic.

    Per-stage constants (GEMM shapes, reciprocal peak rates, link terms) are computed once
    here, because a simulator calls `iteration` for every batch it runs.
    """

    def __init__(self, model: ModelSpec, stages: Sequence[StageProfile], eff: Efficiency) -> None:
        self.model = model
        self.stages = tuple(stages)
        self.eff = eff
        self.pp = len(self.stages)
        self.signature = content_id((model, eff, self.stages))  # equal physics, equal signature
        p = eff.roofline_norm
        self._norm: Callable[[float, float], float] = math.hypot if p == 2.0 else _p_norm(p)
        self._ar_bytes_per_token = model.hidden_size * model.dtype_bytes  # one all-reduce's message per token
        self._consts = [self._stage_consts(st) for st in self.stages]

    def _stage_consts(self, st: StageProfile) -> tuple[float, ...]:
        """Per-stage constants, so that a stage's time for a batch is a few multiply-adds and
        six square roots (the simulator's hot path).

        Each GEMM [T x k] @ [k x n] becomes three coefficients of its token count T:
        t_compute = a T and t_memory = b + c T (weights once, activations per token). The
        attention kernel, the element-wise traffic and the two all-reduces per layer reduce to
        per-token (or per-context-token) coefficients the same way; see `_parts`."""
        m, eff, spec = self.model, self.eff, st.spec
        t = st.tp
        d = m.dtype_bytes
        fd = 1.0 / (eff.mfu * spec.bf16_flops)
        md = 1.0 / (eff.mbu * spec.hbm_bytes_per_s)
        q = m.q_dim // t
        kv = m.kv_dim // m.kv_shards(t)
        inter = m.intermediate_size // t
        up = (2 if m.gated_mlp else 1) * inter
        h = m.hidden_size
        layers = float(st.layers)
        coeffs: list[float] = []
        for k, n in ((h, q + 2 * kv), (q, h), (h, up), (inter, h)):
            coeffs += [2.0 * k * n * fd, d * k * n * md, d * (k + n) * md]
        vocab = m.vocab_size // t
        # element-wise: two residual-add+RMSNorm (read 2, write 2 vectors of h), rotary on Q
        # and K, SiLU-and-mul (read 2 x inter, write inter) per layer, and the embedding on
        # the first stage; memory traffic only
        elementwise = d * (8 * h + 2 * (q + kv) + 3 * inter) * md * layers + (h * d * md if st.first else 0.0)
        # the two all-reduces per layer, as `allreduce_time_s` has them: fixed time (call + hops)
        # and, per token, its bytes over the link plus the reduction's HBM traffic
        ar_fixed = ar_per_token = 0.0
        if t > 1:
            ar_bw = st.tp_path.bytes_per_s * eff.link_efficiency
            share = (t - 1) / t * h * d
            ar_fixed = 2 * layers * (eff.allreduce_latency_s + 2.0 * (t - 1) * st.tp_path.latency(eff))
            ar_per_token = 2 * layers * (2.0 * share / ar_bw + REDUCE_HBM_TOUCHES * share * md)
        return (
            eff.kernel_overhead_s,  # 0 fixed cost of one kernel
            layers,  # 1
            *coeffs,  # 2..13: (a, b, c) of QKV, O, MLP up, MLP down
            4.0 * q * fd,  # 14 attention compute seconds per (query x context) token pair
            2.0 * kv * d * md,  # 15 attention: seconds to read one context token's K and V
            2.0 * q * d * md,  # 16 attention: seconds to read Q and write the output, per token
            elementwise,  # 17 element-wise seconds per token
            ar_fixed,  # 18 all-reduce seconds per batch
            ar_per_token,  # 19 all-reduce seconds per token
            2.0 * h * vocab * fd, d * h * vocab * md, d * (h + vocab) * md,  # 20..22 LM head (a, b, c)
            1.0 if st.last else 0.0,  # 23 holds the LM head
        )

    def stage_time_parts(self, st: StageProfile, b: Batch) -> tuple[float, float, float, float]:
        """(gemm, attention, elementwise, allreduce) seconds of one stage for batch `b`."""
        return self._parts(st, self._consts[self.stages.index(st)], b.prefill_tokens, b.prefill_seqs,
                           b.prefill_context_tokens, b.decode_seqs, b.decode_context_tokens)

    def _parts(self, st: StageProfile, c: Sequence[float], prefill_tokens: int, prefill_seqs: int,
               prefill_context_tokens: int, decode_seqs: int, decode_context_tokens: int
               ) -> tuple[float, float, float, float]:
        tokens = prefill_tokens + decode_seqs
        if tokens == 0:
            return 0.0, 0.0, 0.0, 0.0
        norm = self._norm
        # (one unpacking instead of two dozen subscripts: a decision computes ~200 of these)
        (o, layers, qkv_a, qkv_b, qkv_c, o_a, o_b, o_c, up_a, up_b, up_c, down_a, down_b, down_c, attn_a, attn_kv,
         attn_q, elementwise_c, ar_fixed, ar_per_token, head_a, head_b, head_c, has_head) = c
        # the four GEMMs of a layer
        gemm = (4.0 * o + norm(qkv_a * tokens, qkv_b + qkv_c * tokens) + norm(o_a * tokens, o_b + o_c * tokens)
                + norm(up_a * tokens, up_b + up_c * tokens) + norm(down_a * tokens, down_b + down_c * tokens)) * layers
        # attention: decode reads every context token's K and V; prefill chunks attend their
        # cached prefix plus (causally) themselves.
        attn_pairs = float(decode_context_tokens)
        attn_reads = float(decode_context_tokens)
        if prefill_tokens:
            chunk = prefill_tokens / (prefill_seqs if prefill_seqs > 1 else 1)
            attn_pairs += prefill_context_tokens * chunk + prefill_tokens * (chunk + 1) / 2
            attn_reads += prefill_context_tokens + prefill_tokens
        attention = (o + norm(attn_a * attn_pairs, attn_kv * attn_reads + attn_q * tokens)) * layers
        elementwise = elementwise_c * tokens
        curve = st.tp_curve
        if curve is None:
            allreduce = ar_fixed + ar_per_token * tokens
        else:  # measured beats modelled (collectives.py): two all-reduces of the hidden state per layer
            allreduce = 2.0 * layers * curve.time_s(tokens * self._ar_bytes_per_token)
        if has_head:
            sampled = decode_seqs + ((prefill_seqs if prefill_seqs > 1 else 1) if prefill_tokens else 0)
            gemm += o + norm(head_a * sampled, head_b + head_c * sampled)
        slow = st.slowdown
        if slow != 1.0:  # a time-sliced GPU: every kernel waits for its turn
            return gemm * slow, attention * slow, elementwise * slow, allreduce * slow
        return gemm, attention, elementwise, allreduce

    def iteration(self, b: Batch) -> IterationCost:
        """Time of one iteration for batch `b` (module docstring: how a simulator uses it)."""
        stage_s: list[float] = []
        handoff_s: list[float] = []
        totals = [0.0, 0.0, 0.0, 0.0]
        act_bytes = b.tokens * self.model.activation_bytes_per_token
        for st, consts in zip(self.stages, self._consts, strict=True):
            parts = self._parts(st, consts, b.prefill_tokens, b.prefill_seqs, b.prefill_context_tokens,
                                b.decode_seqs, b.decode_context_tokens)
            for i in range(4):
                totals[i] += parts[i]
            stage_s.append(sum(parts))
            if st.next_path is not None:
                handoff_s.append(transfer_time_s(act_bytes, st.next_path, self.eff) if b.tokens else 0.0)
        latency = sum(stage_s) + sum(handoff_s)
        interval = max(s + (handoff_s[i] if i < len(handoff_s) else 0.0) for i, s in enumerate(stage_s))
        return IterationCost(
            latency_s=latency,
            interval_s=interval,
            stage_s=tuple(stage_s),
            handoff_s=tuple(handoff_s),
            gemm_s=totals[0],
            attention_s=totals[1],
            elementwise_s=totals[2],
            allreduce_s=totals[3],
        )

    def latency_interval(self, prefill_tokens: int = 0, prefill_seqs: int = 0, prefill_context_tokens: int = 0,
                         decode_seqs: int = 0, decode_context_tokens: int = 0) -> tuple[float, float]:
        """(latency_s, interval_s) of `iteration`, without building the breakdown (hot path)."""
        tokens = prefill_tokens + decode_seqs
        if tokens == 0:
            return 0.0, 0.0
        if self.pp == 1:  # one stage, no hand-off: latency == interval
            g, a, e, r = self._parts(self.stages[0], self._consts[0], prefill_tokens, prefill_seqs,
                                     prefill_context_tokens, decode_seqs, decode_context_tokens)
            stage = g + a + e + r
            return stage, stage
        act_bytes = tokens * self.model.activation_bytes_per_token
        latency = interval = 0.0
        for st, consts in zip(self.stages, self._consts, strict=True):
            g, a, e, r = self._parts(st, consts, prefill_tokens, prefill_seqs, prefill_context_tokens,
                                     decode_seqs, decode_context_tokens)
            stage = g + a + e + r
            if st.next_path is not None:
                stage_out = stage + transfer_time_s(act_bytes, st.next_path, self.eff)
            else:
                stage_out = stage
            latency += stage_out
            interval = max(interval, stage_out)
        return latency, interval

    def latency_interval_memo(self, prefill_tokens: int = 0, prefill_seqs: int = 0, prefill_context_tokens: int = 0,
                              decode_seqs: int = 0, decode_context_tokens: int = 0) -> tuple[float, float]:
        """`latency_interval`, memoised by the pipeline's signature: steady-state tables ask for
        the same few batches again for every plan of the same physics (equal signatures)."""
        key = (self.signature, prefill_tokens, prefill_seqs, prefill_context_tokens, decode_seqs,
               decode_context_tokens)
        hit = _ITERATION_MEMO.get(key)
        if hit is None:
            if len(_ITERATION_MEMO) >= 8 * _STEADY_CACHE_SIZE:
                _ITERATION_MEMO.clear()
            if self.pp == 1 and prefill_tokens + decode_seqs:  # `latency_interval`'s one-stage case, inline
                g, a, e, r = self._parts(self.stages[0], self._consts[0], prefill_tokens, prefill_seqs,
                                         prefill_context_tokens, decode_seqs, decode_context_tokens)
                stage = g + a + e + r
                hit = _ITERATION_MEMO[key] = (stage, stage)
            else:
                hit = _ITERATION_MEMO[key] = self.latency_interval(prefill_tokens, prefill_seqs,
                                                                   prefill_context_tokens, decode_seqs,
                                                                   decode_context_tokens)
        return hit

    def prefill_time_s(self, prompt_tokens: int, chunk_tokens: int = MAX_BATCHED_TOKENS) -> float:
        """One prompt alone, in chunks of at most `chunk_tokens`, until its first token."""
        key = (self.signature, prompt_tokens, chunk_tokens)
        hit = _PREFILL_MEMO.get(key)
        if hit is not None:
            return hit
        done, total = 0, 0.0
        while done < prompt_tokens:
            chunk = min(chunk_tokens, prompt_tokens - done)
            total += self.latency_interval_memo(chunk, 1, done)[0]
            done += chunk
        if len(_PREFILL_MEMO) >= _STEADY_CACHE_SIZE:
            _PREFILL_MEMO.clear()
        _PREFILL_MEMO[key] = total
        return total

    def decode_step_s(self, seqs: int, context_tokens_per_seq: int) -> float:
        """One decode iteration of `seqs` sequences of the given context, nothing else batched."""
        return self.iteration(Batch(decode_seqs=seqs, decode_context_tokens=seqs * context_tokens_per_seq)).latency_s


@dataclass(frozen=True)
class KvRoute:
    """How KV moves from one plan to another: time = latency_s + tokens x s_per_token."""

    latency_s: float  # fixed part of one sequence's transfer
    s_per_token: float  # seconds per context token (slowest of the parallel stage-to-stage copies)
    bytes_per_token: int  # KV bytes moved per context token (0 where the KV stays in place)

    def time_s(self, context_tokens: int) -> float:
        if self.bytes_per_token == 0 or context_tokens == 0:
            return 0.0
        return self.latency_s + context_tokens * self.s_per_token


class PlanProfile:
    """A plan resolved against a snapshot: its pipelines, KV capacity and KV hand-off route."""

    def __init__(self, plan: Plan, model: ModelSpec, pipelines: Mapping[Role, PipelineProfile],
                 handoff: KvRoute | None, eff: Efficiency) -> None:
        self.plan = plan
        self.model = model
        self._pipelines = dict(pipelines)
        self.handoff = handoff
        self.eff = eff
        # what its estimates depend on: equal signatures, equal estimates (memoisation key)
        self.signature = content_id((
            plan.mode,
            self._pipelines["prefill"].signature,
            self._pipelines["decode"].signature if plan.mode == "disaggregated" else None,
            handoff,
            plan.kv_reserve_tokens,
        ))

    @classmethod
    def build(cls, plan: Plan, model: ModelSpec, snapshot: Snapshot, eff: Efficiency = DEFAULT_EFFICIENCY) -> PlanProfile:
        first = _pipeline(plan.stages, model, snapshot, eff)
        if plan.mode == "disaggregated":
            second = _pipeline(plan.decode_stages, model, snapshot, eff)
            handoff = kv_route(plan.stages, plan.decode_stages, model, snapshot, eff)
            return cls(plan, model, {"prefill": first, "decode": second}, handoff, eff)
        return cls(plan, model, {"prefill": first, "decode": first}, None, eff)

    @classmethod
    def single_block(cls, plan: Plan, model: ModelSpec, spec: GpuSpec, tp_link_bytes_per_s: float,
                     eff: Efficiency = DEFAULT_EFFICIENCY, curve: CollectiveCurve | None = None) -> PlanProfile:
        """A one-stage colocated plan inside one atomic block, resolved from the block's figures
        (its GPU spec and its TP link) without walking the snapshot: what `build` gives for it.
        Memoised, so units of one shape on different blocks share one profile (they differ only
        in which GPUs they use; `plan` is the first one seen)."""
        if plan.mode != "colocated" or len(plan.stages) != 1:
            raise ValueError("single_block: needs a colocated one-stage plan")
        tp = plan.stages[0].tp
        # by pipeline, then by KV reserve: plans that differ only in their KV reserve share one
        # pipeline (and the pipeline key, whose specs hash in Python, is hashed once per call)
        pipe_key = (model, eff, spec, tp, tp_link_bytes_per_s, curve if tp > 1 else None)
        entry = _SINGLE_BLOCK.get(pipe_key)
        if entry is not None:
            hit = entry[1].get(plan.kv_reserve_tokens)
            if hit is not None:
                return hit
            pipe = entry[0]
        else:
            stage = StageProfile(
                layers=model.num_layers,
                tp=tp,
                spec=spec,
                tp_path=Path(bytes_per_s=tp_link_bytes_per_s if tp > 1 else math.inf),
                first=True,
                last=True,
                next_path=None,
                tp_curve=curve if tp > 1 else None,
            )
            pipe = PipelineProfile(model, [stage], eff)
            if len(_SINGLE_BLOCK) >= _STEADY_CACHE_SIZE:
                _SINGLE_BLOCK.clear()
            entry = _SINGLE_BLOCK[pipe_key] = (pipe, {})
        by_kv = entry[1]
        if len(by_kv) >= 256:  # (KV reserves are bucketed: a handful per pipeline)
            by_kv.clear()
        profile = by_kv[plan.kv_reserve_tokens] = cls(plan, model, {"prefill": pipe, "decode": pipe}, None, eff)
        return profile

    def pipeline(self, role: Role) -> PipelineProfile:
        """The pipeline doing `role`; colocated plans return the same one for both."""
        return self._pipelines[role]

    @property
    def kv_capacity_tokens(self) -> int:
        return self.plan.kv_reserve_tokens

    def kv_handoff_s(self, prompt_tokens: int) -> float:
        """Disaggregated: moving one prompt's KV from the prefill to the decode group; 0 otherwise."""
        return 0.0 if self.handoff is None else self.handoff.time_s(prompt_tokens)


def _pipeline(stages: Sequence[Stage], model: ModelSpec, snapshot: Snapshot, eff: Efficiency) -> PipelineProfile:
    profiles = []
    for i, stage in enumerate(stages):
        specs = [snapshot.spec_of(u) for u in stage.gpu_uuids]
        spec = min(specs, key=lambda s: s.bf16_flops * s.hbm_bytes_per_s)
        nxt = None
        if i + 1 < len(stages):
            nxt = gpu_path(snapshot, stage.gpu_uuids[0], stages[i + 1].gpu_uuids[0])
        curve = None
        if stage.tp > 1 and snapshot.collectives:
            homes = {snapshot.gpu_by_uuid[u].node_id for u in stage.gpu_uuids}
            curve = snapshot.allreduce_curve(homes.pop(), stage.tp) if len(homes) == 1 else None
        profiles.append(
            StageProfile(
                layers=stage.num_layers,
                tp=stage.tp,
                spec=spec,
                tp_path=group_path(snapshot, stage.gpu_uuids),
                first=stage.layer_start == 0,
                last=stage.layer_end == model.num_layers,
                next_path=nxt,
                tp_curve=curve,
                slowdown=1.0 / min(snapshot.gpu_by_uuid[u].compute_share for u in stage.gpu_uuids),
            )
        )
    return PipelineProfile(model, profiles, eff)


def kv_route(src: Sequence[Stage], dst: Sequence[Stage], model: ModelSpec, snapshot: Snapshot,
             eff: Efficiency = DEFAULT_EFFICIENCY) -> KvRoute:
    """KV of one sequence from pipeline `src` to pipeline `dst`, stage pairs in parallel.

    Each source stage sends the KV of the layers a destination stage holds. Inside a node the
    TP ranks of a pair copy in parallel over their own links (min of the two TP degrees);
    across nodes they share the node link. A pair on the same GPUs with the same layers and
    TP keeps its KV in place. A source GPU missing from the snapshot has lost its KV, and an
    engine at either end that cannot move KV (capabilities.EngineCaps.kv_migration) takes none:
    the route is infinitely slow, so every sequence replays.
    """
    per_layer = model.kv_bytes_per_token_per_layer
    worst_s_per_token, worst_latency, moved = 0.0, 0.0, 0
    gpus = snapshot.gpu_by_uuid
    for s in src:
        for t in dst:
            overlap = min(s.layer_end, t.layer_end) - max(s.layer_start, t.layer_start)
            if overlap <= 0:
                continue
            if s.gpu_uuids == t.gpu_uuids and s.layer_start == t.layer_start and s.layer_end == t.layer_end:
                continue
            moved += overlap * per_layer
            u, v = s.gpu_uuids[0], t.gpu_uuids[0]
            if u not in gpus or v not in gpus or not all(g in gpus for g in s.gpu_uuids):
                return KvRoute(latency_s=math.inf, s_per_token=math.inf, bytes_per_token=max(1, moved))
            if not migrates_kv(snapshot, (gpus[u].node_id, gpus[v].node_id)):
                # an engine that cannot export or import KV (vLLM): every sequence replays
                return KvRoute(latency_s=math.inf, s_per_token=math.inf, bytes_per_token=max(1, moved))
            path = gpu_path(snapshot, u, v)
            lanes = min(s.tp, t.tp) if gpus[u].node_id == gpus[v].node_id else 1
            if path.curve is not None:  # a measured copy sweep over this path: its bandwidth (per lane) and floor
                bw = path.curve.bandwidth_bytes_per_s() * lanes
                if math.isfinite(bw):
                    worst_s_per_token = max(worst_s_per_token, overlap * per_layer / bw)
                worst_latency = max(worst_latency, path.curve.latency_s())
                continue
            bw = path.effective_bytes_per_s(eff) * lanes
            if bw <= 0:
                return KvRoute(latency_s=math.inf, s_per_token=math.inf, bytes_per_token=max(1, moved))
            if math.isfinite(bw):
                worst_s_per_token = max(worst_s_per_token, overlap * per_layer / bw)
            worst_latency = max(worst_latency, path.transfer_latency(eff))
    return KvRoute(latency_s=worst_latency, s_per_token=worst_s_per_token, bytes_per_token=moved)


# --- convenience functions (build a profile, then ask it) -----------------------------------------
def iteration_time_s(plan: Plan, model: ModelSpec, snapshot: Snapshot, *, prefill_tokens: int = 0,
                     prefill_seqs: int = 0, prefill_context_tokens: int = 0, decode_seqs: int = 0,
                     decode_context_tokens: int = 0, role: Role = "prefill",
                     eff: Efficiency = DEFAULT_EFFICIENCY) -> float:
    """Latency of one continuous-batching iteration (chunked prefill + decode) of `plan`.

    For many calls build a `PlanProfile` once and call `pipeline(role).iteration(Batch(...))`.
    """
    if prefill_tokens and not prefill_seqs:
        prefill_seqs = 1
    batch = Batch(prefill_tokens, prefill_seqs, prefill_context_tokens, decode_seqs, decode_context_tokens)
    return PlanProfile.build(plan, model, snapshot, eff).pipeline(role).iteration(batch).latency_s


def prefill_time_s(plan: Plan, model: ModelSpec, snapshot: Snapshot, prompt_tokens: int,
                   eff: Efficiency = DEFAULT_EFFICIENCY) -> float:
    """Time to first token of one prompt on an idle plan (KV hand-off included when disaggregated)."""
    profile = PlanProfile.build(plan, model, snapshot, eff)
    return profile.pipeline("prefill").prefill_time_s(prompt_tokens) + profile.kv_handoff_s(prompt_tokens)


def decode_step_s(plan: Plan, model: ModelSpec, snapshot: Snapshot, seqs: int, context_tokens_per_seq: int,
                  eff: Efficiency = DEFAULT_EFFICIENCY) -> float:
    """One decode iteration of `seqs` sequences on an otherwise idle plan."""
    return PlanProfile.build(plan, model, snapshot, eff).pipeline("decode").decode_step_s(seqs, context_tokens_per_seq)


def kv_capacity_tokens(plan: Plan) -> int:
    """KV tokens the plan holds per pipeline (what it reserved; see `max_kv_tokens`)."""
    return plan.kv_reserve_tokens


def max_kv_tokens(stages: Sequence[Stage], model: ModelSpec, snapshot: Snapshot, *,
                  reclaimable_bytes: Mapping[str, int] | None = None, mem_fraction: float = 0.92) -> int:
    """The most KV tokens a pipeline of `stages` can reserve on `snapshot` (0 if weights do not fit)."""
    reclaim = reclaimable_bytes or {}
    best = math.inf
    for stage in stages:
        weights_only = stage_bytes_per_gpu(stage, model, 0)
        per_token = stage.num_layers * model.kv_bytes_per_token_per_layer / model.kv_shards(stage.tp)
        for u in stage.gpu_uuids:
            g = snapshot.gpu_by_uuid[u]
            room = usable_bytes(g.mem_total_bytes, g.mem_used_bytes, reclaim.get(u, 0), mem_fraction) - weights_only
            best = min(best, max(0.0, room) / per_token)
    return 0 if math.isinf(best) else int(best)


_PREFILL_MEMO: dict[tuple[object, ...], float] = {}  # (pipeline signature, tokens, chunk) -> seconds
_ITERATION_MEMO: dict[tuple[object, ...], tuple[float, float]] = {}  # see PipelineProfile.latency_interval_memo
# see PlanProfile.single_block: pipeline key -> (its pipeline, KV reserve -> profile)
_SINGLE_BLOCK: dict[tuple[object, ...], tuple[PipelineProfile, dict[int, PlanProfile]]] = {}
_STEADY_CACHE_SIZE = 4096
