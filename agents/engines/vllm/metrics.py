"""vLLM's Prometheus /metrics, read into our EngineReport.

vLLM exports cumulative counters and histograms since the server started, plus a few gauges.
A report covers an interval, so `engine_report(plan_id, before, now)` takes two scrapes and
reports the differences: tokens per second, requests finished and admitted, TTFT/TPOT
quantiles of the requests of that interval.

Metric names moved between vLLM versions; each quantity lists the names that carried it,
newest first (vLLM docs, "Production Metrics", and its v1 metrics design notes):
- KV cache use, 0..1:   vllm:kv_cache_usage_perc (v1)      | vllm:gpu_cache_usage_perc (v0, early v1)
- per-request TPOT:     vllm:request_time_per_output_token_seconds (v1, >= 0.10)
                        | vllm:time_per_output_token_seconds (older: per-token gaps)
                        | vllm:inter_token_latency_seconds (the newer name of those gaps)
Gauges and counters are summed over label sets (one per engine of a data-parallel server, one
per finish reason); KV use is averaged over engines.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from agents.protocol import EngineReport

RUNNING = ("vllm:num_requests_running",)
WAITING = ("vllm:num_requests_waiting",)
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
PROMPT_TOKENS = ("vllm:prompt_tokens_total",)
GENERATION_TOKENS = ("vllm:generation_tokens_total",)
FINISHED = ("vllm:request_success_total",)
TTFT = ("vllm:time_to_first_token_seconds",)
TPOT = ("vllm:request_time_per_output_token_seconds", "vllm:time_per_output_token_seconds",
        "vllm:inter_token_latency_seconds")
PROMPT_LEN = ("vllm:request_prompt_tokens",)
OUTPUT_LEN = ("vllm:request_generation_tokens",)


@dataclass(frozen=True)
class Histogram:
    """A cumulative Prometheus histogram: (upper bound, observations <= bound), ascending."""

    buckets: tuple[tuple[float, float], ...]
    count: float
    sum: float

    def minus(self, earlier: Histogram | None) -> Histogram:
        """The observations made after `earlier` (same bucket bounds: one server's series)."""
        if earlier is None:
            return self
        before = dict(earlier.buckets)
        return Histogram(tuple((le, n - before.get(le, 0.0)) for le, n in self.buckets),
                         self.count - earlier.count, self.sum - earlier.sum)

    def quantile(self, q: float) -> float | None:
        """Prometheus' histogram_quantile: linear inside the bucket that holds rank q * count.

        None without observations. A rank in the +Inf bucket gives the highest finite bound
        (the histogram cannot say more).
        """
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"q: must be within 0..1; got {q}")
        if self.count <= 0 or not self.buckets:
            return None
        rank = q * self.count
        lower_le, lower_n = 0.0, 0.0
        for le, n in self.buckets:
            if n >= rank:
                if math.isinf(le):
                    return lower_le
                if n == lower_n:
                    return le
                return lower_le + (le - lower_le) * (rank - lower_n) / (n - lower_n)
            lower_le, lower_n = le, n
        return lower_le


@dataclass(frozen=True)
class VllmMetrics:
    """One scrape of a vLLM server's /metrics."""

    at_s: float  # when it was taken (monotonic seconds, the caller's clock)
    running: int
    waiting: int
    kv_usage: float | None  # 0..1, None when the server exports neither name
    prompt_tokens: float  # cumulative counters since the server started
    generation_tokens: float
    finished: float
    ttft_s: Histogram | None = None
    tpot_s: Histogram | None = None
    prompt_len: Histogram | None = None
    output_len: Histogram | None = None
    names: frozenset[str] = field(default=frozenset(), compare=False)  # every sample name seen

    @classmethod
    def zero(cls, at_s: float) -> VllmMetrics:
        """The state of a server that just started: the baseline of its first report."""
        return cls(at_s, 0, 0, 0.0, 0.0, 0.0, 0.0)


