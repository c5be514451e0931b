"""The gateway's side of the one request router (scheduler.router, shared with the simulators):
the deployment's routing table and the fleet made into the router's pool, this process's load
book, and a sample of decisions for the deployment page.

Per request (views._admit):

    routed = await order(dep, prompt_ids, max_tokens, priority=..., deadline_ms=..., outstanding=...)
    for cand in routed.candidates: ...           # the order to try: the router's top-K, then its retry pool
    admitted(routed, cand, seq_id)               # a plan took it: prefix index, load book, decision sample
    first_token(seq_id)                          # its first token came: TTFT to the jitter tracker
    done(seq_id)                                 # it ended, however

The pool has one slot per route of the table that names a plan: frozen, weightless and leaderless
routes are in it too (the prefilter rejects them, and the decision says so). Its facts come from
the fleet's snapshot (`console.gearbox.snapshot.fleet_snapshot`, cached FLEXPIPE_ROUTER_FLEET_TTL_S)
and the model's spec; a plan whose GPUs or model the fleet does not describe (a GPU never
reported, a model outside the catalog) gets facts without hardware (`_unpriced`): no memory bound
beyond its KV reserve, no step times - the router then balances it by load alone. Loads combine
what the engines last reported (running, waiting, KV in use: `Node.engines`, cached
FLEXPIPE_ROUTER_REPORT_TTL_S) with this process's own book (requests it has open on the plan,
prompt tokens still waiting for their first token), which is fresher than any report.
A route's weight is the table's times the global correction's live multiplier for the plan
(`_hinted`: the newest `apply_hints` the console queued naming it, until its ttl_s runs out;
console/gearbox/correction.py), read when the pool is made - so at most
FLEXPIPE_ROUTER_FLEET_TTL_S late.

KV spillover (FLEXPIPE_ROUTER_POLICY "flexpipe+budget", or FLEXPIPE_ROUTER's `spill`: the bands and
`spill_timeout_s`, scheduler/router/spillover.py). A request the bands sent away from its first
choice is watched from the stream's open: the gateway sees nothing of the engine's queue, so
"admitted" is its first token. Past `spill_timeout_s` without one (`spill_timeout`), it is counted -
flexpipe_gateway_spill_timeouts_total, and a stamp in Redis (`SPILL_PREFIX`<deployment>, a sorted
set by time) from which /metrics exports flexpipe_spillover_timeouts_recent{deployment, plan_id}
over the last 5 min (console/metrics/gearbox.py) - and the view re-routes it by the router's fresh
decision: its stream closed (which drops it from that engine, no token sent yet) and the prompt
opened where `spillover.reroute` says; when that is where it waits, it keeps waiting there.

Settings: FLEXPIPE_ROUTER (scheduler.router.RouterConfig.from_dict: weights, top_k, block_tokens,
host_tier_weight, jitter, prices, spill), FLEXPIPE_ROUTER_SEED (ties between equal plans; default: from
the OS), FLEXPIPE_ROUTER_SAMPLE_S (at most one decision per deployment and process is kept for the
deployment page per this many seconds; default 2).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import redis
from asgiref.sync import sync_to_async
from django.conf import settings

from console.gateway import decisions, learned, metrics
from console.registry.specs import spec_for
from scheduler.plan import Plan
from scheduler.router import (
    Decision,
    PlanFacts,
    PlanLoad,
    Pool,
    RouterConfig,
    RouteRequest,
    RoutingPolicy,
    block_hashes,
    make_router,
    plan_facts,
    spillover,
)
from scheduler.router.learned import LearnedRouter
from scheduler.router.pool import StepModel
from scheduler.router.spillover import Spilled, SpillWatch
from scheduler.topology import Snapshot

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Candidate:
    plan_id: str
    weight: float
    leader: str  # node id of the plan's first stage's first GPU
    route: Mapping[str, Any]


def leader_of(route: Mapping[str, Any]) -> str | None:
    """The route's leader node: the first of `nodes` (the table lists the leader first)."""
    nodes = route.get("nodes") or []
    return str(nodes[0]) if nodes else None


def any_frozen(routes: Sequence[Mapping[str, Any]]) -> bool:
    return any(r.get("frozen") for r in routes)


@dataclass
class Routed:
    """One decision of the router, with the routes in the order to try them."""

    decision: Decision
    candidates: list[Candidate]
    deployment: str
    prompt_tokens: int
    low_priority: bool
    policy: RoutingPolicy  # the one that decided: the process's router, or the deployment's learned one


# -- the router and this process's book -------------------------------------------------------------

