"""GPU memory across a transition: what each plan books, and the one check every agent makes.

DESIGN.md invariant 4: weights plus KV reserve may use at most 92% of a GPU's memory, summed
over every plan that holds the GPU at that moment - the current gear, the shadow plans a
transition prepares, and the plans it drains - from PREPARE until the plan's release is acked.
A transition's new plans are therefore booked *beside* the old gear, not in its place: the
old gear keeps serving (and holding its weights and KV) until CLEANUP releases it.

Three users, one arithmetic:

* Agents (the real daemon, `agents.sim.fleet.FleetSim` - the simulated one of the replays, the
  live fleet and the tests' worlds) call `refuse_booking` at PREPARE and refuse with its `Overbooking.message()` and
  `REFUSAL_REASON` - the same words whichever agent refuses.
* The gearbox asks `beside_conflicts(current, target, ...)` whether a candidate fits beside the
  current gear; when it does not, `scheduler.staging` finds and prices what it would take.
* The replay's invariant checker (`scheduler.invariants`, events `mem_booked`) fails a run in
  which any GPU was booked above the limit.

Weight sharing: a shadow plan whose stage holds exactly the shard an old plan holds on the same
GPU (same layers, same TP rank) could map the resident weights instead of loading a copy. That
is counted once only where the node's engine says it does so
(`capabilities.EngineCaps.shares_weights`); no engine shipped today does, so both copies count.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache

from scheduler.modelspec import ModelSpec
from scheduler.plan import MEM_FRACTION, Gear, Plan, stage_bytes_per_gpu
from scheduler.topology import Snapshot

REFUSAL_REASON = "out_of_memory"  # agents.protocol.FAILURE_REASONS: a PREPARE refused for memory


def plan_memory(plan: Plan, model: ModelSpec) -> dict[str, int]:
    """Bytes each GPU of `plan` holds: its weight shard plus its KV reserve (a copy: callers may
    change it; the arithmetic is memoised, a decision asks it for every candidate and stage)."""
    return dict(_plan_memory(plan, model))


@lru_cache(maxsize=4096)
def _plan_memory(plan: Plan, model: ModelSpec) -> tuple[tuple[str, int], ...]:
    out: dict[str, int] = {}
    for st in plan.all_stages:
        need = stage_bytes_per_gpu(st, model, plan.kv_reserve_tokens)
        for u in st.gpu_uuids:
            out[u] = out.get(u, 0) + need
    return tuple(out.items())


def plans_memory(plans: Iterable[Plan], model: ModelSpec) -> dict[str, int]:
    """Bytes per GPU of several plans together (a plan listed twice is one engine: counted once)."""
    return dict(_plans_memory(tuple(dict.fromkeys(plans)), model))


@lru_cache(maxsize=4096)
def _plans_memory(plans: tuple[Plan, ...], model: ModelSpec) -> tuple[tuple[str, int], ...]:
    if len(plans) == 1:
        return _plan_memory(plans[0], model)
    out: dict[str, int] = {}
    for plan in plans:
        for u, b in _plan_memory(plan, model):
            out[u] = out.get(u, 0) + b
    return tuple(out.items())


def shard_bytes(plan: Plan, model: ModelSpec) -> dict[tuple[str, int, int, int, int], int]:
    """(GPU, first layer, end layer, TP, rank) -> weight bytes of that shard, for every GPU of `plan`."""
    out: dict[tuple[str, int, int, int, int], int] = {}
    for st in plan.all_stages:
        weights = -(-model.stage_weight_bytes(st.layer_start, st.layer_end) // st.tp)
        for rank, u in enumerate(st.gpu_uuids):
            out[(u, st.layer_start, st.layer_end, st.tp, rank)] = weights
    return out


@dataclass(frozen=True)
class Overbooking:
    """One GPU a booking would put over the limit."""

    gpu: str  # its uuid
    need_bytes: int  # what the new plan(s) would book on it
    used_bytes: int  # what is booked or in use there already (others' use included)
    total_bytes: int  # its memory
    limit: float = MEM_FRACTION  # the share of `total_bytes` that may be booked

    @property
    def free_bytes(self) -> int:
        """What may still be booked there (0 when it is already over)."""
        return max(0, int(self.limit * self.total_bytes) - self.used_bytes)

    @property
    def fraction_after(self) -> float:
        return (self.used_bytes + self.need_bytes) / self.total_bytes if self.total_bytes else float("inf")

    def message(self) -> str:
        """The refusal every agent sends (the daemon, the simulated fleets): one wording."""
        gib = 2**30
        return (f"GPU {self.gpu}: booking {self.need_bytes / gib:.2f} GiB beside the {self.used_bytes / gib:.2f} GiB"
                f" already held would hold {self.fraction_after:.1%} of its {self.total_bytes / gib:.2f} GiB, above"
                f" the {self.limit:.0%} limit (free under it: {self.free_bytes / gib:.2f} GiB)")

    def to_dict(self) -> dict[str, object]:
        return {"gpu": self.gpu, "need_bytes": self.need_bytes, "used_bytes": self.used_bytes,
                "total_bytes": self.total_bytes, "limit": self.limit}


def refuse_booking(want: Mapping[str, int], used: Mapping[str, int], total: Mapping[str, int],
                   limit: float = MEM_FRACTION) -> Overbooking | None:
    """The PREPARE check of every agent: the first GPU (by uuid) on which booking `want` beside
    what is `used` there would exceed `limit` of its `total`; None when the booking fits.
    A GPU missing from `total` is not this agent's to judge (another check refuses it)."""
    for u in sorted(want):
        need = want[u]
        cap = total.get(u)
        if cap is None or need <= 0:
            continue
        have = used.get(u, 0)
        if have + need > limit * cap:
            return Overbooking(u, need, have, cap, limit)
    return None


