"""Roofline cost model: per-iteration step times, KV capacity, steady-state estimates, switch cost.

Physics, and only a handful of fitted factors (`Efficiency`):

* Every matrix multiply (and the attention kernel) is one kernel. Its time is a fixed
  per-kernel overhead plus the p-norm of its two roofline bounds:
      t = overhead + (t_compute^p + t_memory^p)^(1/p)
      t_compute = FLOPs / (mfu x peak FLOP/s),  t_memory = bytes / (mbu x peak HBM B/s)
  With p = 2 the kernel is compute-bound for prefill-sized batches and memory-bound for
  decode-sized ones, and the two overlap imperfectly near the ridge point, as real GEMMs do.
  Element-wise kernels (fused residual-add+RMSNorm, rotary, SiLU-and-mul) are memory traffic
  only (vLLM fuses them; their launch cost hides under CUDA graphs).
* TP all-reduce (two per layer), an alpha-beta ring (`allreduce_time_s`): a fixed cost per
  call + 2(t-1) hops x one hop's latency + 2(t-1)/t x bytes / (link_efficiency x link B/s)
  + the reduction's own HBM traffic (3 x (t-1)/t x bytes at the MBU). Small messages are
  latency-bound (the fixed part is ~45-70 us for 2-8 GPUs, as Vidur measured NCCL, against
  ~2 us of bandwidth time for a decode step's 16 KB), large ones bandwidth-bound.
  Point-to-point (PP hand-off, KV hand-off and migration): one kernel launch + a send/recv
  handshake + one hop + bytes / (p2p efficiency x B/s). Where an agent measured the collective itself (a sweep of message
  sizes, scheduler.collectives), its curve replaces the model: the TP all-reduce of a group on
  that node and size, and copies between the two nodes. Links measured by the agents' probes are used as measured for
  copies (their efficiency is already in the number); datasheet links (NVLink, PCIe) are
  derated by `link_efficiency`.
* A pipeline of S stages keeps S micro-batches in flight: a batch takes the sum of the stage
  times and hand-offs (`latency_s`); a new batch can enter every `interval_s` (the slowest
  stage plus its hand-off). With fewer running sequences than stages, stages idle (bubbles).

How a discrete-event simulator uses this, per plan:

    profile = PlanProfile.build(plan, model, snapshot)       # once per plan and topology
    pipe = profile.pipeline("prefill")                      # or "decode"; the same object when colocated
    cost = pipe.iteration(Batch(prefill_tokens=..., prefill_seqs=..., prefill_context_tokens=...,
                                decode_seqs=..., decode_context_tokens=...))
    # cost.latency_s: when this batch's tokens are done; cost.interval_s: when the next batch
    # may enter (PP > 1 keeps up to pp batches in flight; PP = 1: latency == interval).
    profile.kv_handoff_s(prompt_tokens)                     # disaggregated: prefill -> decode

Steady-state estimates (`estimate_plan`, `estimate_gear`) solve Little's law on top of the
same iteration function, and add an M/G/1-style queueing tail for P50/P99 (`SteadyState`).
`switch_cost` prices a gear change in output tokens of service lost, with its parts;
`migrate_or_replay` is the per-sequence choice the transition executor makes.

Units: seconds (`_s`), bytes (`_bytes`), bytes per second (`_bytes_per_s`), FLOP/s.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from scheduler._lazy import (
    cached_field_hash,
    check_plain_dataclass,
    content_id,
    make_frozen,
    state_without_hash,
)
from scheduler.capabilities import migrates_kv
from scheduler.collectives import CollectiveCurve
from scheduler.hardware import GpuSpec
from scheduler.modelspec import ModelSpec
from scheduler.plan import Gear, Plan, Stage, stage_bytes_per_gpu, usable_bytes
from scheduler.topology import Snapshot

Role = Literal["prefill", "decode"]


# --- the fitted factors ------------------------------------------------------------------------
@dataclass(frozen=True)
class Efficiency:
    """The few efficiency factors, fitted once on ../shared/calibration (A100-80GB, Vidur's
    operator and collective timings; `python -m bench.fidelity --fit` reproduces the fit), then
    used unchanged for every GPU and model."""

    __hash__ = cached_field_hash  # fields hashed once (memo keys)
    __getstate__ = state_without_hash

    mfu: float = 0.72  # fraction of dense peak FLOP/s a compute-bound GEMM reaches (prefill)
    mbu: float = 0.78  # fraction of peak HBM bandwidth a memory-bound kernel reaches (decode)
    link_efficiency: float = 0.76  # fraction of a datasheet link's bandwidth a ring collective reaches per link
    link_latency_s: float = 2e-6  # one hop over a link (a copy pays one, a ring all-reduce 2(t-1))
    kernel_overhead_s: float = 6.5e-6  # fixed cost of one kernel: a GEMM, attention, a send/recv
    roofline_norm: float = 2.0  # p of the p-norm joining the compute and memory bounds
    # Fixed cost of one all-reduce call: the kernel launch and the synchronisation of the ring
    # before each of its two phases (reduce-scatter, all-gather). Fitted on Vidur's NCCL timings,
    # which launch each collective on its own (no CUDA graph), so it is on the safe side for
    # engines that capture decode steps in graphs and use a custom all-reduce for small messages.
    # (Last, so that the fields before it keep their positions.)
    allreduce_latency_s: float = 37e-6
    # A point-to-point copy over a datasheet link (NVLink/PCIe: a PP hand-off, a KV move inside a
    # node) is one copy stream with no reduction: it reaches more of the link than a ring's share
    # (fitted on Vidur's in-node NCCL send/recv: ~0.94), and an NCCL send/recv call pays a
    # handshake beyond a kernel launch (~4 us). Measured paths are used as measured.
    p2p_link_efficiency: float = 0.94
    p2p_latency_s: float = 4e-6

    def __post_init__(self) -> None:
        for name in ("mfu", "mbu", "link_efficiency", "p2p_link_efficiency"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{name}: must be within (0, 1], got {value}")
        for name in ("link_latency_s", "allreduce_latency_s", "kernel_overhead_s", "p2p_latency_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.roofline_norm < 1:
            raise ValueError(f"roofline_norm: must be >= 1, got {self.roofline_norm}")


DEFAULT_EFFICIENCY = Efficiency()

# Chunked-prefill token budget per iteration and the running-sequence cap (vLLM defaults).
MAX_BATCHED_TOKENS = 2048
MAX_RUNNING_SEQS = 256


def kernel_time_s(flops: float, bytes_moved: float, spec: GpuSpec, eff: Efficiency = DEFAULT_EFFICIENCY) -> float:
    """One GEMM or attention kernel on one GPU (module docstring)."""
    tc = flops / (eff.mfu * spec.bf16_flops)
    tm = bytes_moved / (eff.mbu * spec.hbm_bytes_per_s)
    p = eff.roofline_norm
    if p == 2.0:
        bound = math.sqrt(tc * tc + tm * tm)
    else:
        bound = (tc**p + tm**p) ** (1.0 / p)
    return eff.kernel_overhead_s + bound


def gemm_time_s(tokens: int, k: int, n: int, dtype_bytes: int, spec: GpuSpec,
                eff: Efficiency = DEFAULT_EFFICIENCY) -> float:
    """[tokens x k] @ [k x n]: 2 t k n FLOPs; reads the weights and the input, writes the output."""
    flops = 2.0 * tokens * k * n
    bytes_moved = dtype_bytes * (k * n + tokens * k + tokens * n)
    return kernel_time_s(flops, bytes_moved, spec, eff)


def _p_norm(p: float) -> Callable[[float, float], float]:
    def norm(tc: float, tm: float) -> float:
        return float((tc**p + tm**p) ** (1.0 / p))
    return norm


# --- links -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Path:
    """The path data takes between two GPUs (or two groups, at its bottleneck)."""

    bytes_per_s: float  # per direction
    latency_s: float | None = None  # measured latency beyond the model's link_latency_s; None: none
    measured: bool = False  # True: a probe measured the bandwidth (no efficiency applied)
    curve: CollectiveCurve | None = None  # a measured send/recv sweep over this path: point-to-point copies use it

    def effective_bytes_per_s(self, eff: Efficiency) -> float:
        """What one point-to-point copy gets of the path: as measured, or the datasheet figure derated."""
        return self.bytes_per_s if self.measured else self.bytes_per_s * eff.p2p_link_efficiency

    def latency(self, eff: Efficiency) -> float:
        """One hop over the path: the link's latency (plus what a probe measured beyond it)."""
        return eff.link_latency_s if self.latency_s is None else eff.link_latency_s + self.latency_s

    def transfer_latency(self, eff: Efficiency) -> float:
        """Fixed time of a point-to-point copy: one kernel launch (send/recv is a kernel, with
        the same fixed cost as any other), the send/recv handshake, and one hop."""
        return eff.kernel_overhead_s + eff.p2p_latency_s + self.latency(eff)


