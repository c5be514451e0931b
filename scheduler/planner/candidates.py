"""`plan_candidates` and the named steps it takes (the package docstring states the algorithm):

1. `_filter_blocks`: the blocks planning may use, each with its GPUs ordered by usable memory,
   best first (stable, the current gear's, the most room);
2. units into a `_UnitBook` (it keeps one list per unit type, disjoint GPUs, and what a node's
   engine refuses): `_add_kept` (the plans running now, as they are), `_add_tp_units`
   (single-block TP groups), the prefill/decode splits and - only when single blocks cannot
   hold the model or carry the load - the PP chains (`units`);
3. `_TypeEstimates` (each unit type estimated once) and `_fill` (the greedy mixed fill);
4. `_drafts` (replicas of each type, the single unit, the mixed fill: estimated and ranked
   before any Gear is built) and `_candidate` (the Gear of a draft that is returned).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from functools import partial

from scheduler._lazy import make_frozen
from scheduler.capabilities import EngineCaps, engine_refusals, mem_fraction_of
from scheduler.costmodel import (
    DEFAULT_EFFICIENCY,
    MAX_RUNNING_SEQS,
    Efficiency,
    Estimate,
    PlanProfile,
    Slo,
    Workload,
    steady_state,
)
from scheduler.costmodel import clear_caches as _clear_cost_model_caches
from scheduler.modelspec import ModelSpec
from scheduler.plan import Gear, Plan
from scheduler.planner.options import DEFAULT_OPTIONS, Candidate, Candidates, PlannerOptions
from scheduler.planner.sizing import _SLO_RATES, _capacity, _GearEstimator, _serve_rate, _slo_rate, _weights
from scheduler.planner.units import (
    _GIB,
    _BlockRoom,
    _bucket,
    _cap,
    _colocated,
    _const,
    _first,
    _first_of_pair,
    _kv_cap_tokens,
    _min_kv_tokens,
    _no_fit_reasons,
    _no_gpus_reason,
    _pd_units,
    _pp_units,
    _stage_terms,
    _Unit,
    _UnitType,
)
from scheduler.topology import DEFAULT_POLICY, AtomicBlock, BlockPolicy, Snapshot, partition


def plan_candidates(
    model: ModelSpec,
    snapshot: Snapshot,
    workload: Workload,
    *,
    slo: Slo | None = None,
    options: PlannerOptions = DEFAULT_OPTIONS,
    blocks: Sequence[AtomicBlock] | None = None,
    stability: Mapping[str, float] | None = None,
    reclaimable_bytes: Mapping[str, int] | None = None,
    prefer_gpus: Iterable[str] = (),
    keep: Sequence[Plan] = (),
    policy: BlockPolicy = DEFAULT_POLICY,
    eff: Efficiency = DEFAULT_EFFICIENCY,
) -> Candidates:
    """Feasible candidate gears for `model` under `workload` on `snapshot` (package docstring).

    `reclaimable_bytes`: memory the deployment holds now per GPU and would give back (so its
    current GPUs count as free). `prefer_gpus`: GPUs to pick first among equals (the current
    gear's), so candidates keep weights in place where they can. `keep`: the current gear's
    plans, each offered as a unit as it is - a gear that keeps a running plan books nothing new
    for it, so under the memory a transition holds (scheduler.booking) it can grow beside it
    where a re-planned copy of it could not. Deterministic.
    """
    if blocks is None:
        part = partition(snapshot, policy)
        blocks, excluded = part.blocks, dict(part.excluded)
    else:
        excluded = {}
    reasons: list[str] = []
    min_kv = _min_kv_tokens(model, workload, options)
    valid_tps = model.valid_tps(max((b.size for b in blocks), default=1))
    # what the nodes' engines can run (capabilities.py; none reported: no restriction)
    engines = {n.id: n.engine for n in snapshot.nodes if n.engine is not None}

    # 1. filter and order blocks
    rooms, kept_off = _filter_blocks(blocks, snapshot, options, stability or {}, reclaimable_bytes or {},
                                     set(prefer_gpus), engines, reasons)
    book = _UnitBook(engines, options, rooms, {k: 1 for k in kept_off})
    if not rooms:
        return Candidates((), tuple(reasons + kept_off[:5] + [_no_gpus_reason(snapshot, excluded)]), 0, 0, 0,
                          _left_out(book.excluded_units))

    # 2. units: the plans running now, single-block TP groups, prefill/decode splits
    _add_kept(book, model, keep, rooms)
    _add_tp_units(book, model, snapshot, workload, rooms, valid_tps, min_kv)
    if options.allow_disaggregated and len(rooms) >= 2:
        for unit, label in _pd_units(model, snapshot, rooms, valid_tps, min_kv, workload, options):
            book.add(unit, label)

    target_rps = workload.rate_rps * options.headroom
    types = book.types
    estimates = _TypeEstimates(model, snapshot, workload, slo, eff, rooms)
    live = estimates.live(types)
    mixed, mixed_cap = _fill(types, live, target_rps, options.max_plans_per_gear)
    # PP chains across blocks, only when single-block units cannot hold the model or cannot
    # reach the load (PP costs hand-offs and bubbles), and only where links allow
    if options.allow_pp and options.max_pp >= 2 and (not live or mixed_cap < target_rps):
        for unit, label in _pp_units(model, snapshot, rooms, valid_tps, min_kv, workload, options):
            book.add(unit, label)
        live = estimates.live(types)
        mixed, mixed_cap = _fill(types, live, target_rps, options.max_plans_per_gear)

    if not types:
        reasons.extend(_no_fit_reasons(model, snapshot, rooms, min_kv, options))
        return Candidates((), tuple(reasons), len(rooms), len({r.shape for r in rooms}), 0,
                          _left_out(book.excluded_units))
    if not live:
        reasons.append("every plan that fits has zero capacity for this workload (KV reserve too small for one"
                       " request); to fix: free memory or lower the prompt/output lengths")
        return Candidates((), tuple(reasons), len(rooms), len({r.shape for r in rooms}), len(types),
                          _left_out(book.excluded_units))

    # 3. gears, ranked as drafts; Gear and Plan objects only for the candidates returned
    ranked = sorted(_drafts(types, live, mixed, workload, slo, options, target_rps), key=_rank)
    feasible = tuple(_candidate(d, types, model, workload) for d in ranked[: options.max_candidates])
    if feasible and all(c.estimate.capacity_rps < workload.rate_rps for c in feasible):
        best = max(feasible, key=lambda c: c.estimate.capacity_rps)
        reasons.append(
            f"no gear reaches the offered {workload.rate_rps:.2f} rps (best: {best.estimate.capacity_rps:.2f} rps"
            f" on {best.estimate.gpus} GPUs); to fix: free more GPUs, raise max_plans_per_gear, or shed load"
        )
    return Candidates(feasible, tuple(reasons), len(rooms), len({r.shape for r in rooms}), len(types),
                      _left_out(book.excluded_units))


# --- 1. blocks ---------------------------------------------------------------------------------
def _filter_blocks(blocks: Sequence[AtomicBlock], snapshot: Snapshot, options: PlannerOptions,
                   stability: Mapping[str, float], reclaim: Mapping[str, int], preferred: set[str],
                   engines: Mapping[str, EngineCaps], reasons: list[str]) -> tuple[list[_BlockRoom], list[str]]:
    """The blocks planning may use, best first, each with its GPUs ordered by usable memory (the
    92% rule - or the share a node's engine takes - less others' use, plus what this deployment
    would give back); and the blocks the model version's requirements refuse, with why. Blocks
    left out as unstable (latency-critical deployments) add a reason."""
    unstable: list[str] = []
    sort_keys: list[tuple[tuple[object, ...], _BlockRoom]] = []
    preferred_blocks = {b.id for b in blocks if not preferred.isdisjoint(b.gpu_uuids)} if preferred else set()
    frac = options.mem_fraction
    latency_critical, min_stability = options.latency_critical, options.min_stability
    caps: dict[int, int] = {}  # capacity -> int(frac x capacity): one figure per GPU model
    reclaim_uuids = set(reclaim)  # (a set: dict keys test a tuple for overlap by scanning it)
    memos: dict[float, dict[int, int]] = {frac: caps}
    requires = options.requires if options.requires.any else None
    kept_off: list[str] = []  # blocks the model version's requirements refuse, and why
    gpus = snapshot.gpu_by_uuid
    for b in blocks:
        if requires is not None and (off := requires.block_refusal(b, snapshot)) is not None:
            kept_off.append(f"block {b.id}: {off}")
            continue
        score = stability.get(b.id, 1.0) if stability else 1.0
        if latency_critical and score < min_stability:
            unstable.append(b.id)
            continue
        if engines and b.node_id in engines:
            # an engine that takes a fixed share of each GPU (vLLM) leaves the plan that much
            frac = mem_fraction_of(snapshot, b.node_id, options.mem_fraction)
            caps = memos.setdefault(frac, {})
        else:
            frac, caps = options.mem_fraction, memos[options.mem_fraction]
        # usable bytes per GPU, as plan.usable_bytes counts them (used = total - free)
        totals, frees, uuids = b.mem_total_bytes, b.mem_free_bytes, b.gpu_uuids
        if reclaim_uuids and not reclaim_uuids.isdisjoint(uuids):
            room = [_cap(caps, t, frac) - max(0, t - f - reclaim.get(u, 0))
                    for u, t, f in zip(uuids, totals, frees, strict=True)]
        elif totals.count(totals[0]) == len(totals):
            base = _cap(caps, totals[0], frac) - totals[0]
            room = [base + f for f in frees]
        else:
            room = [_cap(caps, t, frac) - t + f for t, f in zip(totals, frees, strict=True)]
        has_preferred = b.id in preferred_blocks
        if has_preferred:
            order = sorted(range(b.size), key=lambda i: (-room[i], uuids[i] not in preferred, i))
            ordered, sorted_room = [uuids[i] for i in order], [room[i] for i in order]
        elif room.count(room[0]) == len(room):
            ordered, sorted_room = list(uuids), room  # already in order
        else:
            order = sorted(range(b.size), key=room.__getitem__, reverse=True)  # stable: ties by index
            ordered, sorted_room = [uuids[i] for i in order], [room[i] for i in order]
        # the block's shape: blocks with equal shapes are interchangeable for planning (rooms
        # are sorted, most first, so the last is the least)
        least = sorted_room[-1]
        shape = (b.gpu_model, len(uuids), b.link_kind, round(b.tp_link_bytes_per_s / 1e9),
                 _bucket((least if least > 0 else 0) // _GIB),
                 min(gpus[u].compute_share for u in uuids))  # a GPU other deployments time-slice is slower
        r = _BlockRoom(b, ordered, sorted_room, score, shape)
        sort_keys.append(((-score, not has_preferred, -sum(sorted_room), b.id), r))
    sort_keys.sort(key=_first)
    if unstable:
        reasons.append(
            f"{len(unstable)} block(s) left out as unstable (stability < {options.min_stability}): "
            f"{', '.join(sorted(unstable)[:5])}; to use them, lower min_stability or mark the deployment "
            "not latency-critical"
        )
    return [r for _, r in sort_keys], kept_off


# --- 2. units ----------------------------------------------------------------------------------
class _UnitBook:
    """The units found so far, by type (each type's units on disjoint GPUs, at most as many as a
    gear may hold), and why plans were left out (a node's engine cannot run them, a block the
    requirements refuse) -> how many."""

    def __init__(self, engines: Mapping[str, EngineCaps], options: PlannerOptions, rooms: Sequence[_BlockRoom],
                 excluded_units: dict[str, int]) -> None:
        self.engines = engines
        self.max_units = options.max_plans_per_gear
        self.types: dict[tuple[object, ...], _UnitType] = {}
        self.excluded_units = excluded_units
        self._used_in_type: dict[tuple[object, ...], set[str]] = {}
        self._block_node = {r.block.id: r.block.node_id for r in rooms}

    def add(self, unit: _Unit, label: str, check: bool = True) -> None:
        """Record `unit` under its type - unless a node's engine cannot run it, the type is full,
        or (`check`) it shares a GPU with a unit of its type already there."""
        engines = self.engines
        if engines:
            nodes = sorted({self._block_node[b] for b in unit.blocks if b in self._block_node})
            why = engine_refusals(unit.plan, nodes, engines)
            if why:
                key = f"{label}: {why[0]}"
                self.excluded_units[key] = self.excluded_units.get(key, 0) + 1
                return
        types = self.types
        t = types.get(unit.type_key)
        if t is None:
            t = types[unit.type_key] = _UnitType(unit.type_key, label, len(types))
        if len(t.units) >= self.max_units:
            return  # no gear uses more instances of one type than that
        if not check:
            t.units.append(unit)
            return
        used = self._used_in_type.setdefault(unit.type_key, set())
        if used.isdisjoint(unit.uuids):
            t.units.append(unit)
            used.update(unit.uuids)


def _add_kept(book: _UnitBook, model: ModelSpec, keep: Sequence[Plan], rooms: Sequence[_BlockRoom]) -> None:
    """The plans running now, as they are (a unit type each; first, so that among equals a gear
    keeps what runs rather than re-planning it)."""
    if not keep:
        return
    in_rooms = {u for r in rooms for u in r.uuids}
    stability_of = {r.block.id: r.stability for r in rooms}
    block_node_of = {u: r.block.id for r in rooms for u in r.uuids}  # GPU -> its block
    for plan in dict.fromkeys(keep):
        if plan.model != model.name or not in_rooms.issuperset(plan.gpu_uuids):
            continue  # it lost GPUs (or runs on ones planning may not use): nothing to keep
        kept_blocks = tuple(sorted({block_node_of[u] for u in plan.gpu_uuids}))
        book.add(_Unit(("keep", plan.plan_id), plan.gpu_uuids, kept_blocks,
                       min(stability_of.get(b, 1.0) for b in kept_blocks), "keep", _const(plan)),
                 f"kept {plan.shape()}")


def _add_tp_units(book: _UnitBook, model: ModelSpec, snapshot: Snapshot, workload: Workload,
                  rooms: Sequence[_BlockRoom], valid_tps: Sequence[int], min_kv: int) -> None:
    """Single-block TP units: for each block and TP size, as many disjoint groups as hold the
    weights plus the minimum KV reserve (groups of one block, and blocks, are disjoint by
    construction). Written out for speed: a few hundred groups a decision."""
    types, engines, excluded_units, max_units = book.types, book.engines, book.excluded_units, book.max_units
    layers = model.num_layers
    cap1 = _kv_cap_tokens(model, workload, 1)
    # KV beyond what the running-sequence cap can fill changes no estimate: units that reserve
    # at least that much share a type (each still reserves its own amount)
    useful = MAX_RUNNING_SEQS * (workload.prompt_tokens_mean + workload.output_tokens_mean / 2)
    terms = {tp: _stage_terms(model, 0, layers, tp) for tp in valid_tps}
    floors = {tp: terms[tp][0] + -(-(min_kv * terms[tp][1]) // terms[tp][2]) for tp in valid_tps}
    curved = bool(snapshot.collectives)
    for r in rooms:
        size = len(r.uuids)
        block = r.block
        block_ids = (block.id,)
        # with measured collective curves, blocks of one shape on different nodes may differ (each
        # node's all-reduce is its own curve): their units are types of their own
        key_head = ("tp", block.gpu_model, block.link_kind, r.shape[3]) + ((block.node_id,) if curved else ())
        engine = engines.get(block.node_id) if engines else None
        for tp in valid_tps:
            if tp > size:
                break
            if engine is not None and (not engine.allows_tp(tp) or "colocated" not in engine.modes):
                why = engine_refusals(_colocated(model, tuple(r.uuids[:tp]), 1), (block.node_id,), engines)
                if why:
                    excluded_units[f"TP{tp} on {block.node_id}: {why[0]}"] = 1
                continue
            weights, kv_per_token, shards = terms[tp]
            floor_bytes = floors[tp]
            for g in range(size // tp):
                group_room = r.room[(g + 1) * tp - 1]  # rooms are sorted, most first
                if group_room < floor_bytes:
                    break  # later groups of this block have less room
                most = (group_room - weights) * shards // kv_per_token
                if most > cap1:
                    most = cap1
                # max(_bucket(most), min(min_kv, most)), written out (a few hundred groups a decision)
                if most < 16:
                    kv = most if most > 0 else 0
                else:
                    step = 1 << (most.bit_length() - 3)
                    kv = (most // step) * step
                if kv < min_kv and kv < most:
                    kv = min_kv if min_kv < most else most
                key = (*key_head, tp, kv if kv < useful else "ample")
                t = types.get(key)
                if t is None:
                    t = types[key] = _UnitType(key, f"TP{tp} on {block.gpu_model}", len(types))
                elif len(t.units) >= max_units:
                    continue  # no gear uses more instances of one type than that
                group = tuple(r.uuids[g * tp:(g + 1) * tp])
                t.units.append(_Unit(key, group, block_ids, r.stability, "tp", partial(_colocated, model, group, kv)))


# --- 3. unit types' estimates and the mixed fill -----------------------------------------------
class _TypeEstimates:
    """Each unit type estimated once, as a single plan (its profile, steady state, capacity and
    SLO rate), however often the unit book grows."""

    def __init__(self, model: ModelSpec, snapshot: Snapshot, workload: Workload, slo: Slo | None,
                 eff: Efficiency, rooms: Sequence[_BlockRoom]) -> None:
        self.model, self.snapshot, self.workload, self.slo, self.eff = model, snapshot, workload, slo, eff
        self.block_by_id = {r.block.id: r.block for r in rooms}
        self.estimated: dict[tuple[object, ...], _UnitType] = {}

    def live(self, types: Mapping[tuple[object, ...], _UnitType]) -> list[_UnitType]:
        """Estimate the types not estimated yet; the types with capacity, their sizing rates set."""
        snapshot, model, eff = self.snapshot, self.model, self.eff
        for key, t in types.items():
            if key in self.estimated:
                continue
            first = t.units[0]
            if first.kind == "tp":
                block = self.block_by_id[first.blocks[0]]
                tp = len(first.uuids)
                curve = snapshot.allreduce_curve(block.node_id, tp) if tp > 1 and snapshot.collectives else None
                t.profile = PlanProfile.single_block(first.plan, model, snapshot.spec(block.gpu_model),
                                                     block.tp_link_bytes_per_s, eff, curve)
            else:
                t.profile = PlanProfile.build(first.plan, model, snapshot, eff)
            t.state = steady_state(t.profile, self.workload, self.slo)
            t.capacity_rps = max(0.0, t.state.capacity_rps)
            t.slo_rps = _slo_rate(t.state) if self.slo is not None else None
            self.estimated[key] = t
        live_types = [t for t in types.values() if t.capacity_rps]
        _serve_rate(live_types)
        return live_types


def _fill(types: Mapping[tuple[object, ...], _UnitType], live: Sequence[_UnitType], target_rps: float,
          max_plans: int) -> tuple[list[_Unit], float]:
    """Greedy mixed fill: the most capacity per GPU first, disjoint GPUs, until the target."""
    # Units in order of (capacity per GPU, stability, type, index): a unit's capacity per
    # GPU is its type's, so each type's units are sorted on their own and the types merged
    # lazily - the fill stops after a handful.
    def ranked(order: int, t: _UnitType) -> list[tuple[tuple[float, float, int, int], _Unit]]:
        per_gpu = -t.serve_rps / t.units[0].gpus
        return sorted(((per_gpu, -u.stability, order, i), u) for i, u in enumerate(t.units))

    pool = heapq.merge(*(ranked(order, t) for order, t in enumerate(live)), key=_first_of_pair)
    taken: set[str] = set()
    chosen: list[_Unit] = []
    cap = 0.0
    for _, u in pool:
        if len(chosen) >= max_plans or cap >= target_rps:
            break
        if taken.isdisjoint(u.uuids):
            chosen.append(u)
            taken.update(u.uuids)
            cap += _capacity(types, u)
    return chosen, cap


# --- 4. gears ----------------------------------------------------------------------------------
class _Draft:
    """A gear before it is built: what ranks it and what builds it."""

    __slots__ = ("rank", "units", "weights", "estimate", "kind", "stability", "capacity_rps")

    def __init__(self, rank: tuple[object, ...], units: tuple[_Unit, ...], weights: tuple[float, ...],
                 estimate: Estimate, kind: str, stability: float, capacity_rps: float) -> None:
        self.rank = rank  # best first: goodput, fewer GPUs, stability, GPUs (deterministic)
        self.units = units
        self.weights = weights
        self.estimate = estimate
        self.kind = kind
        self.stability = stability
        self.capacity_rps = capacity_rps  # the units' capacities summed


def _rank(d: _Draft) -> tuple[object, ...]:
    return d.rank


def _drafts(types: Mapping[tuple[object, ...], _UnitType], live: Sequence[_UnitType], mixed: Sequence[_Unit],
            workload: Workload, slo: Slo | None, options: PlannerOptions, target_rps: float) -> list[_Draft]:
    """The gears, estimated as drafts (units + weights): replicas of each unit type until the
    target, the single unit where it carries the load alone, and the mixed fill; each set of
    units once."""
    estimator = _GearEstimator(workload, slo)
    drafts: dict[tuple[object, ...], _Draft] = {}

    def consider(units: Sequence[_Unit], kind: str) -> None:
        if not units:
            return
        dedupe = tuple(u.uuids for u in units) + tuple(u.type_key for u in units)
        if dedupe in drafts:
            return
        caps = [_capacity(types, u) for u in units]
        weights = _weights(caps)
        est = estimator.gear_estimate([types[u.type_key] for u in units], weights)
        stability = min(u.stability for u in units)
        rank = (-round(est.goodput_tokens_s, 6), est.gpus, -stability, tuple(u.uuids for u in units))
        drafts[dedupe] = _Draft(rank, tuple(units), weights, est, kind, stability, sum(caps))

    for t in sorted(live, key=lambda t: t.order):
        chosen: list[_Unit] = []
        cap = 0.0
        for u in t.units[: options.max_plans_per_gear]:
            chosen.append(u)
            cap += _capacity(types, u)
            if cap >= target_rps:
                break
        consider(chosen, f"replicas of {t.label}")
        if len(chosen) > 1 and _capacity(types, chosen[0]) >= workload.rate_rps:
            consider(chosen[:1], f"one {t.label}")  # fewer GPUs that still carry the load
    consider(mixed, "mixed")
    return list(drafts.values())


def _candidate(d: _Draft, types: Mapping[tuple[object, ...], _UnitType], model: ModelSpec,
               workload: Workload) -> Candidate:
    """The Candidate of a draft: its Gear (and Plans) built now, with the profiles already made."""
    notes: list[str] = []
    if d.capacity_rps < workload.rate_rps:
        notes.append(f"capacity {d.capacity_rps:.2f} rps is below the offered {workload.rate_rps:.2f} rps")
    blocks_used = tuple(sorted({b for u in d.units for b in u.blocks}))
    profiles: dict[Plan, PlanProfile] = {}
    for u in d.units:
        prof = types[u.type_key].profile
        if prof is not None:
            profiles[u.plan] = prof  # units of one type share the physics of its profile
    gear = Gear(model.name, tuple(u.plan for u in d.units), d.weights)
    return make_frozen(Candidate, {"gear": gear, "estimate": d.estimate, "kind": d.kind, "blocks": blocks_used,
                                   "stability": d.stability, "notes": tuple(notes), "profiles": profiles})


def _left_out(excluded: Mapping[str, int]) -> tuple[str, ...]:
    """'P:TP2 L40S / D:TP4 A100-80G: node b1 (vllm) cannot run disaggregated plans (x3)', sorted."""
    return tuple(f"left out {k}" + (f" (x{n})" if n > 1 else "") for k, n in sorted(excluded.items()))


def clear_caches() -> None:
    """Forget the planner's memos and the cost model's (a benchmark's cold run starts here)."""
    _kv_cap_tokens.cache_clear()
    _stage_terms.cache_clear()
    _SLO_RATES.clear()
    _clear_cost_model_caches()
