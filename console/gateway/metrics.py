"""Per-request metrics: Prometheus events (console.metrics' registry) and the gearbox's load window.

Prometheus (process-local events, summed over web processes by Prometheus):
    flexpipe_gateway_requests_total{deployment, endpoint, status}
    flexpipe_gateway_ttft_seconds, flexpipe_gateway_tpot_seconds   histograms per deployment
    flexpipe_gateway_prompt_tokens_total, flexpipe_gateway_completion_tokens_total
    flexpipe_gateway_handovers_total, flexpipe_gateway_handover_stall_seconds
    flexpipe_gateway_cold_starts_total{deployment}      deployments at zero this process woke up
    flexpipe_gateway_cold_start_wait_seconds{deployment, outcome}   how long held requests waited
                                                        (outcome: served | timeout | refused)
    flexpipe_gateway_cold_start_held{deployment}        requests held right now
    flexpipe_gateway_spills_total{deployment}           requests KV spillover sent away from their first
                                                        choice (FLEXPIPE_ROUTER_POLICY flexpipe+budget)
    flexpipe_gateway_spill_timeouts_total{deployment}   of those, without a first token within
                                                        spill_timeout_s: re-routed (routing.py); the
                                                        alert reads flexpipe_spillover_timeouts_recent,
                                                        the last 5 min of every process (Redis)

Load window: each gateway process sums what it admitted over FLEXPIPE_GATEWAY_LOAD_INTERVAL_S
(arrivals/s, mean prompt and output tokens) and appends one gearbox LoadSample per interval with
gearbox.actions.do_record_load - the same path and shape the engine reports feed; a sample not
newer than the window's last is ignored there, so a repeated flush changes nothing.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from django.conf import settings
from django.utils import timezone
from prometheus_client import Counter, Gauge, Histogram

from console.metrics import REGISTRY
from scheduler.gearbox import LoadSample

REQUESTS = Counter("flexpipe_gateway_requests", "Gateway requests by deployment, endpoint and HTTP status",
                   ["deployment", "endpoint", "status"], registry=REGISTRY)
TTFT = Histogram("flexpipe_gateway_ttft_seconds", "Time to first token seen by the gateway", ["deployment"],
                 buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=REGISTRY)
TPOT = Histogram("flexpipe_gateway_tpot_seconds", "Mean time per output token after the first, per request",
                 ["deployment"], buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1), registry=REGISTRY)
PROMPT_TOKENS = Counter("flexpipe_gateway_prompt_tokens", "Prompt tokens admitted", ["deployment"], registry=REGISTRY)
COMPLETION_TOKENS = Counter("flexpipe_gateway_completion_tokens", "Tokens streamed back", ["deployment"],
                            registry=REGISTRY)
HANDOVERS = Counter("flexpipe_gateway_handovers", "Streams continued at another plan after a switch",
                    ["deployment"], registry=REGISTRY)
FAILOVERS = Counter("flexpipe_gateway_failovers",
                    "Streams resumed on another plan (by replay) after their plan failed mid-way",
                    ["deployment"], registry=REGISTRY)
HANDOVER_STALL = Histogram("flexpipe_gateway_handover_stall_seconds",
                           "From a stream's `moved` end to the continued stream being open", ["deployment"],
                           buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5), registry=REGISTRY)

COLD_STARTS = Counter("flexpipe_gateway_cold_starts", "Deployments at zero woken up by a request this gateway held",
                      ["deployment"], registry=REGISTRY)
COLD_START_WAIT = Histogram("flexpipe_gateway_cold_start_wait_seconds",
                            "How long a request of a deployment at zero was held before it was admitted (or not)",
                            ["deployment", "outcome"], buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
                            registry=REGISTRY)
SPILLS = Counter("flexpipe_gateway_spills", "Requests KV spillover sent away from their first-choice plan",
                 ["deployment"], registry=REGISTRY)
SPILL_TIMEOUTS = Counter("flexpipe_gateway_spill_timeouts",
                         "Spilled requests without a first token within the spillover timeout (re-routed)",
                         ["deployment"], registry=REGISTRY)
COLD_START_HELD = Gauge("flexpipe_gateway_cold_start_held", "Requests held now for a deployment at zero",
                        ["deployment"], registry=REGISTRY)


@dataclass
class _Bucket:
    start_s: float
    arrivals: int = 0
    prompt_tokens: int = 0
    finished: int = 0
    output_tokens: int = 0


class LoadRecorder:
    """Arrivals and request shape per deployment, flushed to its load window once per interval."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buckets: dict[str, _Bucket] = {}

    def arrived(self, deployment: str, prompt_tokens: int) -> None:
        with self._lock:
            b = self._buckets.setdefault(deployment, _Bucket(time.monotonic()))
            b.arrivals += 1
            b.prompt_tokens += prompt_tokens

    def finished(self, deployment: str, output_tokens: int) -> None:
        with self._lock:
            b = self._buckets.setdefault(deployment, _Bucket(time.monotonic()))
            b.finished += 1
            b.output_tokens += output_tokens

    def due(self, deployment: str, *, force: bool = False) -> LoadSample | None:
        """Take the deployment's bucket as a sample when its interval is over (or `force`)."""
        interval_s = float(getattr(settings, "FLEXPIPE_GATEWAY_LOAD_INTERVAL_S", 10.0))
        now = time.monotonic()
        with self._lock:
            b = self._buckets.get(deployment)
            if b is None or b.arrivals == 0 or (not force and now - b.start_s < interval_s):
                return None
            del self._buckets[deployment]
        span_s = max(now - b.start_s, 1e-3)
        return LoadSample(
            t_s=timezone.now().timestamp(),
            rate_rps=b.arrivals / span_s,
            prompt_tokens_mean=b.prompt_tokens / b.arrivals,
            output_tokens_mean=b.output_tokens / b.finished if b.finished else 128.0,
        )


RECORDER = LoadRecorder()


def record_load(deployment: str, *, force: bool = False) -> LoadSample | None:
    """Append the deployment's due sample to its load window (sync: call via sync_to_async)."""
    sample = RECORDER.due(deployment, force=force)
    if sample is None:
        return None
    from console.gearbox.actions import do_record_load
    from console.gearbox.models import Deployment

    dep = Deployment.objects.filter(name=deployment).first()
    if dep is not None:
        do_record_load(dep, sample)
    return sample
