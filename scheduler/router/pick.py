"""Pick: the order in which to try the candidates.

Primary candidates are those that passed the filters and are not demoted for jitter, and the
demoted ones whose total (their TTFT priced by their tail, jitter.py) still beats the best of
those; the other demoted plans are the retry pool (when every candidate is demoted, they all are
primary: demotion reorders, it never refuses). Primaries are ranked
by the weighted sum of the plugins' scores, highest first, those predicted to meet the request's
deadline ahead of those predicted to miss it. Among the candidates tied for the first place the
least loaded (outstanding requests relative to routing weight) wins - the Kubernetes framework's
"ties to the least loaded" - and an exact tie is broken by the injected random generator, so equal
plans share the traffic and a run stays deterministic for a seed. The first `top_k` primaries are
tried on a backend failure (a 429, an unreachable leader), then the retry pool (demoted plans),
best first.
"""

from __future__ import annotations

import random

import numpy as np

from scheduler.router._arrays import Bools, Floats

NAME = "pick"
TIE_DECIMALS = 6  # totals within 10^-6 (relative) of each other are a tie
_LATE = 1e9  # what missing the deadline costs in the ranking: more than any score


def pick(total: Floats, cand: Bools, demoted: Bools | None, deadline_ok: Bools | None, load_rel: Floats,
         top_k: int, rng: random.Random, *, count: int | None = None) -> tuple[int, ...]:
    """Pool slots in the order to try them (module docstring). `count`: the candidates in
    `cand`, when the caller has counted them."""
    retry = None
    primary = cand
    if demoted is not None:
        kept = cand & ~demoted
        if np.count_nonzero(kept):
            healthy_best = float(np.where(kept, total, -np.inf).max())
            overflow = cand & demoted & (total > healthy_best)
            primary, retry = kept | overflow, cand & demoted & ~overflow
        count = None
    if count is None:
        count = int(np.count_nonzero(primary))
    neg = -total  # (sorted ascending: the best first)
    if deadline_ok is not None:
        neg += _LATE * ~deadline_ok
    ranked = neg.argsort(kind="stable")  # (the method: half the call overhead of np.argsort)
    every = count == len(total)
    # the first `head` primaries in rank order: all the answer reads (a tied winner from further
    # down goes first, then these); with some plans filtered out, the ranking skips them
    head = max(top_k, 2)
    order: list[int]
    if every:
        order = ranked[:head].tolist()
    else:
        mask = primary.tolist()
        order = []
        for i in ranked.tolist():
            if mask[i]:
                order.append(i)
                if len(order) == head:
                    break
    first = order[0]
    best = -float(neg[first])
    if count > 1 and _tie(-float(neg[order[1]]), best):
        key = -neg
        near = np.abs(key - best) <= _EPS * max(1.0, abs(best))
        tied = np.flatnonzero(near if every else near & primary)
        loads = load_rel[tied]
        tied = tied[loads == loads[loads.argmin()]]
        winner = int(tied[int(rng.random() * len(tied))]) if len(tied) > 1 else int(tied[0])
        if winner != first:
            order = [winner, *(i for i in order if i != winner)]
    out = order[:max(1, top_k)]
    if retry is not None and np.count_nonzero(retry):
        ridx = np.flatnonzero(retry)
        out += ridx[np.argsort(-total[ridx], kind="stable")].tolist()
    return tuple(out)


_EPS = 10.0 ** -TIE_DECIMALS


def _tie(a: float, b: float) -> bool:
    return abs(a - b) <= _EPS * max(1.0, abs(b))
