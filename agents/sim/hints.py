"""The global correction's hints on the simulated fleet (agents/protocol.py: `apply_hints`;
scheduler/control/correction.py: the rules). A node keeps its hints in its own HintBook; each plan
it leads reads the batch-token threshold there on its local loop (agents/sim/engine.py), and the
fleet's routing (the live fleet's gateway side: agents/sim/live.py) multiplies the plan's table
weight by the hint's weight multiplier while the hint lives. A mixin of FleetSim (agents/sim/fleet.py)."""

# mypy: disable-error-code="misc"
# (its methods take `self: FleetSim`, the class that mixes it in: see agents/sim/churn.py)

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

from scheduler.control.correction import HintBook, hints_from_payload

if TYPE_CHECKING:
    from agents.sim.fleet import FleetSim


class Hinting:
    """FleetSim's side of `apply_hints` (module docstring)."""

    def apply_hints(self: FleetSim, node_id: str, payload: Mapping[str, object], *, ttl_scale: float = 1.0
                    ) -> tuple[str, dict[str, object]]:
        """Carry out one `apply_hints` that agents.protocol.check_payload accepted, on `node_id`, at
        the simulator's now; `ttl_scale` turns the controller's seconds into sim seconds (the live
        fleet's time scale). Returns the ack's (detail, result)."""
        deployment, version, ttl_s, hints = hints_from_payload(payload)
        book = self.hint_books.setdefault(node_id, HintBook())
        if not book.apply(deployment, version, ttl_s * ttl_scale, hints, self.now_s):
            held = book.versions[deployment]
            return (f"hints {version} of {deployment} ignored: {held} is newer",
                    {"applied": False, "hints_version": held, "plans": [], "unknown": []})
        took: list[str] = []
        unknown: list[str] = []
        for h in hints:
            engine = self.engine_of(deployment, h.plan_id) if deployment in self.deployments else None
            if engine is None or self._plan_nodes(engine.plan)[0] != node_id:
                unknown.append(h.plan_id)  # not a plan this node leads
                continue
            engine.hints = book
            engine.next_look_s = -math.inf  # its next round reads the new threshold
            took.append(h.plan_id)
        detail = f"hints {version} of {deployment}: {len(took)} plan(s)" + (
            f"; not led here: {', '.join(unknown)}" if unknown else "")
        return detail, {"applied": True, "hints_version": version, "plans": took, "unknown": unknown}

    def hinted_weight(self: FleetSim, deployment: str, plan_id: str) -> float:
        """The live weight multiplier of a plan (1 without a live hint), from its leader's book."""
        engine = self.engine_of(deployment, plan_id) if deployment in self.deployments else None
        if engine is None or engine.hints is None:
            return 1.0
        return engine.hints.weight(deployment, plan_id, self.now_s)


__all__ = ["Hinting"]