def transfer_time_s(bytes_moved: float, path: Path, eff: Efficiency = DEFAULT_EFFICIENCY) -> float:
    """Point-to-point copy (send/recv): the measured curve where there is one, else one launch,
    one hop and the bytes over the path's bandwidth. inf when there is no path."""
    if path.curve is not None:
        return path.curve.time_s(bytes_moved)
    bw = path.effective_bytes_per_s(eff)
    if bw <= 0:
        return math.inf
    if math.isinf(bw):
        return 0.0
    return path.transfer_latency(eff) + bytes_moved / bw


REDUCE_HBM_TOUCHES = 3  # a reduce-scatter step reads two operands and writes the sum


def allreduce_time_s(ranks: int, bytes_moved: float, path: Path, eff: Efficiency = DEFAULT_EFFICIENCY,
                     hbm_bytes_per_s: float = 0.0, *, lanes: int = 1) -> float:
    """Ring all-reduce of `bytes_moved` over `ranks` GPUs whose slowest link is `path`.

    alpha-beta, term by term:
    * `allreduce_latency_s` once per call (launch, and the ring's synchronisation before its
      reduce-scatter and its all-gather phase);
    * 2(t-1) hops, each one transfer's latency over the path (`Path.latency`: `link_latency_s`,
      plus the probed latency on a measured network link): a chunk must cross every hop of
      the ring before the last rank has it, which is why an 8-GPU ring costs more than a
      2-GPU one before any byte counts, and a 16-rank ring across nodes ~30 network latencies;
    * each rank sends 2(t-1)/t of the bytes at `link_efficiency` of the path's bandwidth, even
      on a measured path: a probe times a one-way copy, while a ring sends and receives on
      every link at once and forwards each chunk only after reducing it;
    * `lanes` parallel paths share the bytes (ranks of one node spread their ring channels over
      that many network cards; 1 inside a node, where `path` is the whole NVLink/PCIe link);
    * the reduction streams its operands through HBM (read two, write one per element,
      (t-1)/t of the bytes); NCCL runs it in the same few SMs as the copies, so that time adds
      rather than overlaps. `hbm_bytes_per_s` 0 leaves it out.
    """
    if ranks <= 1:
        return 0.0
    bw = path.bytes_per_s * eff.link_efficiency * max(1, lanes)
    if bw <= 0:
        return math.inf
    share = (ranks - 1) / ranks * bytes_moved
    reduce_s = REDUCE_HBM_TOUCHES * share / (eff.mbu * hbm_bytes_per_s) if hbm_bytes_per_s > 0 else 0.0
    hops_s = 2.0 * (ranks - 1) * path.latency(eff)
    return eff.allreduce_latency_s + hops_s + 2.0 * share / bw + reduce_s


def gpu_path(snapshot: Snapshot, u: str, v: str) -> Path:
    """The path between two GPUs of a snapshot (nominal inside a node, measured across nodes)."""
    gu, gv = snapshot.gpu_by_uuid[u], snapshot.gpu_by_uuid[v]
    if gu.node_id == gv.node_id:
        # a measured copy sweep (an agent times GPU 0 -> 1) stands for pairs of one NVLink group
        curve = (snapshot.copy_curve(gu.node_id) if snapshot.collectives and gu.nvlink_group is not None
                 and gu.nvlink_group == gv.nvlink_group else None)
        return Path(bytes_per_s=snapshot.gpu_link_bytes_per_s(u, v), curve=curve)
    # across nodes: what Snapshot.gpu_link_bytes_per_s and gpu_link_latency_s give, with the
    # host links and the node link looked up once for both
    host = min(snapshot.spec(gu.model).host_link_bytes_per_s, snapshot.spec(gv.model).host_link_bytes_per_s)
    node_bw = snapshot.node_link_bytes_per_s(gu.node_id, gv.node_id)
    measured = node_bw <= host  # the node link is the bottleneck: use it as the probe measured it
    curve = snapshot.sendrecv_curve(gu.node_id, gv.node_id) if snapshot.collectives else None
    return Path(bytes_per_s=min(host, node_bw), latency_s=snapshot.node_link_latency_s(gu.node_id, gv.node_id),
                measured=measured, curve=curve)


def group_path(snapshot: Snapshot, uuids: Sequence[str]) -> Path:
    """The slowest path inside a TP group (ring neighbours)."""
    if len(uuids) <= 1:
        return Path(bytes_per_s=math.inf)
    gpus = snapshot.gpu_by_uuid
    first = gpus[uuids[0]]
    home = (first.node_id, first.nvlink_group, first.model)
    if all((g.node_id, g.nvlink_group, g.model) == home for g in map(gpus.__getitem__, uuids)):
        # one node, one NVLink group (or none), one model: every ring hop is the same path
        return gpu_path(snapshot, uuids[0], uuids[1])
    paths = [gpu_path(snapshot, uuids[i], uuids[(i + 1) % len(uuids)]) for i in range(len(uuids))]
    return min(paths, key=lambda p: p.bytes_per_s)


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


