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
(`pull_back_s`: scheduler.costmodel's link bandwidth), and the wait at a plan that was not its
first choice - bounded by the spillover timeout.

The spillover timeout (`spill_timeout_s`, default 2 s). A request that spilled waits in the queue
of the plan that took it; "admitted" there means it got its first KV pages (its prefill started,
the engine moved it from waiting to running). If it is not admitted within `spill_timeout_s` of
when it was sent there, it *times out*, once: it is counted (`SpillWatch.timeouts`; the console
exports the last 5 min's per plan as flexpipe_spillover_timeouts_recent) and re-routed (`reroute`):

    1. back to its first choice, if that plan's band takes its own traffic again;
    2. else to the first plan of the router's fresh ranking, other than the one it waits at,
       that takes it as a spill;
    3. else it stays where it waits, keeping its place in that queue (moving it would only put
       it at the back of another full one).

Never dropped (nothing admitted is lost: a re-route moves a request that holds no KV yet, so it
loses no work), and re-routed at most once - a request that timed out is not watched again, so
it cannot bounce between saturated plans. A request admitted in time is forgotten uncounted.
Unlike a flow-control TTL that sheds a request when its queue wait runs out, the timeout here
only changes where it waits. The simulator (agents/sim/gateway.py) sees the admission itself;
the console's gateway (console/gateway/routing.py) sees nothing of the engine's queue before a
first token, so it counts from the stream's open to its first token.
"""

from __future__ import annotations

import enum
import hashlib
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from scheduler.router._arrays import Floats

if TYPE_CHECKING:
    from scheduler.router.pool import Pool


class Band(enum.StrEnum):
    PROBE = "probe"
    NORMAL = "normal"
    HIGH_ONLY = "high_only"


@dataclass(frozen=True)
class SpillConfig:
    probe_above: float = 0.30
    high_only_below: float = 0.10
    probe_share: float = 0.50
    spill_timeout_s: float = 2.0  # a spilled request not admitted within this is re-routed (inf: never)

    def __post_init__(self) -> None:
        if not 0.0 <= self.high_only_below < self.probe_above <= 1.0:
            raise ValueError(f"high_only_below, probe_above: need 0 <= high_only_below < probe_above <= 1; got "
                             f"{self.high_only_below}, {self.probe_above}")
        if not 0.0 <= self.probe_share <= 1.0:
            raise ValueError(f"probe_share: must be in [0, 1]; got {self.probe_share}")
        if not self.spill_timeout_s >= 0:  # (NaN too)
            raise ValueError(f"spill_timeout_s: must be >= 0; got {self.spill_timeout_s}")


def band(free_ratio: float, config: SpillConfig = SpillConfig()) -> Band:
    """The band of a plan whose KV pool has `free_ratio` (0..1) of its pages free."""
    if free_ratio > config.probe_above:
        return Band.PROBE
    if free_ratio < config.high_only_below:
        return Band.HIGH_ONLY
    return Band.NORMAL


def kv_free(pool: Pool) -> Floats:
    """Each plan's share of its KV pool still free, as the bands read it (its memory bound's room
    over its token capacity)."""
    return pool.room / np.maximum(pool.cap_tokens, 1.0)


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


def reroute(order: tuple[int, ...], free_ratio: Sequence[float] | Floats, *, home: int, waiting_at: int,
            high_priority: bool, key: str, config: SpillConfig = SpillConfig()) -> tuple[int, str]:
    """Where a spilled request goes when its timeout fires (module docstring, rules 1-3): `order`
    is the router's fresh ranking, `home` its first choice's slot, `waiting_at` the slot whose
    queue holds it. Always a slot: `waiting_at` itself when nothing better takes it."""
    ok, why = admits(float(free_ratio[home]), spilled=False, high_priority=high_priority, key=key, config=config)
    if ok and home != waiting_at:
        return home, f"spillover timeout: back to its first choice ({why})"
    for slot in order:
        if slot in (home, waiting_at):
            continue
        took, how = admits(float(free_ratio[slot]), spilled=True, high_priority=high_priority, key=key, config=config)
        if took:
            return slot, f"spillover timeout: first choice {why}; taken as {how}"
    return waiting_at, f"spillover timeout: no other plan takes it (first choice {why}): it keeps its place"


@dataclass
class Spilled:
    """One spilled request on watch: where it wanted to go, where it waits, since when."""

    key: Hashable  # the caller's name for the request (a request id, a sequence id)
    home: str  # plan id of its first choice
    at: str  # plan id of the plan that took it
    since_s: float
    deadline_s: float  # since_s + spill_timeout_s


class SpillWatch:
    """The spilled requests not yet admitted where they went, and the timeouts counted (module
    docstring). The caller says when one spilled, when it was admitted, and asks at its deadline
    (`expire`); each key times out at most once. Pure: the caller passes the time."""

    def __init__(self, config: SpillConfig = SpillConfig()) -> None:
        self.config = config
        self.spills = 0  # requests sent away from their first choice
        self.timeouts = 0  # of those, not admitted within spill_timeout_s
        self._waiting: dict[Hashable, Spilled] = {}
        self._timed_out: set[Hashable] = set()  # never watched again: re-routed at most once

    def spilled(self, key: Hashable, home: str, at: str, now_s: float) -> Spilled | None:
        """`key` spilled from `home` to `at`; what to expire at its deadline, or None when it is
        not watched (it timed out once already, or the timeout is off)."""
        self.spills += 1
        if key in self._timed_out or math.isinf(self.config.spill_timeout_s):
            return None
        s = self._waiting[key] = Spilled(key, home, at, now_s, now_s + self.config.spill_timeout_s)
        return s

    def admitted(self, key: Hashable) -> None:
        """It got its first KV pages (or left otherwise: finished, failed, moved by a gear change):
        forgotten, not counted."""
        self._waiting.pop(key, None)

    def expire(self, key: Hashable, now_s: float) -> Spilled | None:
        """At (or past) its deadline and still not admitted: counted and returned, once - the
        caller re-routes it (`reroute`). None when it was admitted, forgotten or is not due."""
        s = self._waiting.get(key)
        if s is None or now_s < s.deadline_s:
            return None
        del self._waiting[key]
        self._timed_out.add(key)
        self.timeouts += 1
        return s

    def forget(self, key: Hashable) -> None:
        """The request ended: drop what is kept of it (its once-only mark included)."""
        self._waiting.pop(key, None)
        self._timed_out.discard(key)

    @property
    def waiting(self) -> int:
        return len(self._waiting)


def pull_back_s(kv_bytes: float, link_gbps: float) -> float:
    """Seconds to bring a spilled request's KV back to its home plan over a link of `link_gbps`
    (the cost model's link figures; PCIe Gen5 x16 is ~64 GB/s, seed 003)."""
    if link_gbps <= 0:
        raise ValueError(f"link_gbps: must be > 0; got {link_gbps}")
    return kv_bytes * 8 / (link_gbps * 1e9)


__all__ = ["Band", "SpillConfig", "SpillWatch", "Spilled", "admits", "band", "kv_free", "pull_back_s", "reorder", "reroute"]
