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

from scheduler.costmodel.kernels import DEFAULT_EFFICIENCY, Efficiency, gemm_time_s, kernel_time_s
from scheduler.costmodel.kernels import MAX_BATCHED_TOKENS as MAX_BATCHED_TOKENS
from scheduler.costmodel.kernels import MAX_RUNNING_SEQS as MAX_RUNNING_SEQS
from scheduler.costmodel.links import REDUCE_HBM_TOUCHES as REDUCE_HBM_TOUCHES
from scheduler.costmodel.links import Path, allreduce_time_s, gpu_path, group_path, transfer_time_s
from scheduler.costmodel.profiles import (
    _ITERATION_MEMO,
    _PREFILL_MEMO,
    _SINGLE_BLOCK,
    Batch,
    IterationCost,
    KvRoute,
    PipelineProfile,
    PlanProfile,
    StageProfile,
    decode_step_s,
    iteration_time_s,
    kv_capacity_tokens,
    kv_route,
    max_kv_tokens,
    prefill_time_s,
)
from scheduler.costmodel.profiles import Role as Role
from scheduler.costmodel.steady import (
    _STEADY_CACHE,
    SteadyState,
    capacity_weights,
    combine_estimates,
    estimate_gear,
    estimate_plan,
    steady_state,
    workload_shape,
)
from scheduler.costmodel.switch import COLD_START_S as COLD_START_S
from scheduler.costmodel.switch import DISK_BYTES_PER_S as DISK_BYTES_PER_S
from scheduler.costmodel.switch import (
    SequenceMove,
    SwitchCost,
    _context_buckets,
    _holdings,
    migrate_or_replay,
    running_seqs,
    switch_cost,
)
from scheduler.costmodel.workload import Estimate, Slo, Workload, _lognormal_quantile


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


__all__ = [
    "Batch", "DEFAULT_EFFICIENCY", "Efficiency", "Estimate", "IterationCost", "KvRoute", "Path",
    "PipelineProfile", "PlanProfile", "SequenceMove", "Slo", "StageProfile", "SteadyState", "SwitchCost", "Workload",
    "allreduce_time_s", "capacity_weights", "combine_estimates", "decode_step_s", "estimate_gear",
    "estimate_plan", "gemm_time_s", "gpu_path", "group_path", "iteration_time_s", "kernel_time_s",
    "clear_caches", "kv_capacity_tokens", "kv_route", "max_kv_tokens", "migrate_or_replay", "prefill_time_s",
    "steady_state", "workload_shape",
    "running_seqs", "switch_cost", "transfer_time_s",
]

