"""Candidate gears for one deployment on one snapshot, each with its estimates.

Filter -> build -> score, pruned so that the work grows with the number of atomic blocks
(in fact with the number of distinct block *shapes*), not with the number of GPUs:

1. Filter blocks: usable memory per GPU (92% rule - or less on a node whose engine takes a
   fixed share, capabilities.py - others' use, what this deployment would give back), and -
   for latency-critical deployments - stability (blocks that keep shrinking are left out,
   seed 000 section 4.1). Plans a node's engine cannot run (its modes, TP sizes, PP, mixed TP,
   spanning nodes) are never built; `Candidates.excluded` says which were left out and why.
2. Units (single plans): TP groups only inside one block, sized from the memory floor up
   (the minimum TP is the smallest that holds weights plus the minimum KV reserve); a block
   hosts as many disjoint groups as fit. PP chains of whole groups across blocks whose
   links pass `min_pp_link_gbps`; prefill/decode splits across two blocks whose link passes
   `min_kv_link_gbps`. Blocks of the same shape are interchangeable, so each unit *type* is
   estimated once.
3. Gears: for each unit type, as many replicas on distinct blocks as the load needs
   (`headroom` x offered rate), plus one mixed gear that fills the load greedily with the
   most efficient units of any type - several plans side by side on different blocks.
   Routing weights follow capacity.
4. Score: goodput (output tokens/s within the SLO), then fewer GPUs, then stability.

No fit -> `Candidates.infeasible` says why and what to relax.
"""

from __future__ import annotations

import heapq
import math
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache, partial
from typing import Literal

from scheduler._lazy import check_plain_dataclass, make_frozen
from scheduler.capabilities import engine_refusals, mem_fraction_of
from scheduler.costmodel import (
    DEFAULT_EFFICIENCY,
    MAX_RUNNING_SEQS,
    Efficiency,
    Estimate,
    PlanProfile,
    Slo,
    SteadyState,
    Workload,
    combine_estimates,
    steady_state,
)
from scheduler.costmodel import clear_caches as _clear_cost_model_caches
from scheduler.modelspec import ModelSpec
from scheduler.plan import MEM_FRACTION, Gear, Plan, Stage
from scheduler.requirements import NONE as NO_REQUIREMENTS
from scheduler.requirements import Requirements
from scheduler.topology import (
    DEFAULT_POLICY,
    GBPS_TO_BYTES_PER_S,
    AtomicBlock,
    BlockPolicy,
    Snapshot,
    partition,
)

UnitKind = Literal["tp", "pp", "pd", "keep"]
MAX_CHAINS_PER_LENGTH = 8  # PP chains built per pipeline length (keeps the work O(blocks))


@dataclass(frozen=True)
class PlannerOptions:
    """Knobs of the enumeration; defaults suit a mixed cluster."""

    max_pp: int = 4  # longest pipeline across blocks
    min_pp_link_gbps: float = 100.0  # PP hand-off only over node links at least this fast
    min_kv_link_gbps: float = 100.0  # prefill/decode split only over links at least this fast
    allow_pp: bool = True  # consider pipelines across blocks
    allow_disaggregated: bool = True  # consider prefill/decode splits
    max_plans_per_gear: int = 16  # most plans side by side in one gear
    max_candidates: int = 12  # candidates returned (best first)
    headroom: float = 1.25  # a gear aims at capacity >= offered rate x headroom
    min_kv_tokens: int | None = None  # KV each pipeline must reserve at least; None: from the workload
    latency_critical: bool = False  # keep off blocks whose stability is below min_stability
    min_stability: float = 0.5  # see latency_critical
    mem_fraction: float = MEM_FRACTION  # invariant 4
    requires: Requirements = NO_REQUIREMENTS  # the registry version's min GPU memory and engine (requirements.py)


DEFAULT_OPTIONS = PlannerOptions()


@dataclass(frozen=True)
class Candidate:
    """One candidate gear with its estimates."""

    gear: Gear  # the plans and routing weights
    estimate: Estimate  # the gear under the workload
    kind: str  # how it was built: "replicas of <unit>", "mixed"
    blocks: tuple[str, ...]  # atomic blocks it uses
    stability: float  # the least stable of those blocks, 0..1
    notes: tuple[str, ...] = ()  # e.g. "capacity below the offered load"
    profiles: Mapping[Plan, PlanProfile] = field(default_factory=dict, compare=False, repr=False)  # already built

    def to_dict(self) -> dict[str, object]:
        return {
            "gear_id": self.gear.gear_id,
            "shape": self.gear.shape(),
            "gear": self.gear.to_dict(),
            "estimate": self.estimate.to_dict(),
            "kind": self.kind,
            "blocks": list(self.blocks),
            "stability": self.stability,
            "notes": list(self.notes),
        }