_lock = threading.RLock()
_router: RoutingPolicy | None = None
_config = RouterConfig()


_seed = 0


def router() -> RoutingPolicy:
    """The process's router (settings read once)."""
    global _router, _config, _seed
    with _lock:
        if _router is None:
            _config = RouterConfig.from_dict(getattr(settings, "FLEXPIPE_ROUTER", None))
            seed = getattr(settings, "FLEXPIPE_ROUTER_SEED", None)
            _seed = int.from_bytes(os.urandom(8)) if seed is None else int(seed)
            budget = learned.policy_name() == "flexpipe+budget"
            _router = make_router("flexpipe+budget" if budget else "flexpipe", _config, seed=_seed)
        return _router


def policy_for(name: str, slo_s: tuple[float, float] | None) -> RoutingPolicy:
    """Who routes the deployment's requests: the process's router, or with FLEXPIPE_ROUTER_POLICY
    "flexpipe+learned" the deployment's own learned one (console/gateway/learned.py)."""
    shared = router()
    if slo_s is None or not learned.enabled():
        return shared
    return learned.policy_for(name, slo_s, _config, _seed)


def reset() -> None:
    """Forget the router, the pools and the book (tests; a settings change)."""
    global _router
    with _lock:
        _router = None
        learned.reset()
        _pools.clear()
        _snapshot_cache.clear()
        _reports_cache.clear()
        _open.clear()
        _last_sample.clear()
        _spill.clear()
        for c in (_pend_count, _pend_tokens, _pend_low):
            c.clear()


@dataclass
class _Open:
    plan_id: str
    prompt_tokens: int
    low: bool
    predicted_ttft_s: float | None
    started: float
    policy: RoutingPolicy
    request: RouteRequest  # the router's own object: a learned policy knows its requests by it
    deployment: str
    first_seen: bool = False
    spill_key: str | None = None  # on its deployment's SpillWatch (a spilled request)


_open: dict[str, _Open] = {}  # seq_id -> what it holds in the book
_spill: dict[str, SpillWatch] = {}  # deployment -> its spilled requests waiting for a first token
SPILL_PREFIX = "flexpipe:router:spill-timeouts:"  # + deployment: sorted set "<plan_id> <key>" by unix time
SPILL_KEEP_S = 3600.0  # stamps older than this are trimmed at each write


def _watch(routed: Routed) -> SpillWatch | None:
    spill = getattr(getattr(routed.policy, "config", None), "spill", None)
    if spill is None:
        return None
    w = _spill.get(routed.deployment)
    if w is None or w.config != spill:
        w = _spill[routed.deployment] = SpillWatch(spill)
    return w


# per plan: requests without a first token yet, their prompt tokens, of those low-priority's
_pend_count: Counter[str] = Counter()
_pend_tokens: Counter[str] = Counter()
_pend_low: Counter[str] = Counter()


def _unpend(o: _Open) -> None:
    _pend_count[o.plan_id] -= 1
    _pend_tokens[o.plan_id] -= o.prompt_tokens
    if o.low:
        _pend_low[o.plan_id] -= o.prompt_tokens
    if _pend_count[o.plan_id] <= 0:
        for c in (_pend_count, _pend_tokens, _pend_low):
            c.pop(o.plan_id, None)


# -- facts ---------------------------------------------------------------------------------------------

@dataclass
class _PoolEntry:
    pool: Pool
    candidates: list[Candidate | None]
    made: float
    reserve: list[int] = field(default_factory=list)


_pools: dict[tuple[str, int], _PoolEntry] = {}
_snapshot_cache: dict[str, tuple[float, Snapshot | None]] = {}
_reports_cache: dict[str, tuple[float, dict[str, dict[str, float]]]] = {}


def _ttl(name: str, default: float) -> float:
    return float(getattr(settings, name, default))


def _snapshot() -> Snapshot | None:
    now = time.monotonic()
    hit = _snapshot_cache.get("fleet")
    if hit is not None and now - hit[0] < _ttl("FLEXPIPE_ROUTER_FLEET_TTL_S", 10.0):
        return hit[1]
    from console.gearbox.snapshot import fleet_snapshot

    try:
        snap: Snapshot | None = fleet_snapshot(datetime.now(UTC))
    except ValueError as exc:  # reports that do not make a valid snapshot: route on load alone
        log.warning("gateway routing: no fleet snapshot (%s); plans are routed without hardware facts", exc)
        snap = None
    _snapshot_cache["fleet"] = (now, snap)
    return snap


