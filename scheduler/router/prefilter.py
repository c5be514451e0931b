"""Prefilter: the plans that may take this request at all - they serve the deployment's model,
are open (not frozen by a switch, routable, a weight above 0) and take its priority class.

A filter in the Kubernetes scheduler framework's sense: a plan it rejects is unresolvable for
this request (no waiting makes it a candidate), and the reason says which rule. The static half
is the pool's `base_ok`; only pools with priority-reserved plans look at the request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler.router.request import RouteRequest

if TYPE_CHECKING:
    from scheduler.router._arrays import Bools
    from scheduler.router.pool import Pool

NAME = "prefilter"


def prefilter(req: RouteRequest, pool: Pool) -> Bools:
    """Mask of the plans that pass."""
    if not pool.priority_limited:
        return pool.base_ok
    out: Bools = pool.base_ok & (req.priority <= pool.priority_max)
    return out


def why(req: RouteRequest, pool: Pool, i: int) -> str:
    """Why plan `i` did not pass (for an explanation)."""
    f = pool.facts[i]
    if pool.model is not None and f.model != pool.model:
        return f"serves {f.model}, not {pool.model}"
    if f.frozen:
        return "frozen by a switch in progress"
    if not f.routable:
        return "not routable (not serving, or its leader has no data address)"
    if f.weight <= 0:
        return "routing weight 0"
    if f.priority_max is not None and req.priority > f.priority_max:
        return f"takes priority <= {f.priority_max}; the request has {req.priority}"
    return ""
