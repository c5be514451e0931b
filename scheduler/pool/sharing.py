"""GPU sharing by memory fraction: what one deployment's decision sees of the others' GPUs.

Seed 004 section 4.2 configures its scheduler with `max_models_per_gpu: 2` ("each GPU loads at
most 2 different models"): up to that many deployments may hold one GPU, as long as all their
plans' weights + KV reserves fit under 92% of its memory together (DESIGN.md invariant 4,
summed over every plan that holds the GPU - of any deployment; scheduler.booking).

`shared_snapshot` is the snapshot one deployment decides on. A GPU nobody else holds is left as
the agents reported it. A GPU other deployments hold is

* unschedulable when it already holds `max_models_per_gpu` deployments besides this one (1: the
  exclusive pool of before - every GPU another deployment holds is unschedulable), or when what
  one of them booked there is unknown (a GPU counted as free that is not would be a PREPARE an
  agent refuses);
* otherwise schedulable but partly used: its `mem_used_bytes` is at least what the others booked
  there plus what this deployment holds there itself (the planner takes its own plans back as
  reclaimable), so the planner's room per GPU (`plan.usable_bytes`) leaves the others' bytes
  out and only places plans that fit beside them.

The agents report what every plan on a GPU holds, so the reported use already counts the others'
running plans; the booked bytes add what was decided but not reported yet (a transition started
earlier in the same step). Compute is split by time: a shared GPU's `compute_share` is 1 / (the
deployments that would hold it), and the cost model stretches a stage's time there by its inverse
(costmodel.profiles `StageProfile.slowdown`) - as the simulator slows engines that share a GPU
(`FleetSim._reshare`), so a plan that meets its SLOs only at full speed is not put beside another.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from scheduler.topology import Snapshot

# seed 004 section 4.2, its scheduler config: `max_models_per_gpu: 2` ("每个GPU最多加载2个不同模型")
MAX_MODELS_PER_GPU = 2


def check_max_models(value: object, where: str = "max_models_per_gpu") -> int:
    """`value` as a limit of deployments per GPU (an int >= 1), else ValueError naming `where`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: must be an integer >= 1 (1: one deployment per GPU), got {value!r}")
    return value


def others_on(gpu: str, own: str, held: Mapping[str, frozenset[str] | set[str]]) -> list[str]:
    """The deployments other than `own` that hold `gpu`, by name."""
    return sorted(d for d, gpus in held.items() if d != own and gpu in gpus)


def shared_snapshot(base: Snapshot, own: str, held: Mapping[str, frozenset[str] | set[str]],
                    booked: Mapping[str, Mapping[str, int]], *, own_bytes: Mapping[str, int] | None = None,
                    max_models_per_gpu: int = MAX_MODELS_PER_GPU,
                    withheld: frozenset[str] | set[str] = frozenset()) -> Snapshot:
    """`base` as deployment `own` decides on it (module docstring). `held`: deployment -> GPUs it
    holds; `booked`: deployment -> GPU -> bytes its plans book there (a held GPU missing here is
    unknown: unschedulable); `own_bytes`: what `own` holds per GPU; `withheld`: GPUs kept from
    `own` whoever holds them (given to a higher-priority deployment, scheduler.pool.priority)."""
    mine = own_bytes or {}
    changed = False
    gpus = []
    for g in base.gpus:
        u = g.uuid
        if u in withheld:
            gpus.append(replace(g, schedulable=False))
            changed = True
            continue
        others = others_on(u, own, held)
        if not others:
            gpus.append(g)
            continue
        changed = True
        joining = u not in held.get(own, ())
        full = len(others) + (1 if joining else 0) > max_models_per_gpu
        known = [booked.get(d, {}).get(u) for d in others]
        if full or any(b is None for b in known):
            gpus.append(replace(g, schedulable=False))
            continue
        used = sum(b for b in known if b is not None) + mine.get(u, 0)
        gpus.append(replace(g, mem_used_bytes=min(g.mem_total_bytes, max(g.mem_used_bytes, used)),
                            compute_share=1.0 / (1 + len(others))))
    return replace(base, gpus=tuple(gpus)) if changed else base


def sharing_conflicts(deployment: str, holders: Mapping[str, set[str] | frozenset[str]],
                      max_models_per_gpu: int = MAX_MODELS_PER_GPU) -> list[str]:
    """The reservation check of every transition store (in memory, the console's): for each GPU
    (uuid -> the deployments with bookings there) on which `deployment` booking would make more
    than `max_models_per_gpu` deployments, a sentence naming who holds it. Memory is the agents'
    check at PREPARE (scheduler.booking.refuse_booking), summed over every deployment's plans."""
    out = []
    for u in sorted(holders):
        others = sorted(d for d in holders[u] if d != deployment)
        if len(others) + 1 <= max_models_per_gpu:
            continue
        if max_models_per_gpu == 1:
            out.append(f"GPU {u} is booked by deployment {others[0]}")
        else:
            out.append(f"GPU {u} is booked by deployments {', '.join(others)}: at most {max_models_per_gpu}"
                       f" deployments share a GPU (max_models_per_gpu)")
    return out


__all__ = ["MAX_MODELS_PER_GPU", "check_max_models", "others_on", "shared_snapshot", "sharing_conflicts"]
