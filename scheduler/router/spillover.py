"""KV spillover bands: which new requests a plan takes, by the share of its KV pool still free.

Seed 003's third layer of the KV budget (the first two: weights and activations reserved, then
one soft-isolated shared pool per plan - the engines' own KV pool): when a plan's pool saturates,
new requests overflow to other plans, and how much a plan takes depends on its *relative* free
KV (corollary 2: 48 GB and 80 GB cards make absolute thresholds wrong), in three bands:

    free > probe_above (30%)        PROBE      its own traffic, and spilled requests: up to
                                               probe_share (50%) of them, picked by the request's
                                               key (the same request gets the same answer)
    high_only_below..probe_above    NORMAL     its own traffic only; spilled requests go elsewhere
    free < high_only_below (10%)    HIGH_ONLY  high-priority requests only (own or spilled)

A request *spills* when the plan the router ranks first for it is past its bound (HIGH_ONLY for a
normal request): it goes down the ranking to the first plan that admits it. What a spilled request
gives up (seed 003's three traps), priced where the prices live: no prefix reuse on a plan whose
KV it does not have (prefix_affinity scores only what each plan recently served: a spill target
scores 0 unless the KV was moved there), the KV it would pull back over the link
(`pull_back_s`: scheduler.costmodel's link bandwidth), and a spillover timeout: a request no plan
admits within spill_timeout_s waits at its first choice's queue - queued, never dropped.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.router._arrays import Floats


class Band(enum.StrEnum):
    PROBE = "probe"
    NORMAL = "normal"
    HIGH_ONLY = "high_only"


@dataclass(frozen=True)
class SpillConfig:
    probe_above: float = 0.30
    high_only_below: float = 0.10
    probe_share: float = 0.50
    spill_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.high_only_below < self.probe_above <= 1.0:
            raise ValueError(f"high_only_below, probe_above: need 0 <= high_only_below < probe_above <= 1; got "
                             f"{self.high_only_below}, {self.probe_above}")
        if not 0.0 <= self.probe_share <= 1.0:
            raise ValueError(f"probe_share: must be in [0, 1]; got {self.probe_share}")
        if self.spill_timeout_s < 0:
            raise ValueError(f"spill_timeout_s: must be >= 0; got {self.spill_timeout_s}")


def band(free_ratio: float, config: SpillConfig = SpillConfig()) -> Band:
    """The band of a plan whose KV pool has `free_ratio` (0..1) of its pages free."""
    if free_ratio > config.probe_above:
        return Band.PROBE
    if free_ratio < config.high_only_below:
        return Band.HIGH_ONLY
    return Band.NORMAL


def _draw(key: str) -> float:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") / 2**64


def admits(free_ratio: float, *, spilled: bool, high_priority: bool, key: str,
           config: SpillConfig = SpillConfig()) -> tuple[bool, str]:
    """Whether a plan with this much free KV takes the request, and why (for the decision's explanation)."""
    b = band(free_ratio, config)
    pct = f"{free_ratio:.0%} KV free"
    if b is Band.HIGH_ONLY:
        if high_priority:
            return True, f"{pct}: high priority only, and this one is"
        return False, f"{pct} (< {config.high_only_below:.0%}): high priority only"
    if not spilled:
        return True, f"{pct}: its own traffic"
    if b is Band.NORMAL:
        return False, f"{pct} ({config.high_only_below:.0%}-{config.probe_above:.0%}): takes no spilled requests"
    if _draw(key) < config.probe_share:
        return True, f"{pct} (> {config.probe_above:.0%}): a spill probe"
    return False, f"{pct}: past its share of spill probes ({config.probe_share:.0%})"


def reorder(order: tuple[int, ...], free_ratio: Sequence[float] | Floats, *, high_priority: bool, key: str,
            config: SpillConfig = SpillConfig()) -> tuple[tuple[int, ...], str]:
    """The router's order with the bands applied: the first plan keeps the request when its band
    takes its own traffic; otherwise the request spills to the first of the others that admits a
    spilled one, and the plans that refused go last (tried only if every other one fails). When no
    plan admits it, the order stands: it waits at its first choice's queue (never dropped)."""
    if not order:
        return order, ""
    first = order[0]
    ok, why = admits(float(free_ratio[first]), spilled=False, high_priority=high_priority, key=key, config=config)
    if ok:
        return order, ""
    for i, slot in enumerate(order[1:], start=1):
        took, how = admits(float(free_ratio[slot]), spilled=True, high_priority=high_priority, key=key, config=config)
        if took:
            return (slot, *order[1:i], *order[i + 1:], first), f"spilled: first choice {why}; taken as {how}"
    return order, f"no plan takes it as a spill ({why}): it waits at its first choice"


def pull_back_s(kv_bytes: float, link_gbps: float) -> float:
    """Seconds to bring a spilled request's KV back to its home plan over a link of `link_gbps`
    (the cost model's link figures; PCIe Gen5 x16 is ~64 GB/s, seed 003)."""
    if link_gbps <= 0:
        raise ValueError(f"link_gbps: must be > 0; got {link_gbps}")
    return kv_bytes * 8 / (link_gbps * 1e9)


__all__ = ["Band", "SpillConfig", "admits", "band", "pull_back_s", "reorder"]