def _unpriced(plan: Plan, *, weight: float, frozen: bool, routable: bool) -> PlanFacts:
    """Facts for a plan the fleet cannot describe (module docstring)."""
    return PlanFacts(plan_id=plan.plan_id, model=plan.model, gpu_model="unknown", gpus=len(plan.gpu_uuids),
                     kv_capacity_tokens=plan.kv_reserve_tokens, flops_per_gpu=0.0, link_bytes_per_s=0.0,
                     budgets=(), steps=StepModel(0.0, 0.0, 0.0, 0.0, 0.0, 0.0), weight=weight, frozen=frozen,
                     routable=routable)


def _hinted(name: str) -> dict[str, float]:
    """plan id -> the live weight multiplier of the global correction's newest hint naming it (module docstring)."""
    from datetime import timedelta

    from agents.protocol import MAX_HINT_TTL_S
    from console.fleet.hints import APPLY
    from console.fleet.models import AgentCommand

    now = datetime.now(UTC)
    out: dict[str, float] = {}
    seen: set[str] = set()
    recent = (AgentCommand.objects.filter(kind=APPLY, payload__deployment=name,
                                          created_at__gte=now - timedelta(seconds=MAX_HINT_TTL_S))
              .order_by("-id").values_list("payload", "created_at")[:500])
    for payload, created in recent:  # queued through check_payload (console/fleet/hints.py): well formed
        until = created + timedelta(seconds=float(payload["ttl_s"]))
        for h in payload["plans"]:
            if h["plan_id"] not in seen:
                seen.add(h["plan_id"])  # the newest hint for the plan decides, live or lapsed
                if until > now:
                    out[h["plan_id"]] = float(h["weight_multiplier"])
    return out


def _facts(route: Mapping[str, Any], snap: Snapshot | None, hinted: Mapping[str, float] | None = None
           ) -> tuple[PlanFacts, Candidate | None] | None:
    try:
        plan = Plan.from_dict(route.get("plan"), "route.plan")
    except ValueError:
        return None  # a route without a valid plan is no route
    plan_id = str(route.get("plan_id") or plan.plan_id)  # the table's name for it is what the data plane knows
    weight = float(route.get("weight") or 0.0) * (hinted or {}).get(plan_id, 1.0)
    leader = leader_of(route)
    frozen = bool(route.get("frozen"))
    routable = leader is not None
    cand = Candidate(plan_id, weight, leader, route) if leader is not None else None
    if snap is not None and all(u in snap.gpu_by_uuid for u in plan.gpu_uuids):
        try:
            made = plan_facts(plan, spec_for(plan.model), snap, weight=weight, frozen=frozen, routable=routable)
            return replace(made, plan_id=plan_id), cand
        except (KeyError, ValueError):
            pass
    return replace(_unpriced(plan, weight=weight, frozen=frozen, routable=routable), plan_id=plan_id), cand


def _pool(name: str, model_name: str, version: int, routes: Sequence[Mapping[str, Any]]) -> _PoolEntry:
    key = (name, version)
    now = time.monotonic()
    hit = _pools.get(key)
    if hit is not None and now - hit.made < _ttl("FLEXPIPE_ROUTER_FLEET_TTL_S", 10.0):
        return hit
    snap = _snapshot()
    hinted = _hinted(name)
    facts: list[PlanFacts] = []
    cands: list[Candidate | None] = []
    for r in routes:
        made = _facts(r, snap, hinted)
        if made is not None:
            facts.append(made[0])
            cands.append(made[1])
    router()  # (settings read)
    entry = _PoolEntry(Pool(facts, model=model_name, prices=_config.prices), cands, now,
                       [f.kv_capacity_tokens for f in facts])
    for old in [k for k in _pools if k[0] == name]:
        del _pools[old]
    _pools[key] = entry
    return entry


def _reports() -> dict[str, dict[str, float]]:
    """plan id -> its engines' last report: running and waiting summed, KV usage the worst."""
    now = time.monotonic()
    hit = _reports_cache.get("engines")
    if hit is not None and now - hit[0] < _ttl("FLEXPIPE_ROUTER_REPORT_TTL_S", 1.0):
        return hit[1]
    from console.fleet.models import Node

    out: dict[str, dict[str, float]] = {}
    for reports in Node.objects.exclude(engines=[]).values_list("engines", flat=True):
        for e in reports if isinstance(reports, list) else []:
            if not isinstance(e, dict) or not e.get("plan_id"):
                continue
            mine = out.setdefault(str(e["plan_id"]), {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0})
            for k in ("running", "waiting"):
                v = e.get(k)
                mine[k] += float(v) if isinstance(v, int | float) and not isinstance(v, bool) else 0.0
            kv = e.get("kv_usage")
            if isinstance(kv, int | float) and not isinstance(kv, bool):
                mine["kv_usage"] = max(mine["kv_usage"], min(1.0, max(0.0, float(kv))))
    _reports_cache["engines"] = (now, out)
    return out


