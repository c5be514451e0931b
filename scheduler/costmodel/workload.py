"""What a deployment is asked for and what a plan gives: `Workload` (offered load and length
distributions), `Slo`, `Estimate`, and the quantile helpers they use."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache

from scheduler._lazy import cached_field_hash, check_plain_dataclass, state_without_hash


# --- workload and steady-state estimates -----------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """Offered load of one deployment (sliding-window statistics or a scenario's description)."""

    __hash__ = cached_field_hash  # fields hashed once (memo keys)
    __getstate__ = state_without_hash

    rate_rps: float  # request arrival rate
    prompt_tokens_mean: float  # mean prompt length
    output_tokens_mean: float  # mean output length
    prompt_tokens_cv: float = 1.0  # coefficient of variation (std / mean) of prompt length
    output_tokens_cv: float = 0.6  # same for output length

    def __post_init__(self) -> None:
        if self.rate_rps < 0 or not math.isfinite(self.rate_rps):
            raise ValueError(f"rate_rps: must be a finite number >= 0, got {self.rate_rps}")
        for name in ("prompt_tokens_mean", "output_tokens_mean"):
            if not getattr(self, name) >= 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("prompt_tokens_cv", "output_tokens_cv"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")

    def prompt_quantile(self, q: float) -> float:
        return _lognormal_quantile(self.prompt_tokens_mean, self.prompt_tokens_cv, q)

    def output_quantile(self, q: float) -> float:
        return _lognormal_quantile(self.output_tokens_mean, self.output_tokens_cv, q)

    def scaled(self, factor: float) -> Workload:
        return Workload(self.rate_rps * factor, self.prompt_tokens_mean, self.output_tokens_mean,
                        self.prompt_tokens_cv, self.output_tokens_cv)

    def to_dict(self) -> dict[str, float]:
        return {
            "rate_rps": self.rate_rps,
            "prompt_tokens_mean": self.prompt_tokens_mean,
            "output_tokens_mean": self.output_tokens_mean,
            "prompt_tokens_cv": self.prompt_tokens_cv,
            "output_tokens_cv": self.output_tokens_cv,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, object], path: str = "workload") -> Workload:
        allowed = ("rate_rps", "prompt_tokens_mean", "output_tokens_mean", "prompt_tokens_cv", "output_tokens_cv")
        if not isinstance(d, Mapping):
            raise ValueError(f"{path}: must be an object")
        for key in d:
            if key not in allowed:
                raise ValueError(f"{path}.{key}: unknown key")
        values: dict[str, float] = {}
        for key in allowed:
            if key not in d:
                if key.endswith("_cv"):
                    continue
                raise ValueError(f"{path}.{key}: required")
            v = d[key]
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise ValueError(f"{path}.{key}: must be a number, got {v!r}")
            values[key] = float(v)
        try:
            return cls(**values)
        except ValueError as exc:
            raise ValueError(f"{path}.{exc}") from None


@dataclass(frozen=True)
class Slo:
    """Latency objectives of a deployment."""

    __hash__ = cached_field_hash  # fields hashed once (memo keys)
    __getstate__ = state_without_hash

    ttft_ms: float  # time to first token, P99 target
    tpot_ms: float  # time per output token, P99 target

    def __post_init__(self) -> None:
        if not (self.ttft_ms > 0 and self.tpot_ms > 0):
            raise ValueError(f"slo: ttft_ms and tpot_ms must be > 0, got {self.ttft_ms}, {self.tpot_ms}")

    def missed(self, ttft_s: float, tpot_s: float | None) -> bool:
        """Whether one finished request missed these objectives (TTFT, or TPOT when it made more than one token)."""
        return ttft_s * 1e3 > self.ttft_ms or (tpot_s is not None and tpot_s * 1e3 > self.tpot_ms)


@dataclass(frozen=True)
class Estimate:
    """Steady-state prediction for one plan or gear under a workload. Latencies in seconds;
    inf when overloaded (serialised as null)."""

    capacity_rps: float  # the most requests/s it sustains (compute, KV capacity, seq cap)
    served_rps: float  # min(offered, capacity)
    utilization: float  # offered / capacity (may exceed 1)
    throughput_tokens_s: float  # output tokens/s served
    goodput_tokens_s: float  # output tokens/s served within the SLO (= throughput without an SLO)
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    kv_capacity_tokens: int  # summed over plans
    max_running_seqs: int  # sequences it can hold at once (KV and seq cap), summed
    gpus: int  # GPUs used
    limit: str  # what bounds the capacity: "compute", "kv", "seqs", "prefill", "link"

    @property
    def overloaded(self) -> bool:
        return self.utilization >= 1.0

    def to_dict(self) -> dict[str, object]:
        return {k: _finite_or_none(getattr(self, k)) for k in _ESTIMATE_FIELDS}

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> Estimate:
        values: dict[str, object] = {}
        for key in _ESTIMATE_FIELDS:
            if key not in d:
                raise ValueError(f"estimate.{key}: required")
            v = d[key]
            values[key] = math.inf if v is None else v
        return cls(**values)  # type: ignore[arg-type]  # values come from to_dict


_ESTIMATE_FIELDS = (
    "capacity_rps", "served_rps", "utilization", "throughput_tokens_s", "goodput_tokens_s",
    "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "kv_capacity_tokens",
    "max_running_seqs", "gpus", "limit",
)
check_plain_dataclass(Estimate, field_names=_ESTIMATE_FIELDS)  # built with make_frozen in hot loops


def _finite_or_none(v: object) -> object:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


_Z99 = 2.3263478740408408  # standard normal 0.99 quantile


@lru_cache(maxsize=4096)
def _lognormal_quantile(mean: float, cv: float, q: float) -> float:
    if cv <= 0:
        return mean
    sigma2 = math.log1p(cv * cv)
    mu = math.log(mean) - sigma2 / 2
    return math.exp(mu + math.sqrt(sigma2) * _norm_ppf(q))


def _norm_ppf(q: float) -> float:
    """Inverse standard normal CDF (Acklam's rational approximation, |error| < 1.2e-9)."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"quantile: must be within (0, 1), got {q}")
    a = (-3.969683028665376e01, 2.209460984245205e02, -2.759285104469687e02, 1.383577518672690e02,
         -3.066479806614716e01, 2.506628277459239e00)
    b = (-5.447609879822406e01, 1.615858368580409e02, -1.556989798598866e02, 6.680131188771972e01,
         -1.328068155288572e01)
    c = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e00, -2.549732539343734e00,
         4.374664141464968e00, 2.938163982698783e00)
    dd = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e00, 3.754408661907416e00)
    lo = 0.02425
    if q < lo:
        r = math.sqrt(-2 * math.log(q))
        return (((((c[0] * r + c[1]) * r + c[2]) * r + c[3]) * r + c[4]) * r + c[5]) / (
            (((dd[0] * r + dd[1]) * r + dd[2]) * r + dd[3]) * r + 1)
    if q > 1 - lo:
        return -_norm_ppf(1 - q)
    r = q - 0.5
    s = r * r
    return (((((a[0] * s + a[1]) * s + a[2]) * s + a[3]) * s + a[4]) * s + a[5]) * r / (
        ((((b[0] * s + b[1]) * s + b[2]) * s + b[3]) * s + b[4]) * s + 1)
