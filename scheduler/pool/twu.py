"""Token-weighted utilisation (TWU): how much of a plan's modelled capacity its served tokens used.

Definition
----------

Over a window of T seconds a plan's engines report P prompt tokens admitted (prefilled) and D
output tokens generated. The cost model (scheduler.costmodel.steady, `SteadyState.token_costs_s`)
says what one token of each kind costs that plan when it runs at its capacity under the observed
request shape (mean prompt and output lengths): c_p seconds of the plan per prompt token, c_d per
output token, with P_mean x c_p + D_mean x c_d = 1 / capacity_rps. Then

    TWU_plan = (c_p x P + c_d x D) / T

that is, tokens served weighted by their cost, over GPU time x the plan's modelled capacity: with
n GPUs, the plan's GPU time is n x T and its capacity n / (P_mean c_p + D_mean c_d) weighted
tokens per GPU-second, and the n cancels. 0 is an idle plan, 1 a plan serving exactly what the
model says it can (a measured plan above the model shows above 1: TWU is not clamped).

A disaggregated plan runs its prefill and decode pipelines on separate GPUs, so each side has
its own share: TWU_prefill = c_p x P / T on the prefill GPUs, TWU_decode = c_d x D / T on the
decode GPUs, and the plan's TWU is the busier side's (the one that saturates first bounds the
plan's capacity, as it does in the cost model).

Per GPU: each GPU of a plan carries the plan's TWU (its side's, when split) - the stages of a
plan work in lock step, so a plan at 0.7 keeps each of its GPUs 0.7 busy. A GPU shared by two
plans (two models by memory fraction, seed 004 section 4.2) sums their shares: each plan's costs
are modelled as if it had the GPU alone, so the sum is the share of the GPU's time both use.

Per deployment: the GPU-weighted mean of its plans' TWU, sum(TWU_p x n_p) / sum(n_p), over the
plans with reports in the window. Per pool: the mean over the pool's GPUs of their TWU (a GPU
nothing reports on counts 0).

No reports in the window: TWU is unknown (None), not 0 - a silent agent is not an idle plan, and
the scale rule (autoscale.py) never sheds GPUs on silence, as the gearbox does not.

Where this departs from seed 004 (section 3.2) and why
------------------------------------------------------

The seed writes TWU = sum(token_count_i x latency_i) / (total_gpu_time x baseline_throughput),
token_count_i the tokens request i generated, latency_i its end-to-end latency, and
baseline_throughput the theoretical maximum of a baseline model (Phi-3-mini) on that GPU; its
stated meaning is "effective tokens per unit of GPU time as a share of the theoretical ceiling".

* Weighting by latency is dropped: token x second over second x token/second is seconds, not a
  share, and a request that waits in a queue would count as more work the longer it waits -
  the metric would rise with congestion rather than with work done. We weight each token by
  what it costs the plan instead (a decode token, read-bound in small batches, costs the plan
  far more than a prompt token computed in a large batch), which is the seed's stated meaning.
* The ceiling is the plan's own modelled capacity (its model, its GPUs, its TP/PP, under the
  observed request shape), not a baseline model's: a Phi-3-mini ceiling would make a 72B plan
  look idle at full load, and two different models could not share one scale rule.
* Tokens come from the engines' reports (agents/protocol/ EngineReport): D = tokens_per_s x T,
  P = arrivals x prompt_tokens_mean - the prompts admitted in the window. A sequence re-prefilled
  after a hand-over (replay) and prefix-cache hits are not in these counts; the window is the
  report interval.

Pure: the console and the simulator call it with what they have; no Django, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from scheduler.costmodel import PlanProfile, Workload, steady_state
from scheduler.plan import Plan
from scheduler.topology import Snapshot


@dataclass(frozen=True)
class TokenCosts:
    """What one token costs a plan at its modelled capacity (seconds of the plan's time)."""

    prefill_s: float  # per prompt token
    decode_s: float  # per output token
    split: bool = False  # disaggregated: prefill and decode run on separate GPUs

    def __post_init__(self) -> None:
        for name in ("prefill_s", "decode_s"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"{name}: must be >= 0, got {value}")

    @classmethod
    def of(cls, profile: PlanProfile, shape: Workload) -> TokenCosts:
        """The costs of `profile`'s plan under the request shape of `shape` (its rate is ignored)."""
        prefill_s, decode_s = steady_state(profile, shape).token_costs_s()
        return cls(prefill_s, decode_s, profile.plan.mode == "disaggregated")

    @property
    def live(self) -> bool:
        """False for a plan the model gives no capacity (it holds no sequence)."""
        return math.isfinite(self.prefill_s) and math.isfinite(self.decode_s)


@dataclass(frozen=True)
class PlanTokens:
    """What one plan's engines reported over one window."""

    plan_id: str
    window_s: float  # the window (the report interval)
    prompt_tokens: float  # prompt tokens admitted in it
    output_tokens: float  # tokens generated in it

    def __post_init__(self) -> None:
        if not self.window_s > 0 or not math.isfinite(self.window_s):
            raise ValueError(f"window_s: must be a finite number > 0, got {self.window_s}")
        for name in ("prompt_tokens", "output_tokens"):
            value = getattr(self, name)
            if not value >= 0 or not math.isfinite(value):
                raise ValueError(f"{name}: must be a finite number >= 0, got {value}")

    @classmethod
    def from_reports(cls, plan_id: str, reports: Iterable[Mapping[str, object]], window_s: float) -> PlanTokens | None:
        """Sum engine reports (EngineReport fields: tokens_per_s, arrivals, prompt_tokens_mean) of
        one plan over `window_s`; None when there are none."""
        prompt = output = 0.0
        seen = False
        for r in reports:
            seen = True
            output += _number(r.get("tokens_per_s")) * window_s
            prompt += _number(r.get("arrivals")) * _number(r.get("prompt_tokens_mean"))
        return cls(plan_id, window_s, prompt, output) if seen else None


@dataclass(frozen=True)
class PlanTwu:
    """One plan's TWU over one window."""

    plan_id: str
    twu: float  # the plan's: the busier side's when split
    prefill: float  # share of the prefill GPUs' time (colocated: == twu)
    decode: float  # share of the decode GPUs' time (colocated: == twu)
    gpus: tuple[tuple[str, float], ...]  # (GPU uuid, this plan's share of it)


def plan_twu(plan: Plan, costs: TokenCosts, tokens: PlanTokens | None) -> PlanTwu | None:
    """TWU of one plan (module docstring); None without reports or for a plan with no capacity."""
    if tokens is None or not costs.live:
        return None
    prefill = costs.prefill_s * tokens.prompt_tokens / tokens.window_s
    decode = costs.decode_s * tokens.output_tokens / tokens.window_s
    if plan.mode == "disaggregated":
        share_p, share_d = prefill, decode
        gpus = tuple((u, share_p) for s in plan.stages for u in s.gpu_uuids) + tuple(
            (u, share_d) for s in plan.decode_stages for u in s.gpu_uuids)
        return PlanTwu(plan.plan_id, max(share_p, share_d), share_p, share_d, gpus)
    total = prefill + decode
    return PlanTwu(plan.plan_id, total, total, total, tuple((u, total) for u in plan.gpu_uuids))


def gpu_twu(plans: Iterable[PlanTwu]) -> dict[str, float]:
    """GPU uuid -> its TWU: the sum of the shares of the plans on it."""
    out: dict[str, float] = {}
    for p in plans:
        for uuid, share in p.gpus:
            out[uuid] = out.get(uuid, 0.0) + share
    return out


def deployment_twu(plans: Sequence[PlanTwu | None]) -> float | None:
    """GPU-weighted mean of the plans' TWU (plans without reports left out); None: none reported."""
    weighted = gpus = 0.0
    for p in plans:
        if p is None or not p.gpus:
            continue
        weighted += p.twu * len(p.gpus)
        gpus += len(p.gpus)
    return weighted / gpus if gpus else None


def pool_gpus(snapshot: Snapshot, held: Iterable[str] = ()) -> list[str]:
    """The pool's GPUs, as `pool_twu` averages over them: healthy ones that are schedulable or that one
    of our deployments holds (`held`). Another tenant's or a cordoned GPU nobody of ours holds is not
    the pool's; a failed one serves nothing."""
    ours = set(held)
    return [g.uuid for g in snapshot.gpus if g.healthy and (g.schedulable or g.uuid in ours)]


def pool_twu(per_gpu: Mapping[str, float], pool_gpus: Iterable[str]) -> float | None:
    """Mean TWU over the pool's GPUs (one nothing reports on counts 0); None for an empty pool."""
    uuids = list(dict.fromkeys(pool_gpus))
    return sum(per_gpu.get(u, 0.0) for u in uuids) / len(uuids) if uuids else None


def _number(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return 0.0
    return max(0.0, float(value))


__all__ = ["PlanTokens", "PlanTwu", "TokenCosts", "deployment_twu", "gpu_twu", "plan_twu", "pool_gpus", "pool_twu"]