def _decide(name: str, model_name: str, version: int, routes: Sequence[Mapping[str, Any]], req: RouteRequest,
            outstanding: Mapping[str, int], policy: RoutingPolicy) -> tuple[Decision, list[Candidate]]:
    """Sync (database reads, cached): the pool with its loads, and the router's decision. The
    reads happen outside the lock, which the event loop's hooks (admitted, first_token) take too:
    it is held only for in-memory work of microseconds."""
    entry = _pool(name, model_name, version, routes)
    reports = _reports()
    with _lock:
        pool = entry.pool
        count, tokens, low = _pend_count, _pend_tokens, _pend_low
        loads = []
        for pid, reserve in zip(pool.ids, entry.reserve, strict=True):
            rep = reports.get(pid, {})
            mine = int(outstanding.get(pid, 0))
            running = max(int(rep.get("running", 0)), mine - count[pid])
            waiting = max(int(rep.get("waiting", 0)), count[pid])
            loads.append(PlanLoad(running, waiting, tokens[pid], low[pid], int(rep.get("kv_usage", 0.0) * reserve)))
        pool.set_loads(loads)
        if isinstance(policy, LearnedRouter):
            now = learned.clock()
            policy.controller.plans_seen(frozenset(pool.ids), now)
            decision = policy.route(req, pool, now)
        else:
            decision = policy.route(req, pool, time.monotonic())
        cands = [entry.candidates[s] for s in decision.order]
    if isinstance(policy, LearnedRouter):
        learned.publish(name, policy)  # a window that ended with this request may have moved the stage
    return decision, [c for c in cands if c is not None]


async def order(name: str, model_name: str, version: int, routes: Sequence[Mapping[str, Any]],
                prompt_ids: Sequence[int], max_tokens: int, *, priority: int = 0, deadline_ms: float | None = None,
                outstanding: Mapping[str, int], slo_s: tuple[float, float] | None = None) -> Routed:
    """The routes to try for one request, best first (module docstring). `slo_s`: the deployment's
    (TTFT, TPOT) objectives in seconds, what a learned policy holds its requests to."""
    policy = policy_for(name, slo_s)
    req = RouteRequest(len(prompt_ids), max_tokens, priority, None if deadline_ms is None else deadline_ms / 1e3,
                       block_hashes(prompt_ids, _config.block_tokens))
    decision, cands = await sync_to_async(_decide)(name, model_name, version, routes, req, outstanding, policy)
    return Routed(decision, cands, name, len(prompt_ids), req.low_priority, policy)


def admitted(routed: Routed, cand: Candidate, seq_id: str, *, key: str | None = None) -> Spilled | None:
    """`cand` took the request: remember its prefix there, book it, keep a sample of the decision.
    A plan other than the first choice of a decision that spilled: the request is watched (module
    docstring) under `key` (the request's own id; default `seq_id`) - what to wait for, or None."""
    d = routed.decision
    slot = d.pool.slot.get(cand.plan_id)
    if slot is None:
        return None
    sample = None
    spilled = None
    with _lock:
        routed.policy.admitted(d, slot)
        o = _open[seq_id] = _Open(cand.plan_id, routed.prompt_tokens, routed.low_priority, d.predicted_ttft_s(slot),
                                  time.monotonic(), routed.policy, d.request, routed.deployment)
        home = d.spilled_from
        watch = _watch(routed) if home is not None and home != slot else None
        if watch is not None and home is not None:
            metrics.SPILLS.labels(routed.deployment).inc()
            o.spill_key = key or seq_id
            spilled = watch.spilled(o.spill_key, d.pool.ids[home], cand.plan_id, o.started)
        _pend_count[o.plan_id] += 1
        _pend_tokens[o.plan_id] += o.prompt_tokens
        if o.low:
            _pend_low[o.plan_id] += o.prompt_tokens
        if time.monotonic() - _last_sample.get(routed.deployment, -1e18) >= _ttl("FLEXPIPE_ROUTER_SAMPLE_S", 2.0):
            _last_sample[routed.deployment] = time.monotonic()
            sample = {**d.explain(), "taken_by": cand.plan_id, "at": datetime.now(UTC).isoformat()}
    if sample is not None:
        decisions.record_soon(routed.deployment, sample)
    return spilled


_last_sample: dict[str, float] = {}


