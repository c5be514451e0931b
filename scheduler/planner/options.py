"""What the planner is asked with (`PlannerOptions`) and what it answers (`Candidates`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from scheduler._lazy import check_plain_dataclass
from scheduler.costmodel import (
    Estimate,
    PlanProfile,
)
from scheduler.plan import MEM_FRACTION, Gear, Plan
from scheduler.requirements import NONE as NO_REQUIREMENTS
from scheduler.requirements import Requirements


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


