"""When a candidate does not fit beside the current gear: what it would take, and its price.

A transition prepares its new plans while the old gear still serves (seed 000 section 3.3), so
they must fit in what the GPUs have left beside every plan that holds them (scheduler.booking,
DESIGN.md invariant 4). A candidate that does not - typically a re-shape on the same GPUs, such
as TP8 -> 2 x TP4 on one node - cannot be reached in one switch. It can be reached in two:

* **staged**: first to an intermediate gear that does fit beside the current one (another
  candidate, usually on other blocks), then - once the first switch has released the current
  gear - on to the target, which then fits beside the intermediate;
* **drain** (brief): first to the current gear without its plans that hold the conflicting
  GPUs (they drain and are released; the rest of the gear serves), then to the target.

Both are two ordinary transitions: the gearbox switches to the first stage's gear and records
the target (`Decision.staged_target`); its drivers (the console's tick, the simulator's FlexPipe
policy) ask for the second stage as soon as the first is done, and the gearbox continues
without cooldown or hysteresis (the whole path was weighed when it was chosen). When neither
exists - a gear of one plan whose GPUs the target needs, and no room elsewhere - the only way is
a full drain (no plan serves while the target loads): `outage_cost` prices it so the decision
can say what it would take, but it is never chosen automatically.

A path's price adds the two switch costs and what is lost while the intermediate serves instead
of the current gear (`dwell_tokens`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from scheduler.booking import Overbooking, beside_conflicts, describe, new_plan_bytes, plans_memory
from scheduler.costmodel import Estimate, SwitchCost
from scheduler.modelspec import ModelSpec
from scheduler.plan import Gear, Plan
from scheduler.topology import Snapshot

PathKind = Literal["direct", "staged", "drain", "blocked"]


@dataclass(frozen=True)
class SwitchPath:
    """How a candidate would be reached from the current gear."""

    kind: PathKind  # direct | staged | drain | blocked (no executable path)
    via: Gear | None = None  # staged/drain: the first stage's gear
    conflicts: tuple[Overbooking, ...] = ()  # why a direct switch does not fit (empty: it does)
    note: str = ""  # in words, for the decision's candidate list

    @property
    def executable(self) -> bool:
        return self.kind != "blocked"

    @property
    def staged(self) -> bool:
        return self.kind in ("staged", "drain")

    def to_dict(self) -> dict[str, object]:
        return {"kind": self.kind, "via": self.via.to_dict() if self.via is not None else None,
                "via_shape": self.via.shape() if self.via is not None else None,
                "conflicts": [c.to_dict() for c in self.conflicts], "note": self.note}

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> SwitchPath:
        kind = d.get("kind")
        if kind not in ("direct", "staged", "drain", "blocked"):
            raise ValueError(f"path.kind: must be direct, staged, drain or blocked; got {kind!r}")
        via = d.get("via")
        raw = d.get("conflicts") or []
        conflicts = []
        for i, c in enumerate(raw if isinstance(raw, list) else []):
            if not isinstance(c, Mapping):
                raise ValueError(f"path.conflicts[{i}]: must be an object")
            conflicts.append(Overbooking(str(c["gpu"]), int(c["need_bytes"]), int(c["used_bytes"]),
                                         int(c["total_bytes"]), float(c.get("limit", 0.92))))
        return cls(kind=kind, via=None if via is None else Gear.from_dict(via, "path.via"),
                   conflicts=tuple(conflicts), note=str(d.get("note", "")))


DIRECT = SwitchPath("direct")


def conflicts(current: Gear | None, target: Gear, model: ModelSpec, snapshot: Snapshot) -> list[Overbooking]:
    """GPUs on which target's new plans do not fit beside the current gear (empty: direct)."""
    return beside_conflicts(current, target, model, snapshot)


def fits_after(current: Gear | None, first: Gear, target: Gear, model: ModelSpec, snapshot: Snapshot) -> bool:
    """Whether `target` fits beside `first` once the switch current -> first is done: the
    current gear's plans that `first` does not keep are released, `first`'s new plans hold
    their memory."""
    # what the first stage frees: the current plans it does not keep and that still hold memory
    # (a plan that lost a GPU crashed with it: its memory is already free in the snapshot)
    released = plans_memory([p for p in current.plans if p not in first.plans and _holds(p, snapshot)],
                            model) if current else {}
    added = new_plan_bytes(current, first, model)
    return not beside_conflicts(first, target, model, snapshot, released=released, added=added)


