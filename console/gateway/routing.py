"""Choosing a route of a deployment's routing table, and finding where its leader listens.

`order_routes` is a pure function (filter -> score -> pick): it drops frozen, weightless and
nodeless routes, draws one by weight, breaks ties between routes of equal weight by the fewest
requests this gateway process has outstanding on them, and returns every candidate in the order
to try them (the drawn one first, then the others by weight), so a plan that answers 429 hands
the request to the next.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Candidate:
    plan_id: str
    weight: float
    leader: str  # node id of the plan's first stage's first GPU
    route: Mapping[str, Any]


def leader_of(route: Mapping[str, Any]) -> str | None:
    """The route's leader node: the first of `nodes` (the table lists the leader first)."""
    nodes = route.get("nodes") or []
    return str(nodes[0]) if nodes else None


def routable(routes: Sequence[Mapping[str, Any]]) -> list[Candidate]:
    out = []
    for r in routes:
        leader = leader_of(r)
        weight = float(r.get("weight") or 0.0)
        if r.get("frozen") or weight <= 0 or leader is None or not r.get("plan_id"):
            continue
        out.append(Candidate(str(r["plan_id"]), weight, leader, r))
    return out


def order_routes(routes: Sequence[Mapping[str, Any]], outstanding: Mapping[str, int],
                 rng: random.Random) -> list[Candidate]:
    """Every routable candidate, in the order to try them (module docstring)."""
    cands = routable(routes)
    if not cands:
        return []
    pick = rng.random() * sum(c.weight for c in cands)
    drawn = cands[-1]
    for c in cands:
        pick -= c.weight
        if pick <= 0:
            drawn = c
            break
    ties = [c for c in cands if c.weight == drawn.weight]
    first = min(ties, key=lambda c: outstanding.get(c.plan_id, 0))
    rest = sorted((c for c in cands if c is not first), key=lambda c: (-c.weight, outstanding.get(c.plan_id, 0)))
    return [first, *rest]


def any_frozen(routes: Sequence[Mapping[str, Any]]) -> bool:
    return any(r.get("frozen") for r in routes)
