"""The fitted factors (`Efficiency`) and one kernel's roofline time: the p-norm of its compute and
memory bounds plus a fixed overhead (see the package docstring)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from scheduler._lazy import cached_field_hash, state_without_hash
from scheduler.hardware import GpuSpec


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