# --- workload and steady-state estimates -----------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """Offered load of one deployment (sliding-window statistics or a scenario's description)."""

    __hash__ = cached_field_hash  # fields hashed once (memo keys)
    __getstate__ = state_without_hash

    rate_rps: float  # request arrival rate
    prompt_tokens_mean: float  # mean prompt length
    output_tokens_mean: float  # mean output length
    prompt_tokens_cv: float = 1.0  # coefficient of variation (std / mean) of prompt length
    output_tokens_cv: float = 0.6  # same for output length

    def __post_init__(self) -> None:
        if self.rate_rps < 0 or not math.isfinite(self.rate_rps):
            raise ValueError(f"rate_rps: must be a finite number >= 0, got {self.rate_rps}")
        for name in ("prompt_tokens_mean", "output_tokens_mean"):
            if not getattr(self, name) >= 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("prompt_tokens_cv", "output_tokens_cv"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")

    def prompt_quantile(self, q: float) -> float:
        return _lognormal_quantile(self.prompt_tokens_mean, self.prompt_tokens_cv, q)

    def output_quantile(self, q: float) -> float:
        return _lognormal_quantile(self.output_tokens_mean, self.output_tokens_cv, q)

    def scaled(self, factor: float) -> Workload:
        return Workload(self.rate_rps * factor, self.prompt_tokens_mean, self.output_tokens_mean,
                        self.prompt_tokens_cv, self.output_tokens_cv)

    def to_dict(self) -> dict[str, float]:
        return {
            "rate_rps": self.rate_rps,
            "prompt_tokens_mean": self.prompt_tokens_mean,
            "output_tokens_mean": self.output_tokens_mean,
            "prompt_tokens_cv": self.prompt_tokens_cv,
            "output_tokens_cv": self.output_tokens_cv,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, object], path: str = "workload") -> Workload:
        allowed = ("rate_rps", "prompt_tokens_mean", "output_tokens_mean", "prompt_tokens_cv", "output_tokens_cv")
        if not isinstance(d, Mapping):
            raise ValueError(f"{path}: must be an object")
        for key in d:
            if key not in allowed:
                raise ValueError(f"{path}.{key}: unknown key")
        values: dict[str, float] = {}
        for key in allowed:
            if key not in d:
                if key.endswith("_cv"):
                    continue
                raise ValueError(f"{path}.{key}: required")
            v = d[key]
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise ValueError(f"{path}.{key}: must be a number, got {v!r}")
            values[key] = float(v)
        try:
            return cls(**values)
        except ValueError as exc:
            raise ValueError(f"{path}.{exc}") from None


@dataclass(frozen=True)
class Slo:
    """Latency objectives of a deployment."""

    __hash__ = cached_field_hash  # fields hashed once (memo keys)
    __getstate__ = state_without_hash

    ttft_ms: float  # time to first token, P99 target
    tpot_ms: float  # time per output token, P99 target

    def __post_init__(self) -> None:
        if not (self.ttft_ms > 0 and self.tpot_ms > 0):
            raise ValueError(f"slo: ttft_ms and tpot_ms must be > 0, got {self.ttft_ms}, {self.tpot_ms}")


@dataclass(frozen=True)
class Estimate:
    """Steady-state prediction for one plan or gear under a workload. Latencies in seconds;
    inf when overloaded (serialised as null)."""

    capacity_rps: float  # the most requests/s it sustains (compute, KV capacity, seq cap)
    served_rps: float  # min(offered, capacity)
    utilization: float  # offered / capacity (may exceed 1)
    throughput_tokens_s: float  # output tokens/s served
    goodput_tokens_s: float  # output tokens/s served within the SLO (= throughput without an SLO)
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    kv_capacity_tokens: int  # summed over plans
    max_running_seqs: int  # sequences it can hold at once (KV and seq cap), summed
    gpus: int  # GPUs used
    limit: str  # what bounds the capacity: "compute", "kv", "seqs", "prefill", "link"

    @property
    def overloaded(self) -> bool:
        return self.utilization >= 1.0

    def to_dict(self) -> dict[str, object]:
        return {k: _finite_or_none(getattr(self, k)) for k in _ESTIMATE_FIELDS}

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> Estimate:
        values: dict[str, object] = {}
        for key in _ESTIMATE_FIELDS:
            if key not in d:
                raise ValueError(f"estimate.{key}: required")
            v = d[key]
            values[key] = math.inf if v is None else v
        return cls(**values)  # type: ignore[arg-type]  # values come from to_dict


_ESTIMATE_FIELDS = (
    "capacity_rps", "served_rps", "utilization", "throughput_tokens_s", "goodput_tokens_s",
    "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "kv_capacity_tokens",
    "max_running_seqs", "gpus", "limit",
)
check_plain_dataclass(Estimate, field_names=_ESTIMATE_FIELDS)  # built with make_frozen in hot loops


def _finite_or_none(v: object) -> object:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


_Z99 = 2.3263478740408408  # standard normal 0.99 quantile


@lru_cache(maxsize=4096)
def _lognormal_quantile(mean: float, cv: float, q: float) -> float:
    if cv <= 0:
        return mean
    sigma2 = math.log1p(cv * cv)
    mu = math.log(mean) - sigma2 / 2
    return math.exp(mu + math.sqrt(sigma2) * _norm_ppf(q))