def parse_metrics(text: str, at_s: float) -> VllmMetrics:
    """Read the quantities we report from a Prometheus text exposition of vLLM."""
    values: dict[str, float] = {}
    kv: list[float] = []
    kv_name: str | None = None
    hist: dict[str, dict[float, float]] = {}
    hsum: dict[str, float] = {}
    hcount: dict[str, float] = {}
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, float(sample.value)
            names.add(name)
            if name in KV_USAGE:
                if kv_name is None or KV_USAGE.index(name) < KV_USAGE.index(kv_name):
                    kv_name, kv = name, []
                if name == kv_name:
                    kv.append(value)
            elif name.endswith("_bucket"):
                le = float(labels.get("le", "nan"))
                base = name.removesuffix("_bucket")
                hist.setdefault(base, {})
                hist[base][le] = hist[base].get(le, 0.0) + value
            elif name.endswith("_sum"):
                hsum[name.removesuffix("_sum")] = hsum.get(name.removesuffix("_sum"), 0.0) + value
            elif name.endswith("_count"):
                hcount[name.removesuffix("_count")] = hcount.get(name.removesuffix("_count"), 0.0) + value
            else:
                values[name] = values.get(name, 0.0) + value

    def first(names_: tuple[str, ...]) -> float:
        for n in names_:
            if n in values:
                return values[n]
        return 0.0

    def histogram(names_: tuple[str, ...]) -> Histogram | None:
        for n in names_:
            if n in hist:
                buckets = tuple(sorted(hist[n].items()))
                return Histogram(buckets, hcount.get(n, buckets[-1][1] if buckets else 0.0), hsum.get(n, 0.0))
        return None

    return VllmMetrics(
        at_s=at_s,
        running=int(first(RUNNING)),
        waiting=int(first(WAITING)),
        kv_usage=min(max(sum(kv) / len(kv), 0.0), 1.0) if kv else None,
        prompt_tokens=first(PROMPT_TOKENS),
        generation_tokens=first(GENERATION_TOKENS),
        finished=first(FINISHED),
        ttft_s=histogram(TTFT),
        tpot_s=histogram(TPOT),
        prompt_len=histogram(PROMPT_LEN),
        output_len=histogram(OUTPUT_LEN),
        names=frozenset(names),
    )


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1000.0


def _mean(h: Histogram | None) -> float | None:
    return h.sum / h.count if h is not None and h.count > 0 else None


def engine_report(plan_id: str, before: VllmMetrics | None, now: VllmMetrics) -> EngineReport:
    """The EngineReport of the interval between two scrapes of one server.

    `before` None (or a server restarted in between, seen as a counter going down) means "since
    the server started": counts are taken whole and the rate is left at 0, the interval unknown.
    Arrivals follow from conservation: admitted = finished + (in system now - in system before).
    """
    restarted = before is not None and (now.generation_tokens < before.generation_tokens
                                        or now.finished < before.finished)
    base = VllmMetrics.zero(now.at_s) if before is None or restarted else before
    interval_s = now.at_s - base.at_s
    generated = now.generation_tokens - base.generation_tokens
    finished = max(int(round(now.finished - base.finished)), 0)
    in_system_delta = (now.running + now.waiting) - (base.running + base.waiting)
    ttft = now.ttft_s.minus(base.ttft_s) if now.ttft_s else None
    tpot = now.tpot_s.minus(base.tpot_s) if now.tpot_s else None
    prompt_len = now.prompt_len.minus(base.prompt_len) if now.prompt_len else None
    output_len = now.output_len.minus(base.output_len) if now.output_len else None
    return EngineReport(
        plan_id=plan_id,
        running=now.running,
        waiting=now.waiting,
        tokens_per_s=generated / interval_s if interval_s > 0 and generated > 0 else 0.0,
        kv_usage=now.kv_usage or 0.0,
        ttft_p50_ms=_ms(ttft.quantile(0.5)) if ttft else None,
        ttft_p95_ms=_ms(ttft.quantile(0.95)) if ttft else None,
        tpot_p50_ms=_ms(tpot.quantile(0.5)) if tpot else None,
        tpot_p95_ms=_ms(tpot.quantile(0.95)) if tpot else None,
        finished=finished,
        arrivals=max(finished + in_system_delta, 0),
        prompt_tokens_mean=_mean(prompt_len),
        output_tokens_mean=_mean(output_len),
    )