def over_limit(booked_bytes: int, total_bytes: int, limit: float = MEM_FRACTION) -> bool:
    """Whether `booked_bytes` on a GPU of `total_bytes` breaks invariant 4 (the checker's test)."""
    return booked_bytes > limit * total_bytes


def new_plan_bytes(current: Gear | None, target: Gear, model: ModelSpec, *,
                   sharing: frozenset[str] = frozenset()) -> dict[str, int]:
    """What the transition current -> target books on top of what the current gear holds: the
    bytes of target's new plans (plans in both gears are one engine and book nothing new), less
    the weight shards an old plan already holds on a GPU whose engine maps them into the new plan
    in place (`sharing`: those GPUs' uuids, `sharing_gpus`)."""
    old = set(current.plans) if current is not None else set()
    new = [p for p in dict.fromkeys(target.plans) if p not in old]
    need = plans_memory(new, model)
    if sharing and current is not None and new:
        held: dict[tuple[str, int, int, int, int], int] = {}
        for p in current.plans:
            held.update(shard_bytes(p, model))
        for p in new:
            for key, b in shard_bytes(p, model).items():
                if key in held and key[0] in sharing and need.get(key[0], 0) >= b:
                    need[key[0]] -= b
                    del held[key]  # one resident copy maps into one new shard
    return need


def sharing_gpus(snapshot: Snapshot) -> frozenset[str]:
    """GPUs whose node's engine maps resident weights into a new plan in place."""
    nodes = {n.id for n in snapshot.nodes if n.engine is not None and n.engine.shares_weights}
    if not nodes:
        return frozenset()
    return frozenset(g.uuid for g in snapshot.gpus if g.node_id in nodes)


def beside_conflicts(current: Gear | None, target: Gear, model: ModelSpec, snapshot: Snapshot, *,
                     limit: float = MEM_FRACTION, released: Mapping[str, int] | None = None,
                     added: Mapping[str, int] | None = None) -> list[Overbooking]:
    """The GPUs on which target's new plans do not fit beside what is held now (the snapshot's
    use, which includes the current gear), as an agent would find at PREPARE; empty: the switch
    can be made directly. `released` / `added`: bytes per GPU freed / booked before these plans
    are prepared (a staged switch's first stage releasing the old gear and booking its own), on
    top of the snapshot's use."""
    need = new_plan_bytes(current, target, model, sharing=sharing_gpus(snapshot))
    out: list[Overbooking] = []
    gone = released or {}
    more = added or {}
    gpus = snapshot.gpu_by_uuid
    for u in sorted(need):
        b = need[u]
        g = gpus.get(u)
        if g is None or b <= 0:
            continue
        used = max(0, g.mem_used_bytes - gone.get(u, 0)) + more.get(u, 0)
        if used + b > limit * g.mem_total_bytes:
            out.append(Overbooking(u, b, used, g.mem_total_bytes, limit))
    return out


def describe(conflicts: Iterable[Overbooking], most: int = 3) -> str:
    """'GPU a1-3 needs 40.0 GiB, 3.1 GiB free under 92%; ...' for reasons and notes."""
    items = list(conflicts)
    gib = 2**30
    text = "; ".join(f"GPU {c.gpu} needs {c.need_bytes / gib:.1f} GiB, {c.free_bytes / gib:.1f} GiB free under"
                     f" {c.limit:.0%}" for c in items[:most])
    return text + (f"; and {len(items) - most} more GPU(s)" if len(items) > most else "")


__all__ = [
    "REFUSAL_REASON", "Overbooking", "beside_conflicts", "describe", "new_plan_bytes", "over_limit", "plan_memory",
    "plans_memory", "refuse_booking", "shard_bytes", "sharing_gpus",
]
