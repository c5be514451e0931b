"""The router: filter -> score -> pick over one deployment's plans (the package docstring has
the plugins), and the state it learns from what it routed (prefix index, jitter residuals).

    router = Router(RouterConfig(), rng=random.Random(seed))
    pool = Pool([plan_facts(plan, model, snapshot, weight=w) for ...], model=name)
    pool.set_loads([...])                       # what the engines last reported
    d = router.route(RouteRequest(prompt, max_tokens, blocks=block_hashes(ids)), pool, now_s)
    slot = d.chosen                             # d.order: the slots to try, best first
    router.admitted(d, slot)                    # it went there: remember its prefix
    router.first_token(pool.ids[slot], now_s, ttft_s, d.predicted_ttft_s(slot))
    d.explain()                                 # scores per plugin, filters' reasons

Pure and deterministic: no clock (the caller passes `now_s`), no I/O, randomness only from the
injected `random.Random` (ties between equal plans).
"""

from __future__ import annotations

import random
from bisect import bisect_left
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Protocol

import numpy as np

from scheduler.router import predicted_latency, prefix_affinity, spillover, topology_affinity
from scheduler.router._arrays import Bools, Floats
from scheduler.router.decision import Decision
from scheduler.router.jitter import JitterConfig, JitterTracker
from scheduler.router.memory_bound import memory_bound
from scheduler.router.pick import pick
from scheduler.router.pool import Pool
from scheduler.router.prefilter import prefilter
from scheduler.router.prefix_affinity import PrefixIndex
from scheduler.router.request import BLOCK_TOKENS, RouteRequest
from scheduler.router.spillover import SpillConfig


@dataclass(frozen=True)
class RouterWeights:
    """Each scoring plugin's weight in the sum. Latency is the objective and counts double; the
    other two look past this one request (cache locality for the next turn of a conversation,
    dense cards kept free for long prompts)."""

    predicted_latency: float = 2.0
    prefix_affinity: float = 1.0
    topology_affinity: float = 1.0

    def as_dict(self) -> dict[str, float]:
        return {f.name: float(getattr(self, f.name)) for f in fields(self)}