def _holds(plan: Plan, snapshot: Snapshot) -> bool:
    """Whether the plan still holds its memory: every GPU of it present, healthy and ours."""
    gpus = snapshot.gpu_by_uuid
    return all((g := gpus.get(u)) is not None and g.healthy and g.schedulable for u in plan.gpu_uuids)


def drain_gear(current: Gear | None, found: Sequence[Overbooking], snapshot: Snapshot) -> Gear | None:
    """The current gear without its plans that hold a conflicting GPU (and without those that
    lost GPUs: they serve nothing), weights renormalised; None when nothing would be left (a
    full drain) or nothing would be dropped."""
    if current is None:
        return None
    hot = {c.gpu for c in found}
    kept = [(p, w) for p, w in zip(current.plans, current.weights, strict=True)
            if hot.isdisjoint(p.gpu_uuids) and _holds(p, snapshot)]
    if not kept or len(kept) == len(current.plans):
        return None
    total = sum(w for _, w in kept)
    weights = [round(w / total, 6) if total > 0 else round(1.0 / len(kept), 6) for _, w in kept]
    weights[-1] = round(1.0 - sum(weights[:-1]), 6)
    return Gear(current.model, tuple(p for p, _ in kept), tuple(weights))


def dwell_tokens(current: Estimate | None, first: Estimate | None, dwell_s: float) -> float:
    """Output tokens lost while the intermediate serves instead of the current gear (the goodput
    it lacks, over the time until the target takes over; nothing when it serves as well)."""
    if current is None or first is None or dwell_s <= 0:
        return 0.0
    return max(0.0, current.goodput_tokens_s - first.goodput_tokens_s) * dwell_s


def combine(first: SwitchCost, second: SwitchCost, extra_tokens: float = 0.0) -> SwitchCost:
    """The price of two switches one after the other (plus `extra_tokens` lost between them)."""
    source: Literal["host", "disk", "none"] = (
        second.weight_source if second.weight_source != "none" else first.weight_source)
    return replace(
        first,
        tokens=first.tokens + second.tokens + extra_tokens,
        pause_s=first.pause_s + second.pause_s,
        prepare_s=first.prepare_s + second.prepare_s,
        time_to_effect_s=first.time_to_effect_s + second.time_to_effect_s,
        lost_pause_tokens=first.lost_pause_tokens + second.lost_pause_tokens + extra_tokens,
        lost_contention_tokens=first.lost_contention_tokens + second.lost_contention_tokens,
        lost_cold_start_tokens=first.lost_cold_start_tokens + second.lost_cold_start_tokens,
        kv_migrate_bytes=first.kv_migrate_bytes + second.kv_migrate_bytes,
        kv_migrate_s=first.kv_migrate_s + second.kv_migrate_s,
        migrate_seqs=first.migrate_seqs + second.migrate_seqs,
        replay_seqs=first.replay_seqs + second.replay_seqs,
        replay_tokens=first.replay_tokens + second.replay_tokens,
        replay_s=first.replay_s + second.replay_s,
        weight_load_bytes=first.weight_load_bytes + second.weight_load_bytes,
        weight_load_s=first.weight_load_s + second.weight_load_s,
        weight_source=source,
        cold_start_s=first.cold_start_s + second.cold_start_s,
    )


def outage_cost(direct: SwitchCost, current: Estimate | None, drain_s: float) -> tuple[float, float]:
    """(seconds without service, output tokens lost) of a full drain: the current gear stops
    admitting, finishes what it holds (`drain_s`), is released, and the target loads (the direct
    switch's prepare time) before anything is served again."""
    outage_s = drain_s + direct.prepare_s
    served = current.throughput_tokens_s if current is not None else 0.0
    return outage_s, served * outage_s + direct.lost_cold_start_tokens


def drain_s(current: Estimate | None, output_tokens_p99: float) -> float:
    """How long the current gear takes to finish what it holds: the longest usual output at its
    decode pace (TPOT P50)."""
    if current is None or not current.tpot_p50_s or current.tpot_p50_s == float("inf"):
        return 0.0
    return output_tokens_p99 * current.tpot_p50_s


def blocked_note(found: Sequence[Overbooking], outage_s: float, outage_tokens: float) -> str:
    return (f"does not fit beside the current gear ({describe(found)}) and no intermediate gear makes room;"
            f" it would take a full drain: about {outage_s:.0f} s without service (~{outage_tokens:.0f} tokens)"
            "; to fix: free GPUs elsewhere, or an operator drains the deployment")


__all__ = ["DIRECT", "PathKind", "SwitchPath", "blocked_note", "combine", "conflicts", "drain_gear", "drain_s",
           "dwell_tokens", "fits_after", "outage_cost"]
