"""The router's fast paths (the prefix index's strided walk and its few hits, the filters' counts
from sorted rooms, minima without masked copies, a ranking that skips filtered plans) decide
exactly as the plain formulas do: a reference router written with dense arrays and masks, a
linear prefix scan and Python's sort, replayed against the real one over conversations that share
prefixes, on pools where plans fill up, keep evicted blocks in host memory or take only some
priority classes."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

from scheduler.router import PlanLoad, Pool, Router, RouteRequest, predicted_latency, topology_affinity
from scheduler.router.pick import TIE_DECIMALS
from scheduler.router.prefilter import prefilter
from tests.scheduler.router.builders import copies, facts, mixed_snapshot, router

LATE = 1e9  # pick's price of a missed deadline (its module docstring: more than any score)
EPS = 10.0 ** -TIE_DECIMALS


def conversations(seed: int, n: int) -> list[RouteRequest]:
    """Turns of conversations whose prompts grow turn by turn, up to 30 blocks; a third of them
    open with one of two shared system prompts (chained ids: a block id stands for its prefix)."""
    rng = random.Random(seed)
    ids = iter(range(1, 10**9))
    systems = [[next(ids) for _ in range(6)] for _ in range(2)]
    live: list[list[int]] = []
    out = []
    for _ in range(n):
        if not live or rng.random() < 0.25:
            head = list(rng.choice(systems)) if rng.random() < 0.35 else []
            live.append(head)
        conv = rng.choice(live)
        conv += [next(ids) for _ in range(rng.randint(1, 8))]
        if len(conv) > 30:  # (at most 15k tokens: every plan of the pool can hold it)
            live.remove(conv)
        prompt = 512 * len(conv) - rng.randint(0, 400)
        out.append(RouteRequest(prompt, rng.randint(1, 400), priority=rng.choice((0, 0, 0, -1, 2)),
                                deadline_s=rng.choice((None, None, 0.05, 2.0)), blocks=tuple(conv)))
    return out


def pool_of(kind: str) -> Pool:
    snap = mixed_snapshot()
    plans = (copies(facts("h100", snap, kv_tokens=40_000), 3) + copies(facts("a100", snap, kv_tokens=30_000), 3)
             + copies(facts("l40s", snap, kv_tokens=20_000, host_kv_tokens=60_000), 2))
    if kind == "classes":  # one plan reserved for urgent traffic, one taking none of low priority
        plans[0] = replace(plans[0], priority_max=-1)
        plans[4] = replace(plans[4], priority_max=0)
    return Pool(plans, model="Qwen2-72B")


def run_length(blocks: tuple[int, ...], held: set[int]) -> int:
    k = 0
    while k < len(blocks) and blocks[k] in held:
        k += 1
    return k


def reference(r: Router, req: RouteRequest, pool: Pool, rng: random.Random) -> tuple[tuple[int, ...], np.ndarray]:
    """(order, totals): the decision by the plain formulas (the plugins' module docstrings)."""
    cfg, p = r.config, req.prompt_tokens
    hard = prefilter(req, pool) & (pool.cap_tokens >= req.kv_tokens)
    cand = hard & (pool.room >= req.kv_tokens)
    if not cand.any():
        cand = hard  # relaxed: every candidate is full now
    slots = [int(i) for i in np.flatnonzero(cand)]
    assert slots, "the streams below always leave a plan that can ever hold the request"
    gpu_run, any_run = [], []
    for pid in pool.ids:  # what each plan holds, read from the index's own LRUs
        on_gpu = set(r.index._lru_gpu.get(pid, ()))
        gpu_run.append(run_length(req.blocks, on_gpu))
        any_run.append(run_length(req.blocks, on_gpu | set(r.index._lru_host.get(pid, ()))))
    b = float(cfg.block_tokens)
    gpu_tokens = np.minimum(np.array(gpu_run) * b, p - 1.0)
    cached = gpu_tokens + cfg.host_tier_weight * (np.minimum(np.array(any_run) * b, p - 1.0) - gpu_tokens)
    own = predicted_latency.prefill_s(req, pool, cached)  # (the dense formula: no list of hits)
    ttft, tpot = predicted_latency.predict(req, pool, cached, own)
    per_token = tpot + predicted_latency.stall_s(req, own, pool)
    ttft_ref = req.deadline_s if req.deadline_s is not None else float(ttft[cand].min())
    cost = ttft * (1.0 / max(ttft_ref, 1e-6))
    cost += per_token * (1.0 / max(float(per_token[cand].min()), 1e-9))
    s_lat = 100.0 * float(cost[cand].min()) / cost
    total = s_lat * cfg.weights.predicted_latency + topology_affinity.score(req, pool) + cached * (100.0 / p)
    late = [False] * pool.n if req.deadline_s is None else (ttft > req.deadline_s).tolist()
    neg = [-float(total[i]) + (LATE if late[i] else 0.0) for i in range(pool.n)]
    ranked = sorted(slots, key=lambda i: (neg[i], i))
    best = -neg[ranked[0]]
    tol = EPS * max(1.0, abs(best))
    if len(ranked) > 1 and abs(-neg[ranked[1]] - best) <= tol:  # a tie: the least loaded, then the seed
        tied = [i for i in slots if abs(-neg[i] - best) <= tol]
        low = min(float(pool.load_rel[i]) for i in tied)
        tied = [i for i in tied if float(pool.load_rel[i]) == low]
        winner = tied[int(rng.random() * len(tied))] if len(tied) > 1 else tied[0]
        ranked = [winner] + [i for i in ranked if i != winner]
    return tuple(ranked[:cfg.top_k]), total


@pytest.mark.parametrize("kind", ["open", "classes"])
def test_the_router_decides_as_the_plain_formulas_do(kind: str) -> None:
    pool = pool_of(kind)
    r = router(3)
    ref_rng = random.Random(3)  # the router's seed: both draw only on ties
    rng = random.Random(11)
    paths = {"fast": 0, "filtered": 0, "relaxed": 0, "hit": 0, "host hit": 0, "tie": 0}
    for k, req in enumerate(conversations(5, 400)):
        tight = rng.random() < 0.4  # plans fill up: some have no room now (and now and then none has)
        same = rng.random() < 0.15  # every plan equally loaded: replicas tie
        one = (rng.randint(0, 40), rng.randint(0, 8), rng.randint(0, 50_000))
        loads = []
        for f in pool.facts:
            run, wait, queued = one if same else (rng.randint(0, 40), rng.randint(0, 8), rng.randint(0, 50_000))
            used = rng.randint(f.kv_capacity_tokens // 2, f.kv_capacity_tokens) if tight else rng.randint(0, 4000)
            loads.append(PlanLoad(run, wait, queued, 0, 0 if same else used))
        pool.set_loads(loads)
        want, total = reference(r, req, pool, ref_rng)
        d = r.route(req, pool, 0.1 * k)
        assert d.demoted is None
        assert d.order == want, f"request {k}"
        assert d.total is not None and np.array_equal(d.total, total), f"request {k}"
        r.admitted(d, d.order[0])
        filtered = d.fits_now is not None and not d.fits_now.all()
        paths["relaxed" if d.relaxed else "filtered" if filtered else "fast"] += 1
        cached = d.cached_tokens
        paths["hit"] += cached is not None and bool(cached.any())
        paths["host hit"] += cached is not None and bool((cached[6:] % 512 != 0).any())
        paths["tie"] += len(set(np.round(d.total, 6).tolist())) < pool.n
    assert all(paths.values()), paths  # every path the fast code takes was compared
