"""The cluster changing under the plans: at each scenario change (a GPU preempted or failed, a
node gone or joined, a link degraded) and each injected one (`set_gpu_owner`) every plan that
lost a GPU stops - as a real engine crashes when one of its ranks disappears - and its requests
go back to the router to be recomputed; plans across nodes get new profiles when a link changes. `break_gpus` does the
same for an injected fault. A mixin of FleetSim (agents/sim/fleet.py)."""

# mypy: disable-error-code="misc"
# (its methods take `self: FleetSim`, the class that mixes it in: mypy wants a self type to be a
# supertype of the mixin, which the simulator is not; everything else is checked as usual)

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from agents.sim.cluster import US, Change
from agents.sim.engine import KIND_CLUSTER, Event, PlanEngine
from scheduler.costmodel import PlanProfile

if TYPE_CHECKING:
    from agents.sim.fleet import FleetSim


class Churn:
    """FleetSim's cluster changes and the plans they break (module docstring)."""

    def _push_cluster(self: FleetSim) -> None:
        nxt = self.cluster.next_change_s()
        if nxt is not None:
            self._push(nxt, KIND_CLUSTER, self._on_cluster, None)

    def _on_cluster(self: FleetSim, t: float, _: object) -> list[Event]:
        self._account_availability(t)  # (what was ours until now, before the change)
        out = self._changed(t, self.cluster.advance_to(t))
        self._push_cluster()
        return out

    def set_gpu_owner(self: FleetSim, uuids: Iterable[str], owner: str) -> None:
        """An injected cluster change (a test's world, a fault): these GPUs change hands now -
        another tenant takes them (`cluster.TENANT`), they fail (`FAILED`) or come back (`US`) -
        with what a scenario change does: every plan on a GPU no longer ours stops."""
        self._account_availability(self.now_s)
        change = self.cluster.set_owner(uuids, owner, self.now_s)
        if change is not None:
            self._push_all(self._changed(self.now_s, [change]))

    def _changed(self: FleetSim, t: float, changes: list[Change]) -> list[Event]:
        """The plans after the cluster changed (availability accounted up to `t` already)."""
        self.change_log.extend(changes)
        self._snapshot = None
        self._links = None
        if self.jobs:
            self._jobs_lost(t)  # a job on a GPU no longer ours crashes to its checkpoint; GPUs back: jobs start
        gpus = self._gpus_by_uuid()
        out: list[Event] = []
        broke: dict[str, list[PlanEngine]] = {}
        broke_nodes: dict[str, set[str]] = {}  # node -> deployments whose serving plan it broke
        for engine in list(self.live.values()):
            gone = [u for u in engine.plan.gpu_uuids if u not in gpus or gpus[u].owner != US]
            if not gone:
                continue
            serving = engine.state == "serving"
            out += self._kill(engine, t)
            if serving:
                broke.setdefault(engine.deployment, []).append(engine)
                for u in gone:
                    broke_nodes.setdefault(self._gpu_home[u][0], set()).add(engine.deployment)
        if any(c.kind in ("degrade_link", "link_restored", "join", "leave") for c in changes):
            snap = self.snapshot()
            for engine in self.live.values():
                if len(set(self._plan_nodes(engine.plan))) > 1:
                    engine.profile = PlanProfile.build(engine.plan, engine.model, snap, self.eff)
                    for pipe, role in zip(engine.pipes, ("prefill", "decode"), strict=False):
                        pipe.prof = engine.profile.pipeline(role)  # type: ignore[arg-type]
                    self._routes = {k: v for k, v in self._routes.items() if engine.engine_id not in k}
        # each broken deployment is charged to the change that took its GPUs' node
        for c in changes:
            hit = sorted(broke_nodes.pop(c.node or "", set())) if c.kind in ("preempt", "fail", "leave") else []
            self.recorder.change(c.at_s, c.kind, c.node, c.text, hit)
        self.listener.on_cluster_change(self, t, changes, broke)
        return out

    def _kill(self: FleetSim, engine: PlanEngine, t: float) -> list[Event]:
        """A plan lost a GPU: it stops now, its KV is gone, its requests are recomputed."""
        dep = self.deployments[engine.deployment]
        was_routed = engine.accepting
        reqs, out = engine.stop(t, keep_kv=self.kv_survives_loss)
        self._drop(engine, t)
        if was_routed:
            self._gear_changed(dep, t, serving=False)
        for req in reqs:
            if (req.generated or req.done) and not req.has_kv:
                req.replays += 1
            out += self._dispatch(dep, req, t)
        return out

    def break_gpus(self: FleetSim, uuids: Iterable[str]) -> list[PlanEngine]:
        """Every plan holding one of these GPUs crashes now, as when a rank dies, though the GPUs
        stay ours (an injected fault, not a scenario event): its KV is gone and its requests go
        back to the router to be recomputed. Returns the engines that stopped."""
        hit = set(uuids)
        broken = [e for e in self.live.values() if hit.intersection(e.plan.gpu_uuids)]
        for engine in broken:
            self._push_all(self._kill(engine, self.now_s))
        return broken