def _norm_ppf(q: float) -> float:
    """Inverse standard normal CDF (Acklam's rational approximation, |error| < 1.2e-9)."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"quantile: must be within (0, 1), got {q}")
    a = (-3.969683028665376e01, 2.209460984245205e02, -2.759285104469687e02, 1.383577518672690e02,
         -3.066479806614716e01, 2.506628277459239e00)
    b = (-5.447609879822406e01, 1.615858368580409e02, -1.556989798598866e02, 6.680131188771972e01,
         -1.328068155288572e01)
    c = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e00, -2.549732539343734e00,
         4.374664141464968e00, 2.938163982698783e00)
    dd = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e00, 3.754408661907416e00)
    lo = 0.02425
    if q < lo:
        r = math.sqrt(-2 * math.log(q))
        return (((((c[0] * r + c[1]) * r + c[2]) * r + c[3]) * r + c[4]) * r + c[5]) / (
            (((dd[0] * r + dd[1]) * r + dd[2]) * r + dd[3]) * r + 1)
    if q > 1 - lo:
        return -_norm_ppf(1 - q)
    r = q - 0.5
    s = r * r
    return (((((a[0] * s + a[1]) * s + a[2]) * s + a[3]) * s + a[4]) * s + a[5]) * r / (
        ((((b[0] * s + b[1]) * s + b[2]) * s + b[3]) * s + b[4]) * s + 1)


class SteadyState:
    """Steady-state model of one plan under one workload *shape* (lengths and spread, not
    rate): small tables computed once, so `estimate(rate_rps)` is interpolation.

    A *round* is the time in which every running sequence makes one token; in it the plan
    also prefills prompt/output tokens per running sequence (the arrivals that keep the
    population steady). With S stages the sequences split into S micro-batches, so a round is
    max(latency, S x interval) of one micro-batch: fewer sequences than stages leave bubbles.

    Colocated: decode and chunked prefill share each iteration; capacity is the rate at the
    largest running population that KV memory, the sequence cap and the token budget allow.
    Disaggregated: the prefill pipeline and the decode pipeline each bound it. TTFT = an
    M/G/1-style queueing wait (exponential tail, the token-length spread as the service
    spread) + the prompt's own prefill; TPOT P99 is a round that also carries a full prefill
    chunk.
    """

    def __init__(self, profile: PlanProfile, workload: Workload, slo: Slo | None = None, *,
                 max_batched_tokens: int = MAX_BATCHED_TOKENS, max_running_seqs: int = MAX_RUNNING_SEQS) -> None:
        self.profile = profile
        self.slo = slo
        self.shape = workload
        self.max_batched_tokens = max_batched_tokens
        self._latency_ready = False  # the TTFT/TPOT tables (`_latency_tables`), built by the first estimate
        prompt, output = workload.prompt_tokens_mean, workload.output_tokens_mean
        self.prompt, self.output = prompt, output
        self.context = prompt + output / 2
        self.colocated = profile.plan.mode == "colocated"
        self.decode_pipe = profile.pipeline("decode")
        self.prefill_pipe = profile.pipeline("prefill")
        plan = profile.plan
        # (a one-stage colocated plan's GPUs are its stage's: no need to build plan.gpu_uuids)
        self.gpus = (len(plan.stages[0].gpu_uuids) if len(plan.stages) == 1 and not plan.decode_stages
                     else len(plan.gpu_uuids))
        self.kv_tokens = profile.kv_capacity_tokens
        pp = self.decode_pipe.pp
        seq_cap = max_running_seqs * pp
        kv_seqs = int(self.kv_tokens // self.context)
        budget_seqs = int(max_batched_tokens * pp / (1 + prompt / output)) if self.colocated else seq_cap
        self.running_cap = max(0, min(kv_seqs, seq_cap, budget_seqs))
        self.limit = "kv" if self.running_cap == kv_seqs else ("seqs" if self.running_cap == seq_cap else "compute")
        self.work_cv2 = (prompt / (prompt + output) * workload.prompt_tokens_cv) ** 2 + (
            output / (prompt + output) * workload.output_tokens_cv) ** 2
        if self.running_cap < 1:
            self.capacity_rps = 0.0
            self.limit = "kv"
            return
        # population -> round time, on a grid of factors of 4 up to the cap (the round time is
        # smooth and monotone in the population; between grid points we interpolate)
        grid = [1]
        while grid[-1] * 4 < self.running_cap:
            grid.append(grid[-1] * 4)
        if grid[-1] != self.running_cap:
            grid.append(self.running_cap)
        self.grid = grid
        # round times on the grid, computed when first needed: an estimate reads the points up
        # to its population (and capacity the last), so light loads never touch the middle
        self._rounds: list[float | None] = [None] * len(grid)
        self.capacity_rps = self.running_cap / (output * self._round_at(len(grid) - 1))
        if not self.colocated:
            chunk = max_batched_tokens
            per_chunk = self.prefill_pipe.latency_interval_memo(chunk, max(1, int(chunk // prompt)))[1]
            prefill_cap = chunk / prompt / per_chunk
            if prefill_cap < self.capacity_rps:
                self.capacity_rps, self.limit = prefill_cap, "prefill"
        self.chunks_per_prompt = math.ceil(prompt / max_batched_tokens)

    def _latency_tables(self) -> None:
        """What latency estimates need beyond throughput: a median and a P99 prompt's prefill
        (and KV hand-off), and the extra time of a round that carries a prefill chunk. Built
        on first use: the planner ranks some plans by capacity alone."""
        workload, max_batched_tokens, profile = self.shape, self.max_batched_tokens, self.profile
        p50, p99 = workload.prompt_quantile(0.5), workload.prompt_quantile(0.99)
        self.prefill50_s = self.prefill_pipe.prefill_time_s(max(1, int(p50)), max_batched_tokens)
        self.prefill99_s = self.prefill_pipe.prefill_time_s(max(1, int(p99)), max_batched_tokens)
        self.chunks50 = math.ceil(p50 / max_batched_tokens)
        self.chunks99 = math.ceil(p99 / max_batched_tokens)
        self.handoff50_s = profile.kv_handoff_s(int(p50))
        self.handoff99_s = profile.kv_handoff_s(int(p99))
        # a round that also carries a prompt's chunk: the chunk's extra time
        chunk_tokens = max(1, min(max_batched_tokens, int(self.prompt)))
        alone = self.decode_pipe.latency_interval_memo(chunk_tokens, 1)[0]
        one = self.decode_pipe.latency_interval_memo(0, 0, 0, 1, int(self.context))[0]
        self.chunk_extra_s = max(0.0, alone - one) if self.colocated else 0.0
        self.idle_round_s = self.decode_pipe.latency_interval_memo(0, 0, 0, 1, 1)[0]  # weights alone
        self._latency_ready = True

    def _round(self, seqs: int) -> float:
        # NOTE(mixed rounds): the prompt work of a colocated round does not spread thinly over
        # every round. The engine (vLLM's chunked prefill, agents.sim.engine) gives a round's
        # leftover token budget to whole prompt chunks, so a few rounds carry a chunk and pay
        # its compute in full, and the others are plain decode steps that pay the weights and
        # KV reads. A round that carried a thin slice of prompt instead would hide that slice's
        # compute under the weight reads (one kernel's compute and memory bounds overlap), and
        # the estimate would promise a TPOT the engine never reaches. So the mean round is a
        # decode step plus, for the share of rounds that carry a chunk, the chunk's extra time.
        pipe = self.decode_pipe
        pp = pipe.pp
        per_mb = max(1.0, seqs / pp)
        decode_seqs = int(round(per_mb))
        decode_ctx = int(decode_seqs * self.context)
        if not self.colocated:
            latency, interval = pipe.latency_interval_memo(0, 0, 0, decode_seqs, decode_ctx)
            return max(latency, min(pp, max(1, seqs)) * interval)
        # prompt tokens per micro-batch round that keep the population steady
        prompt = self.prompt
        prefill_per_round = per_mb * prompt / self.output
        # the prompt tokens a round carries when it carries any: the budget left by the decodes,
        # or less when the prompts waiting are shorter (a round takes what has arrived); and the
        # mean cached prefix such a chunk attends to (0 when a prompt fits one chunk). Written
        # out: a decision computes ~80 rounds
        left = self.max_batched_tokens - decode_seqs
        if left < 1:
            left = 1
        want = int(round(prompt if prompt >= prefill_per_round else prefill_per_round))
        chunk = want if want < left else left
        if chunk < 1:
            chunk = 1
        share = prefill_per_round / chunk
        if not share < 1.0:
            share = 1.0
        chunk_seqs = int(round(chunk / prompt))
        if chunk_seqs < 1:
            chunk_seqs = 1
        pieces = math.ceil(prompt / chunk)
        plain = pipe.latency_interval_memo(0, 0, 0, decode_seqs, decode_ctx)
        mixed = pipe.latency_interval_memo(chunk, chunk_seqs, int(chunk * (pieces - 1) / 2) * chunk_seqs, decode_seqs,
                                           decode_ctx)
        latency = plain[0] + share * (mixed[0] - plain[0])
        if pp == 1:  # one stage: interval == latency (the same floats), so the max below is latency
            return latency
        interval = plain[1] + share * (mixed[1] - plain[1])
        return max(latency, min(pp, max(1, seqs)) * interval)

    def _round_at(self, i: int) -> float:
        """Round time at grid point i."""
        r = self._rounds[i]
        if r is None:
            r = self._rounds[i] = self._round(self.grid[i])
        return r

    @property
    def rounds(self) -> list[float]:
        """Round times at every grid point."""
        return [self._round_at(i) for i in range(len(self.grid))]

    def round_s(self, seqs: float) -> float:
        """Round time at `seqs` running sequences (linear between grid points)."""
        grid, at = self.grid, self._round_at
        if seqs <= grid[0]:
            return at(0)
        for i in range(1, len(grid)):
            if seqs <= grid[i]:
                a, b = grid[i - 1], grid[i]
                return at(i - 1) + (seqs - a) * (at(i) - at(i - 1)) / (b - a)
        return at(len(grid) - 1)

    def _population_round(self, rate_rps: float) -> tuple[float, float]:
        """(running sequences n with n / (output x round(n)) == rate, capped at the cap; the
        round time at max(1, n)) in one walk of the grid: n lies on the segment whose rates
        bracket `rate_rps`, and inside it the round time is that segment's interpolation (as
        `round_s` has it; at a grid point or past the cap it asks `round_s` itself)."""
        if rate_rps <= 0:
            return 0.0, self._round_at(0)
        grid, rounds, out = self.grid, self._rounds, self.output
        ra = rounds[0]
        if ra is None:
            ra = self._round_at(0)
        if grid[0] / (out * ra) >= rate_rps:
            return grid[0] * rate_rps * out * ra / grid[0], ra  # below one sequence: a fraction
        a = grid[0]
        for i in range(1, len(grid)):
            b, rb = grid[i], rounds[i]
            if rb is None:
                rb = self._round_at(i)
            if b / (out * rb) >= rate_rps:
                slope = (rb - ra) / (b - a)
                lo = rate_rps * out
                denom = 1.0 - lo * slope
                n = lo * (ra - a * slope) / denom if denom > 0 else float(b)
                # min(max(n, a), b) as the builtins pick (the first unless the other is beyond)
                if float(a) > n:
                    n = float(a)
                if float(b) < n:
                    n = float(b)
                if n <= a:
                    return n, self.round_s(max(1.0, n))
                return n, ra + (n - a) * (rb - ra) / (b - a)
            a, ra = b, rb
        n = float(grid[-1])
        return n, self.round_s(n)

    def _latencies(self, rate_rps: float) -> tuple[float, float, float, float, float, float, float]:
        """(served, utilisation, rho, TTFT P50, P99, TPOT P50, P99) at `rate_rps` (a live plan)."""
        if not self._latency_ready:
            self._latency_tables()
        capacity = self.capacity_rps
        served = min(rate_rps, capacity)
        util = rate_rps / capacity
        seqs, round_s = self._population_round(served)
        # TPOT is a request's mean time per output token, over its own rounds. Two things
        # spread it across requests. (1) Its rounds carry whole chunks with probability `frac`,
        # so over its `output` rounds the chunk count is binomial. (2) The load it shares its
        # life with: the sequences decoding beside it and the prompts arriving meanwhile are
        # Poisson counts of mean ~`seqs`, so the load-dependent part of a round (all of it but
        # the weights' read) varies by 1/sqrt(seqs) from one request's lifetime to another's.
        # P99 adds 2.33 sigma of the two together.
        tpot50 = round_s
        frac = min(1.0, served * self.chunks_per_prompt * round_s)
        chunk_var = self.chunk_extra_s ** 2 * frac * (1.0 - frac) / self.output
        load_var = max(0.0, round_s - self.idle_round_s) ** 2 / max(1.0, seqs)
        tpot99 = round_s + _Z99 * math.sqrt(chunk_var + load_var)
        rho = min(util, 0.999)
        theta = (1.0 / capacity) * (1 + self.work_cv2) / (2 * (1 - rho))

        def wait(q: float) -> float:
            return theta * math.log(rho / (1 - q)) if rho > 1 - q else 0.0

        if util >= 1.0:
            ttft50 = ttft99 = math.inf
        else:
            base50, base99 = self.prefill50_s, self.prefill99_s
            if self.colocated and seqs >= 1:
                # the prompt's chunks ride in rounds that also carry the running decodes
                base50 = max(base50, self.chunks50 * round_s)
                base99 = max(base99, self.chunks99 * tpot99)
            ttft50 = base50 + self.handoff50_s + wait(0.5)
            ttft99 = base99 + self.handoff99_s + wait(0.99)
        return served, util, rho, ttft50, ttft99, tpot50, tpot99

    def meets_slo(self, rate_rps: float, attainment: float) -> bool:
        """Whether goodput >= attainment x throughput at `rate_rps`: `estimate(rate_rps)`'s
        verdict without building the Estimate (the planner asks it a dozen times per plan)."""
        if self.running_cap < 1 or self.capacity_rps <= 0 or self.slo is None:
            est = self.estimate(rate_rps)
            return est.goodput_tokens_s >= attainment * est.throughput_tokens_s
        served, _, rho, ttft50, ttft99, tpot50, tpot99 = self._latencies(rate_rps)
        throughput = served * self.output
        goodput = throughput * _slo_attainment(self.slo, ttft50, ttft99, tpot50, tpot99, rho)
        return goodput >= attainment * throughput

    def slo_margin(self, rate_rps: float) -> float:
        """How far the worse P99 is past its objective at `rate_rps`: max(TTFT P99 / ttft,
        TPOT P99 / tpot) - 1 (<= 0: both met). Continuous and increasing in the rate, so a
        root-finder can look for the SLO rate on it (`planner._slo_rate`). With attainment
        0.99, `meets_slo` is true exactly where this is <= 0: `_attainment` interpolates from
        0.5 at P50 to 0.99 at P99 and is 1 only at or past P99. A live plan with an SLO only."""
        if self.slo is None or self.running_cap < 1 or self.capacity_rps <= 0:
            raise ValueError("slo_margin: needs a live plan with an SLO")
        # NOTE(p99 only): the planner's SLO-rate search asks this a hundred times a decision,
        # so it computes `_latencies`' two P99s alone - the same expressions in the same order,
        # hence the same floats - without the medians or the helper calls
        # (min and max written out as the builtins pick: the first argument unless the second
        # is strictly smaller / larger)
        if not self._latency_ready:
            self._latency_tables()
        capacity = self.capacity_rps
        served = capacity if capacity < rate_rps else rate_rps
        util = rate_rps / capacity
        seqs, round_s = self._population_round(served)
        frac = served * self.chunks_per_prompt * round_s
        if not frac < 1.0:
            frac = 1.0
        chunk_var = self.chunk_extra_s ** 2 * frac * (1.0 - frac) / self.output
        load = round_s - self.idle_round_s
        load_var = (load if load > 0.0 else 0.0) ** 2 / (seqs if seqs > 1.0 else 1.0)
        tpot99 = round_s + _Z99 * math.sqrt(chunk_var + load_var)
        if util >= 1.0:
            ttft99 = math.inf
        else:
            rho = 0.999 if 0.999 < util else util
            theta = (1.0 / capacity) * (1 + self.work_cv2) / (2 * (1 - rho))
            base99 = self.prefill99_s
            if self.colocated and seqs >= 1:
                ride = self.chunks99 * tpot99
                if ride > base99:
                    base99 = ride
            ttft99 = base99 + self.handoff99_s + (theta * math.log(rho / (1 - 0.99)) if rho > 1 - 0.99 else 0.0)
        ttft_excess, tpot_excess = ttft99 * 1e3 / self.slo.ttft_ms, tpot99 * 1e3 / self.slo.tpot_ms
        return (tpot_excess if tpot_excess > ttft_excess else ttft_excess) - 1.0

    def estimate(self, rate_rps: float) -> Estimate:
        """The plan under this workload shape at `rate_rps`."""
        if self.running_cap < 1 or self.capacity_rps <= 0:
            return _dead_estimate(rate_rps, self.kv_tokens, self.gpus, "kv")
        capacity = self.capacity_rps
        served, util, rho, ttft50, ttft99, tpot50, tpot99 = self._latencies(rate_rps)
        throughput = served * self.output
        goodput = throughput
        if self.slo is not None:
            goodput = throughput * _slo_attainment(self.slo, ttft50, ttft99, tpot50, tpot99, rho)
        return make_frozen(Estimate, {
            "capacity_rps": capacity,
            "served_rps": served,
            "utilization": util,
            "throughput_tokens_s": throughput,
            "goodput_tokens_s": goodput,
            "ttft_p50_s": ttft50,
            "ttft_p99_s": ttft99,
            "tpot_p50_s": tpot50,
            "tpot_p99_s": tpot99,
            "kv_capacity_tokens": self.kv_tokens,
            "max_running_seqs": self.running_cap,
            "gpus": self.gpus,
            "limit": self.limit,
        })


_STEADY_CACHE: OrderedDict[tuple[object, ...], SteadyState] = OrderedDict()
_PREFILL_MEMO: dict[tuple[object, ...], float] = {}  # (pipeline signature, tokens, chunk) -> seconds
_ITERATION_MEMO: dict[tuple[object, ...], tuple[float, float]] = {}  # see PipelineProfile.latency_interval_memo
# see PlanProfile.single_block: pipeline key -> (its pipeline, KV reserve -> profile)
_SINGLE_BLOCK: dict[tuple[object, ...], tuple[PipelineProfile, dict[int, PlanProfile]]] = {}
_STEADY_CACHE_SIZE = 4096


def steady_state(profile: PlanProfile, workload: Workload, slo: Slo | None = None, *,
                 max_batched_tokens: int = MAX_BATCHED_TOKENS, max_running_seqs: int = MAX_RUNNING_SEQS) -> SteadyState:
    """The `SteadyState` of a plan under a workload shape, memoised by content.

    The key is the plan's physical signature (model, factors, resolved stages, KV reserve,
    hand-off route) and the workload's shape (not its rate) rounded by `workload_shape`, so
    equal plans on equal blocks share one entry, and successive ticks whose window means
    drift by a percent or two hit it too. The tables are built from the rounded shape, so
    the result is a function of the inputs alone: memoising keeps it deterministic.
    """
    shape = workload_shape(workload)
    key = (profile.signature, shape, slo, max_batched_tokens, max_running_seqs)
    hit = _STEADY_CACHE.get(key)
    if hit is not None:
        _STEADY_CACHE.move_to_end(key)
        return hit
    state = SteadyState(profile, shape, slo, max_batched_tokens=max_batched_tokens,
                        max_running_seqs=max_running_seqs)
    _STEADY_CACHE[key] = state
    if len(_STEADY_CACHE) > _STEADY_CACHE_SIZE:
        _STEADY_CACHE.popitem(last=False)
    return state


def _round_log(value: float, steps_per_doubling: int = 16) -> float:
    return float(2.0 ** (round(math.log2(value) * steps_per_doubling) / steps_per_doubling))


@lru_cache(maxsize=1024)
def workload_shape(workload: Workload) -> Workload:
    """The workload's lengths and spread at rate 0, rounded: means to 1/16 of a doubling
    (about 4%), coefficients of variation to 0.05."""
    return Workload(
        rate_rps=0.0,
        prompt_tokens_mean=max(1.0, _round_log(workload.prompt_tokens_mean)),
        output_tokens_mean=max(1.0, _round_log(workload.output_tokens_mean)),
        prompt_tokens_cv=round(workload.prompt_tokens_cv * 20) / 20,
        output_tokens_cv=round(workload.output_tokens_cv * 20) / 20,
    )


def clear_caches() -> None:
    """Forget every memo of the cost model (benchmarks measure cold runs with it)."""
    _STEADY_CACHE.clear()
    _PREFILL_MEMO.clear()
    _ITERATION_MEMO.clear()
    _lognormal_quantile.cache_clear()
    _holdings.cache_clear()
    _context_buckets.cache_clear()
    workload_shape.cache_clear()
    _SINGLE_BLOCK.clear()


def estimate_plan(profile: PlanProfile, workload: Workload, slo: Slo | None = None, *,
                  max_batched_tokens: int = MAX_BATCHED_TOKENS, max_running_seqs: int = MAX_RUNNING_SEQS) -> Estimate:
    """Steady-state throughput and P50/P99 latency of one plan (see `SteadyState`)."""
    return steady_state(profile, workload, slo, max_batched_tokens=max_batched_tokens,
                        max_running_seqs=max_running_seqs).estimate(workload.rate_rps)


def _attainment(slo_s: float, p50: float, p99: float) -> float:
    """Share of requests under `slo_s`, interpolating a distribution known at P50 and P99."""
    if math.isinf(p50):
        return 0.0
    if slo_s >= p99:
        return 1.0
    if slo_s >= p50:
        span = p99 - p50
        return 0.5 + 0.49 * ((slo_s - p50) / span if span > 0 else 1.0)
    return 0.5 * slo_s / p50 if p50 > 0 else 0.0


def _slo_attainment(slo: Slo, ttft50: float, ttft99: float, tpot50: float, tpot99: float, rho: float) -> float:
    return _attainment(slo.ttft_ms / 1e3, ttft50, ttft99) * _attainment(slo.tpot_ms / 1e3, tpot50, tpot99)


def _dead_estimate(rate_rps: float, kv_tokens: int, gpus: int, limit: str) -> Estimate:
    return make_frozen(Estimate, {
        "capacity_rps": 0.0, "served_rps": 0.0, "utilization": math.inf if rate_rps > 0 else 0.0,
        "throughput_tokens_s": 0.0, "goodput_tokens_s": 0.0, "ttft_p50_s": math.inf, "ttft_p99_s": math.inf,
        "tpot_p50_s": math.inf, "tpot_p99_s": math.inf, "kv_capacity_tokens": kv_tokens, "max_running_seqs": 0,
        "gpus": gpus, "limit": limit,
    })


def estimate_gear(profiles: Sequence[PlanProfile], weights: Sequence[float], workload: Workload,
                  slo: Slo | None = None, *, plan_estimates: Sequence[Estimate] | None = None) -> Estimate:
    """A gear's estimate: traffic split by `weights`; capacity is what the split sustains
    (the first plan to saturate bounds it); P50 is traffic-weighted, P99 the worst plan's."""
    if plan_estimates is None:
        plan_estimates = [
            estimate_plan(p, workload.scaled(w), slo) for p, w in zip(profiles, weights, strict=True)
        ]
    return combine_estimates(plan_estimates, weights, workload)


