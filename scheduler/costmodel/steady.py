"""Steady-state estimates: `SteadyState` (Little's law on the iteration function plus an
M/G/1-style queueing tail for P50/P99), its content-keyed memo, and the per-plan and per-gear
estimates built on it."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from functools import lru_cache

from scheduler._lazy import make_frozen
from scheduler.costmodel.kernels import MAX_BATCHED_TOKENS, MAX_RUNNING_SEQS
from scheduler.costmodel.profiles import _STEADY_CACHE_SIZE, PlanProfile
from scheduler.costmodel.workload import _Z99, Estimate, Slo, Workload


class SteadyState:
    """Steady-state model of one plan under one workload *shape* (lengths and spread, not
    rate): small tables computed once, so `estimate(rate_rps)` is interpolation.

    A *round* is the time in which every running sequence makes one token; in it the plan
    also prefills prompt/output tokens per running sequence (the arrivals that keep the
    population steady). With S stages the sequences split into S micro-batches, so a round is
    max(latency, S x interval) of one micro-batch: fewer sequences than stages leave bubbles.

    Colocated: decode and chunked prefill share each iteration; capacity is the rate at the
    largest running population that KV memory, the sequence cap and the token budget allow.
    Disaggregated: the prefill pipeline and the decode pipeline each bound it. TTFT = an
    M/G/1-style queueing wait (exponential tail, the token-length spread as the service
    spread) + the prompt's own prefill; TPOT P99 is a round that also carries a full prefill
    chunk.
    """

    def __init__(self, profile: PlanProfile, workload: Workload, slo: Slo | None = None, *,
                 max_batched_tokens: int = MAX_BATCHED_TOKENS, max_running_seqs: int = MAX_RUNNING_SEQS) -> None:
        self.profile = profile
        self.slo = slo
        self.shape = workload
        self.max_batched_tokens = max_batched_tokens
        self._latency_ready = False  # the TTFT/TPOT tables (`_latency_tables`), built by the first estimate
        prompt, output = workload.prompt_tokens_mean, workload.output_tokens_mean
        self.prompt, self.output = prompt, output
        self.context = prompt + output / 2
        self.colocated = profile.plan.mode == "colocated"
        self.decode_pipe = profile.pipeline("decode")
        self.prefill_pipe = profile.pipeline("prefill")
        plan = profile.plan
        # (a one-stage colocated plan's GPUs are its stage's: no need to build plan.gpu_uuids)
        self.gpus = (len(plan.stages[0].gpu_uuids) if len(plan.stages) == 1 and not plan.decode_stages
                     else len(plan.gpu_uuids))
        self.kv_tokens = profile.kv_capacity_tokens
        pp = self.decode_pipe.pp
        seq_cap = max_running_seqs * pp
        kv_seqs = int(self.kv_tokens // self.context)
        budget_seqs = int(max_batched_tokens * pp / (1 + prompt / output)) if self.colocated else seq_cap
        self.running_cap = max(0, min(kv_seqs, seq_cap, budget_seqs))
        self.limit = "kv" if self.running_cap == kv_seqs else ("seqs" if self.running_cap == seq_cap else "compute")
        self.work_cv2 = (prompt / (prompt + output) * workload.prompt_tokens_cv) ** 2 + (
            output / (prompt + output) * workload.output_tokens_cv) ** 2
        if self.running_cap < 1:
            self.capacity_rps = 0.0
            self.limit = "kv"
            return
        # population -> round time, on a grid of factors of 4 up to the cap (the round time is
        # smooth and monotone in the population; between grid points we interpolate)
        grid = [1]
        while grid[-1] * 4 < self.running_cap:
            grid.append(grid[-1] * 4)
        if grid[-1] != self.running_cap:
            grid.append(self.running_cap)
        self.grid = grid
        # round times on the grid, computed when first needed: an estimate reads the points up
        # to its population (and capacity the last), so light loads never touch the middle
        self._rounds: list[float | None] = [None] * len(grid)
        self.capacity_rps = self.running_cap / (output * self._round_at(len(grid) - 1))
        if not self.colocated:
            chunk = max_batched_tokens
            per_chunk = self.prefill_pipe.latency_interval_memo(chunk, max(1, int(chunk // prompt)))[1]
            prefill_cap = chunk / prompt / per_chunk
            if prefill_cap < self.capacity_rps:
                self.capacity_rps, self.limit = prefill_cap, "prefill"
        self.chunks_per_prompt = math.ceil(prompt / max_batched_tokens)

    def _latency_tables(self) -> None:
        """What latency estimates need beyond throughput: a median and a P99 prompt's prefill
        (and KV hand-off), and the extra time of a round that carries a prefill chunk. Built
        on first use: the planner ranks some plans by capacity alone."""
        workload, max_batched_tokens, profile = self.shape, self.max_batched_tokens, self.profile
        p50, p99 = workload.prompt_quantile(0.5), workload.prompt_quantile(0.99)
        self.prefill50_s = self.prefill_pipe.prefill_time_s(max(1, int(p50)), max_batched_tokens)
        self.prefill99_s = self.prefill_pipe.prefill_time_s(max(1, int(p99)), max_batched_tokens)
        self.chunks50 = math.ceil(p50 / max_batched_tokens)
        self.chunks99 = math.ceil(p99 / max_batched_tokens)
        self.handoff50_s = profile.kv_handoff_s(int(p50))
        self.handoff99_s = profile.kv_handoff_s(int(p99))
        # a round that also carries a prompt's chunk: the chunk's extra time
        chunk_tokens = max(1, min(max_batched_tokens, int(self.prompt)))
        alone = self.decode_pipe.latency_interval_memo(chunk_tokens, 1)[0]
        one = self.decode_pipe.latency_interval_memo(0, 0, 0, 1, int(self.context))[0]
        self.chunk_extra_s = max(0.0, alone - one) if self.colocated else 0.0
        self.idle_round_s = self.decode_pipe.latency_interval_memo(0, 0, 0, 1, 1)[0]  # weights alone
        self._latency_ready = True

    def _round(self, seqs: int) -> float:
        # NOTE(mixed rounds): the prompt work of a colocated round does not spread thinly over
        # every round. The engine (vLLM's chunked prefill, agents.sim.engine) gives a round's
        # leftover token budget to whole prompt chunks, so a few rounds carry a chunk and pay
        # its compute in full, and the others are plain decode steps that pay the weights and
        # KV reads. A round that carried a thin slice of prompt instead would hide that slice's
        # compute under the weight reads (one kernel's compute and memory bounds overlap), and
        # the estimate would promise a TPOT the engine never reaches. So the mean round is a
        # decode step plus, for the share of rounds that carry a chunk, the chunk's extra time.
        pipe = self.decode_pipe
        pp = pipe.pp
        per_mb = max(1.0, seqs / pp)
        decode_seqs = int(round(per_mb))
        decode_ctx = int(decode_seqs * self.context)
        if not self.colocated:
            latency, interval = pipe.latency_interval_memo(0, 0, 0, decode_seqs, decode_ctx)
            return max(latency, min(pp, max(1, seqs)) * interval)
        # prompt tokens per micro-batch round that keep the population steady
        prompt = self.prompt
        prefill_per_round = per_mb * prompt / self.output
        # the prompt tokens a round carries when it carries any: the budget left by the decodes,
        # or less when the prompts waiting are shorter (a round takes what has arrived); and the
        # mean cached prefix such a chunk attends to (0 when a prompt fits one chunk). Written
        # out: a decision computes ~80 rounds
        left = self.max_batched_tokens - decode_seqs
        if left < 1:
            left = 1
        want = int(round(prompt if prompt >= prefill_per_round else prefill_per_round))
        chunk = want if want < left else left
        if chunk < 1:
            chunk = 1
        share = prefill_per_round / chunk
        if not share < 1.0:
            share = 1.0
        chunk_seqs = int(round(chunk / prompt))
        if chunk_seqs < 1:
            chunk_seqs = 1
        pieces = math.ceil(prompt / chunk)
        plain = pipe.latency_interval_memo(0, 0, 0, decode_seqs, decode_ctx)
        mixed = pipe.latency_interval_memo(chunk, chunk_seqs, int(chunk * (pieces - 1) / 2) * chunk_seqs, decode_seqs,
                                           decode_ctx)
        latency = plain[0] + share * (mixed[0] - plain[0])
        if pp == 1:  # one stage: interval == latency (the same floats), so the max below is latency
            return latency
        interval = plain[1] + share * (mixed[1] - plain[1])
        return max(latency, min(pp, max(1, seqs)) * interval)

    def token_costs_s(self) -> tuple[float, float]:
        """(seconds per prompt token, seconds per output token) of this plan's time when it runs
        at its capacity under this shape - what one token of each kind costs (scheduler.pool.twu
        weighs the tokens engines report by them).

        Colocated: a round at the running cap makes `running_cap` output tokens in the time of a
        plain decode round, and carries running_cap x prompt / output prompt tokens whose chunks
        add the rest of the round; so prompt x prefill_s + output x decode_s = 1 / capacity_rps.
        Disaggregated: each pipeline on its own GPUs - a decode round at the cap for the output
        tokens, a full prefill chunk's interval for the prompt tokens; the one that saturates
        first bounds `capacity_rps`. A plan that holds no sequence: (inf, inf)."""
        if self.running_cap < 1 or self.capacity_rps <= 0:
            return math.inf, math.inf
        cap = self.running_cap
        full = self._round_at(len(self.grid) - 1)
        if not self.colocated:
            chunk = self.max_batched_tokens
            per_chunk = self.prefill_pipe.latency_interval_memo(chunk, max(1, int(chunk // self.prompt)))[1]
            return per_chunk / chunk, full / cap
        pipe = self.decode_pipe
        decode_seqs = int(round(max(1.0, cap / pipe.pp)))
        latency, interval = pipe.latency_interval_memo(0, 0, 0, decode_seqs, int(decode_seqs * self.context))
        plain = latency if pipe.pp == 1 else max(latency, min(pipe.pp, cap) * interval)
        plain = min(plain, full)
        return (full - plain) / (cap * self.prompt / self.output), plain / cap

    def _round_at(self, i: int) -> float:
        """Round time at grid point i."""
        r = self._rounds[i]
        if r is None:
            r = self._rounds[i] = self._round(self.grid[i])
        return r

    @property
    def rounds(self) -> list[float]:
        """Round times at every grid point."""
        return [self._round_at(i) for i in range(len(self.grid))]

    def round_s(self, seqs: float) -> float:
        """Round time at `seqs` running sequences (linear between grid points)."""
        grid, at = self.grid, self._round_at
        if seqs <= grid[0]:
            return at(0)
        for i in range(1, len(grid)):
            if seqs <= grid[i]:
                a, b = grid[i - 1], grid[i]
                return at(i - 1) + (seqs - a) * (at(i) - at(i - 1)) / (b - a)
        return at(len(grid) - 1)

    def _population_round(self, rate_rps: float) -> tuple[float, float]:
        """(running sequences n with n / (output x round(n)) == rate, capped at the cap; the
        round time at max(1, n)) in one walk of the grid: n lies on the segment whose rates
        bracket `rate_rps`, and inside it the round time is that segment's interpolation (as
        `round_s` has it; at a grid point or past the cap it asks `round_s` itself)."""
        if rate_rps <= 0:
            return 0.0, self._round_at(0)
        grid, rounds, out = self.grid, self._rounds, self.output
        ra = rounds[0]
        if ra is None:
            ra = self._round_at(0)
        if grid[0] / (out * ra) >= rate_rps:
            return grid[0] * rate_rps * out * ra / grid[0], ra  # below one sequence: a fraction
        a = grid[0]
        for i in range(1, len(grid)):
            b, rb = grid[i], rounds[i]
            if rb is None:
                rb = self._round_at(i)
            if b / (out * rb) >= rate_rps:
                slope = (rb - ra) / (b - a)
                lo = rate_rps * out
                denom = 1.0 - lo * slope
                n = lo * (ra - a * slope) / denom if denom > 0 else float(b)
                # min(max(n, a), b) as the builtins pick (the first unless the other is beyond)
                if float(a) > n:
                    n = float(a)
                if float(b) < n:
                    n = float(b)
                if n <= a:
                    return n, self.round_s(max(1.0, n))
                return n, ra + (n - a) * (rb - ra) / (b - a)
            a, ra = b, rb
        n = float(grid[-1])
        return n, self.round_s(n)

    def _latencies(self, rate_rps: float) -> tuple[float, float, float, float, float, float, float]:
        """(served, utilisation, rho, TTFT P50, P99, TPOT P50, P99) at `rate_rps` (a live plan)."""
        if not self._latency_ready:
            self._latency_tables()
        capacity = self.capacity_rps
        served = min(rate_rps, capacity)
        util = rate_rps / capacity
        seqs, round_s = self._population_round(served)
        # TPOT is a request's mean time per output token, over its own rounds. Two things
        # spread it across requests. (1) Its rounds carry whole chunks with probability `frac`,
        # so over its `output` rounds the chunk count is binomial. (2) The load it shares its
        # life with: the sequences decoding beside it and the prompts arriving meanwhile are
        # Poisson counts of mean ~`seqs`, so the load-dependent part of a round (all of it but
        # the weights' read) varies by 1/sqrt(seqs) from one request's lifetime to another's.
        # P99 adds 2.33 sigma of the two together.
        tpot50 = round_s
        frac = min(1.0, served * self.chunks_per_prompt * round_s)
        chunk_var = self.chunk_extra_s ** 2 * frac * (1.0 - frac) / self.output
        load_var = max(0.0, round_s - self.idle_round_s) ** 2 / max(1.0, seqs)
        tpot99 = round_s + _Z99 * math.sqrt(chunk_var + load_var)
        rho = min(util, 0.999)
        theta = (1.0 / capacity) * (1 + self.work_cv2) / (2 * (1 - rho))

        def wait(q: float) -> float:
            return theta * math.log(rho / (1 - q)) if rho > 1 - q else 0.0

        if util >= 1.0:
            ttft50 = ttft99 = math.inf
        else:
            base50, base99 = self.prefill50_s, self.prefill99_s
            if self.colocated and seqs >= 1:
                # the prompt's chunks ride in rounds that also carry the running decodes
                base50 = max(base50, self.chunks50 * round_s)
                base99 = max(base99, self.chunks99 * tpot99)
            ttft50 = base50 + self.handoff50_s + wait(0.5)
            ttft99 = base99 + self.handoff99_s + wait(0.99)
        return served, util, rho, ttft50, ttft99, tpot50, tpot99

    def meets_slo(self, rate_rps: float, attainment: float) -> bool:
        """Whether goodput >= attainment x throughput at `rate_rps`: `estimate(rate_rps)`'s
        verdict without building the Estimate (the planner asks it a dozen times per plan)."""
        if self.running_cap < 1 or self.capacity_rps <= 0 or self.slo is None:
            est = self.estimate(rate_rps)
            return est.goodput_tokens_s >= attainment * est.throughput_tokens_s
        served, _, rho, ttft50, ttft99, tpot50, tpot99 = self._latencies(rate_rps)
        throughput = served * self.output
        goodput = throughput * _slo_attainment(self.slo, ttft50, ttft99, tpot50, tpot99, rho)
        return goodput >= attainment * throughput

    def slo_margin(self, rate_rps: float) -> float:
        """How far the worse P99 is past its objective at `rate_rps`: max(TTFT P99 / ttft,
        TPOT P99 / tpot) - 1 (<= 0: both met). Continuous and increasing in the rate, so a
        root-finder can look for the SLO rate on it (`planner._slo_rate`). With attainment
        0.99, `meets_slo` is true exactly where this is <= 0: `_attainment` interpolates from
        0.5 at P50 to 0.99 at P99 and is 1 only at or past P99. A live plan with an SLO only."""
        if self.slo is None or self.running_cap < 1 or self.capacity_rps <= 0:
            raise ValueError("slo_margin: needs a live plan with an SLO")
        # NOTE(p99 only): the planner's SLO-rate search asks this a hundred times a decision,
        # so it computes `_latencies`' two P99s alone - the same expressions in the same order,
        # hence the same floats - without the medians or the helper calls
        # (min and max written out as the builtins pick: the first argument unless the second
        # is strictly smaller / larger)
        if not self._latency_ready:
            self._latency_tables()
        capacity = self.capacity_rps
        served = capacity if capacity < rate_rps else rate_rps
        util = rate_rps / capacity
        seqs, round_s = self._population_round(served)
        frac = served * self.chunks_per_prompt * round_s
        if not frac < 1.0:
            frac = 1.0
        chunk_var = self.chunk_extra_s ** 2 * frac * (1.0 - frac) / self.output
        load = round_s - self.idle_round_s
        load_var = (load if load > 0.0 else 0.0) ** 2 / (seqs if seqs > 1.0 else 1.0)
        tpot99 = round_s + _Z99 * math.sqrt(chunk_var + load_var)
        if util >= 1.0:
            ttft99 = math.inf
        else:
            rho = 0.999 if 0.999 < util else util
            theta = (1.0 / capacity) * (1 + self.work_cv2) / (2 * (1 - rho))
            base99 = self.prefill99_s
            if self.colocated and seqs >= 1:
                ride = self.chunks99 * tpot99
                if ride > base99:
                    base99 = ride
            ttft99 = base99 + self.handoff99_s + (theta * math.log(rho / (1 - 0.99)) if rho > 1 - 0.99 else 0.0)
        ttft_excess, tpot_excess = ttft99 * 1e3 / self.slo.ttft_ms, tpot99 * 1e3 / self.slo.tpot_ms
        return (tpot_excess if tpot_excess > ttft_excess else ttft_excess) - 1.0

    def estimate(self, rate_rps: float) -> Estimate:
        """The plan under this workload shape at `rate_rps`."""
        if self.running_cap < 1 or self.capacity_rps <= 0:
            return _dead_estimate(rate_rps, self.kv_tokens, self.gpus, "kv")
        capacity = self.capacity_rps
        served, util, rho, ttft50, ttft99, tpot50, tpot99 = self._latencies(rate_rps)
        throughput = served * self.output
        goodput = throughput
        if self.slo is not None:
            goodput = throughput * _slo_attainment(self.slo, ttft50, ttft99, tpot50, tpot99, rho)
        return make_frozen(Estimate, {
            "capacity_rps": capacity,
            "served_rps": served,
            "utilization": util,
            "throughput_tokens_s": throughput,
            "goodput_tokens_s": goodput,
            "ttft_p50_s": ttft50,
            "ttft_p99_s": ttft99,
            "tpot_p50_s": tpot50,
            "tpot_p99_s": tpot99,
            "kv_capacity_tokens": self.kv_tokens,
            "max_running_seqs": self.running_cap,
            "gpus": self.gpus,
            "limit": self.limit,
        })


_STEADY_CACHE: OrderedDict[tuple[object, ...], SteadyState] = OrderedDict()


def steady_state(profile: PlanProfile, workload: Workload, slo: Slo | None = None, *,
                 max_batched_tokens: int = MAX_BATCHED_TOKENS, max_running_seqs: int = MAX_RUNNING_SEQS) -> SteadyState:
    """The `SteadyState` of a plan under a workload shape, memoised by content.

    The key is the plan's physical signature (model, factors, resolved stages, KV reserve,
    hand-off route) and the workload's shape (not its rate) rounded by `workload_shape`, so
    equal plans on equal blocks share one entry, and successive ticks whose window means
    drift by a percent or two hit it too. The tables are built from the rounded shape, so
    the result is a function of the inputs alone: memoising keeps it deterministic.
    """
    shape = workload_shape(workload)
    key = (profile.signature, shape, slo, max_batched_tokens, max_running_seqs)
    hit = _STEADY_CACHE.get(key)
    if hit is not None:
        _STEADY_CACHE.move_to_end(key)
        return hit
    state = SteadyState(profile, shape, slo, max_batched_tokens=max_batched_tokens,
                        max_running_seqs=max_running_seqs)
    _STEADY_CACHE[key] = state
    if len(_STEADY_CACHE) > _STEADY_CACHE_SIZE:
        _STEADY_CACHE.popitem(last=False)
    return state


def _round_log(value: float, steps_per_doubling: int = 16) -> float:
    return float(2.0 ** (round(math.log2(value) * steps_per_doubling) / steps_per_doubling))


@lru_cache(maxsize=1024)
def workload_shape(workload: Workload) -> Workload:
    """The workload's lengths and spread at rate 0, rounded: means to 1/16 of a doubling
    (about 4%), coefficients of variation to 0.05."""
    return Workload(
        rate_rps=0.0,
        prompt_tokens_mean=max(1.0, _round_log(workload.prompt_tokens_mean)),
        output_tokens_mean=max(1.0, _round_log(workload.output_tokens_mean)),
        prompt_tokens_cv=round(workload.prompt_tokens_cv * 20) / 20,
        output_tokens_cv=round(workload.output_tokens_cv * 20) / 20,
    )

def estimate_plan(profile: PlanProfile, workload: Workload, slo: Slo | None = None, *,
                  max_batched_tokens: int = MAX_BATCHED_TOKENS, max_running_seqs: int = MAX_RUNNING_SEQS) -> Estimate:
    """Steady-state throughput and P50/P99 latency of one plan (see `SteadyState`)."""
    return steady_state(profile, workload, slo, max_batched_tokens=max_batched_tokens,
                        max_running_seqs=max_running_seqs).estimate(workload.rate_rps)


def _attainment(slo_s: float, p50: float, p99: float) -> float:
    """Share of requests under `slo_s`, interpolating a distribution known at P50 and P99."""
    if math.isinf(p50):
        return 0.0
    if slo_s >= p99:
        return 1.0
    if slo_s >= p50:
        span = p99 - p50
        return 0.5 + 0.49 * ((slo_s - p50) / span if span > 0 else 1.0)
    return 0.5 * slo_s / p50 if p50 > 0 else 0.0


def _slo_attainment(slo: Slo, ttft50: float, ttft99: float, tpot50: float, tpot99: float, rho: float) -> float:
    return _attainment(slo.ttft_ms / 1e3, ttft50, ttft99) * _attainment(slo.tpot_ms / 1e3, tpot50, tpot99)


def _dead_estimate(rate_rps: float, kv_tokens: int, gpus: int, limit: str) -> Estimate:
    return make_frozen(Estimate, {
        "capacity_rps": 0.0, "served_rps": 0.0, "utilization": math.inf if rate_rps > 0 else 0.0,
        "throughput_tokens_s": 0.0, "goodput_tokens_s": 0.0, "ttft_p50_s": math.inf, "ttft_p99_s": math.inf,
        "tpot_p50_s": math.inf, "tpot_p99_s": math.inf, "kv_capacity_tokens": kv_tokens, "max_running_seqs": 0,
        "gpus": gpus, "limit": limit,
    })


def estimate_gear(profiles: Sequence[PlanProfile], weights: Sequence[float], workload: Workload,
                  slo: Slo | None = None, *, plan_estimates: Sequence[Estimate] | None = None) -> Estimate:
    """A gear's estimate: traffic split by `weights`; capacity is what the split sustains
    (the first plan to saturate bounds it); P50 is traffic-weighted, P99 the worst plan's."""
    if plan_estimates is None:
        plan_estimates = [
            estimate_plan(p, workload.scaled(w), slo) for p, w in zip(profiles, weights, strict=True)
        ]
    return combine_estimates(plan_estimates, weights, workload)


