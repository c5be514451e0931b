"""Predicted latency: when the request's first token would come out on each plan, and how fast
its tokens would follow, from the plan's own step times (pool.StepModel, fitted to
scheduler.costmodel on that plan's hardware) and its load.

    ttft = (queue + prefill) x share
      queue   = prefill time of the prompt tokens queued ahead of it: a normal or urgent request
                overtakes low-priority work (the engines' priority queue), a low-priority one
                waits behind everything
      prefill = its uncached tokens, the cached prefix as their attention context (a prefix hit
                saves exactly the prefill of the cached blocks)
      share   = budget / (budget - running): the decodes of a round take part of its token budget
    tpot = one decode step of the batch with this request in it (d0 + d1 x seqs + d2 x KV read)
           + the prefill chunks that share its rounds: the Q prompt tokens queued on the plan go
           through its next rounds, (budget - running) a round, so over its max_tokens rounds
           each costs pre_b x min(budget - running, Q / max_tokens) more - at most one full
           chunk per token (chunked prefill's stall on decodes, Sarathi-Serve's subject)
    stall = the same stall the other way round: the request's own prefill lengthens the rounds
           of the `running` sequences already there, by prefill / max_tokens per token of theirs
           (`stall_s`); without it every plan looks as good for a long prompt as its own latency
           says, and the long prompts land on the plans decoding the most short answers

`load_terms` computes the load-only parts once per load update (Pool.set_loads); a decision adds
the request's own terms: its prefill is computed once (`prefill_s`) and read by the TTFT and the
stall.

Score: cost = ttft / ttft_ref + (tpot + stall) / tpot_ref, with the request's deadline as TTFT
yardstick when it has one, else the best candidate's TTFT, and the best candidate's tpot + stall
(so both count as ratios to what the pool can do now); score = 100 x the best candidate's cost /
the plan's cost.
`deadline_ok` marks the plans predicted to meet the request's deadline: the pick prefers those.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from scheduler.router._arrays import CHUNK_TOKENS, Bools, Floats
from scheduler.router.request import RouteRequest

if TYPE_CHECKING:
    from scheduler.router.pool import Pool

NAME = "predicted_latency"


def load_terms(pool: Pool) -> tuple[Floats, Floats, Floats, Floats]:
    """(share, queue_s of a normal request, queue_s of a low-priority one, tpot before the
    request's own context) per plan, from the pool's load (module docstring)."""
    room = np.maximum(CHUNK_TOKENS - pool.running, 1.0)  # prefill tokens a round still carries
    share: Floats = CHUNK_TOKENS / np.maximum(room, CHUNK_TOKENS / 2)
    queue_all: Floats = pool.queued_tokens * pool.pre_b_chunk  # (finite: an unpriceable plan's own prefill is inf)
    queue: Floats = (pool.queued_tokens - pool.queued_low_tokens) * pool.pre_b_chunk
    tpot: Floats = pool.dec_0 + pool.dec_1 * (pool.running + 1.0) + pool.dec_2 * pool.kv_used
    pool.chunk_room = room
    return share, queue, queue_all, tpot


def prefill_s(req: RouteRequest, pool: Pool, cached_tokens: Floats | None,
              at: Sequence[tuple[int, float, float]] | None = None) -> Floats:
    """Per plan, the request's own prefill on an idle plan: its uncached tokens with the cached
    prefix as their attention context (no queue, no decodes sharing the rounds). `at`: the
    (slot, cached tokens, _) of every plan with a cached prefix (prefix_affinity.score), when
    the caller has them - only those are corrected, the others' is the whole prompt's."""
    p = float(req.prompt_tokens)
    own: Floats = pool.pre_poly.dot(np.array((p * p, p, 1.0)))  # (.dot: a third of `@`'s call overhead)
    if cached_tokens is None:
        return own
    # a + b (p - h) + c (p - h)(h + (p - h) / 2) = [the whole prompt's] - h (b + c h / 2)
    if at is not None and pool.pre_b_finite:
        b, c_half = pool.pre_b_list, pool.pre_c_half_list
        for i, h, _ in at:
            own[i] = float(own[i]) - (c_half[i] * h + b[i]) * h
        return own
    # (a plan the cost model cannot price: inf x 0 is NaN, as the arrays have it)
    saved = pool.pre_c_half * cached_tokens
    saved += pool.pre_b
    saved *= cached_tokens
    own -= saved
    return own


def predict(req: RouteRequest, pool: Pool, cached_tokens: Floats | None,
            own: Floats | None = None) -> tuple[Floats, Floats]:
    """(ttft_s, tpot_s) per plan (module docstring); `cached_tokens` None: no plan holds any;
    `own`: `prefill_s` of the request when the caller has it already."""
    if own is None:
        own = prefill_s(req, pool, cached_tokens)
    ttft: Floats = own * pool.share
    ttft += pool.queue_all_sh if req.low_priority else pool.queue_sh
    tpot: Floats = pool.queued_chunk_s * (1.0 / req.max_tokens)  # (x pre_b_chunk already: pool._derive)
    np.minimum(tpot, pool.chunk_room_s, out=tpot)
    tpot += pool.tpot_base
    tpot += pool.dec_2 * float(req.prompt_tokens)
    return ttft, tpot


def stall_s(req: RouteRequest, own: Floats, pool: Pool) -> Floats:
    """Per plan, what the request's prefill costs the sequences already running there, per token
    of theirs: its `own` prefill time stalls each of them once (the rounds that carry its chunks
    are that much longer), spread over their remaining tokens - unknown to the router, so taken
    as this request's `max_tokens` (one workload's outputs are alike). A myopic TTFT/TPOT of the
    request alone misses this: a long prompt sent to a plan decoding many short answers makes
    every one of them late (Sarathi-Serve's stall, seen from the other side)."""
    out: Floats = own * pool.running
    out *= 1.0 / req.max_tokens
    return out


def score(req: RouteRequest, pool: Pool, ttft: Floats, tpot: Floats, cand: Bools,
          stall: Floats | None = None, *, every: bool | None = None) -> tuple[Floats, Bools | None]:
    """(score 0..100, predicted to meet the deadline - None without one) per plan. `stall`
    (stall_s) counts with the request's own TPOT; `every`: whether `cand` holds every plan,
    when the caller knows it."""
    if every is None:
        every = len(cand) == int(np.count_nonzero(cand))  # (the usual case: no need to mask)
    ttft_ref = req.deadline_s
    if ttft_ref is None:
        ttft_ref = _least(ttft, cand, every)
    per_token = tpot if stall is None else tpot + stall
    tpot_ref = _least(per_token, cand, every)
    if not (math.isfinite(ttft_ref) and math.isfinite(tpot_ref)):
        return _unpriced(ttft, tpot, cand), None
    cost = ttft * (1.0 / max(ttft_ref, 1e-6))
    cost += per_token * (1.0 / max(tpot_ref, 1e-9))
    best = _least(cost, cand, every)
    if not best > 1e-9:  # plans without step times (unpriced) cost "nothing": equal
        np.maximum(cost, 1e-9, out=cost)
        best = max(best, 1e-9)
    if not math.isfinite(best):
        return _unpriced(ttft, tpot, cand), None
    out: Floats = np.divide(100.0 * best, cost, out=cost)
    ok: Bools | None = ttft <= req.deadline_s if req.deadline_s is not None else None
    return out, ok


def _least(values: Floats, cand: Bools, every: bool) -> float:
    """The least of `values` over the candidates. The least of every plan is usually a candidate's
    (a plan without room now has the most KV in use, so the slowest decode steps): then it is the
    answer without masking the array (a masked copy costs as much as the rest of the score)."""
    i = values.argmin()
    if every or cand[i]:
        return float(values[i])
    c = values[cand]
    return float(c[c.argmin()])


def _unpriced(ttft: Floats, tpot: Floats, cand: Bools) -> Floats:
    """Scores when the best candidate's time is infinite (the cost model cannot price a plan: a
    stage pair with no link): every plan that can be priced gets 100, the others 0."""
    out: Floats = np.where(np.isfinite(ttft) & np.isfinite(tpot), 100.0, 0.0)
    return out