def combine_estimates(ests: Sequence[Estimate], weights: Sequence[float], workload: Workload) -> Estimate:
    """Aggregate per-plan estimates (each computed at its share of the traffic)."""
    active = [(e, w) for e, w in zip(ests, weights, strict=True) if w > 0]
    if not active:
        return _dead_estimate(workload.rate_rps, sum(e.kv_capacity_tokens for e in ests), sum(e.gpus for e in ests), "kv")
    # the first plan to saturate bounds the split (its capacity / its share), first on ties
    e0, w0 = active[0]
    capacity, limit = e0.capacity_rps / w0, e0.limit
    for e, w in active[1:]:
        c = e.capacity_rps / w
        if c < capacity:
            capacity, limit = c, e.limit
    lam = workload.rate_rps
    served = min(lam, capacity)
    total_w = 0.0  # (the weights of active plans are > 0: the same sum as sum() from 0)
    ttft50 = tpot50 = throughput = goodput = 0.0
    ttft99 = tpot99 = -math.inf
    for e, w in active:  # P50s traffic-weighted, P99s the worst plan's, rates summed
        total_w += w
        ttft50 += e.ttft_p50_s * w
        tpot50 += e.tpot_p50_s * w
        if e.ttft_p99_s > ttft99:
            ttft99 = e.ttft_p99_s
        if e.tpot_p99_s > tpot99:
            tpot99 = e.tpot_p99_s
        throughput += e.throughput_tokens_s
        goodput += e.goodput_tokens_s
    kv_tokens = running = gpus = 0
    for e in ests:
        kv_tokens += e.kv_capacity_tokens
        running += e.max_running_seqs
        gpus += e.gpus
    return make_frozen(Estimate, {
        "capacity_rps": capacity,
        "served_rps": served,
        "utilization": lam / capacity if capacity > 0 else math.inf,
        "throughput_tokens_s": throughput,
        "goodput_tokens_s": goodput,
        "ttft_p50_s": ttft50 / total_w,
        "ttft_p99_s": ttft99,
        "tpot_p50_s": tpot50 / total_w,
        "tpot_p99_s": tpot99,
        "kv_capacity_tokens": kv_tokens,
        "max_running_seqs": running,
        "gpus": gpus,
        "limit": limit,
    })