check_plain_dataclass(Candidate, field_names=("gear", "estimate", "kind", "blocks", "stability", "notes", "profiles"))


@dataclass(frozen=True)
class Candidates:
    """The planner's answer: feasible gears (best first) and, if none or none enough, why."""

    feasible: tuple[Candidate, ...]  # best first
    infeasible: tuple[str, ...]  # reasons, each saying what to relax
    blocks_considered: int  # blocks after filtering
    block_shapes: int  # distinct block shapes (what the enumeration scales with)
    unit_types: int  # distinct unit plans estimated
    excluded: tuple[str, ...] = ()  # plans left out because a node's engine cannot run them, and why

    @property
    def ok(self) -> bool:
        return bool(self.feasible)

    def to_dict(self) -> dict[str, object]:
        return {
            "feasible": [c.to_dict() for c in self.feasible],
            "infeasible": list(self.infeasible),
            "blocks_considered": self.blocks_considered,
            "block_shapes": self.block_shapes,
            "unit_types": self.unit_types,
            "excluded": list(self.excluded),
        }


# --- internal building blocks ------------------------------------------------------------------
@dataclass
class _BlockRoom:
    """A block with its GPUs ordered by usable memory (most first)."""

    block: AtomicBlock
    uuids: list[str]  # most room first
    room: list[int]  # usable bytes, same order
    stability: float
    shape: tuple[object, ...]  # interchangeable blocks share it


class _Unit:
    """A plan on concrete GPUs, with the type key its estimate is cached under. The Plan
    object itself is built only if a gear uses the unit (most are never used)."""

    __slots__ = ("type_key", "uuids", "blocks", "stability", "kind", "gpus", "_factory", "_plan")

    def __init__(self, type_key: tuple[object, ...], uuids: tuple[str, ...], blocks: tuple[str, ...],
                 stability: float, kind: UnitKind, factory: Callable[[], Plan]) -> None:
        self.type_key = type_key
        self.uuids = uuids
        self.blocks = blocks
        self.stability = stability
        self.kind = kind
        self.gpus = len(uuids)
        self._factory = factory
        self._plan: Plan | None = None

    @property
    def plan(self) -> Plan:
        if self._plan is None:
            self._plan = self._factory()
        return self._plan


@dataclass
class _UnitType:
    key: tuple[object, ...]
    label: str
    order: int  # creation order: types are considered in it (deterministic)
    units: list[_Unit] = field(default_factory=list)  # disjoint instances, best first
    profile: PlanProfile | None = None
    state: SteadyState | None = None  # its steady state under the workload's shape
    capacity_rps: float | None = None  # as a single plan (None: not estimated yet)
    slo_rps: float | None = None  # the most it carries with both SLOs met (None: no SLO given)
    serve_rps: float = 0.0  # what sizing counts it for (`_serve_rate`)


def _min_kv_tokens(model: ModelSpec, workload: Workload, options: PlannerOptions) -> int:
    if options.min_kv_tokens is not None:
        return options.min_kv_tokens
    # one long request (P99 prompt + P99 output) must fit, and a handful of average ones
    long_one = workload.prompt_quantile(0.99) + workload.output_quantile(0.99)
    few = 4 * (workload.prompt_tokens_mean + workload.output_tokens_mean)
    return int(min(model.max_context_tokens, max(long_one, few, 256)))


@lru_cache(maxsize=256)
def _kv_cap_tokens(model: ModelSpec, workload: Workload, pp: int) -> int:
    """No point reserving more KV than the running-sequence cap can use."""
    per_seq = workload.prompt_quantile(0.9) + workload.output_quantile(0.9)
    return int(max(per_seq * MAX_RUNNING_SEQS * pp, model.max_context_tokens))


