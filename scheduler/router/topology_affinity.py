"""Topology affinity (seed 003's second component and its corollary 1): long prompts to
compute-dense, well-linked plans; short prompts and low-priority traffic to cheaper cards.

A long prompt's prefill is compute-bound and, under TP, all-reduce-bound: it belongs on H100-class
GPUs over NVLink, not on L40S over PCIe. A short prompt's cost is mostly decode, which a cheaper
card does well enough, and sending it there keeps the dense cards free for the long prompts that
need them - an effect the (myopic) latency prediction does not see.

Per plan, two static scores relative to the pool (`static_scores`):
* dense = 50 x its GPUs' BF16 peak / the pool's best + 50 x its TP link / the pool's best
  (corollary 1: compute density and interconnect weighed apart, not one linear term);
* cheap = 100 x the pool's lowest price / its price (price per hour of all its GPUs).
How long a prompt is, `longness`, goes from 0 at `SHORT_TOKENS` to 1 at `LONG_TOKENS`, linear in
log length (corollary 3's buckets: short < 2K, long > 32K); a low-priority request counts as
short. score = longness x dense + (1 - longness) x cheap.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from scheduler.router.request import RouteRequest

if TYPE_CHECKING:
    from scheduler.router._arrays import Floats
    from scheduler.router.pool import PlanFacts, Pool

NAME = "topology_affinity"
SHORT_TOKENS = 2048  # seed 003 corollary 3: short prompts are < 2K tokens
LONG_TOKENS = 32768  # ... long ones > 32K

# On-demand list price per GPU-hour: the 8-GPU instance's hourly price / 8, AWS EC2 us-east-1,
# Linux (https://aws.amazon.com/ec2/pricing/on-demand/): p5.48xlarge (8x H100 SXM) $98.32,
# p4de.24xlarge (8x A100 80GB) $40.97, p4d.24xlarge (8x A100 40GB) $32.77, g6e.48xlarge
# (8x L40S) $30.13, g5.48xlarge (8x A10G) $16.29. Prices move; only their ratios matter here, and
# operators override them (settings FLEXPIPE_ROUTER["prices"]). A card not listed is priced by
# its BF16 peak at the H100's price per FLOP/s.
PRICE_PER_GPU_HOUR: Mapping[str, float] = {
    "H100-SXM": 98.32 / 8,
    "A100-80G": 40.97 / 8,
    "A100-40G": 32.77 / 8,
    "L40S": 30.13 / 8,
    "A10G": 16.29 / 8,
}
_H100_PRICE_PER_FLOPS = PRICE_PER_GPU_HOUR["H100-SXM"] / 989e12  # hardware.py: H100 989 TFLOPS dense


def gpu_price(gpu_model: str, flops_per_gpu: float, prices: Mapping[str, float] | None = None) -> float:
    table = PRICE_PER_GPU_HOUR if prices is None else {**PRICE_PER_GPU_HOUR, **prices}
    price = table.get(gpu_model)
    return price if price is not None else flops_per_gpu * _H100_PRICE_PER_FLOPS


def static_scores(facts: Sequence[PlanFacts], prices: Mapping[str, float] | None = None) -> tuple[Floats, Floats]:
    """(dense, cheap) 0..100 per plan, relative to the best of the pool (module docstring)."""
    if not facts:
        return np.zeros(0), np.zeros(0)
    # (a plan the fleet cannot describe has no figures: 0 FLOP/s, no link, no price - it scores
    # as the pool's weakest for density and as the cheapest, which is what is known of it)
    flops = np.array([f.flops_per_gpu for f in facts], dtype=np.float64)
    links = np.array([f.link_bytes_per_s if math.isfinite(f.link_bytes_per_s) else 0.0 for f in facts])
    dense = 50.0 * _share(flops) + 50.0 * _share(links)
    price = np.array([gpu_price(f.gpu_model, f.flops_per_gpu, prices) * f.gpus for f in facts], dtype=np.float64)
    known = price[price > 0]
    price = np.where(price > 0, price, known.min() if known.size else 1.0)
    cheap = 100.0 * price.min() / price
    return dense, cheap


def _share(values: Floats) -> Floats:
    best = float(values.max())
    out: Floats = values / best if best > 0 else np.zeros(len(values))
    return out


def longness(prompt_tokens: int) -> float:
    """0 for a short prompt, 1 for a long one, log-linear between (module docstring)."""
    if prompt_tokens <= SHORT_TOKENS:
        return 0.0
    if prompt_tokens >= LONG_TOKENS:
        return 1.0
    return math.log(prompt_tokens / SHORT_TOKENS) / math.log(LONG_TOKENS / SHORT_TOKENS)


def score(req: RouteRequest, pool: Pool) -> Floats:
    long_share = 0.0 if req.low_priority else longness(req.prompt_tokens)
    if long_share == 0.0:
        return pool.cheap
    if long_share == 1.0:
        return pool.dense
    out: Floats = pool.dense_minus_cheap * long_share  # = long_share x dense + (1 - long_share) x cheap
    out += pool.cheap
    return out