@dataclass(frozen=True)
class RouterConfig:
    """The router's settings (console: settings.FLEXPIPE_ROUTER, read by `from_dict`)."""

    weights: RouterWeights = field(default_factory=RouterWeights)
    top_k: int = 3  # on a backend failure, the next of the best K is tried (then the retry pool)
    block_tokens: int = BLOCK_TOKENS  # prompt hash block size
    host_tier_weight: float = 0.5  # a host-memory KV hit is worth this share of a GPU hit, where a
    # plan's facts do not price its restore (prefix_affinity's docstring)
    jitter: JitterConfig = field(default_factory=JitterConfig)
    prices: Mapping[str, float] | None = None  # GPU model -> price per GPU-hour (topology_affinity)
    spill: SpillConfig | None = None  # KV spillover bands (spillover.py); None: not applied

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise ValueError(f"top_k: must be >= 1, got {self.top_k}")
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens: must be >= 1, got {self.block_tokens}")
        if not 0.0 <= self.host_tier_weight <= 1.0:
            raise ValueError(f"host_tier_weight: must be in [0, 1], got {self.host_tier_weight}")
        for k, v in self.weights.as_dict().items():
            if v < 0:
                raise ValueError(f"weights.{k}: must be >= 0, got {v}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None, path: str = "FLEXPIPE_ROUTER") -> RouterConfig:
        """Settings as a dict; every unknown key or bad value raises ValueError naming `path.key`."""
        if not d:
            return cls()
        if not isinstance(d, Mapping):
            raise ValueError(f"{path}: must be a dict")
        known = {"weights", "top_k", "block_tokens", "host_tier_weight", "jitter", "prices", "spill"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{path}.{unknown[0]}: unknown key (known: {', '.join(sorted(known))})")
        kw: dict[str, Any] = {}
        try:
            if "weights" in d:
                kw["weights"] = _sub(RouterWeights, d["weights"], f"{path}.weights")
            if "jitter" in d:
                kw["jitter"] = _sub(JitterConfig, d["jitter"], f"{path}.jitter")
            if "spill" in d:  # the bands and the spillover timeout (a policy with spillover reads them)
                kw["spill"] = _sub(SpillConfig, d["spill"], f"{path}.spill")
            for k in ("top_k", "block_tokens"):
                if k in d:
                    v = d[k]
                    if isinstance(v, bool) or not isinstance(v, int):
                        raise ValueError(f"{path}.{k}: must be an integer, got {v!r}")
                    kw[k] = v
            if "host_tier_weight" in d:
                kw["host_tier_weight"] = _number(d["host_tier_weight"], f"{path}.host_tier_weight")
            if "prices" in d:
                prices = d["prices"]
                if not isinstance(prices, Mapping):
                    raise ValueError(f"{path}.prices: must be a dict of GPU model -> price per GPU-hour")
                kw["prices"] = {str(k): _number(v, f"{path}.prices.{k}") for k, v in prices.items()}
            return cls(**kw)
        except ValueError as exc:
            msg = str(exc)
            raise ValueError(msg if msg.startswith(path) else f"{path}.{msg}") from None


def _number(v: object, path: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ValueError(f"{path}: must be a number, got {v!r}")
    return float(v)


def _sub(kind: Any, d: object, path: str) -> Any:
    if not isinstance(d, Mapping):
        raise ValueError(f"{path}: must be a dict")
    names = {f.name for f in fields(kind)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"{path}.{unknown[0]}: unknown key (known: {', '.join(sorted(names))})")
    base = kind()
    values: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(getattr(base, k), int) and not isinstance(getattr(base, k), bool):
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{path}.{k}: must be an integer, got {v!r}")
            values[k] = v
        else:
            values[k] = _number(v, f"{path}.{k}")
    try:
        return replace(base, **values)
    except ValueError as exc:
        msg = str(exc)
        raise ValueError(msg if msg.startswith(path) else f"{path}.{msg}") from None


class RoutingPolicy(Protocol):
    """What the gateway and the simulators call: FlexPipe's router, or a baseline (baselines.py)."""

    name: str

    def route(self, req: RouteRequest, pool: Pool, now_s: float) -> Decision: ...

    def admitted(self, decision: Decision, slot: int) -> None:
        """The request went to `slot` (the first of `decision.order` that took it)."""
        ...

    def finished(self, req: RouteRequest, ttft_s: float, tpot_s: float | None, now_s: float) -> None:
        """A request it routed finished with these latencies (what a learning policy learns from)."""
        ...

    def first_token(self, plan_id: str, now_s: float, ttft_s: float, predicted_s: float | None) -> None: ...

    def forget(self, plan_id: str) -> None:
        """The plan is gone: drop what was learnt about it."""
        ...


def hard_filters(req: RouteRequest, pool: Pool) -> tuple[Bools, Bools, Bools, bool, int]:
    """(hard_ok, fits_now, candidates, relaxed, how many candidates): the prefilter and the memory
    bound, with the bound's fits-now half relaxed when no plan has room now (memory_bound's
    docstring)."""
    if req.kv_tokens <= pool.room_floor and not pool.priority_limited:
        # (the usual case: it fits every plan now - the filters are the pool's static half)
        return pool.base_ok, pool.all_true, pool.base_ok, False, pool.base_count
    ever, now = memory_bound(req, pool)
    hard: Bools = prefilter(req, pool)
    if ever is not pool.all_true:
        hard = hard & ever
    if hard is pool.base_ok and pool.base_all:
        # every plan passes the static filters: the candidates are the plans with room now, and
        # the pool's sorted rooms count them without another pass over the mask
        cand: Bools = now
        count = pool.n - bisect_left(pool.room_sorted, float(req.kv_tokens))
    else:
        cand = hard & now
        count = int(np.count_nonzero(cand))
    if count:
        return hard, now, cand, False, count
    return hard, now, hard, True, int(np.count_nonzero(hard))


class Router:
    """FlexPipe's router (module docstring)."""

    name = "flexpipe"

    def __init__(self, config: RouterConfig | None = None, *, rng: random.Random | None = None) -> None:
        self.config = config or RouterConfig()
        self.rng = rng or random.Random(0)
        self.index = PrefixIndex(self.config.block_tokens)
        self.jitter = JitterTracker(self.config.jitter)
        self._weights = self.config.weights.as_dict()
        self._n = 0  # requests routed with spillover: each one's key for its spill probe draw

    def route(self, req: RouteRequest, pool: Pool, now_s: float) -> Decision:
        cfg = self.config
        if pool.n == 1 and not pool.priority_limited and pool.base_ok[0] and pool.cap_tokens[0] >= req.kv_tokens:
            # one plan, and it can ever hold the request: nothing to score, whatever its load (the
            # common single-plan gear; it is the prefilter and the memory bound of one plan, inline)
            return Decision(self.name, req, pool, (0,), note="the only plan")
        hard, now, cand, relaxed, count = hard_filters(req, pool)
        every = count == pool.n
        if not count:
            return Decision(self.name, req, pool, (), hard_ok=hard, fits_now=now)
        hits = self.index.hits(req.blocks, pool) if req.blocks else None
        s_prefix, cached, at = prefix_affinity.score(req, hits, pool.n, block_tokens=cfg.block_tokens,
                                                     host_tier_weight=cfg.host_tier_weight, pool=pool)
        s_topo = topology_affinity.score(req, pool)
        own = predicted_latency.prefill_s(req, pool, cached, at)
        ttft, tpot = predicted_latency.predict(req, pool, cached, own)
        stall = predicted_latency.stall_s(req, own, pool)
        demotion = self.jitter.demotion(pool, now_s)
        demoted = None
        if demotion is not None:
            demoted, factor = demotion
            ttft = ttft * factor  # a demoted plan is priced as its tail says (jitter.py)
        s_lat, deadline_ok = predicted_latency.score(req, pool, ttft, tpot, cand, stall, every=every)
        w = cfg.weights
        total = s_lat * w.predicted_latency
        total += s_topo if w.topology_affinity == 1.0 else s_topo * w.topology_affinity
        # (+ the prefix score: 0 but at the few plans that hit)
        w_prefix = w.prefix_affinity
        for i, _, s in at:
            total[i] = float(total[i]) + (s if w_prefix == 1.0 else s * w_prefix)
        order = pick(total, cand, demoted, deadline_ok, pool.load_rel, cfg.top_k, self.rng, count=count)
        note = ""
        spilled_from: int | None = None
        free: Floats | None = None
        if cfg.spill is not None and len(order) > 1:
            self._n += 1
            free = spillover.kv_free(pool)
            first = order[0]
            order, note = spillover.reorder(order, free, high_priority=req.priority < 0, key=str(self._n),
                                            config=cfg.spill)
            spilled_from = first if order[0] != first else None
        return Decision(self.name, req, pool, order, hard_ok=hard, fits_now=now, relaxed=relaxed, note=note,
                        scores={predicted_latency.NAME: s_lat,
                                prefix_affinity.NAME: pool.zeros if s_prefix is None else s_prefix,
                                topology_affinity.NAME: s_topo},
                        weights=self._weights, total=total, demoted=demoted, ttft_s=ttft, tpot_s=tpot,
                        stall_s=stall, cached_tokens=cached, spilled_from=spilled_from, kv_free=free)

    def admitted(self, decision: Decision, slot: int) -> None:
        record_prefix(self.index, decision, slot)

    def first_token(self, plan_id: str, now_s: float, ttft_s: float, predicted_s: float | None) -> None:
        if predicted_s is not None:
            self.jitter.observe(plan_id, now_s, ttft_s, predicted_s)

    def forget(self, plan_id: str) -> None:
        self.index.forget(plan_id)
        self.jitter.forget(plan_id)

    def finished(self, req: RouteRequest, ttft_s: float, tpot_s: float | None, now_s: float) -> None:
        return None  # static weights (learned.py learns them)

    def weights(self) -> dict[str, float]:
        return dict(self._weights)

    def set_weights(self, weights: Mapping[str, float]) -> None:
        """New score weights (learned.py); every name one of RouterWeights', every value >= 0."""
        self.config = replace(self.config, weights=RouterWeights(**{k: float(v) for k, v in weights.items()}))
        self._weights = self.config.weights.as_dict()


def record_prefix(index: PrefixIndex, decision: Decision, slot: int) -> None:
    """The request's blocks are now the newest of the plan at `slot` (tiers sized by its facts)."""
    req = decision.request
    if not req.blocks:
        return
    f = decision.pool.facts[slot]
    b = index.block_tokens
    index.record(f.plan_id, req.blocks, f.kv_capacity_tokens // b, f.host_kv_tokens // b)
