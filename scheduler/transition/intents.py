"""What each step of a transition will do, computed once and saved before it is done: its
commands (with the prepare_plan and move_sequences payloads), its reservations and its routing
target. `StepIntents` is the part of the executor that builds them (`Executor` derives from it)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

from scheduler.booking import plan_memory
from scheduler.costmodel import Efficiency
from scheduler.modelspec import ModelSpec
from scheduler.plan import Gear, Plan
from scheduler.topology import Snapshot
from scheduler.transition.moves import SeqInfo, _present, node_stages, plan_moves, plan_nodes
from scheduler.transition.ports import (
    AgentPort,
    ModelResolver,
    RoutingTable,
    WeightsResolver,
)
from scheduler.transition.records import (
    CommandIntent,
    Intent,
    Route,
    RoutingState,
    TransitionRecord,
    _num_or,
    _str_list,
)
from scheduler.transition.vocabulary import (
    CommandKind,
    JsonDict,
    Kind,
    Step,
    TransitionConfig,
)


def _shape(gear: Gear | None) -> str:
    return gear.shape() if gear is not None else "nothing"


class StepIntents:
    """The executor's planning half: from a record and a step, the `Intent` to save. Reads the
    record, the snapshot and the routing state; has no effect of its own."""

    agents: AgentPort
    routing: RoutingTable
    config: TransitionConfig
    models: ModelResolver
    eff: Efficiency
    weights: WeightsResolver

    # -- what a step will do (computed once, saved before it is done) ---------------------------
    def _intent(self, rec: TransitionRecord, step: Step, attempt: int) -> Intent:
        cfg = self.config
        model = self.models(rec.model)
        snap = self.agents.snapshot()
        routing = self.routing.current(rec.deployment_id)
        new_ids = {p.plan_id for p in rec.new_plans}

        def commands(kind: CommandKind, plans: Iterable[tuple[Plan, Sequence[str], JsonDict]]) -> tuple[
                CommandIntent, ...]:
            return self._commands(rec, step, attempt, kind, plans)

        if step is Step.RESERVE:
            needs = {p.plan_id: plan_memory(p, model) for p in rec.new_plans}
            return Intent(needs=needs, note=f"book {len(needs)} new plan(s)", noop=not needs)
        if step is Step.PREPARE:
            cmds = commands(CommandKind.PREPARE_PLAN, ((p, plan_nodes(p, snap), {}) for p in rec.new_plans))
            return Intent(commands=cmds, timeout_s=cfg.prepare_timeout_s, noop=not rec.new_plans,
                          note=f"prepare {len(rec.new_plans)} shadow plan(s) on {len({c.node_id for c in cmds})} node(s)")
        if step is Step.CANARY:
            # built from the stable gear, not from the table now: a retry must not compound the share
            old = [r for r in self._stable_routes(rec, routing, snap) if r.weight > 0]
            if not rec.new_plans or not old:
                return Intent(routes=routing.routes, base_version=routing.version, noop=True,
                              note="no canary: nothing else serves yet" if not old else "no canary: no new plan")
            share = cfg.canary_share
            routes = [replace(r, weight=r.weight * (1 - share)) for r in old]
            new_total = sum(w for p, w in zip(rec.to_gear.plans, rec.to_gear.weights, strict=True)
                            if p.plan_id in new_ids) or 1.0
            for p, w in zip(rec.to_gear.plans, rec.to_gear.weights, strict=True):
                if p.plan_id in new_ids:
                    routes.append(Route(p, share * (w / new_total if new_total else 1.0 / len(new_ids)),
                                        nodes=plan_nodes(p, snap)))
            return Intent(routes=tuple(routes), base_version=routing.version, timeout_s=cfg.canary_dwell_s + 60.0,
                          note=f"canary: {share:.0%} of new requests to the new plan(s)")
        if step is Step.FLIP:
            routes = self._target_routes(rec, routing, snap)
            routes += [replace(r, weight=0.0, frozen=True) for r in self._leaving_routes(rec, routing, snap)]
            return Intent(routes=tuple(routes), base_version=routing.version, timeout_s=60.0,
                          note=f"flip to {rec.to_gear.shape()}; {len(rec.leaving_plans)} leaving plan(s) frozen")
        if step is Step.FREEZE:
            leaving = self._leaving_routes(rec, routing, snap)
            cmds = commands(CommandKind.FREEZE_PLAN, ((r.plan, r.nodes[:1], {"routing_version": routing.version})
                                                      for r in leaving if r.nodes))
            return Intent(commands=cmds, timeout_s=cfg.step_timeout_s, noop=not cmds,
                          note=f"freeze {len(cmds)} leaving plan(s)")
        if step is Step.MOVE:
            return self._move_intent(rec, step, attempt, rec.ok_result(Step.FREEZE), self._leaving_routes(
                rec, routing, snap), [(p, w) for p, w in zip(rec.to_gear.plans, rec.to_gear.weights, strict=True)],
                model, snap, routing.version)
        if step is Step.UNROUTE:
            routes = self._target_routes(rec, routing, snap)
            return Intent(routes=tuple(routes), base_version=routing.version, timeout_s=60.0,
                          note=f"drop {len(rec.leaving_plans)} leaving plan(s) from the routing table")
        if step is Step.RELEASE:
            leaving = self._leaving_routes(rec, routing, snap, include_unrouted=True)
            # sequences left to finish get twice the budget they were chosen by (estimates err);
            # what cannot finish there (the drain ran out, or the plan lost its GPUs) is replayed
            # on the target gear's main plan rather than lost
            drain_s = 2 * cfg.drain_budget_s
            body: JsonDict = {"drain_timeout_s": drain_s}
            fallback = self._fallback(rec, routing)
            if fallback:
                body["fallback"] = fallback
            cmds = commands(CommandKind.RELEASE_PLAN, ((r.plan, _present(r.nodes, snap), body) for r in leaving))
            return Intent(commands=cmds, timeout_s=cfg.release_timeout_s + drain_s, noop=not cmds,
                          note=f"release {len(leaving)} leaving plan(s)")
        if step is Step.UNRESERVE:
            ids = tuple(p.plan_id for p in rec.leaving_plans)
            return Intent(plan_ids=ids, noop=not ids, note=f"unbook {len(ids)} leaving plan(s)")
        # -- rollback --
        # the new plans may have taken requests once a flip, or a real canary, was saved
        routed = rec.started(Step.FLIP) or any(not a.intent.noop for a in rec.attempts(Step.CANARY))
        if step is Step.RB_THAW:
            if not rec.started(Step.FREEZE):
                return Intent(noop=True, note="nothing was frozen")
            leaving = self._leaving_routes(rec, routing, snap, include_unrouted=True)
            cmds = commands(CommandKind.THAW_PLAN, ((r.plan, _present(r.nodes[:1], snap), {}) for r in leaving))
            return Intent(commands=cmds, timeout_s=cfg.step_timeout_s, noop=not cmds,
                          note=f"thaw {len(cmds)} leaving plan(s)")
        if step is Step.RB_ROUTE:
            if not routed:
                return Intent(routes=routing.routes, base_version=routing.version, noop=True,
                              note="routing was never changed")
            routes = self._stable_routes(rec, routing, snap)
            routes += [replace(r, weight=0.0, frozen=True) for r in routing.routes if r.plan_id in new_ids]
            return Intent(routes=tuple(routes), base_version=routing.version, timeout_s=60.0,
                          note=f"route back to {_shape(rec.from_gear)}; new plan(s) frozen")
        if step is Step.RB_FREEZE:
            new_routes = [r for r in routing.routes if r.plan_id in new_ids]
            if not routed or not new_routes:
                return Intent(noop=True, note="the new plans never took requests")
            cmds = commands(CommandKind.FREEZE_PLAN, ((r.plan, _present(r.nodes[:1], snap),
                                                       {"routing_version": routing.version}) for r in new_routes))
            return Intent(commands=cmds, timeout_s=cfg.step_timeout_s, noop=not cmds,
                          note=f"freeze {len(cmds)} new plan(s)")
        if step is Step.RB_MOVE:
            new_routes = [r for r in routing.routes if r.plan_id in new_ids]
            if not routed or not new_routes:
                return Intent(noop=True, note="the new plans never took requests")
            targets = list(zip(rec.from_gear.plans, rec.from_gear.weights, strict=True)) if rec.from_gear else []
            # nothing is left to finish on a plan that is about to be aborted, unless that is
            # cheaper than moving it (abort_plan drains those first)
            return self._move_intent(rec, step, attempt, rec.ok_result(Step.RB_FREEZE), new_routes, targets, model,
                                     snap, routing.version, drain_budget_s=0.0)
        if step is Step.RB_UNROUTE:
            if not routed:
                return Intent(routes=routing.routes, base_version=routing.version, noop=True,
                              note="routing was never changed")
            routes = [r for r in routing.routes if r.plan_id not in new_ids]
            return Intent(routes=tuple(routes), base_version=routing.version, timeout_s=60.0,
                          note="drop the new plan(s) from the routing table")
        if step is Step.RB_ABORT:
            if not rec.done(Step.RESERVE):
                # nothing was booked, so nothing was prepared: the plans on those GPUs (if any)
                # belong to someone else and must not be touched
                return Intent(noop=True, note="the booking never succeeded: nothing to abort")
            nodes_of = self._prepared_nodes(rec)
            why: JsonDict = {"reason": rec.error or "rolled back", "drain_timeout_s": 2 * cfg.drain_budget_s}
            plans = [(p, _present(nodes_of.get(p.plan_id, plan_nodes(p, snap)), snap), why) for p in rec.new_plans]
            cmds = commands(CommandKind.ABORT_PLAN, plans)
            return Intent(commands=cmds, timeout_s=cfg.step_timeout_s + 2 * cfg.drain_budget_s, noop=not cmds,
                          note=f"abort {len(rec.new_plans)} new plan(s)")
        if step is Step.RB_UNRESERVE:
            ids = tuple(p.plan_id for p in rec.new_plans)
            return Intent(plan_ids=ids, noop=not ids, note=f"unbook {len(ids)} new plan(s)")
        raise ValueError(f"step: unknown step {step!r}")

    def _commands(self, rec: TransitionRecord, step: Step, attempt: int, kind: CommandKind,
                  plans: Iterable[tuple[Plan, Sequence[str], JsonDict]], suffix: str = "") -> tuple[CommandIntent, ...]:
        """One command per (plan, node), keyed by (deployment, seq, step, attempt, node, plan)."""
        snap = self.agents.snapshot()
        model = self.models(rec.model)
        out = []
        for plan, nodes, payload in plans:
            for node in nodes:
                key = f"{rec.deployment_id}/{rec.seq}/{step.value}/{attempt}/{node}/{plan.plan_id}"
                body = dict(payload)
                body.setdefault("plan_id", plan.plan_id)
                body.setdefault("deployment", rec.deployment_id)
                if kind is CommandKind.PREPARE_PLAN:
                    body = self._prepare_payload(rec, plan, node, snap, model, body)
                out.append(CommandIntent(key + (f"/{suffix}" if suffix else ""), node, kind, body,
                                         rec.deployment_id, rec.seq, step, attempt))
        return tuple(out)

    def _prepare_payload(self, rec: TransitionRecord, plan: Plan, node: str, snap: Snapshot, model: ModelSpec,
                         body: JsonDict) -> JsonDict:
        memory = plan_memory(plan, model)
        stages = node_stages(plan, node, snap)
        mine = {u for st in stages for u in _str_list(st["gpus"], "gpus")
                if (g := snap.gpu_by_uuid.get(u)) is not None and g.node_id == node}
        nodes = plan_nodes(plan, snap)
        load = self.weights(rec) or {}
        if load.get("model_version"):
            body["model_version"] = load["model_version"]
        if load.get("slo"):
            body["slo"] = load["slo"]
        body.update({
            "plan": plan.to_dict(),
            "model": rec.model,
            # the shape reserve_bytes was sized with: an agent that does not know the model runs it from this
            "model_spec": model.to_dict(),
            "weights_sha256": load.get("weights_sha256"),
            "role": "leader" if nodes and nodes[0] == node else "member",
            "stages": stages,
            "reserve_bytes": {u: memory[u] for u in sorted(mine)},
            "peers": {n: self.agents.data_addr(n) for n in nodes if n != node},
        })
        return body

    def _move_intent(self, rec: TransitionRecord, step: Step, attempt: int, frozen: Mapping[str, object],
                     sources: Sequence[Route], targets: Sequence[tuple[Plan, float]], model: ModelSpec,
                     snap: Snapshot, routing_version: int, drain_budget_s: float | None = None) -> Intent:
        per_plan = frozen.get("sequences", {})
        if not isinstance(per_plan, Mapping):
            per_plan = {}
        steps = frozen.get("decode_step_s", {})
        if not isinstance(steps, Mapping):
            steps = {}
        cmds: list[CommandIntent] = []
        est_total = 0.0
        counts = {"migrate": 0, "replay": 0, "finish": 0}
        for r in sources:
            raw = per_plan.get(r.plan_id, [])
            seqs = [SeqInfo.from_dict(s) for s in raw if isinstance(s, Mapping)] if isinstance(raw, list) else []
            if not seqs or not r.nodes:
                continue
            measured = _num_or(steps.get(r.plan_id), 0.0)
            directives = plan_moves(seqs, r.plan, [(p, w) for p, w in targets if p.plan_id != r.plan_id], model,
                                    snap, drain_budget_s=self.config.drain_budget_s if drain_budget_s is None
                                    else drain_budget_s,
                                    bw_share=self.config.migrate_bw_share, source_step_s=measured or None,
                                    eff=self.eff, kv_compatible=rec.kind is not Kind.ROLLOUT)
            bw_cap = {d.target_node: self._bw_cap(r.nodes[0], d.target_node, snap) for d in directives}
            moves = [d.to_payload(self.agents.data_addr(d.target_node) if d.target_node else "",
                                  bw_cap.get(d.target_node, 0.0)) for d in directives]
            for d in directives:
                counts[d.action] += 1
                if d.action in ("migrate", "replay") and math.isfinite(d.est_stall_s):
                    est_total += d.est_stall_s  # an unknown cost leaves the step the base move timeout
            key = f"{rec.deployment_id}/{rec.seq}/{step.value}/{attempt}/{r.nodes[0]}/{r.plan_id}"
            cmds.append(CommandIntent(key, r.nodes[0], CommandKind.MOVE_SEQUENCES,
                                      {"plan_id": r.plan_id, "deployment": rec.deployment_id,
                                       "routing_version": routing_version,
                                       "boundary": "decode_end", "moves": moves},
                                      rec.deployment_id, rec.seq, step, attempt))
        note = (f"{counts['migrate']} to migrate, {counts['replay']} to replay, {counts['finish']} to finish"
                if cmds else "no sequence to move")
        return Intent(commands=tuple(cmds), timeout_s=self.config.move_timeout_s + 2 * est_total, noop=not cmds,
                      note=note)

    def _fallback(self, rec: TransitionRecord, routing: RoutingState) -> JsonDict | None:
        """Where a releasing plan replays what it cannot finish: the target gear's heaviest routed plan."""
        best: Route | None = None
        for r in routing.routes:
            if r.frozen or r.weight <= 0 or not r.nodes or r.plan not in rec.to_gear.plans:
                continue
            if best is None or r.weight > best.weight:
                best = r
        if best is None:
            return None
        return {"target_plan": best.plan_id, "target_node": best.nodes[0],
                "target_addr": self.agents.data_addr(best.nodes[0]), "routing_version": routing.version}

    def _bw_cap(self, src_node: str, dst_node: str, snap: Snapshot) -> float:
        if not dst_node or src_node == dst_node:
            return 0.0  # inside a node: NVLink/PCIe copies, no cap
        bw = snap.node_link_bytes_per_s(src_node, dst_node)
        return bw * self.config.migrate_bw_share if math.isfinite(bw) else 0.0

    def _target_routes(self, rec: TransitionRecord, routing: RoutingState, snap: Snapshot) -> list[Route]:
        out = []
        for p, w in zip(rec.to_gear.plans, rec.to_gear.weights, strict=True):
            existing = routing.route(p.plan_id)
            nodes = existing.nodes if existing is not None and existing.nodes else plan_nodes(p, snap)
            out.append(Route(p, w, False, nodes))
        return out

    def _stable_routes(self, rec: TransitionRecord, routing: RoutingState, snap: Snapshot) -> list[Route]:
        if rec.from_gear is None:
            return []
        out = []
        for p, w in zip(rec.from_gear.plans, rec.from_gear.weights, strict=True):
            existing = routing.route(p.plan_id)
            nodes = existing.nodes if existing is not None and existing.nodes else plan_nodes(p, snap)
            out.append(Route(p, w, False, nodes))
        return out

    def _leaving_routes(self, rec: TransitionRecord, routing: RoutingState, snap: Snapshot, *,
                        include_unrouted: bool = False) -> list[Route]:
        out = []
        for p in rec.leaving_plans:
            existing = routing.route(p.plan_id)
            if existing is not None:
                out.append(existing if existing.nodes else replace(existing, nodes=plan_nodes(p, snap)))
            elif include_unrouted:
                out.append(Route(p, 0.0, True, self._remembered_nodes(rec, p) or plan_nodes(p, snap)))
        return out

    def _remembered_nodes(self, rec: TransitionRecord, plan: Plan) -> tuple[str, ...]:
        """Nodes a plan was routed with earlier in this transition (its route may be gone now)."""
        for s in reversed(rec.steps):
            for r in s.intent.routes or ():
                if r.plan_id == plan.plan_id and r.nodes:
                    return r.nodes
        return ()

    def _prepared_nodes(self, rec: TransitionRecord) -> dict[str, tuple[str, ...]]:
        out: dict[str, list[str]] = {}
        for s in rec.attempts(Step.PREPARE):
            for c in s.intent.commands:
                pid = str(c.payload.get("plan_id", ""))
                if c.node_id not in out.setdefault(pid, []):
                    out[pid].append(c.node_id)
        return {k: tuple(v) for k, v in out.items()}