def capacity_weights(ests: Sequence[Estimate]) -> tuple[float, ...]:
    """Routing weights proportional to each plan's capacity (rounded, summing to exactly 1)."""
    caps = [max(0.0, e.capacity_rps) for e in ests]
    total = sum(caps)
    if total <= 0:
        return tuple(1.0 / len(ests) for _ in ests)
    raw = [round(c / total, 6) for c in caps]
    raw[-1] = round(1.0 - sum(raw[:-1]), 6)
    return tuple(raw)


# --- switch cost -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SequenceMove:
    """How one in-flight sequence reaches the new plan: migrate its KV or re-prefill it."""

    context_tokens: int  # tokens in its KV cache
    choice: Literal["migrate", "replay", "stay"]  # the cheaper; "stay" when its KV does not move
    migrate_bytes: int  # KV bytes a migration moves
    migrate_s: float  # time to move them
    replay_s: float  # time to re-prefill the context on the new plan

    @property
    def cost_s(self) -> float:
        return 0.0 if self.choice == "stay" else min(self.migrate_s, self.replay_s)


def migrate_or_replay(context_tokens: int, route: KvRoute, target: PipelineProfile,
                      chunk_tokens: int = MAX_BATCHED_TOKENS) -> SequenceMove:
    """Per sequence, the cheaper of moving its KV along `route` or recomputing it on `target`.

    The transition executor calls this for each sequence it hands over; `route` comes from
    `kv_route(old_stages, new_stages, ...)`, `target` from the new plan's profile.
    """
    if context_tokens <= 0 or route.bytes_per_token == 0:
        return SequenceMove(max(0, context_tokens), "stay", 0, 0.0, 0.0)
    migrate_s = route.time_s(context_tokens)
    replay_s = target.prefill_time_s(context_tokens, chunk_tokens)
    choice: Literal["migrate", "replay"] = "migrate" if migrate_s <= replay_s else "replay"
    return SequenceMove(context_tokens, choice, context_tokens * route.bytes_per_token, migrate_s, replay_s)


