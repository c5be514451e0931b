"""Execution plans and gears as values, their JSON, content-derived ids, and validation.

A `Stage` is a contiguous layer range on one TP group; a `Plan` is one or two pipelines of
stages (`colocated`: one pipeline does prefill and decode; `disaggregated`: `stages` do the
prefill and hand the KV cache to `decode_stages`); a `Gear` is the set of plans serving one
model, with routing weights. Plans name GPUs by uuid.

KV partitioning (`kv_partition`): the only scheme so far is "layer_head" - each stage holds
the KV of its own layers, split over its TP ranks by KV head (replicated when tp exceeds the
number of KV heads). `kv_reserve_tokens` is how many tokens of KV each pipeline reserves; it
is what the memory check counts and what `costmodel.kv_capacity_tokens` reports.

`validate_plan` / `validate_gear` check DESIGN.md invariant 4 and return reasons (empty list
= valid); they never raise for a bad plan.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from scheduler._lazy import lazy
from scheduler.modelspec import ModelSpec
from scheduler.topology import DEFAULT_POLICY, AtomicBlock, BlockPolicy, Snapshot, partition

PlanMode = Literal["colocated", "disaggregated"]
KvPartition = Literal["layer_head"]
MEM_FRACTION = 0.92  # weights + KV reserve may use at most this share of a GPU (invariant 4)


@dataclass(frozen=True)
class Stage:
    """A contiguous layer range of the model on one TP group."""

    layer_start: int  # first layer, inclusive
    layer_end: int  # last layer, exclusive
    gpu_uuids: tuple[str, ...]  # the TP group, rank order; tp == len(gpu_uuids)

    @property
    def tp(self) -> int:
        return len(self.gpu_uuids)

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    def to_dict(self) -> dict[str, object]:
        return {"layers": [self.layer_start, self.layer_end], "tp": self.tp, "gpus": list(self.gpu_uuids)}

    @classmethod
    def from_dict(cls, d: object, path: str = "stage") -> Stage:
        m = _mapping(d, path, ("layers", "gpus"), ("tp",))
        layers = m["layers"]
        if (
            not isinstance(layers, list)
            or len(layers) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in layers)
        ):
            raise ValueError(f"{path}.layers: must be [start, end) integers, got {layers!r}")
        gpus = m["gpus"]
        if not isinstance(gpus, list) or not gpus or not all(isinstance(u, str) and u for u in gpus):
            raise ValueError(f"{path}.gpus: must be a non-empty list of GPU uuids")
        if "tp" in m and m["tp"] != len(gpus):
            raise ValueError(f"{path}.tp: {m['tp']!r} does not match {len(gpus)} GPUs")
        return cls(layer_start=layers[0], layer_end=layers[1], gpu_uuids=tuple(gpus))


@dataclass(frozen=True)
class Plan:
    """How one model runs on a set of GPUs."""

    model: str  # model name (modelspec catalog or registry)
    mode: PlanMode  # colocated | disaggregated
    stages: tuple[Stage, ...]  # colocated: the pipeline; disaggregated: the prefill pipeline
    decode_stages: tuple[Stage, ...] = ()  # disaggregated: the decode pipeline; else empty
    kv_reserve_tokens: int = 0  # KV tokens each pipeline reserves memory for
    kv_partition: KvPartition = "layer_head"  # how the KV cache is split (module docstring)

    def __hash__(self) -> int:
        # Plans are set members and dict keys all through a decision (old vs new plans,
        # profiles by plan): hash the fields once. The cached value never leaves the process
        # (`__getstate__`), since str hashes differ between processes.
        cached: int | None = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.model, self.mode, self.stages, self.decode_stages, self.kv_reserve_tokens,
                           self.kv_partition))
            self.__dict__["_hash"] = cached
        return cached

    def __getstate__(self) -> dict[str, object]:
        state = dict(self.__dict__)
        state.pop("_hash", None)
        return state

    @property
    def pipelines(self) -> tuple[tuple[Stage, ...], ...]:
        return (self.stages, self.decode_stages) if self.mode == "disaggregated" else (self.stages,)

    @lazy
    def all_stages(self) -> tuple[Stage, ...]:
        return self.stages + self.decode_stages

    @lazy
    def gpu_uuids(self) -> tuple[str, ...]:
        return tuple(u for s in self.all_stages for u in s.gpu_uuids)

    @property
    def pp(self) -> int:
        return len(self.stages)

    @lazy
    def plan_id(self) -> str:
        """Stable id from the content: equal plans have equal ids, in any process."""
        return "p-" + _digest(self.to_dict())

    def shape(self) -> str:
        """Short human label: 'TP4', 'PP2xTP4', 'P:TP2 / D:TP4'."""

        def label(stages: Sequence[Stage]) -> str:
            tps = {s.tp for s in stages}
            tp = f"TP{stages[0].tp}" if len(tps) == 1 else "TP" + "+".join(str(s.tp) for s in stages)
            return tp if len(stages) == 1 else f"PP{len(stages)}x{tp}"

        if self.mode == "disaggregated":
            return f"P:{label(self.stages)} / D:{label(self.decode_stages)}"
        return label(self.stages)

    def to_dict(self) -> dict[str, object]:
        return {
            "model": self.model,
            "mode": self.mode,
            "stages": [s.to_dict() for s in self.stages],
            "decode_stages": [s.to_dict() for s in self.decode_stages],
            "kv_reserve_tokens": self.kv_reserve_tokens,
            "kv_partition": self.kv_partition,
        }

    @classmethod
    def from_dict(cls, d: object, path: str = "plan") -> Plan:
        m = _mapping(d, path, ("model", "mode", "stages"), ("decode_stages", "kv_reserve_tokens", "kv_partition", "plan_id"))
        model = m["model"]
        if not isinstance(model, str) or not model:
            raise ValueError(f"{path}.model: must be a non-empty string")
        mode = m["mode"]
        if mode not in ("colocated", "disaggregated"):
            raise ValueError(f"{path}.mode: must be 'colocated' or 'disaggregated', got {mode!r}")
        kv_partition = m.get("kv_partition", "layer_head")
        if kv_partition != "layer_head":
            raise ValueError(f"{path}.kv_partition: must be 'layer_head', got {kv_partition!r}")
        reserve = m.get("kv_reserve_tokens", 0)
        if isinstance(reserve, bool) or not isinstance(reserve, int) or reserve < 0:
            raise ValueError(f"{path}.kv_reserve_tokens: must be an integer >= 0, got {reserve!r}")
        plan = cls(
            model=model,
            mode=mode,
            stages=_stages(m["stages"], f"{path}.stages"),
            decode_stages=_stages(m.get("decode_stages", []), f"{path}.decode_stages"),
            kv_reserve_tokens=reserve,
        )
        if "plan_id" in m and m["plan_id"] != plan.plan_id:
            raise ValueError(f"{path}.plan_id: {m['plan_id']!r} does not match the content ({plan.plan_id})")
        return plan


@dataclass(frozen=True)
class Gear:
    """The plans serving one model at a moment, and how requests are split between them."""

    model: str  # model name, the same for every plan
    plans: tuple[Plan, ...]  # one or more plans side by side
    weights: tuple[float, ...]  # routing weight per plan, same order; they sum to 1

    @lazy
    def gear_id(self) -> str:
        return "g-" + _digest(self.to_dict())

    @lazy
    def gpu_uuids(self) -> tuple[str, ...]:
        return tuple(u for p in self.plans for u in p.gpu_uuids)

    def shape(self) -> str:
        counts: dict[str, int] = {}
        for p in self.plans:
            counts[p.shape()] = counts.get(p.shape(), 0) + 1
        return " + ".join(f"{n}x {s}" if n > 1 else s for s, n in counts.items())

    def to_dict(self) -> dict[str, object]:
        return {
            "model": self.model,
            "plans": [p.to_dict() for p in self.plans],
            "weights": list(self.weights),
        }

    @classmethod
    def from_dict(cls, d: object, path: str = "gear") -> Gear:
        m = _mapping(d, path, ("model", "plans", "weights"), ("gear_id",))
        model = m["model"]
        if not isinstance(model, str) or not model:
            raise ValueError(f"{path}.model: must be a non-empty string")
        plans_raw = m["plans"]
        if not isinstance(plans_raw, list) or not plans_raw:
            raise ValueError(f"{path}.plans: must be a non-empty list")
        plans = tuple(Plan.from_dict(p, f"{path}.plans[{i}]") for i, p in enumerate(plans_raw))
        weights_raw = m["weights"]
        if (
            not isinstance(weights_raw, list)
            or len(weights_raw) != len(plans)
            or not all(isinstance(w, int | float) and not isinstance(w, bool) and w >= 0 for w in weights_raw)
        ):
            raise ValueError(f"{path}.weights: must be {len(plans)} numbers >= 0, one per plan")
        gear = cls(model=model, plans=plans, weights=tuple(float(w) for w in weights_raw))
        if "gear_id" in m and m["gear_id"] != gear.gear_id:
            raise ValueError(f"{path}.gear_id: {m['gear_id']!r} does not match the content ({gear.gear_id})")
        return gear


def single_plan_gear(plan: Plan) -> Gear:
    return Gear(model=plan.model, plans=(plan,), weights=(1.0,))


# --- memory ------------------------------------------------------------------------------
def stage_bytes_per_gpu(stage: Stage, model: ModelSpec, kv_reserve_tokens: int) -> int:
    """Weights plus KV reserve on each GPU of a stage (weights split evenly over TP ranks)."""
    weights = model.stage_weight_bytes(stage.layer_start, stage.layer_end)
    kv = kv_reserve_tokens * stage.num_layers * model.kv_bytes_per_token_per_layer
    return -(-weights // stage.tp) + -(-kv // model.kv_shards(stage.tp))


def usable_bytes(mem_total_bytes: int, mem_used_bytes: int, reclaimable_bytes: int = 0,
                 mem_fraction: float = MEM_FRACTION) -> int:
    """What a plan may put on a GPU: `mem_fraction` of its capacity, less what others hold.

    `reclaimable_bytes` is memory the same deployment holds there now and would give back.
    """
    others = max(0, mem_used_bytes - reclaimable_bytes)
    return int(mem_fraction * mem_total_bytes) - others


# --- validation ----------------------------------------------------------------------------
def validate_plan(
    plan: Plan,
    snapshot: Snapshot,
    model: ModelSpec,
    *,
    blocks: Sequence[AtomicBlock] | None = None,
    reclaimable_bytes: Mapping[str, int] | None = None,
    mem_fraction: float = MEM_FRACTION,
    policy: BlockPolicy = DEFAULT_POLICY,
) -> list[str]:
    """Reasons `plan` breaks invariant 4 on `snapshot` (empty = valid). Never raises.

    Checks: the model matches; the mode matches the pipelines; each pipeline's stages cover
    layers [0, num_layers) exactly once, in order; every TP size shards the model's heads;
    every GPU exists, is healthy and schedulable (it is in a block) and is used once; each
    TP group lies inside one atomic block; weights + KV reserve fit in `mem_fraction` of each
    GPU less what others use there.
    """
    reasons: list[str] = []
    if plan.model != model.name:
        reasons.append(f"plan is for model {plan.model!r}, not {model.name!r}")
    if plan.mode == "colocated" and plan.decode_stages:
        reasons.append("a colocated plan has no decode_stages")
    if plan.mode == "disaggregated" and not plan.decode_stages:
        reasons.append("a disaggregated plan needs decode_stages")
    if plan.kv_reserve_tokens <= 0:
        reasons.append("kv_reserve_tokens must be > 0")
    if blocks is None:
        blocks = partition(snapshot, policy).blocks
    block_by_uuid = {u: b.id for b in blocks for u in b.gpu_uuids}
    excluded = None
    reclaim = reclaimable_bytes or {}
    seen: set[str] = set()
    for name, pipeline in (("stages", plan.stages), ("decode_stages", plan.decode_stages)):
        if not pipeline:
            if name == "stages":
                reasons.append("stages: a plan needs at least one stage")
            continue
        expected = 0
        for i, stage in enumerate(pipeline):
            where = f"{name}[{i}]"
            if stage.layer_start != expected:
                reasons.append(f"{where}: starts at layer {stage.layer_start}, expected {expected}")
            if stage.layer_end <= stage.layer_start:
                reasons.append(f"{where}: empty layer range [{stage.layer_start}, {stage.layer_end})")
                expected = max(expected, stage.layer_end)
                continue
            expected = stage.layer_end
            tp_problem = model.tp_error(stage.tp)
            if tp_problem:
                reasons.append(f"{where}: {tp_problem}")
            stage_blocks: set[str] = set()
            for u in stage.gpu_uuids:
                if u in seen:
                    reasons.append(f"{where}: GPU {u} is used twice in the plan")
                seen.add(u)
                gpu = snapshot.gpu_by_uuid.get(u)
                if gpu is None:
                    reasons.append(f"{where}: GPU {u} is not in the snapshot")
                    continue
                if u not in block_by_uuid:
                    if excluded is None:
                        excluded = partition(snapshot, policy).excluded
                    why = excluded.get(u, "not in any atomic block")
                    reasons.append(f"{where}: GPU {u} cannot be used ({why})")
                    continue
                stage_blocks.add(block_by_uuid[u])
            if len(stage_blocks) > 1:
                reasons.append(f"{where}: TP group spans blocks {sorted(stage_blocks)}; TP must stay inside one block")
            if stage.layer_end > model.num_layers or stage.layer_start < 0:
                continue  # reported below as a coverage error; memory needs a valid range
            need = stage_bytes_per_gpu(stage, model, plan.kv_reserve_tokens)
            for u in stage.gpu_uuids:
                gpu = snapshot.gpu_by_uuid.get(u)
                if gpu is None:
                    continue
                have = usable_bytes(gpu.mem_total_bytes, gpu.mem_used_bytes, reclaim.get(u, 0), mem_fraction)
                if need > have:
                    reasons.append(
                        f"{where}: GPU {u} needs {need / 2**30:.1f} GiB (weights + KV reserve) but only"
                        f" {max(0, have) / 2**30:.1f} GiB fit under {mem_fraction:.0%} of its memory"
                    )
        if expected != model.num_layers:
            reasons.append(f"{name}: layers cover [0, {expected}), the model has {model.num_layers}")
    return reasons


def validate_gear(
    gear: Gear,
    snapshot: Snapshot,
    model: ModelSpec,
    *,
    blocks: Sequence[AtomicBlock] | None = None,
    reclaimable_bytes: Mapping[str, int] | None = None,
    mem_fraction: float = MEM_FRACTION,
    policy: BlockPolicy = DEFAULT_POLICY,
) -> list[str]:
    """Reasons the gear is invalid: any plan's reasons (prefixed), GPUs shared between plans,
    weights that do not match the plans or do not sum to 1."""
    reasons: list[str] = []
    if gear.model != model.name:
        reasons.append(f"gear is for model {gear.model!r}, not {model.name!r}")
    if not gear.plans:
        return reasons + ["a gear needs at least one plan"]
    if len(gear.weights) != len(gear.plans):
        reasons.append(f"{len(gear.weights)} weights for {len(gear.plans)} plans")
    elif any(w < 0 for w in gear.weights) or abs(sum(gear.weights) - 1.0) > 1e-6:
        reasons.append(f"weights must be >= 0 and sum to 1, got {list(gear.weights)}")
    if blocks is None:
        blocks = partition(snapshot, policy).blocks
    owner: dict[str, int] = {}
    for i, plan in enumerate(gear.plans):
        for reason in validate_plan(
            plan, snapshot, model, blocks=blocks, reclaimable_bytes=reclaimable_bytes,
            mem_fraction=mem_fraction, policy=policy,
        ):
            reasons.append(f"plans[{i}] {plan.shape()}: {reason}")
        for u in plan.gpu_uuids:
            if u in owner and owner[u] != i:
                reasons.append(f"plans[{i}]: GPU {u} is also used by plans[{owner[u]}]")
            owner.setdefault(u, i)
    return reasons


# --- helpers -------------------------------------------------------------------------------
def _digest(content: object) -> str:
    text = json.dumps(content, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _mapping(d: object, path: str, required: Sequence[str], optional: Sequence[str]) -> Mapping[str, object]:
    if not isinstance(d, Mapping):
        raise ValueError(f"{path}: must be an object, got {type(d).__name__}")
    unknown = sorted(set(d) - set(required) - set(optional))
    if unknown:
        raise ValueError(f"{path}.{unknown[0]}: unknown key")
    for key in required:
        if key not in d:
            raise ValueError(f"{path}.{key}: required")
    return d


def _stages(raw: object, path: str) -> tuple[Stage, ...]:
    if not isinstance(raw, list):
        raise ValueError(f"{path}: must be a list")
    return tuple(Stage.from_dict(s, f"{path}[{i}]") for i, s in enumerate(raw))
