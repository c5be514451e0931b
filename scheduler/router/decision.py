"""A routing decision and its explanation: for every plan, each plugin's score, or the filter
that rejected it and why; the order to try; what the router predicted."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from scheduler.router import memory_bound, prefilter
from scheduler.router._arrays import Bools, Floats
from scheduler.router.request import RouteRequest

if TYPE_CHECKING:
    from scheduler.router.pool import Pool


@dataclass
class Decision:
    """What `route` answered. Slots index `pool` (its plans, in the order the caller gave them).

    The arrays are the decision's own (plugins make new ones per call), but `explain` reads
    the pool's facts and loads too: call it before the pool's next `set_load`."""

    policy: str  # which routing policy decided
    request: RouteRequest
    pool: Pool
    order: tuple[int, ...]  # slots to try, best first (empty: no plan can take it)
    hard_ok: Bools | None = None  # passed prefilter and the never-fits half of the memory bound
    fits_now: Bools | None = None  # the memory bound's fits-now half
    relaxed: bool = False  # every candidate was full now: it queues at the best of them
    scores: dict[str, Floats] = field(default_factory=dict)  # plugin -> 0..100 per slot
    weights: dict[str, float] = field(default_factory=dict)  # plugin -> its weight in the sum
    total: Floats | None = None  # weighted sum per slot
    demoted: Bools | None = None  # in the jitter retry pool
    ttft_s: Floats | None = None  # predicted time to first token per slot
    tpot_s: Floats | None = None  # predicted time per output token per slot
    stall_s: Floats | None = None  # what its prefill adds per token of the sequences running there
    cached_tokens: Floats | None = None  # prompt tokens predicted to hit each plan's cache
    note: str = ""  # how the policy chose, when it is not the weighted sum (baselines)
    spilled_from: int | None = None  # KV spillover (spillover.py): the first choice's slot, when it spilled
    kv_free: Floats | None = None  # ... each plan's share of KV free, as the bands read it

    @property
    def chosen(self) -> int | None:
        return self.order[0] if self.order else None

    @property
    def chosen_id(self) -> str | None:
        return self.pool.ids[self.order[0]] if self.order else None

    def predicted_ttft_s(self, slot: int) -> float | None:
        return None if self.ttft_s is None else float(self.ttft_s[slot])

    def reason(self, slot: int) -> str:
        """Why `slot` was no candidate ("" if it was one)."""
        req, pool = self.request, self.pool
        if self.hard_ok is not None and not self.hard_ok[slot]:
            why = prefilter.why(req, pool, slot)
            if why:
                return f"{prefilter.NAME}: {why}"
            return f"{memory_bound.NAME}: {memory_bound.why(req, pool, slot, now=False)}"
        if self.fits_now is not None and not self.fits_now[slot] and not self.relaxed:
            return f"{memory_bound.NAME}: {memory_bound.why(req, pool, slot, now=True)}"
        return ""

    def explain(self) -> dict[str, Any]:
        """The decision as JSON: the request, then per plan its rank, scores or filter reason."""
        req, pool = self.request, self.pool
        rank = {slot: i + 1 for i, slot in enumerate(self.order)}
        plans = []
        for i, pid in enumerate(pool.ids):
            f = pool.facts[i]
            entry: dict[str, Any] = {
                "plan_id": pid, "gpu": f"{f.gpus}x {f.gpu_model}", "rank": rank.get(i),
                "load": {"running": int(pool.running[i]), "waiting": int(pool.waiting[i]),
                         "queued_tokens": int(pool.queued_tokens[i]), "kv_used_tokens": int(pool.kv_used[i]),
                         "kv_capacity_tokens": f.kv_capacity_tokens},
            }
            why = self.reason(i)
            if why:
                entry["filtered"] = why
            else:
                entry["scores"] = {k: round(float(v[i]), 2) for k, v in self.scores.items()}
                if self.total is not None:
                    entry["total"] = round(float(self.total[i]), 2)
                if self.ttft_s is not None and self.tpot_s is not None:
                    entry["predicted_ttft_ms"] = round(1e3 * float(self.ttft_s[i]), 2)
                    entry["predicted_tpot_ms"] = round(1e3 * float(self.tpot_s[i]), 3)
                if self.stall_s is not None:
                    entry["predicted_stall_ms"] = round(1e3 * float(self.stall_s[i]), 3)
                if self.cached_tokens is not None:
                    entry["cached_tokens"] = int(self.cached_tokens[i])
                if self.demoted is not None and self.demoted[i]:
                    entry["demoted"] = True
            plans.append(entry)
        return {
            "policy": self.policy,
            "request": {"prompt_tokens": req.prompt_tokens, "max_tokens": req.max_tokens, "priority": req.priority,
                        "deadline_ms": None if req.deadline_s is None else round(req.deadline_s * 1e3, 3),
                        "prompt_blocks": len(req.blocks)},
            "chosen": self.chosen_id,
            "order": [pool.ids[s] for s in self.order],
            "relaxed": self.relaxed,
            "weights": dict(self.weights),
            "note": self.note,
            "spilled_from": None if self.spilled_from is None else pool.ids[self.spilled_from],
            "plans": plans,
        }
