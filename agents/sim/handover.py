"""Taking a plan out of service: drain, move (its sequences hand over at round boundaries, KV
migrated or recomputed, the cheaper), stop, or free. A mixin of FleetSim (agents/sim/fleet.py)."""

# mypy: disable-error-code="misc"
# (its methods take `self: FleetSim`, the class that mixes it in: mypy wants a self type to be a
# supertype of the mixin, which the simulator is not; everything else is checked as usual)

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from agents.sim.engine import Event, Pipe, PlanEngine, Request
from agents.sim.metrics import SwitchRecord
from scheduler.costmodel import kv_route, migrate_or_replay

if TYPE_CHECKING:
    from agents.sim.fleet import FleetSim
    from agents.sim.gateway import DeploymentRuntime


RetireMode = Literal["drain", "move", "stop", "free"]


class Handover:
    """FleetSim's retire and its hand-over of sequences (module docstring)."""

    def retire(self: FleetSim, engine: PlanEngine, mode: RetireMode, record: SwitchRecord | None = None) -> None:
        """Take a plan out of service.

        * drain: no new requests; what it holds finishes there; released when empty.
        * move: no new requests; its queue moves at once to the routed plans, and at its next
          round boundary its sequences move too - each the cheaper of migrating its KV (along
          `costmodel.kv_route`, one at a time per route) or recomputing it on the new plan
          (`costmodel.migrate_or_replay`) - except those within `stay_tokens` of done, which
          finish where they are (seed 000 section 5.3).
        * stop: at once; KV dropped, everything recomputed elsewhere.
        * free: at once, and every sequence arrives on the routed plans with its KV, at no cost
          (the oracle's switch).
        """
        t = self.now_s
        dep = self.deployments[engine.deployment]
        engine.accepting = False
        if engine.state == "dead" or engine.engine_id not in self.live:
            return
        if mode in ("stop", "free") or engine.state == "loading":
            reqs, events = engine.stop(t, keep_kv=mode == "free")
            self._push_all(events)
            self._drop(engine, t)
            out: list[Event] = []
            for req in reqs:
                if mode != "free" and (req.generated or req.done):
                    req.replays += 1
                out += self._dispatch(dep, req, t)
            self._push_all(out)
            if record is not None:
                if mode == "free":
                    record.migrated += len(reqs)
                else:
                    record.replayed += len(reqs)
            return
        engine.release_when_empty = True
        out = []
        for pipe in engine.pipes:
            queued = list(pipe.waiting)
            pipe.waiting.clear()
            for req in queued:
                self.paused(req, "idle")
                out += self._dispatch(dep, req, t)
        if mode == "move":
            for pipe in engine.pipes:
                hand = self._hand_over_fn(dep, record)
                if pipe.busy:
                    pipe.handover = hand
                else:
                    out += hand(pipe, t)
        self._push_all(out)
        if engine.empty():
            self._release(engine, t)

    def evict(self: FleetSim, engine: PlanEngine) -> list[Request]:
        """Stop a plan now and give back every sequence it held, KV dropped, owned by nobody until
        the caller hands each over (`PlanEngine.submit`, `dispatch`) or ends it (`failed`): what an
        agent does with a plan's sequences at the end of an abort's or a release's drain (agent
        protocol v1). A plan no longer running gives nothing."""
        engine.accepting = False
        if engine.state == "dead" or engine.engine_id not in self.live:
            return []
        t = self.now_s
        reqs, events = engine.stop(t)
        self._push_all(events)
        self._drop(engine, t)
        return reqs

    def _hand_over_fn(self: FleetSim, dep: DeploymentRuntime, record: SwitchRecord | None
                      ) -> Callable[[Pipe, float], list[Event]]:
        stay = self.options.stay_tokens

        def keep(req: Request) -> bool:
            return req.output - req.tokens_now() <= stay

        def hand(pipe: Pipe, t: float) -> list[Event]:
            out: list[Event] = []
            taken = pipe.take_running(keep)
            for req in taken:
                self.paused(req, "decode_end")  # the round in flight ended: a safe boundary
            queued = list(pipe.waiting)
            pipe.waiting.clear()
            for req in queued:
                self.paused(req, "idle")
            taken += queued
            if record is not None:
                record.stayed += len(pipe.running)
            for req in taken:
                out += self._move(dep, pipe.engine, req, t, record)
            return out

        return hand

    def _move(self: FleetSim, dep: DeploymentRuntime, src: PlanEngine, req: Request, t: float,
              record: SwitchRecord | None) -> list[Event]:
        """One sequence leaves `src` for a routed plan: KV migrated or recomputed, the cheaper."""
        dst, _ = self._route(dep, req)
        if dst is None or not req.has_kv:
            if req.has_kv:
                req.drop_kv()
            if req.generated or req.done:
                req.replays += 1
                if record is not None:
                    record.replayed += 1
            return self._dispatch(dep, req, t)
        key = (src.engine_id, dst.engine_id)
        hit = self._routes.get(key)
        if hit is None:
            src_stages = src.plan.decode_stages if src.plan.mode == "disaggregated" else src.plan.stages
            dst_stages = dst.plan.decode_stages if dst.plan.mode == "disaggregated" else dst.plan.stages
            hit = (kv_route(src_stages, dst_stages, dep.model, self.snapshot(), self.eff), t)
        route, free_s = hit
        move = migrate_or_replay(req.prompt + req.generated, route, dst.profile.pipeline("prefill"))
        if move.choice == "replay":
            req.drop_kv()
            req.replays += 1
            if record is not None:
                record.replayed += 1
            return dst.submit(req, t)
        start = max(t, free_s)
        land = start + move.migrate_s
        self._routes[key] = (route, land)
        req.migrations += 1
        if record is not None:
            record.migrated += 1
        return dst.expect(req, land)
