"""In-flight sequences and the per-sequence choice (finish, migrate or replay: `plan_moves`),
and where a plan lives in a snapshot (its nodes, its stages on a node, the GPUs it lost)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from scheduler.costmodel import (
    DEFAULT_EFFICIENCY,
    Efficiency,
    KvRoute,
    PlanProfile,
    kv_route,
    migrate_or_replay,
)
from scheduler.modelspec import ModelSpec
from scheduler.plan import Plan
from scheduler.topology import Snapshot
from scheduler.transition.records import _num_or
from scheduler.transition.vocabulary import JsonDict


# --- sequences and the per-sequence choice -------------------------------------------------------
@dataclass(frozen=True)
class SeqInfo:
    """One in-flight sequence as a frozen plan reports it (freeze_plan's ack)."""

    seq_id: str
    context_tokens: int  # prompt + generated so far: what its KV cache holds
    generated_tokens: int
    max_tokens: int  # its output limit
    state: Literal["running", "waiting"] = "running"  # waiting = idle, not in the running batch
    kv_lost: bool = False  # its KV is gone (GPUs lost): it can only be replayed

    @property
    def remaining_tokens(self) -> int:
        return max(0, self.max_tokens - self.generated_tokens)

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> SeqInfo:
        state = d.get("state", "running")
        return cls(seq_id=str(d.get("seq_id")), context_tokens=int(_num_or(d.get("context_tokens"), 0)),
                   generated_tokens=int(_num_or(d.get("generated_tokens"), 0)),
                   max_tokens=int(_num_or(d.get("max_tokens"), 0)),
                   state="waiting" if state == "waiting" else "running", kv_lost=bool(d.get("kv_lost", False)))


@dataclass(frozen=True)
class MoveDirective:
    """What to do with one sequence of a leaving plan."""

    seq_id: str
    action: Literal["migrate", "replay", "finish"]
    target_plan: str  # plan_id ('' for finish)
    target_node: str  # the target plan's leader ('' for finish)
    context_tokens: int
    est_stall_s: float  # the cost model's estimate of how long it stands still
    lazy: bool = False  # idle sequence: move after the active ones

    def to_payload(self, target_addr: str, bw_cap_bytes_per_s: float) -> JsonDict:
        # the payload is saved in the record before it is sent, as strict JSON (PostgreSQL's jsonb
        # refuses Infinity): a figure the cost model has none for - a link never measured makes
        # both moves infinitely dear - goes as 0, "no cap" / "no estimate", as the protocol reads it
        return {"seq_id": self.seq_id, "action": self.action, "target_plan": self.target_plan,
                "target_node": self.target_node, "target_addr": target_addr,
                "bw_cap_bytes_per_s": bw_cap_bytes_per_s if math.isfinite(bw_cap_bytes_per_s) else 0.0,
                "lazy": self.lazy,
                "est_stall_s": round(self.est_stall_s, 6) if math.isfinite(self.est_stall_s) else 0.0}


def plan_moves(
    sequences: Sequence[SeqInfo],
    source: Plan,
    targets: Sequence[tuple[Plan, float]],
    model: ModelSpec,
    snapshot: Snapshot,
    *,
    drain_budget_s: float,
    bw_share: float,
    source_step_s: float | None = None,
    eff: Efficiency = DEFAULT_EFFICIENCY,
    kv_compatible: bool = True,
) -> list[MoveDirective]:
    """Per sequence of `source`, the cheapest of finishing there, migrating or replaying.

    `kv_compatible=False` (source and targets load different weights: a rollout) rules migration
    out - KV computed by other weights means nothing to the target - so a sequence that moves is
    replayed (its tokens re-prefilled there).

    Invariants of the result: every sequence appears once; active (running) sequences come
    before idle ones, each group longest context first (seed 000 section 5.3: long sequences
    move first, short ones are left to finish). A sequence stays to finish when the source
    still works and it finishes within `drain_budget_s` or sooner than it could move; else it
    goes to the target (weight > 0) where its move is cheapest; an idle sequence always moves - migrate when moving its KV
    over the link, capped at `bw_share` of it, beats re-prefilling it there
    (`costmodel.migrate_or_replay`); a sequence whose KV is lost is replayed. How long a
    sequence takes to finish uses `source_step_s`, the decode iteration the source engine
    measured (freeze_plan reports it), else the cost model's.
    """
    src_ok = _plan_usable(source, snapshot)
    src_stages = source.decode_stages if source.mode == "disaggregated" else source.stages
    src_profile = PlanProfile.build(source, model, snapshot, eff) if src_ok else None
    running = sum(1 for s in sequences if s.state == "running")
    usable = [(p, w) for p, w in targets if w > 0 and _plan_usable(p, snapshot)]
    if not usable:
        usable = [(p, w) for p, w in targets if _plan_usable(p, snapshot)]
    routes: dict[str, KvRoute] = {}
    pipes = {}
    for plan, _ in usable:
        dst_stages = plan.decode_stages if plan.mode == "disaggregated" else plan.stages
        route = kv_route(src_stages, dst_stages, model, snapshot, eff) if src_ok else KvRoute(math.inf, math.inf, 1)
        if math.isfinite(route.s_per_token):
            route = KvRoute(route.latency_s, route.s_per_token / bw_share, route.bytes_per_token)
        routes[plan.plan_id] = route
        pipes[plan.plan_id] = PlanProfile.build(plan, model, snapshot, eff).pipeline("prefill")
    assigned: dict[str, int] = {p.plan_id: 0 for p, _ in usable}
    weights = {p.plan_id: w for p, w in usable}
    ordered = sorted(sequences, key=lambda s: (s.state != "running", -s.context_tokens, s.seq_id))
    out: list[MoveDirective] = []
    for s in ordered:
        finish_s = math.inf  # idle (waiting) sequences always move: on the old plan they would wait first
        if src_profile is not None and not s.kv_lost and s.state == "running":
            step_s = source_step_s if source_step_s else src_profile.pipeline("decode").decode_step_s(
                max(1, running), max(1, s.context_tokens))
            finish_s = s.remaining_tokens * step_s
        best: tuple[float, float, str, Literal["migrate", "replay"]] | None = None
        for plan, _ in usable:
            pid = plan.plan_id
            route = routes[pid] if not s.kv_lost and kv_compatible else KvRoute(math.inf, math.inf, 1)
            move = migrate_or_replay(max(1, s.context_tokens), route, pipes[pid])
            choice: Literal["migrate", "replay"] = "replay" if move.choice == "replay" else "migrate"
            if move.choice == "stay":  # same GPUs, same layers: the KV is already in place
                cost = 0.0
            else:
                cost = move.migrate_s if choice == "migrate" else move.replay_s
            balance = assigned[pid] / max(weights[pid], 1e-9)
            cand = (cost, balance, pid, choice)
            if best is None or cand[:3] < best[:3]:
                best = cand
        if best is None or (finish_s <= max(drain_budget_s, best[0] if best else 0.0) and math.isfinite(finish_s)):
            out.append(MoveDirective(s.seq_id, "finish", "", "", s.context_tokens, 0.0, s.state == "waiting"))
            continue
        cost, _, pid, choice = best
        assigned[pid] += 1
        target = next(p for p, _ in usable if p.plan_id == pid)
        out.append(MoveDirective(s.seq_id, choice, pid, _leader_from_snapshot(target, snapshot), s.context_tokens,
                                 cost, s.state == "waiting"))
    return out


def _plan_usable(plan: Plan, snapshot: Snapshot) -> bool:
    """Every GPU of the plan is reported, healthy and ours (schedulable)."""
    gpus = snapshot.gpu_by_uuid
    nodes = snapshot.node_by_id
    for u in plan.gpu_uuids:
        g = gpus.get(u)
        if g is None or not g.healthy or not g.schedulable:
            return False
        n = nodes.get(g.node_id)
        if n is None or not n.schedulable:
            return False
    return True


def lost_gpus(plan: Plan, snapshot: Snapshot) -> list[str]:
    """GPUs of `plan` that are gone, unhealthy, taken by another tenant or on a cordoned node."""
    gpus = snapshot.gpu_by_uuid
    nodes = snapshot.node_by_id
    out = []
    for u in plan.gpu_uuids:
        g = gpus.get(u)
        n = nodes.get(g.node_id) if g is not None else None
        if g is None or not g.healthy or not g.schedulable or n is None or not n.schedulable:
            out.append(u)
    return out


def plan_nodes(plan: Plan, snapshot: Snapshot) -> tuple[str, ...]:
    """Nodes that host `plan`'s GPUs, the leader (its first stage's node) first; GPUs missing
    from the snapshot are skipped."""
    out: list[str] = []
    gpus = snapshot.gpu_by_uuid
    for u in plan.gpu_uuids:
        g = gpus.get(u)
        if g is not None and g.node_id not in out:
            out.append(g.node_id)
    return tuple(out)


def _leader_from_snapshot(plan: Plan, snapshot: Snapshot) -> str:
    nodes = plan_nodes(plan, snapshot)
    return nodes[0] if nodes else ""


def node_stages(plan: Plan, node_id: str, snapshot: Snapshot) -> list[JsonDict]:
    """The stages (or parts of stages) of `plan` on `node_id`, as prepare_plan names them."""
    out: list[JsonDict] = []
    gpus = snapshot.gpu_by_uuid
    for pipeline, stages in (("prefill" if plan.mode == "disaggregated" else "main", plan.stages),
                             ("decode", plan.decode_stages)):
        for i, st in enumerate(stages):
            ranks = [r for r, u in enumerate(st.gpu_uuids) if (g := gpus.get(u)) is not None and g.node_id == node_id]
            if ranks:
                out.append({"pipeline": pipeline, "index": i, "layers": [st.layer_start, st.layer_end],
                            "tp": st.tp, "gpus": list(st.gpu_uuids), "ranks": ranks})
    return out

def _present(nodes: Sequence[str], snap: Snapshot) -> tuple[str, ...]:
    """Nodes still in the snapshot (a node that left has nothing left to undo)."""
    return tuple(n for n in nodes if n in snap.node_by_id)
