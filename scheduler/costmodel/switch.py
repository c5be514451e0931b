"""The price of a gear change: `switch_cost` in output tokens of service lost, with its parts
(`SwitchCost`), and the per-sequence migrate-or-replay choice (`migrate_or_replay`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from scheduler._lazy import check_plain_dataclass, make_frozen
from scheduler.costmodel.kernels import DEFAULT_EFFICIENCY, MAX_BATCHED_TOKENS, Efficiency
from scheduler.costmodel.profiles import KvRoute, PipelineProfile, PlanProfile, kv_route
from scheduler.costmodel.workload import Estimate, Workload, _finite_or_none
from scheduler.modelspec import ModelSpec
from scheduler.plan import Gear, Plan
from scheduler.topology import Snapshot


# --- switch cost -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SequenceMove:
    """How one in-flight sequence reaches the new plan: migrate its KV or re-prefill it."""

    context_tokens: int  # tokens in its KV cache
    choice: Literal["migrate", "replay", "stay"]  # the cheaper; "stay" when its KV does not move
    migrate_bytes: int  # KV bytes a migration moves
    migrate_s: float  # time to move them
    replay_s: float  # time to re-prefill the context on the new plan

    @property
    def cost_s(self) -> float:
        return 0.0 if self.choice == "stay" else min(self.migrate_s, self.replay_s)


def migrate_or_replay(context_tokens: int, route: KvRoute, target: PipelineProfile,
                      chunk_tokens: int = MAX_BATCHED_TOKENS) -> SequenceMove:
    """Per sequence, the cheaper of moving its KV along `route` or recomputing it on `target`.

    The transition executor calls this for each sequence it hands over; `route` comes from
    `kv_route(old_stages, new_stages, ...)`, `target` from the new plan's profile.
    """
    if context_tokens <= 0 or route.bytes_per_token == 0:
        return SequenceMove(max(0, context_tokens), "stay", 0, 0.0, 0.0)
    migrate_s = route.time_s(context_tokens)
    replay_s = target.prefill_time_s(context_tokens, chunk_tokens)
    choice: Literal["migrate", "replay"] = "migrate" if migrate_s <= replay_s else "replay"
    return SequenceMove(context_tokens, choice, context_tokens * route.bytes_per_token, migrate_s, replay_s)


@dataclass(frozen=True)
class SwitchCost:
    """What a gear change costs, in parts. `tokens` (output tokens of service lost) is what the
    gearbox weighs against the gain."""

    tokens: float  # total: pause + contention + cold start, in output tokens
    pause_s: float  # SWITCH phase: moved sequences stall (KV migration + replay), counted as the gear pausing
    prepare_s: float  # PREPARE phase: weights load into the new plans while the old gear serves
    time_to_effect_s: float  # prepare + pause: when the new gear carries the load
    lost_pause_tokens: float  # served rate x pause
    lost_contention_tokens: float  # HBM time that copies steal from GPUs that keep serving
    lost_cold_start_tokens: float  # new plans warming up (empty prefix cache, allocator, graphs)
    kv_migrate_bytes: int  # KV bytes moved between GPUs
    kv_migrate_s: float  # time those copies take (one route's sequences one after another)
    migrate_seqs: int  # sequences whose KV moves
    replay_seqs: int  # sequences re-prefilled instead (the cheaper for them, or their KV is lost)
    replay_tokens: int  # tokens recomputed
    replay_s: float  # prefill time of those tokens on the new plan, in full chunks
    weight_load_bytes: int  # weights loaded onto GPUs that do not hold them yet
    weight_load_s: float  # time of that load (parallel per GPU; per node when from disk)
    weight_source: Literal["host", "disk", "none"]  # where they come from
    cold_start_s: float  # warm-up time charged for each new plan

    def to_dict(self) -> dict[str, object]:
        return {k: _finite_or_none(getattr(self, k)) for k in _SWITCH_FIELDS}

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> SwitchCost:
        values: dict[str, object] = {}
        for key in _SWITCH_FIELDS:
            if key not in d:
                raise ValueError(f"cost.{key}: required")
            values[key] = math.inf if d[key] is None else d[key]
        return cls(**values)  # type: ignore[arg-type]  # values come from to_dict


_SWITCH_FIELDS = (
    "tokens", "pause_s", "prepare_s", "time_to_effect_s", "lost_pause_tokens", "lost_contention_tokens",
    "lost_cold_start_tokens", "kv_migrate_bytes", "kv_migrate_s", "migrate_seqs", "replay_seqs",
    "replay_tokens", "replay_s", "weight_load_bytes", "weight_load_s", "weight_source", "cold_start_s",
)
check_plain_dataclass(SwitchCost, field_names=_SWITCH_FIELDS)  # built with make_frozen

DISK_BYTES_PER_S = 2e9  # stated: one NVMe drive per node, sequential read, shared by its GPUs
COLD_START_S = 2.0  # stated: service-seconds a new plan loses warming up (vLLM graph capture is in PREPARE)


def running_seqs(estimate: Estimate, share: float, workload: Workload) -> float:
    """Sequences in flight on a plan carrying `share` of the traffic (Little's law)."""
    if not math.isfinite(estimate.tpot_p50_s) or estimate.served_rps <= 0:
        return 0.0
    seqs = estimate.served_rps * share * workload.output_tokens_mean * estimate.tpot_p50_s
    return min(seqs, float(estimate.max_running_seqs))


def switch_cost(
    current: Gear | None,
    target: Gear,
    model: ModelSpec,
    snapshot: Snapshot,
    workload: Workload,
    *,
    current_estimate: Estimate | None = None,
    target_estimate: Estimate | None = None,
    weights_in_host_memory: bool = True,
    disk_bytes_per_s: float = DISK_BYTES_PER_S,
    cold_start_s: float = COLD_START_S,
    eff: Efficiency = DEFAULT_EFFICIENCY,
    profiles: Mapping[Plan, PlanProfile] | None = None,
) -> SwitchCost:
    """Cost of moving a deployment from `current` to `target` (seed 000 sections 3.1 and 3.4).

    * Weights: every GPU of a new plan that does not already hold the same shard (same
      layers, same TP rank) loads it, from host memory over its host link, or from disk at
      `disk_bytes_per_s` per node. This happens in PREPARE, while the old gear still serves.
    * In-flight sequences of the plans that go away (Little's law on the current estimate,
      lengths spread as the workload says) reach the new gear's largest new plan the cheaper
      way, per sequence (`migrate_or_replay`); a sequence whose KV sits on GPUs that are gone
      can only be replayed. Migrations on one route run one after another; replays run in
      full prefill chunks.
    * SWITCH pauses the moved sequences that long; we charge it as the whole gear pausing
      (lost = served tokens/s x pause), which is conservative.
    * Contention: copies into GPUs that keep serving steal their HBM time.
    * Cold start: each new plan loses `cold_start_s` of its share of the service.
    Plans present in both gears (equal plans, hence the same plan_id) cost nothing.
    """
    known: Mapping[Plan, PlanProfile] = profiles or {}

    def profile(plan: Plan) -> PlanProfile:
        hit = known.get(plan)
        return hit if hit is not None else PlanProfile.build(plan, model, snapshot, eff)

    # plans are values: equal plans are the same plan (cheaper than comparing plan_ids)
    old_plans = set(current.plans if current else ())
    new_plans = [p for p in target.plans if p not in old_plans]
    target_set = set(target.plans)
    served_tokens_s = current_estimate.throughput_tokens_s if current_estimate else 0.0
    new_tokens_s = target_estimate.throughput_tokens_s if target_estimate else served_tokens_s

    # which GPU holds which weight shard now
    held, serving = _holdings(current.plans if current else ())
    load_bytes = 0
    per_gpu_s: list[float] = []
    disk_per_node: dict[str, int] = {}
    contention_s = 0.0
    gpu_by_uuid = snapshot.gpu_by_uuid
    for plan in new_plans:
        for st in plan.all_stages:
            uuids = st.gpu_uuids
            shard = -(-model.stage_weight_bytes(st.layer_start, st.layer_end) // st.tp)
            # only GPUs of the current gear can already hold a shard or be serving
            touches_old = not serving.isdisjoint(uuids)
            if not touches_old and weights_in_host_memory:
                # the common case: every GPU of the stage loads its shard over its host link
                load_bytes += shard * len(uuids)
                models = {gpu_by_uuid[u].model for u in uuids}
                if len(models) == 1:  # (one model: no generator to take the min over)
                    slowest = snapshot.spec(gpu_by_uuid[uuids[0]].model).host_link_bytes_per_s
                else:
                    slowest = min(snapshot.spec(m).host_link_bytes_per_s for m in models)
                per_gpu_s.append(shard / (slowest * eff.link_efficiency))
                continue
            slowest_host = math.inf
            for rank, u in enumerate(uuids):
                if touches_old and (u, st.layer_start, st.layer_end, st.tp, rank) in held:
                    continue
                load_bytes += shard
                spec = snapshot.spec(gpu_by_uuid[u].model)
                if weights_in_host_memory:
                    slowest_host = min(slowest_host, spec.host_link_bytes_per_s)
                else:
                    node = gpu_by_uuid[u].node_id
                    disk_per_node[node] = disk_per_node.get(node, 0) + shard
                if touches_old and u in serving:
                    contention_s += shard / (eff.mbu * spec.hbm_bytes_per_s)
            if weights_in_host_memory and slowest_host < math.inf:
                # every GPU loads its shard over its own host link at once: the slowest bounds it
                per_gpu_s.append(shard / (slowest_host * eff.link_efficiency))
    per_gpu_s.extend(b / disk_bytes_per_s for b in disk_per_node.values())
    weight_load_s = max(per_gpu_s, default=0.0)
    source: Literal["host", "disk", "none"] = (
        "none" if load_bytes == 0 else ("host" if weights_in_host_memory else "disk")
    )

    migrate_bytes = 0
    migrate_s = 0.0
    migrate_seqs = replay_seqs = replay_tokens = 0
    gone = [p for p in (current.plans if current else ()) if p not in target_set]
    replay_s = 0.0
    if gone and new_plans and current is not None and current_estimate is not None:
        shares = dict(zip(current.plans, current.weights, strict=False))
        dest = max(new_plans, key=lambda p: (len(p.gpu_uuids), p.gpu_uuids))
        dest_pipe = profile(dest).pipeline("prefill")
        dest_stages = dest.decode_stages if dest.mode == "disaggregated" else dest.stages
        replay_floor_s = dest_pipe.latency_interval_memo(1, 1)[0]
        landing = next((u for st in dest_stages for u in st.gpu_uuids if u in serving), None)
        landing_s_per_byte = 1.0 / (eff.mbu * snapshot.spec_of(landing).hbm_bytes_per_s) if landing else 0.0
        for plan in gone:
            seqs = running_seqs(current_estimate, shares.get(plan, 0.0), workload)
            if seqs <= 0:
                continue
            src_stages = plan.decode_stages if plan.mode == "disaggregated" else plan.stages
            route = kv_route(src_stages, dest_stages, model, snapshot, eff)
            if route.bytes_per_token == 0:
                continue  # its KV stays in place
            for ctx, weight in _context_buckets(workload):
                count = seqs * weight
                tokens = int(ctx)
                if tokens <= 0:
                    continue
                # migrate_or_replay's choice. Replaying costs at least one one-token iteration
                # per chunk (an iteration never gets faster as its batch grows), so a migration
                # faster than that needs no prefill estimate.
                move_s = route.time_s(tokens)
                if move_s < -(-tokens // MAX_BATCHED_TOKENS) * replay_floor_s or move_s <= dest_pipe.prefill_time_s(
                        tokens, MAX_BATCHED_TOKENS):
                    moved = tokens * route.bytes_per_token
                    migrate_seqs += round(count)
                    migrate_bytes += int(count * moved)
                    migrate_s += count * move_s
                    if landing:
                        contention_s += count * moved * landing_s_per_byte
                else:
                    replay_seqs += round(count)
                    replay_tokens += int(count * ctx)
        if replay_tokens:
            chunk = MAX_BATCHED_TOKENS
            chunk_s = dest_pipe.latency_interval_memo(chunk, 1)[0]
            replay_s = replay_tokens / chunk * chunk_s
    pause_s = migrate_s + replay_s
    lost_pause = served_tokens_s * pause_s
    lost_contention = served_tokens_s * contention_s / max(1, len(serving))
    share_of: dict[Plan, float] = {}  # each plan's routing weight (the first, should it repeat)
    for p, w in zip(target.plans, target.weights, strict=False):
        share_of.setdefault(p, w)
    lost_cold = sum(new_tokens_s * cold_start_s * share_of[p] for p in new_plans)
    return make_frozen(SwitchCost, {
        "tokens": lost_pause + lost_contention + lost_cold,
        "pause_s": pause_s,
        "prepare_s": weight_load_s,
        "time_to_effect_s": weight_load_s + pause_s,
        "lost_pause_tokens": lost_pause,
        "lost_contention_tokens": lost_contention,
        "lost_cold_start_tokens": lost_cold,
        "kv_migrate_bytes": migrate_bytes,
        "kv_migrate_s": migrate_s,
        "migrate_seqs": migrate_seqs,
        "replay_seqs": replay_seqs,
        "replay_tokens": replay_tokens,
        "replay_s": replay_s,
        "weight_load_bytes": load_bytes,
        "weight_load_s": weight_load_s,
        "weight_source": source,
        "cold_start_s": cold_start_s if new_plans else 0.0,
    })



@lru_cache(maxsize=64)
def _holdings(plans: tuple[Plan, ...]) -> tuple[frozenset[tuple[str, int, int, int, int]], frozenset[str]]:
    """(shards held as (GPU, first layer, end layer, TP, rank), GPUs serving) by these plans;
    memoised because every candidate of one decision is priced against the same gear."""
    held: set[tuple[str, int, int, int, int]] = set()
    serving: set[str] = set()
    for plan in plans:
        for st in plan.all_stages:
            for rank, u in enumerate(st.gpu_uuids):
                held.add((u, st.layer_start, st.layer_end, st.tp, rank))
                serving.add(u)
    return frozenset(held), frozenset(serving)


@lru_cache(maxsize=64)
def _context_buckets(workload: Workload) -> tuple[tuple[float, float], ...]:
    """Representative context lengths of running sequences, with their shares (5 quantiles);
    memoised: every candidate of a decision is priced under the same workload."""
    return tuple((workload.prompt_quantile(q) + workload.output_tokens_mean / 2, 0.2)
                 for q in (0.1, 0.3, 0.5, 0.7, 0.9))
