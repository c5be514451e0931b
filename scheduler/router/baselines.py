"""The routing policies FlexPipe's router is measured against (bench.route), behind the same
interface (router.RoutingPolicy), and the registry that names them all.

* round-robin: the next candidate in turn.
* least-loaded: the fewest requests outstanding (running + waiting); ties at random.
* prefix-only: cache-aware routing as SGLang's router does it: while the load is balanced, the
  plan with the longest prefix match if it covers more than `cache_threshold` of the prompt,
  else the plan with the smallest cache (most room); when the load is imbalanced - max - min >
  `balance_abs` and max > `balance_rel` x min - the least loaded. Defaults are the SGLang router's
  (sgl-model-gateway router_args.py: cache_threshold 0.3, balance_abs_threshold 64,
  balance_rel_threshold 1.5). Its prefix index is ours (GPU tier only), sized by each plan's KV.

Every baseline applies the hard filters (prefilter, and plans that could never hold the request):
a real router learns those from the 400 a plan answers and retries elsewhere.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np

from scheduler.router.decision import Decision
from scheduler.router.pool import Pool
from scheduler.router.prefix_affinity import PrefixIndex
from scheduler.router.request import BLOCK_TOKENS, RouteRequest
from scheduler.router.router import Router, RouterConfig, RoutingPolicy, hard_filters, record_prefix


class _Baseline:
    name = "baseline"

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def admitted(self, decision: Decision, slot: int) -> None:
        return None

    def first_token(self, plan_id: str, now_s: float, ttft_s: float, predicted_s: float | None) -> None:
        return None

    def forget(self, plan_id: str) -> None:
        return None

    def finished(self, req: RouteRequest, ttft_s: float, tpot_s: float | None, now_s: float) -> None:
        return None

    def _decide(self, req: RouteRequest, pool: Pool, first: int | None, hard: np.ndarray, now: np.ndarray,
                cand: np.ndarray, note: str) -> Decision:
        if first is None:
            return Decision(self.name, req, pool, (), hard_ok=hard, fits_now=now)
        rest = [int(i) for i in np.flatnonzero(cand) if i != first]
        return Decision(self.name, req, pool, (first, *rest), hard_ok=hard, fits_now=now, relaxed=True, note=note)

    def _least_loaded(self, pool: Pool, cand: np.ndarray) -> int:
        load = pool.outstanding()
        idx = np.flatnonzero(cand)
        low = load[idx].min()
        ties = idx[load[idx] == low]
        return int(ties[int(self.rng.random() * len(ties))])


class RoundRobin(_Baseline):
    name = "round-robin"

    def __init__(self, rng: random.Random) -> None:
        super().__init__(rng)
        self._next = 0

    def route(self, req: RouteRequest, pool: Pool, now_s: float) -> Decision:
        hard, now, *_ = hard_filters(req, pool)
        if not hard.any():
            return self._decide(req, pool, None, hard, now, hard, "")
        for k in range(pool.n):
            i = (self._next + k) % pool.n
            if hard[i]:
                self._next = i + 1
                return self._decide(req, pool, i, hard, now, hard, "next in turn")
        raise AssertionError("unreachable: a candidate exists")  # pragma: no cover


class LeastLoaded(_Baseline):
    name = "least-loaded"

    def route(self, req: RouteRequest, pool: Pool, now_s: float) -> Decision:
        hard, now, *_ = hard_filters(req, pool)
        if not hard.any():
            return self._decide(req, pool, None, hard, now, hard, "")
        return self._decide(req, pool, self._least_loaded(pool, hard), hard, now, hard, "fewest outstanding")


class PrefixOnly(_Baseline):
    name = "prefix-only"

    def __init__(self, rng: random.Random, *, block_tokens: int = BLOCK_TOKENS, cache_threshold: float = 0.3,
                 balance_abs: float = 64, balance_rel: float = 1.5) -> None:
        super().__init__(rng)
        self.index = PrefixIndex(block_tokens)
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel

    def route(self, req: RouteRequest, pool: Pool, now_s: float) -> Decision:
        hard, now, *_ = hard_filters(req, pool)
        if not hard.any():
            return self._decide(req, pool, None, hard, now, hard, "")
        idx = np.flatnonzero(hard)
        load = pool.outstanding()[idx]
        if load.max() - load.min() > self.balance_abs and load.max() > self.balance_rel * load.min():
            return self._decide(req, pool, self._least_loaded(pool, hard), hard, now, hard, "imbalanced: least loaded")
        hits = self.index.match(req.blocks, pool)
        if hits is not None:
            matched = hits[0][idx] * self.index.block_tokens
            best = int(np.argmax(matched))
            if matched[best] / req.prompt_tokens > self.cache_threshold:
                return self._decide(req, pool, int(idx[best]), hard, now, hard, "longest prefix match")
        sizes = np.array([self.index.size(pool.ids[i]) for i in idx])
        smallest = idx[sizes == sizes.min()]
        pick = int(smallest[int(self.rng.random() * len(smallest))])
        return self._decide(req, pool, pick, hard, now, hard, "no match above the threshold: smallest cache")

    def admitted(self, decision: Decision, slot: int) -> None:
        record_prefix(self.index, decision, slot)

    def forget(self, plan_id: str) -> None:
        self.index.forget(plan_id)


ROUTING_POLICIES: dict[str, Callable[[RouterConfig, random.Random], RoutingPolicy]] = {
    "round-robin": lambda cfg, rng: RoundRobin(rng),
    "least-loaded": lambda cfg, rng: LeastLoaded(rng),
    "prefix-only": lambda cfg, rng: PrefixOnly(rng, block_tokens=cfg.block_tokens),
    "flexpipe": lambda cfg, rng: Router(cfg, rng=rng),
    "flexpipe+learned": lambda cfg, rng: _learned(cfg, rng),
    "flexpipe+budget": lambda cfg, rng: _budget(cfg, rng),
}


def _budget(cfg: RouterConfig, rng: random.Random) -> RoutingPolicy:
    from dataclasses import replace

    from scheduler.router.spillover import SpillConfig

    r = Router(replace(cfg, spill=cfg.spill or SpillConfig()), rng=rng)
    r.name = "flexpipe+budget"
    return r


def _learned(cfg: RouterConfig, rng: random.Random) -> RoutingPolicy:
    from scheduler.router.learned import LearnedRouter  # (it builds on this module's RoundRobin)

    return LearnedRouter(cfg, rng=rng)


def make_router(name: str = "flexpipe", config: RouterConfig | None = None, *, seed: int = 0) -> RoutingPolicy:
    """A routing policy by name (ROUTING_POLICIES); unknown names raise ValueError."""
    try:
        make = ROUTING_POLICIES[name]
    except KeyError:
        raise ValueError(f"routing policy: unknown {name!r}; known: {', '.join(ROUTING_POLICIES)}") from None
    return make(config or RouterConfig(), random.Random(f"router:{name}:{seed}"))
