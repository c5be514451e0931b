"""The planner's building blocks: blocks with their GPUs ordered by usable memory (`_BlockRoom`),
units - single plans on concrete GPUs, built lazily - and their types, the KV and stage arithmetic,
the PP chains and prefill/decode splits across blocks, and the reasons when nothing fits."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal

from scheduler._lazy import check_plain_dataclass, make_frozen
from scheduler.costmodel import (
    MAX_RUNNING_SEQS,
    PlanProfile,
    SteadyState,
    Workload,
)
from scheduler.modelspec import ModelSpec
from scheduler.plan import Plan, Stage
from scheduler.planner.options import PlannerOptions
from scheduler.topology import (
    GBPS_TO_BYTES_PER_S,
    AtomicBlock,
    Snapshot,
)

UnitKind = Literal["tp", "pp", "pd", "keep"]
MAX_CHAINS_PER_LENGTH = 8  # PP chains built per pipeline length (keeps the work O(blocks))

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


