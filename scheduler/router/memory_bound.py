"""Memory bound (seed 003's third component): a quick upper bound, not an exact fit.

A request may peak at its prompt plus every token it may generate, so on each GPU of a plan

    weights + others' memory + KV bytes/token x (KV in use + prompt + max_tokens) + activations
        <= MEM_FRACTION (0.92) x the GPU's memory

and, on the engine's side, KV in use + prompt + max_tokens <= the plan's KV reserve. "KV in use"
is what the engine last reported. Activations are a full prefill chunk's (CHUNK_TOKENS tokens,
pool.stage_act_bytes_per_token): an engine reserves that buffer for its largest batch whatever the
prompt (vLLM sizes it by a profiling pass of max_num_batched_tokens). Both sides reduce to one
number per plan, `token_capacity` - the KV tokens it can ever hold - so a decision compares the
request with each plan's room (capacity - KV in use) in one vector operation.

Two verdicts, as the Kubernetes framework separates them:
* never fits (unresolvable): even an idle plan cannot hold it - the plan is no candidate;
* does not fit now (unschedulable): the plan is full at the moment. It is skipped while another
  plan has room; when every plan is full the request queues at the best of them (a queue, not a
  refusal: nothing admitted is dropped).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from scheduler.plan import MEM_FRACTION
from scheduler.router._arrays import CHUNK_TOKENS, Bools, Floats
from scheduler.router.request import RouteRequest

if TYPE_CHECKING:
    from scheduler.router.pool import PlanFacts, Pool

NAME = "memory_bound"


def gpu_token_limit(facts: PlanFacts) -> float:
    """KV tokens the plan's tightest GPU can hold next to its weights, others' memory and a
    chunk's activations, under MEM_FRACTION."""
    best = math.inf
    for b in facts.budgets:
        left = b.limit_bytes - b.act_bytes_per_token * CHUNK_TOKENS
        best = min(best, max(0.0, left) / b.kv_bytes_per_token if b.kv_bytes_per_token > 0 else math.inf)
    return best


def token_capacity(facts: Sequence[PlanFacts]) -> Floats:
    """Per plan, the KV tokens it can ever hold: its reserve, or less if a GPU is tighter. A plan
    that states no reserve (0: its engine sizes its KV itself) is bounded by its GPUs alone."""
    return np.array([min(float(f.kv_capacity_tokens) if f.kv_capacity_tokens > 0 else math.inf, gpu_token_limit(f))
                     for f in facts], dtype=np.float64)


def memory_bound(req: RouteRequest, pool: Pool) -> tuple[Bools, Bools]:
    """(fits ever, fits now), masks over the pool's plans."""
    need = float(req.kv_tokens)  # (a float: numpy compares an array with one faster than with an int)
    ever: Bools = pool.all_true if need <= pool.cap_floor else pool.cap_tokens >= need
    now: Bools = pool.room >= need
    return ever, now


def why(req: RouteRequest, pool: Pool, i: int, *, now: bool) -> str:
    """Why plan `i` failed the bound (`now`: only the fits-now half)."""
    need = req.kv_tokens
    f = pool.facts[i]
    cap = f.kv_capacity_tokens
    used = int(pool.kv_used[i]) if now else 0
    if cap > 0 and used + need > cap:
        if now:
            return f"{used} of its {cap} KV tokens in use (last report): {need} more do not fit now"
        return f"needs {need} KV tokens (prompt + max_tokens); its KV reserve holds {cap}"
    for b in f.budgets:
        peak = b.kv_bytes_per_token * (used + need) + b.act_bytes_per_token * CHUNK_TOKENS
        if peak > b.limit_bytes:
            return (f"GPU {b.uuid}: KV and activations would need {peak / 1e9:.2f} GB; "
                    f"{max(0.0, b.limit_bytes) / 1e9:.2f} GB is left under {MEM_FRACTION:.0%} of it after weights")
    return ""