@dataclass(frozen=True)
class SwitchCost:
    """What a gear change costs, in parts. `tokens` (output tokens of service lost) is what the
    gearbox weighs against the gain."""

    tokens: float  # total: pause + contention + cold start, in output tokens
    pause_s: float  # SWITCH phase: moved sequences stall (KV migration + replay), counted as the gear pausing
    prepare_s: float  # PREPARE phase: weights load into the new plans while the old gear serves
    time_to_effect_s: float  # prepare + pause: when the new gear carries the load
    lost_pause_tokens: float  # served rate x pause
    lost_contention_tokens: float  # HBM time that copies steal from GPUs that keep serving
    lost_cold_start_tokens: float  # new plans warming up (empty prefix cache, allocator, graphs)
    kv_migrate_bytes: int  # KV bytes moved between GPUs
    kv_migrate_s: float  # time those copies take (one route's sequences one after another)
    migrate_seqs: int  # sequences whose KV moves
    replay_seqs: int  # sequences re-prefilled instead (the cheaper for them, or their KV is lost)
    replay_tokens: int  # tokens recomputed
    replay_s: float  # prefill time of those tokens on the new plan, in full chunks
    weight_load_bytes: int  # weights loaded onto GPUs that do not hold them yet
    weight_load_s: float  # time of that load (parallel per GPU; per node when from disk)
    weight_source: Literal["host", "disk", "none"]  # where they come from
    cold_start_s: float  # warm-up time charged for each new plan

    def to_dict(self) -> dict[str, object]:
        return {k: _finite_or_none(getattr(self, k)) for k in _SWITCH_FIELDS}

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> SwitchCost:
        values: dict[str, object] = {}
        for key in _SWITCH_FIELDS:
            if key not in d:
                raise ValueError(f"cost.{key}: required")
            values[key] = math.inf if d[key] is None else d[key]
        return cls(**values)  # type: ignore[arg-type]  # values come from to_dict


_SWITCH_FIELDS = (
    "tokens", "pause_s", "prepare_s", "time_to_effect_s", "lost_pause_tokens", "lost_contention_tokens",
    "lost_cold_start_tokens", "kv_migrate_bytes", "kv_migrate_s", "migrate_seqs", "replay_seqs",
    "replay_tokens", "replay_s", "weight_load_bytes", "weight_load_s", "weight_source", "cold_start_s",
)
check_plain_dataclass(SwitchCost, field_names=_SWITCH_FIELDS)  # built with make_frozen

DISK_BYTES_PER_S = 2e9  # stated: one NVMe drive per node, sequential read, shared by its GPUs
COLD_START_S = 2.0  # stated: service-seconds a new plan loses warming up (vLLM graph capture is in PREPARE)


def running_seqs(estimate: Estimate, share: float, workload: Workload) -> float:
    """Sequences in flight on a plan carrying `share` of the traffic (Little's law)."""
    if not math.isfinite(estimate.tpot_p50_s) or estimate.served_rps <= 0:
        return 0.0
    seqs = estimate.served_rps * share * workload.output_tokens_mean * estimate.tpot_p50_s
    return min(seqs, float(estimate.max_running_seqs))