def combine_estimates(ests: Sequence[Estimate], weights: Sequence[float], workload: Workload) -> Estimate:
    """Aggregate per-plan estimates (each computed at its share of the traffic)."""
    active = [(e, w) for e, w in zip(ests, weights, strict=True) if w > 0]
    if not active:
        return _dead_estimate(workload.rate_rps, sum(e.kv_capacity_tokens for e in ests), sum(e.gpus for e in ests), "kv")
    # the first plan to saturate bounds the split (its capacity / its share), first on ties
    e0, w0 = active[0]
    capacity, limit = e0.capacity_rps / w0, e0.limit
    for e, w in active[1:]:
        c = e.capacity_rps / w
        if c < capacity:
            capacity, limit = c, e.limit
    lam = workload.rate_rps
    served = min(lam, capacity)
    total_w = 0.0  # (the weights of active plans are > 0: the same sum as sum() from 0)
    ttft50 = tpot50 = throughput = goodput = 0.0
    ttft99 = tpot99 = -math.inf
    for e, w in active:  # P50s traffic-weighted, P99s the worst plan's, rates summed
        total_w += w
        ttft50 += e.ttft_p50_s * w
        tpot50 += e.tpot_p50_s * w
        if e.ttft_p99_s > ttft99:
            ttft99 = e.ttft_p99_s
        if e.tpot_p99_s > tpot99:
            tpot99 = e.tpot_p99_s
        throughput += e.throughput_tokens_s
        goodput += e.goodput_tokens_s
    kv_tokens = running = gpus = 0
    for e in ests:
        kv_tokens += e.kv_capacity_tokens
        running += e.max_running_seqs
        gpus += e.gpus
    return make_frozen(Estimate, {
        "capacity_rps": capacity,
        "served_rps": served,
        "utilization": lam / capacity if capacity > 0 else math.inf,
        "throughput_tokens_s": throughput,
        "goodput_tokens_s": goodput,
        "ttft_p50_s": ttft50 / total_w,
        "ttft_p99_s": ttft99,
        "tpot_p50_s": tpot50 / total_w,
        "tpot_p99_s": tpot99,
        "kv_capacity_tokens": kv_tokens,
        "max_running_seqs": running,
        "gpus": gpus,
        "limit": limit,
    })


def capacity_weights(ests: Sequence[Estimate]) -> tuple[float, ...]:
    """Routing weights proportional to each plan's capacity (rounded, summing to exactly 1)."""
    caps = [max(0.0, e.capacity_rps) for e in ests]
    total = sum(caps)
    if total <= 0:
        return tuple(1.0 / len(ests) for _ in ests)
    raw = [round(c / total, 6) for c in caps]
    raw[-1] = round(1.0 - sum(raw[:-1]), 6)
    return tuple(raw)