def spill_timeout(spilled: Spilled, fresh: Routed) -> Routed | None:
    """A spilled request's deadline passed without a first token: count it (once) and say where it
    goes - `fresh` (a new decision for it) with the plan `spillover.reroute` picks first, or None
    when it keeps waiting where it is (admitted meanwhile, or nothing better takes it)."""
    with _lock:
        watch = _spill.get(fresh.deployment)
        s = watch.expire(spilled.key, time.monotonic()) if watch is not None else None
    if s is None or watch is None:
        return None
    metrics.SPILL_TIMEOUTS.labels(fresh.deployment).inc()
    learned.soon(_stamp, fresh.deployment, s.at, str(s.key), time.time())
    d = fresh.decision
    home, at = d.pool.slot.get(s.home), d.pool.slot.get(s.at)
    if home is None or at is None:
        return None  # its first choice or its plan left the table: it waits where it is
    free = d.kv_free if d.kv_free is not None else spillover.kv_free(d.pool)
    slot, _ = spillover.reroute(d.order, free, home=home, waiting_at=at, high_priority=d.request.priority < 0,
                                key=str(s.key), config=watch.config)
    if slot == at:
        return None
    target = d.pool.ids[slot]
    cands = [c for c in fresh.candidates if c.plan_id == target]
    if not cands:
        return None  # (a plan without a leader: not routable)
    return replace(fresh, candidates=cands + [c for c in fresh.candidates if c.plan_id not in (target, s.at)])


def _stamp(deployment: str, plan_id: str, key: str, at: float) -> None:
    """One spillover timeout in Redis, for /metrics (errors logged: the request never waits)."""
    try:
        pipe = decisions._client().pipeline()
        pipe.zadd(SPILL_PREFIX + deployment, {f"{plan_id} {key}": at})
        pipe.zremrangebyscore(SPILL_PREFIX + deployment, "-inf", at - SPILL_KEEP_S)
        pipe.expire(SPILL_PREFIX + deployment, int(SPILL_KEEP_S))
        pipe.execute()
    except (OSError, redis.RedisError) as exc:
        log.warning("gateway: cannot stamp a spillover timeout of %s: %s", deployment, exc)


def spill_timeouts_recent(deployments: Sequence[str], window_s: float) -> dict[tuple[str, str], int]:
    """(deployment, plan id) -> spillover timeouts stamped in the last `window_s` (one Redis round
    trip; {} when Redis is away). What flexpipe_spillover_timeouts_recent exports."""
    since = time.time() - window_s
    try:
        pipe = decisions._client().pipeline()
        for name in deployments:
            pipe.zrangebyscore(SPILL_PREFIX + name, since, "+inf")
        raw = pipe.execute()
    except (OSError, redis.RedisError) as exc:
        log.warning("gateway: cannot read the spillover timeouts: %s", exc)
        return {}
    out: Counter[tuple[str, str]] = Counter()
    for name, members in zip(deployments, raw, strict=True):
        for m in members:
            out[(name, (m.decode() if isinstance(m, bytes) else str(m)).split(" ", 1)[0])] += 1
    return dict(out)


def first_token(seq_id: str) -> None:
    """The request's first token came: its prompt no longer waits, and the TTFT the router
    predicted meets the one observed (the jitter tracker)."""
    with _lock:
        o = _open.get(seq_id)
        if o is None or o.first_seen:
            return
        o.first_seen = True
        _unpend(o)
        if o.spill_key is not None and o.deployment in _spill:
            _spill[o.deployment].admitted(o.spill_key)  # in time: not counted
        now = time.monotonic()
        o.policy.first_token(o.plan_id, now, now - o.started, o.predicted_ttft_s)


def done(seq_id: str, *, ttft_s: float | None = None, tpot_s: float | None = None) -> None:
    """The request ended, however. `ttft_s` (and `tpot_s` past one token): what the gateway
    measured, for a learning policy - inf for one that failed without a token; None when nothing
    was observed (the client left first, or it moved on to another plan: the new one reports)."""
    with _lock:
        o = _open.pop(seq_id, None)
        if o is None:
            return
        if not o.first_seen:
            _unpend(o)
        if o.spill_key is not None and o.deployment in _spill:
            _spill[o.deployment].forget(o.spill_key)
        if ttft_s is None or not isinstance(o.policy, LearnedRouter):
            return
        o.policy.finished(o.request, ttft_s, tpot_s, learned.clock())
    learned.publish(o.deployment, o.policy)


__all__ = ["Candidate", "Routed", "admitted", "any_frozen", "done", "first_token", "leader_of", "order",
           "policy_for", "reset", "router", "spill_timeout", "spill_timeouts_recent"]