def switch_cost(
    current: Gear | None,
    target: Gear,
    model: ModelSpec,
    snapshot: Snapshot,
    workload: Workload,
    *,
    current_estimate: Estimate | None = None,
    target_estimate: Estimate | None = None,
    weights_in_host_memory: bool = True,
    disk_bytes_per_s: float = DISK_BYTES_PER_S,
    cold_start_s: float = COLD_START_S,
    eff: Efficiency = DEFAULT_EFFICIENCY,
    profiles: Mapping[Plan, PlanProfile] | None = None,
) -> SwitchCost:
    """Cost of moving a deployment from `current` to `target` (seed 000 sections 3.1 and 3.4).

    * Weights: every GPU of a new plan that does not already hold the same shard (same
      layers, same TP rank) loads it, from host memory over its host link, or from disk at
      `disk_bytes_per_s` per node. This happens in PREPARE, while the old gear still serves.
    * In-flight sequences of the plans that go away (Little's law on the current estimate,
      lengths spread as the workload says) reach the new gear's largest new plan the cheaper
      way, per sequence (`migrate_or_replay`); a sequence whose KV sits on GPUs that are gone
      can only be replayed. Migrations on one route run one after another; replays run in
      full prefill chunks.
    * SWITCH pauses the moved sequences that long; we charge it as the whole gear pausing
      (lost = served tokens/s x pause), which is conservative.
    * Contention: copies into GPUs that keep serving steal their HBM time.
    * Cold start: each new plan loses `cold_start_s` of its share of the service.
    Plans present in both gears (equal plans, hence the same plan_id) cost nothing.
    """
    known: Mapping[Plan, PlanProfile] = profiles or {}

    def profile(plan: Plan) -> PlanProfile:
        hit = known.get(plan)
        return hit if hit is not None else PlanProfile.build(plan, model, snapshot, eff)

    # plans are values: equal plans are the same plan (cheaper than comparing plan_ids)
    old_plans = set(current.plans if current else ())
    new_plans = [p for p in target.plans if p not in old_plans]
    target_set = set(target.plans)
    served_tokens_s = current_estimate.throughput_tokens_s if current_estimate else 0.0
    new_tokens_s = target_estimate.throughput_tokens_s if target_estimate else served_tokens_s

    # which GPU holds which weight shard now
    held, serving = _holdings(current.plans if current else ())
    load_bytes = 0
    per_gpu_s: list[float] = []
    disk_per_node: dict[str, int] = {}
    contention_s = 0.0
    gpu_by_uuid = snapshot.gpu_by_uuid
    for plan in new_plans:
        for st in plan.all_stages:
            uuids = st.gpu_uuids
            shard = -(-model.stage_weight_bytes(st.layer_start, st.layer_end) // st.tp)
            # only GPUs of the current gear can already hold a shard or be serving
            touches_old = not serving.isdisjoint(uuids)
            if not touches_old and weights_in_host_memory:
                # the common case: every GPU of the stage loads its shard over its host link
                load_bytes += shard * len(uuids)
                models = {gpu_by_uuid[u].model for u in uuids}
                if len(models) == 1:  # (one model: no generator to take the min over)
                    slowest = snapshot.spec(gpu_by_uuid[uuids[0]].model).host_link_bytes_per_s
                else:
                    slowest = min(snapshot.spec(m).host_link_bytes_per_s for m in models)
                per_gpu_s.append(shard / (slowest * eff.link_efficiency))
                continue
            slowest_host = math.inf
            for rank, u in enumerate(uuids):
                if touches_old and (u, st.layer_start, st.layer_end, st.tp, rank) in held:
                    continue
                load_bytes += shard
                spec = snapshot.spec(gpu_by_uuid[u].model)
                if weights_in_host_memory:
                    slowest_host = min(slowest_host, spec.host_link_bytes_per_s)
                else:
                    node = gpu_by_uuid[u].node_id
                    disk_per_node[node] = disk_per_node.get(node, 0) + shard
                if touches_old and u in serving:
                    contention_s += shard / (eff.mbu * spec.hbm_bytes_per_s)
            if weights_in_host_memory and slowest_host < math.inf:
                # every GPU loads its shard over its own host link at once: the slowest bounds it
                per_gpu_s.append(shard / (slowest_host * eff.link_efficiency))
    per_gpu_s.extend(b / disk_bytes_per_s for b in disk_per_node.values())
    weight_load_s = max(per_gpu_s, default=0.0)
    source: Literal["host", "disk", "none"] = (
        "none" if load_bytes == 0 else ("host" if weights_in_host_memory else "disk")
    )

    migrate_bytes = 0
    migrate_s = 0.0
    migrate_seqs = replay_seqs = replay_tokens = 0
    gone = [p for p in (current.plans if current else ()) if p not in target_set]
    replay_s = 0.0
    if gone and new_plans and current is not None and current_estimate is not None:
        shares = dict(zip(current.plans, current.weights, strict=False))
        dest = max(new_plans, key=lambda p: (len(p.gpu_uuids), p.gpu_uuids))
        dest_pipe = profile(dest).pipeline("prefill")
        dest_stages = dest.decode_stages if dest.mode == "disaggregated" else dest.stages
        replay_floor_s = dest_pipe.latency_interval_memo(1, 1)[0]
        landing = next((u for st in dest_stages for u in st.gpu_uuids if u in serving), None)
        landing_s_per_byte = 1.0 / (eff.mbu * snapshot.spec_of(landing).hbm_bytes_per_s) if landing else 0.0
        for plan in gone:
            seqs = running_seqs(current_estimate, shares.get(plan, 0.0), workload)
            if seqs <= 0:
                continue
            src_stages = plan.decode_stages if plan.mode == "disaggregated" else plan.stages
            route = kv_route(src_stages, dest_stages, model, snapshot, eff)
            if route.bytes_per_token == 0:
                continue  # its KV stays in place
            for ctx, weight in _context_buckets(workload):
                count = seqs * weight
                tokens = int(ctx)
                if tokens <= 0:
                    continue
                # migrate_or_replay's choice. Replaying costs at least one one-token iteration
                # per chunk (an iteration never gets faster as its batch grows), so a migration
                # faster than that needs no prefill estimate.
                move_s = route.time_s(tokens)
                if move_s < -(-tokens // MAX_BATCHED_TOKENS) * replay_floor_s or move_s <= dest_pipe.prefill_time_s(
                        tokens, MAX_BATCHED_TOKENS):
                    moved = tokens * route.bytes_per_token
                    migrate_seqs += round(count)
                    migrate_bytes += int(count * moved)
                    migrate_s += count * move_s
                    if landing:
                        contention_s += count * moved * landing_s_per_byte
                else:
                    replay_seqs += round(count)
                    replay_tokens += int(count * ctx)
        if replay_tokens:
            chunk = MAX_BATCHED_TOKENS
            chunk_s = dest_pipe.latency_interval_memo(chunk, 1)[0]
            replay_s = replay_tokens / chunk * chunk_s
    pause_s = migrate_s + replay_s
    lost_pause = served_tokens_s * pause_s
    lost_contention = served_tokens_s * contention_s / max(1, len(serving))
    share_of: dict[Plan, float] = {}  # each plan's routing weight (the first, should it repeat)
    for p, w in zip(target.plans, target.weights, strict=False):
        share_of.setdefault(p, w)
    lost_cold = sum(new_tokens_s * cold_start_s * share_of[p] for p in new_plans)
    return make_frozen(SwitchCost, {
        "tokens": lost_pause + lost_contention + lost_cold,
        "pause_s": pause_s,
        "prepare_s": weight_load_s,
        "time_to_effect_s": weight_load_s + pause_s,
        "lost_pause_tokens": lost_pause,
        "lost_contention_tokens": lost_contention,
        "lost_cold_start_tokens": lost_cold,
        "kv_migrate_bytes": migrate_bytes,
        "kv_migrate_s": migrate_s,
        "migrate_seqs": migrate_seqs,
        "replay_seqs": replay_seqs,
        "replay_tokens": replay_tokens,
        "replay_s": replay_s,
        "weight_load_bytes": load_bytes,
        "weight_load_s": weight_load_s,
        "weight_source": source,
        "cold_start_s": cold_start_s if new_plans else 0.0,
    })



@lru_cache(maxsize=64)
def _holdings(plans: tuple[Plan, ...]) -> tuple[frozenset[tuple[str, int, int, int, int]], frozenset[str]]:
    """(shards held as (GPU, first layer, end layer, TP, rank), GPUs serving) by these plans;
    memoised because every candidate of one decision is priced against the same gear."""
    held: set[tuple[str, int, int, int, int]] = set()
    serving: set[str] = set()
    for plan in plans:
        for st in plan.all_stages:
            for rank, u in enumerate(st.gpu_uuids):
                held.add((u, st.layer_start, st.layer_end, st.tp, rank))
                serving.add(u)
    return frozenset(held), frozenset(serving)


@lru_cache(maxsize=64)
def _context_buckets(workload: Workload) -> tuple[tuple[float, float], ...]:
    """Representative context lengths of running sequences, with their shares (5 quantiles);
    memoised: every candidate of a decision is priced under the same workload."""
    return tuple((workload.prompt_quantile(q) + workload.output_tokens_mean / 2, 0.2)
                 for q in (0.1, 0.3, 0.5, 0.7, 0.9))


__all__ = [
    "Batch", "DEFAULT_EFFICIENCY", "Efficiency", "Estimate", "IterationCost", "KvRoute", "Path",
    "PipelineProfile", "PlanProfile", "SequenceMove", "Slo", "StageProfile", "SteadyState", "SwitchCost", "Workload",
    "allreduce_time_s", "capacity_weights", "combine_estimates", "decode_step_s", "estimate_gear",
    "estimate_plan", "gemm_time_s", "gpu_path", "group_path", "iteration_time_s", "kernel_time_s",
    "clear_caches", "kv_capacity_tokens", "kv_route", "max_kv_tokens", "migrate_or_replay", "prefill_time_s",
    "steady_state", "workload_shape",
    "running_seqs", "switch_cost", "transfer_time_s",
]