@lru_cache(maxsize=4096)
def _stage_terms(model: ModelSpec, start: int, end: int, tp: int) -> tuple[int, int, int]:
    """(weight bytes per GPU, KV bytes per token over all ranks, KV shards) of a stage."""
    weights = -(-model.stage_weight_bytes(start, end) // tp)
    return weights, (end - start) * model.kv_bytes_per_token_per_layer, model.kv_shards(tp)


def _stage_fits(model: ModelSpec, start: int, end: int, tp: int, room: int, kv_tokens: int) -> bool:
    """Same arithmetic as plan.stage_bytes_per_gpu, memoised per stage shape."""
    weights, kv_per_token, shards = _stage_terms(model, start, end, tp)
    return weights + -(-(kv_tokens * kv_per_token) // shards) <= room


def _best_kv(model: ModelSpec, stages: Sequence[tuple[int, int, int, int]], cap: int, floor: int = 0) -> int:
    """KV tokens every stage can reserve - stages are (start, end, tp, min room per GPU) -
    rounded down to a bucket so that nearly equal blocks share a plan shape."""
    best = cap
    for start, end, tp, room in stages:
        weights, kv_per_token, shards = _stage_terms(model, start, end, tp)
        best = min(best, max(0, room - weights) * shards // kv_per_token)
    return max(_bucket(best), min(floor, best))


def _split_layers(num_layers: int, weights: Sequence[float]) -> list[tuple[int, int]]:
    """Contiguous layer ranges proportional to `weights` (each at least one layer)."""
    total = sum(weights)
    bounds = [0]
    acc = 0.0
    for i, w in enumerate(weights[:-1]):
        acc += w
        cut = int(round(num_layers * acc / total))
        cut = max(bounds[-1] + 1, min(cut, num_layers - (len(weights) - 1 - i)))
        bounds.append(cut)
    bounds.append(num_layers)
    return [(bounds[i], bounds[i + 1]) for i in range(len(weights))]


def _bucket(value: int) -> int:
    """Round down to three significant binary digits (four steps per doubling), so that
    nearly equal blocks get equal plans and share one estimate."""
    if value < 16:
        return max(0, value)
    step = 1 << (value.bit_length() - 3)
    return (value // step) * step


def _cap(caps: dict[int, int], total: int, frac: float) -> int:
    """int(frac x total), memoised per capacity (every GPU of a model reports the same)."""
    hit = caps.get(total)
    if hit is None:
        hit = caps[total] = int(frac * total)
    return hit


def _first(pair: tuple[tuple[object, ...], _BlockRoom]) -> tuple[object, ...]:
    return pair[0]


def _first_of_pair(pair: tuple[tuple[float, float, int, int], _Unit]) -> tuple[float, float, int, int]:
    return pair[0]


_GIB = 2**30


# --- the planner -----------------------------------------------------------------------------------
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
    """Feasible candidate gears for `model` under `workload` on `snapshot` (module docstring).

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
    stability = stability or {}
    reclaim = reclaimable_bytes or {}
    preferred = set(prefer_gpus)
    reasons: list[str] = []
    min_kv = _min_kv_tokens(model, workload, options)
    valid_tps = model.valid_tps(max((b.size for b in blocks), default=1))

    # 1. filter and order blocks
    rooms: list[_BlockRoom] = []
    unstable: list[str] = []
    sort_keys: list[tuple[tuple[object, ...], _BlockRoom]] = []
    preferred_blocks = {b.id for b in blocks if not preferred.isdisjoint(b.gpu_uuids)} if preferred else set()
    frac = options.mem_fraction
    latency_critical, min_stability = options.latency_critical, options.min_stability
    caps: dict[int, int] = {}  # capacity -> int(frac x capacity): one figure per GPU model
    reclaim_uuids = set(reclaim)  # (a set: dict keys test a tuple for overlap by scanning it)
    # what the nodes' engines can run (capabilities.py; none reported: no restriction)
    engines = {n.id: n.engine for n in snapshot.nodes if n.engine is not None}
    excluded_units: dict[str, int] = {}  # why plans were left out -> how many
    memos: dict[float, dict[int, int]] = {frac: caps}
    requires = options.requires if options.requires.any else None
    kept_off: list[str] = []  # blocks the model version's requirements refuse, and why
    for b in blocks:
        if requires is not None and (off := requires.block_refusal(b, snapshot)) is not None:
            kept_off.append(f"block {b.id}: {off}")
            excluded_units[f"block {b.id}: {off}"] = 1
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
                 _bucket((least if least > 0 else 0) // _GIB))
        r = _BlockRoom(b, ordered, sorted_room, score, shape)
        sort_keys.append(((-score, not has_preferred, -sum(sorted_room), b.id), r))
    sort_keys.sort(key=_first)
    rooms = [r for _, r in sort_keys]
    if unstable:
        reasons.append(
            f"{len(unstable)} block(s) left out as unstable (stability < {options.min_stability}): "
            f"{', '.join(sorted(unstable)[:5])}; to use them, lower min_stability or mark the deployment "
            "not latency-critical"
        )
    if not rooms:
        return Candidates((), tuple(reasons + kept_off[:5] + [_no_gpus_reason(snapshot, excluded)]), 0, 0, 0,
                          _left_out(excluded_units))

    types: dict[tuple[object, ...], _UnitType] = {}
    used_in_type: dict[tuple[object, ...], set[str]] = {}
    block_node = {r.block.id: r.block.node_id for r in rooms}
    block_node_of = {u: r.block.id for r in rooms for u in r.uuids}  # GPU -> its block

    def add_unit(unit: _Unit, label: str, check: bool = True) -> None:
        if engines:
            nodes = sorted({block_node[b] for b in unit.blocks if b in block_node})
            why = engine_refusals(unit.plan, nodes, engines)
            if why:
                key = f"{label}: {why[0]}"
                excluded_units[key] = excluded_units.get(key, 0) + 1
                return
        t = types.get(unit.type_key)
        if t is None:
            t = types[unit.type_key] = _UnitType(unit.type_key, label, len(types))
        if len(t.units) >= options.max_plans_per_gear:
            return  # no gear uses more instances of one type than that
        if not check:
            t.units.append(unit)
            return
        used = used_in_type.setdefault(unit.type_key, set())
        if used.isdisjoint(unit.uuids):
            t.units.append(unit)
            used.update(unit.uuids)

    # 2a. the plans running now, as they are (a unit type each; first, so that among equals a
    # gear keeps what runs rather than re-planning it)
    in_rooms = {u for r in rooms for u in r.uuids}
    stability_of = {r.block.id: r.stability for r in rooms}
    for plan in dict.fromkeys(keep):
        if plan.model != model.name or not in_rooms.issuperset(plan.gpu_uuids):
            continue  # it lost GPUs (or runs on ones planning may not use): nothing to keep
        kept_blocks = tuple(sorted({block_node_of[u] for u in plan.gpu_uuids}))
        add_unit(_Unit(("keep", plan.plan_id), plan.gpu_uuids, kept_blocks,
                       min(stability_of.get(b, 1.0) for b in kept_blocks), "keep", _const(plan)),
                 f"kept {plan.shape()}")

    # 2b. single-block TP units (groups of one block, and blocks, are disjoint by construction)
    layers = model.num_layers
    cap1 = _kv_cap_tokens(model, workload, 1)
    # KV beyond what the running-sequence cap can fill changes no estimate: units that reserve
    # at least that much share a type (each still reserves its own amount)
    useful = MAX_RUNNING_SEQS * (workload.prompt_tokens_mean + workload.output_tokens_mean / 2)
    terms = {tp: _stage_terms(model, 0, layers, tp) for tp in valid_tps}
    max_units = options.max_plans_per_gear
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

    # 2c. prefill/decode splits across two blocks (bounded by the few best shapes)
    if options.allow_disaggregated and len(rooms) >= 2:
        for unit, label in _pd_units(model, snapshot, rooms, valid_tps, min_kv, workload, options):
            add_unit(unit, label)

    target_rps = workload.rate_rps * options.headroom
    estimated: dict[tuple[object, ...], _UnitType] = {}
    block_by_id = {r.block.id: r.block for r in rooms}

    def estimate_types() -> list[_UnitType]:
        """Estimate each new unit type once (its capacity as a single plan)."""
        for key, t in types.items():
            if key in estimated:
                continue
            first = t.units[0]
            if first.kind == "tp":
                block = block_by_id[first.blocks[0]]
                tp = len(first.uuids)
                curve = snapshot.allreduce_curve(block.node_id, tp) if tp > 1 and snapshot.collectives else None
                t.profile = PlanProfile.single_block(first.plan, model, snapshot.spec(block.gpu_model),
                                                     block.tp_link_bytes_per_s, eff, curve)
            else:
                t.profile = PlanProfile.build(first.plan, model, snapshot, eff)
            t.state = steady_state(t.profile, workload, slo)
            t.capacity_rps = max(0.0, t.state.capacity_rps)
            t.slo_rps = _slo_rate(t.state) if slo is not None else None
            estimated[key] = t
        live_types = [t for t in types.values() if t.capacity_rps]
        _serve_rate(live_types)
        return live_types

    def fill(live: Sequence[_UnitType]) -> tuple[list[_Unit], float]:
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
            if len(chosen) >= options.max_plans_per_gear or cap >= target_rps:
                break
            if taken.isdisjoint(u.uuids):
                chosen.append(u)
                taken.update(u.uuids)
                cap += _capacity(types, u)
        return chosen, cap

    live = estimate_types()
    mixed, mixed_cap = fill(live)
    # 2c. PP chains across blocks, only when single-block units cannot hold the model or
    # cannot reach the load (PP costs hand-offs and bubbles), and only where links allow
    if options.allow_pp and options.max_pp >= 2 and (not live or mixed_cap < target_rps):
        for unit, label in _pp_units(model, snapshot, rooms, valid_tps, min_kv, workload, options):
            add_unit(unit, label)
        live = estimate_types()
        mixed, mixed_cap = fill(live)

    if not types:
        reasons.extend(_no_fit_reasons(model, snapshot, rooms, min_kv, options))
        return Candidates((), tuple(reasons), len(rooms), len({r.shape for r in rooms}), 0,
                          _left_out(excluded_units))
    if not live:
        reasons.append("every plan that fits has zero capacity for this workload (KV reserve too small for one"
                       " request); to fix: free memory or lower the prompt/output lengths")
        return Candidates((), tuple(reasons), len(rooms), len({r.shape for r in rooms}), len(types),
                          _left_out(excluded_units))

    # 3. gears: replicas of each unit type, the single unit, and the mixed fill. Each gear is
    # estimated and ranked as a draft (units + weights); Gear and Plan objects are built only
    # for the candidates returned.
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

    def candidate(d: _Draft) -> Candidate:
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

    ranked = sorted(drafts.values(), key=_rank)
    feasible = tuple(candidate(d) for d in ranked[: options.max_candidates])
    if feasible and all(c.estimate.capacity_rps < workload.rate_rps for c in feasible):
        best = max(feasible, key=lambda c: c.estimate.capacity_rps)
        reasons.append(
            f"no gear reaches the offered {workload.rate_rps:.2f} rps (best: {best.estimate.capacity_rps:.2f} rps"
            f" on {best.estimate.gpus} GPUs); to fix: free more GPUs, raise max_plans_per_gear, or shed load"
        )
    return Candidates(feasible, tuple(reasons), len(rooms), len({r.shape for r in rooms}), len(types),
                      _left_out(excluded_units))


def _left_out(excluded: Mapping[str, int]) -> tuple[str, ...]:
    """'P:TP2 L40S / D:TP4 A100-80G: node b1 (vllm) cannot run disaggregated plans (x3)', sorted."""
    return tuple(f"left out {k}" + (f" (x{n})" if n > 1 else "") for k, n in sorted(excluded.items()))


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


def clear_caches() -> None:
    """Forget the planner's memos and the cost model's (a benchmark's cold run starts here)."""
    _kv_cap_tokens.cache_clear()
    _stage_terms.cache_clear()
    _SLO_RATES.clear()
    _clear_cost_model_caches()


def _capacity(types: Mapping[tuple[object, ...], _UnitType], unit: _Unit) -> float:
    """What a unit counts for when gears are sized and traffic split (`_serve_rate`)."""
    return types[unit.type_key].serve_rps


SLO_ATTAINMENT = 0.99  # goodput / throughput at which a plan counts as meeting its SLOs


# a plan state's SLO rate, for as long as the cost model keeps the state (it shares one state
# between plans of equal physics, and keeps it from tick to tick): found once, not per unit type
_SLO_RATES: weakref.WeakKeyDictionary[SteadyState, float] = weakref.WeakKeyDictionary()


def _slo_rate(state: SteadyState) -> float:
    """`_find_slo_rate`, once per state."""
    rate = _SLO_RATES.get(state)
    if rate is None:
        rate = _SLO_RATES[state] = _find_slo_rate(state)
    return rate


def _find_slo_rate(state: SteadyState, rel_tol: float = 2.5e-4) -> float:
    """The highest rate at which the plan meets both SLOs (attainment >= SLO_ATTAINMENT),
    to within `rel_tol` x capacity below it; 0 when it misses them even nearly idle.

    NOTE(root-finding): a bisection on the yes/no verdict needs 12 probes for this tolerance,
    and the planner asks it for every unit type - a third of a decision. The P99 margin
    (`SteadyState.slo_margin`) is continuous and increasing in the rate, so regula falsi with
    the Illinois fix finds its root in fewer probes. Every probe keeps the answer
    bracketed (a rate that meets, a rate that misses), and each one lands at least half a
    tolerance inside the bracket, so the loop ends with the bracket no wider than the tolerance,
    whatever the curve's shape; the answer is the bracket's lower end, a rate that meets."""
    cap = state.capacity_rps
    if cap <= 0:
        return 0.0
    if state.slo is None or state.running_cap < 1:
        return cap if state.meets_slo(cap * 0.999, SLO_ATTAINMENT) else 0.0

    # the margin times (1 - utilisation): the same sign, without the queueing wait's pole at
    # capacity (it grows like 1 / (1 - utilisation)), so the curve is nearly straight for the
    # secant (written out at each probe: a closure call per probe is measurable here)
    slo_margin = state.slo_margin
    hi = cap * 0.999
    f_hi = slo_margin(hi) * (1.0 - hi / cap)
    if f_hi <= 0:
        return cap
    lo = cap * 0.01
    f_lo = slo_margin(lo) * (1.0 - lo / cap)
    if f_lo > 0:
        return 0.0
    tol = rel_tol * cap
    side = 0  # which end the last probe moved: -1 the low one, +1 the high one
    while hi - lo > tol:
        if math.isfinite(f_hi) and f_hi > f_lo:
            mid = (lo * f_hi - hi * f_lo) / (f_hi - f_lo)
        else:
            mid = (lo + hi) / 2
        mid = min(max(mid, lo + tol / 2), hi - tol / 2)
        f_mid = slo_margin(mid) * (1.0 - mid / cap)
        if f_mid <= 0:
            lo, f_lo = mid, f_mid
            if side == -1:
                f_hi /= 2  # Illinois: the high end has not moved twice running, weigh it less
            side = -1
        else:
            hi, f_hi = mid, f_mid
            if side == 1:
                f_lo /= 2
            side = 1
    return lo


def _serve_rate(types: Sequence[_UnitType]) -> None:
    """Set each type's sizing rate. NOTE(sizing): a gear is sized to carry the offered rate
    x headroom, and throughput capacity alone overstates what a plan serves *within its SLOs*:
    under a tight TPOT a colocated plan misses it well before it saturates. So a unit counts
    for at most its SLO rate (then the units that carry rate x headroom together meet the
    SLOs with the headroom's margin, as the gearbox's `standing` asks). When no unit type meets
    the SLOs at any rate, sizing falls back to throughput capacity (serve what can be served)."""
    reachable = any(t.slo_rps for t in types)
    for t in types:
        cap = t.capacity_rps or 0.0
        if t.slo_rps is None or not reachable:
            t.serve_rps = cap
        else:
            t.serve_rps = min(cap, t.slo_rps)


class _GearEstimator:
    """Gear estimates from the unit types' steady states (memoised in the cost model), so
    replicas of one type cost one estimate per traffic share: the steady state depends on the
    workload's shape, not its rate, so a type's share is `state.estimate(rate x weight)`."""

    def __init__(self, workload: Workload, slo: Slo | None) -> None:
        self.workload, self.slo = workload, slo
        self._memo: dict[tuple[object, ...], Estimate] = {}

    def gear_estimate(self, types: Sequence[_UnitType], weights: Sequence[float]) -> Estimate:
        ests = []
        for t, w in zip(types, weights, strict=True):
            key = (t.key, w)
            est = self._memo.get(key)
            if est is None:
                if t.state is None:
                    assert t.profile is not None
                    t.state = steady_state(t.profile, self.workload, self.slo)
                est = self._memo[key] = t.state.estimate(self.workload.rate_rps * w)
            ests.append(est)
        return combine_estimates(ests, weights, self.workload)


def _weights(caps: Sequence[float]) -> tuple[float, ...]:
    total = sum(caps)
    if total <= 0:
        return tuple(round(1.0 / len(caps), 6) for _ in caps)
    raw = [round(c / total, 6) for c in caps]
    raw[-1] = round(1.0 - sum(raw[:-1]), 6)
    return tuple(raw)


def _node_bw(snapshot: Snapshot, a: AtomicBlock, b: AtomicBlock) -> float:
    """Bandwidth between two blocks (bytes/s): host link inside a node, node link across."""
    if a.node_id == b.node_id:
        return min(snapshot.spec(a.gpu_model).host_link_bytes_per_s, snapshot.spec(b.gpu_model).host_link_bytes_per_s)
    return snapshot.node_link_bytes_per_s(a.node_id, b.node_id)


def _pp_units(model: ModelSpec, snapshot: Snapshot, rooms: Sequence[_BlockRoom], valid_tps: Sequence[int],
              min_kv: int, workload: Workload, options: PlannerOptions) -> Iterable[tuple[_Unit, str]]:
    """Pipelines across blocks: greedy chains of the roomiest blocks whose links pass the bar.

    Each stage takes its block's largest valid TP group; layers split in proportion to the
    stage's memory (tp x room). Chains are built for each length 2..max_pp, each from blocks
    not used by earlier chains of that length, so the work is O(blocks x max_pp).
    """
    min_bw = options.min_pp_link_gbps * GBPS_TO_BYTES_PER_S
    order = sorted(rooms, key=lambda r: (-(len(r.uuids) * min(r.room)), r.block.id))
    for pp in range(2, options.max_pp + 1):
        free = list(order)
        chains = 0
        while len(free) >= pp and chains < MAX_CHAINS_PER_LENGTH:
            head = free[0]
            chain = [head]
            for r in free[1:]:
                if len(chain) == pp:
                    break
                if _node_bw(snapshot, chain[-1].block, r.block) >= min_bw:
                    chain.append(r)
            if len(chain) < pp:
                free.pop(0)
                continue
            stages_spec = []
            for r in chain:
                tp = max(t for t in valid_tps if t <= len(r.uuids))
                stages_spec.append((r, tp, min(r.room[:tp])))
            ranges = _split_layers(model.num_layers, [tp * room for _, tp, room in stages_spec])
            fits = all(
                _stage_fits(model, s, e, tp, room, min_kv)
                for (s, e), (_, tp, room) in zip(ranges, stages_spec, strict=True)
            )
            for r in chain:
                free.remove(r)
            if not fits:
                continue
            chains += 1
            kv = _best_kv(
                model,
                [(s, e, tp, room) for (s, e), (_, tp, room) in zip(ranges, stages_spec, strict=True)],
                _kv_cap_tokens(model, workload, pp),
                min_kv,
            )
            stages = tuple(
                Stage(s, e, tuple(r.uuids[:tp])) for (s, e), (r, tp, _) in zip(ranges, stages_spec, strict=True)
            )
            plan = Plan(model.name, "colocated", stages, kv_reserve_tokens=kv)
            uuids = tuple(u for st in stages for u in st.gpu_uuids)
            links = tuple(
                round(_node_bw(snapshot, a.block, b.block) / GBPS_TO_BYTES_PER_S) for a, b in zip(chain, chain[1:], strict=False)
            )
            key = ("pp", tuple((r.shape, tp) for r, tp, _ in stages_spec), tuple(ranges), links, kv)
            label = f"PP{pp} over " + "+".join(f"TP{tp} {r.block.gpu_model}" for r, tp, _ in stages_spec)
            yield (
                _Unit(key, uuids, tuple(r.block.id for r in chain), min(r.stability for r in chain), "pp",
                      _const(plan)),
                label,
            )


def _pd_units(model: ModelSpec, snapshot: Snapshot, rooms: Sequence[_BlockRoom], valid_tps: Sequence[int],
              min_kv: int, workload: Workload, options: PlannerOptions) -> Iterable[tuple[_Unit, str]]:
    """Prefill on the block shape with the most compute, decode on the one with the most
    memory bandwidth x room; one pair per pair of distinct shapes (bounded by shapes^2)."""
    min_bw = options.min_kv_link_gbps * GBPS_TO_BYTES_PER_S
    by_shape: dict[tuple[object, ...], list[_BlockRoom]] = {}
    for r in rooms:
        by_shape.setdefault(r.shape, []).append(r)

    def smallest_tp(r: _BlockRoom, kv: int) -> int | None:
        for tp in valid_tps:
            if tp <= len(r.uuids) and _stage_fits(model, 0, model.num_layers, tp, min(r.room[:tp]), kv):
                return tp
        return None

    specs = {sh: snapshot.spec(rs[0].block.gpu_model) for sh, rs in by_shape.items()}
    names = {sh: repr(sh) for sh in by_shape}  # the last tie-break, deterministic

    # the few shapes with the most compute (prefill) and the most bandwidth and room (decode)
    prefill_shapes = sorted(
        by_shape, key=lambda sh: (-specs[sh].bf16_flops, -len(by_shape[sh][0].uuids), names[sh]))[:2]
    decode_shapes = sorted(
        by_shape, key=lambda sh: (-specs[sh].hbm_bytes_per_s, -sum(by_shape[sh][0].room), names[sh]))[:2]
    for ps in prefill_shapes:
        for ds in decode_shapes:
            p0 = by_shape[ps][0]
            d0 = next((r for r in by_shape[ds] if r is not p0), None)
            if d0 is None:
                continue
            p_spec, d_spec = snapshot.spec(p0.block.gpu_model), snapshot.spec(d0.block.gpu_model)
            # across shapes: the prefill side brings the compute, the decode side the bandwidth
            if ps != ds and (p_spec.bf16_flops < d_spec.bf16_flops or d_spec.hbm_bytes_per_s < p_spec.hbm_bytes_per_s):
                continue
            ptp = smallest_tp(p0, min_kv)
            dtp = smallest_tp(d0, min_kv)
            if ptp is None or dtp is None:
                continue
            # kv_reserve_tokens holds for both pipelines (plan.py), so both sides bound it
            kv = _best_kv(model, [(0, model.num_layers, dtp, min(d0.room[:dtp])),
                                  (0, model.num_layers, ptp, min(p0.room[:ptp]))],
                          _kv_cap_tokens(model, workload, 1), min_kv)
            key = ("pd", ps, ptp, ds, dtp, kv)
            label = f"P:TP{ptp} {p0.block.gpu_model} / D:TP{dtp} {d0.block.gpu_model}"
            # pair blocks of the two shapes one to one (distinct blocks), while links allow
            d_pool = [r for r in by_shape[ds]]
            for p in by_shape[ps]:
                d = next((r for r in d_pool if r is not p and _node_bw(snapshot, p.block, r.block) >= min_bw), None)
                if d is None:
                    continue
                d_pool.remove(d)
                if ps == ds and p in d_pool:
                    d_pool.remove(p)
                if not (_stage_fits(model, 0, model.num_layers, ptp, min(p.room[:ptp]), kv)
                        and _stage_fits(model, 0, model.num_layers, dtp, min(d.room[:dtp]), kv)):
                    continue
                prefill, decode = tuple(p.uuids[:ptp]), tuple(d.uuids[:dtp])
                yield (
                    _Unit(key, prefill + decode, (p.block.id, d.block.id), min(p.stability, d.stability), "pd",
                          _disaggregated(model, prefill, decode, kv)),
                    label,
                )


def _colocated(model: ModelSpec, uuids: tuple[str, ...], kv: int) -> Plan:
    """A one-stage colocated plan on `uuids` (a unit's plan, built when a gear uses it)."""
    return _plan(model, "colocated", (_stage(0, model.num_layers, uuids),), (), kv)


def _disaggregated(model: ModelSpec, prefill: tuple[str, ...], decode: tuple[str, ...], kv: int) -> Callable[[], Plan]:
    return lambda: _plan(model, "disaggregated", (_stage(0, model.num_layers, prefill),),
                         (_stage(0, model.num_layers, decode),), kv)


def _stage(start: int, end: int, uuids: tuple[str, ...]) -> Stage:
    """Stage(start, end, uuids), built the fast way (units build many)."""
    return make_frozen(Stage, {"layer_start": start, "layer_end": end, "gpu_uuids": uuids})


def _plan(model: ModelSpec, mode: Literal["colocated", "disaggregated"], stages: tuple[Stage, ...],
          decode_stages: tuple[Stage, ...], kv: int) -> Plan:
    """Plan(...) with the default KV partitioning, built the fast way."""
    return make_frozen(Plan, {"model": model.name, "mode": mode, "stages": stages, "decode_stages": decode_stages,
                              "kv_reserve_tokens": kv, "kv_partition": "layer_head"})


check_plain_dataclass(Stage, field_names=("layer_start", "layer_end", "gpu_uuids"))
check_plain_dataclass(Plan, field_names=("model", "mode", "stages", "decode_stages", "kv_reserve_tokens",
                                         "kv_partition"))


def _const(plan: Plan) -> Callable[[], Plan]:
    return lambda: plan


def _no_gpus_reason(snapshot: Snapshot, excluded: Mapping[str, str]) -> str:
    if not snapshot.gpus:
        return "the snapshot has no GPUs; to fix: wait for agents to report"
    counts: dict[str, int] = {}
    for why in excluded.values():
        kind = why.split(" ")[0] if not why.startswith("node") else "node " + why.split(" ")[-1]
        counts[kind] = counts.get(kind, 0) + 1
    summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    return (f"no usable GPU: all {len(snapshot.gpus)} are left out ({summary}); to fix: restore or uncordon"
            " GPUs, or raise the heartbeat timeout")


def _no_fit_reasons(model: ModelSpec, snapshot: Snapshot, rooms: Sequence[_BlockRoom], min_kv: int,
                    options: PlannerOptions) -> list[str]:
    gib = 2**30
    need_w = model.weight_bytes
    need_kv = min_kv * model.kv_bytes_per_token
    best = max(rooms, key=lambda r: sum(max(0, x) for x in r.room))
    have = sum(max(0, x) for x in best.room)
    out = [
        f"{model.name} needs {need_w / gib:.1f} GiB of weights plus {need_kv / gib:.1f} GiB of KV reserve"
        f" ({min_kv} tokens); the roomiest block ({best.block.id}: {best.block.size}x {best.block.gpu_model})"
        f" has {have / gib:.1f} GiB usable under {options.mem_fraction:.0%} after others' use"
    ]
    fixes = ["free memory on the GPUs of one block"]
    if not options.allow_pp:
        fixes.append("allow PP across blocks")
    elif len(rooms) >= 2:
        links = [
            _node_bw(snapshot, a.block, b.block) / GBPS_TO_BYTES_PER_S
            for i, a in enumerate(rooms[:16]) for b in rooms[i + 1:16]
        ]
        best_link = max(links, default=0.0)
        total = sum(max(0, x) for r in rooms for x in r.room)
        if best_link < options.min_pp_link_gbps:
            fixes.append(
                f"lower min_pp_link_gbps (best link between usable blocks is {best_link:.0f} Gb/s,"
                f" PP needs {options.min_pp_link_gbps:.0f})"
            )
        elif total < need_w + need_kv:
            fixes.append(f"add GPUs: all usable blocks together hold {total / gib:.1f} GiB")
        else:
            fixes.append(f"raise max_pp above {options.max_pp}")
    fixes.append(f"lower the KV reserve (min_kv_tokens, now {min_kv})")
    fixes.append("use a smaller model or a lower-precision checkpoint")
    out.append("to fix: " + "; or ".join(fixes))
    return out


__all__ = ["Candidate", "Candidates", "DEFAULT_OPTIONS", "PlannerOptions", "clear_caches", "plan_candidates"]
