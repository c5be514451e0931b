"""One pipeline of stages of a simulated plan, running rounds: continuous batching with chunked
prefill, paged KV with preemption by recompute, the prefix cache and its KV tiers. `Pipe` is this
concept; `PlanEngine` (agents/sim/engine.py) holds one pipe per colocated plan, two (prefill,
decode) per disaggregated plan. Step times come from `scheduler.costmodel` (the same
`PipelineProfile` the planner estimates with).

A *round* is one scheduler step of a pipe (a pipeline of stages): every decoding sequence makes
one token, and what is left of the token budget (`MAX_BATCHED_TOKENS` per micro-batch, vLLM's
default) goes to prompt chunks, first of sequences already prefilling (first come first
served), then of waiting ones as KV memory and the sequence cap allow. With PP stages the
sequences split into `pp` micro-batches in flight; a round is then
`max(latency, min(pp, seqs) x interval)` of one micro-batch (`costmodel.SteadyState` uses the
same rule, so the simulator and the estimates agree by construction on what a round is).

KV: a pipe holds `plan.kv_reserve_tokens` tokens (what the plan reserved from GPU memory).
Admission reserves a sequence's whole prefill; each decode token adds one. When the next round's
tokens do not fit, the most recently admitted sequence is preempted: its KV is dropped and it
goes back to the head of the queue to be recomputed (prompt + generated so far), as vLLM does.
With KV tiers (agents/sim/kvtiers.py) the prefix cache's evicted blocks go to host memory and SSD,
and an admission restores the ones its prompt continues with; its round waits for the copy.

The analytic shortcut (why a replay of eight hours is fast): between two things that change a
batch - an arrival, a finish, a sequence that would overflow the KV, a hand-over - the rounds
of a decode-only batch are identical except that each context grows by one token. Such a run of
k rounds is advanced in one step: its round time is the cost model's time at the run's middle
context (the attention term is linear in the context, the rest does not depend on it, so the
error is second order), tokens are credited at its end, and a request that arrives during the
run truncates it at the end of the round in flight. Rounds that carry prompt chunks are always
simulated one by one. A sequence's decode progress is kept as (decode clock, context, tokens)
at the moment it joined, so nothing is touched per sequence per round.

Each round's batch-token threshold is the local loop's (agents/sim/hints.py: LocalHints), asked of
the pipe's engine (`PlanEngine.batch_tokens`).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from agents.sim.events import KIND_BOUNDARY, Event
from agents.sim.kvtiers import TierView, admit_prefix
from agents.sim.queues import PrefixCache, WaitQueue
from agents.sim.request import Request
from scheduler.costmodel import MAX_BATCHED_TOKENS, MAX_RUNNING_SEQS, PipelineProfile

if TYPE_CHECKING:
    from agents.sim.engine import PlanEngine

Role = Literal["both", "prefill", "decode"]

MAX_RUN_ROUNDS = 4096  # longest analytic run: bounds the middle-context approximation
TIME_EPS = 1e-9  # rounding guard when a run is cut at "now"


class Pipe:
    """A pipeline of stages running rounds (module docstring). One per colocated plan; two
    (prefill, decode) per disaggregated plan."""

    def __init__(self, engine: PlanEngine, role: Role, profile: PipelineProfile, kv_cap: int,
                 kv_bytes_per_token: float, gpus: int) -> None:
        self.engine = engine
        self.role = role
        self.prof = profile
        self.pp = profile.pp
        self.budget = MAX_BATCHED_TOKENS * self.pp  # the engine's own threshold (a hint may set another)
        self.seq_cap = MAX_RUNNING_SEQS * self.pp
        self.kv_cap = kv_cap
        self.kv_bytes_per_token = kv_bytes_per_token  # over all GPUs of the pipe (for memory use)
        self.gpus = gpus
        self.max_run = engine.host.max_run_rounds  # longest analytic run (1: every round simulated)
        self.waiting = WaitQueue(engine.host.length_buckets)  # by priority class, bucket, deadline, arrival
        self.running: dict[int, Request] = {}  # admission order: the last one is preempted first
        # (within the least urgent priority class once any other class has run here)
        self.mixed_priorities = False
        block_tokens = engine.host.prefix_block_tokens
        self.cache = PrefixCache(kv_cap // block_tokens, block_tokens) if role != "decode" and block_tokens else None
        # KV tiers (agents/sim/kvtiers.py): what the cache evicts goes to the node's host tier
        self.tiers: TierView | None = engine.host.tier_view(self) if self.cache is not None else None
        if self.tiers is not None:
            self.cache.spill = self.tiers.offload  # type: ignore[union-attr]
        self.prefilling: list[Request] = []  # prefill passes in progress, first come first served
        self.n_dec = 0  # decoding sequences
        self.ctx_base = 0  # sum over decoding of (ctx0 - d0): their context is ctx_base + n_dec x clock
        self.kv_pre = 0  # KV reserved by prefill passes
        self.clock = 0  # decode clock: rounds that carried decodes
        self.fin: list[tuple[int, int, int, Request]] = []  # (clock at finish, rid, epoch, request)
        # the round (or run of rounds) in flight
        self.busy = False
        self.t0 = 0.0
        self.step = 0.0
        self.k = 0
        self.run_n = 0  # decoding sequences in it
        self.chunks: list[tuple[Request, int]] = []
        self.version = 0  # bumps when the scheduled boundary changes: older events are stale
        self.handover: Callable[[Pipe, float], list[Event]] | None = None  # at the next boundary
        # accounting
        self.busy_s = 0.0  # time it ran rounds
        self.kv_token_s = 0.0  # integral of KV tokens in use over time
        self.tokens_done = 0  # tokens it computed (prompt chunks and decode steps), for compute use

    # --- state ----------------------------------------------------------------------------
    @property
    def kv_used(self) -> int:
        return self.ctx_base + self.n_dec * self.clock + self.kv_pre

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    def prefill_left(self) -> tuple[int, int]:
        """Prompt tokens still to prefill here (queued and in-progress passes), and of those the
        low-priority requests' (what the router's queue estimate reads)."""
        tokens, low = self.waiting.tokens, self.waiting.low_tokens
        for req in self.prefilling:
            left = req.need - req.done
            tokens += left
            if req.priority > 0:
                low += left
        return tokens, low

    def empty(self) -> bool:
        return not self.waiting and not self.running and not self.chunks

    # --- entry points -------------------------------------------------------------------
    def enqueue(self, req: Request, t: float, front: bool = False) -> list[Event]:
        """Queue a request (a prefill pass, or decode-ready when it has its KV) and wake the pipe."""
        req.pipe = self
        req.engine_id = self.engine.engine_id
        if front:
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)
        return self.poke(t)

    def poke(self, t: float) -> list[Event]:
        """New work: start a round now when idle, or cut a decode-only run at the round in flight."""
        if self.engine.state != "serving":
            return []
        if not self.busy:
            return self._start_round(t)
        if self.k > 1:
            done = math.ceil((t - self.t0) / self.step - TIME_EPS) if self.step > 0 else 1
            done = max(1, min(self.k, done))
            if done < self.k:
                self.k = done
                self.version += 1
                return [(self.t0 + done * self.step, KIND_BOUNDARY, self.on_boundary, self.version)]
        return []

    def on_boundary(self, t: float, version: object) -> list[Event]:
        if version != self.version or not self.busy:
            return []
        self.busy = False
        out = self._finish_round(t, self.k)
        if self.handover is not None:
            hand, self.handover = self.handover, None
            out += hand(self, t)
        out += self._start_round(t)
        if not self.busy and self.empty():
            out += self.engine.host.pipe_idle(self.engine, t)
        return out

    # --- a round ----------------------------------------------------------------------------
    def _finish_round(self, t: float, k: int) -> list[Event]:
        """Credit the round(s) that ended at t: decode tokens, finishes, completed prompt chunks."""
        out: list[Event] = []
        host = self.engine.host
        n = self.run_n
        span = t - self.t0
        self.busy_s += span
        kv_start = self.ctx_base + self.n_dec * self.clock + self.kv_pre
        self.tokens_done += n * k
        if self.chunks:
            self.tokens_done += sum(c for _, c in self.chunks)
        if n and k:
            self.clock += k
            clock = self.clock
            self.kv_token_s += span * (kv_start + n * k / 2)
            host.tokens(self.engine, self.t0, t, n * k)
            fin = self.fin
            while fin and fin[0][0] <= clock:
                _, _, epoch, req = heapq.heappop(fin)
                if req.epoch == epoch and req.decoding and req.pipe is self:
                    self._leave_decoding(req)
                    del self.running[req.rid]
                    req.generated = req.output
                    out += host.finished(req, t)
            if host.log_decodes:  # who decoded what, for invariant 2 (agents/sim/seqlog.py)
                for req in self.running.values():
                    if req.decoding:
                        host.decoded(req, self.engine, t)
        else:
            self.kv_token_s += span * kv_start
        if self.chunks:
            chunks, self.chunks = self.chunks, []
            sampled = 0
            cache = self.cache
            for req, c in chunks:
                req.done += c
                if cache is not None and req.blocks:
                    self._cache_blocks(cache, req)
                if req.done < req.need:
                    continue
                # the pass is complete: it samples one token
                self.prefilling.remove(req)
                self.kv_pre -= req.need
                req.generated += 1
                req.has_kv = True
                sampled += 1
                if req.generated >= req.output:
                    del self.running[req.rid]
                    req.epoch += 1
                    if req.first_token_s is None:
                        req.first_token_s = t
                        host.first_token(req, t)
                    out += host.finished(req, t)
                elif self.role == "prefill":
                    del self.running[req.rid]
                    req.epoch += 1
                    out += self.engine.hand_off(req, t)
                else:
                    if req.first_token_s is None:
                        req.first_token_s = t
                        host.first_token(req, t)
                    self._join_decoding(req)
            if sampled:
                host.tokens(self.engine, t, t, sampled)
        self.run_n = 0
        return out

    @staticmethod
    def _cache_blocks(cache: PrefixCache, req: Request) -> None:
        """The prompt blocks this pass has now computed join the cache; when the prompt is done,
        all of them are touched again, last to first (queues.PrefixCache)."""
        full = min(req.done, req.prompt) // cache.block_tokens
        if full > len(req.blocks):
            full = len(req.blocks)
        if full > req.blocks_in:
            cache.insert(req.blocks[req.blocks_in:full])
            req.blocks_in = full
        if req.done >= req.need and full:
            cache.insert(req.blocks[:full])

    def _join_decoding(self, req: Request) -> None:
        req.ctx0 = req.prompt + req.generated
        req.d0 = self.clock
        req.gen0 = req.generated
        req.decoding = True
        self.n_dec += 1
        self.ctx_base += req.ctx0 - self.clock
        heapq.heappush(self.fin, (self.clock + req.output - req.generated, req.rid, req.epoch, req))

    def _leave_decoding(self, req: Request) -> None:
        req.generated = req.gen0 + self.clock - req.d0
        req.decoding = False
        req.epoch += 1
        self.n_dec -= 1
        self.ctx_base -= req.ctx0 - req.d0

    def _preempt_last(self, t: float) -> list[Event]:
        """Drop the KV of the most recently admitted sequence of the least urgent priority class
        here (vLLM's priority policy; plain last-admitted while every sequence has one class); it
        is recomputed later."""
        buckets = self.engine.host.length_buckets
        if buckets is not None:
            # the least urgent class, then its longest bucket (scheduler/buckets.py), then the last admitted
            worst = max(r.priority for r in self.running.values())
            order = list(self.running.values())
            rid = max((i for i, r in enumerate(order) if r.priority == worst),
                      key=lambda i: (buckets.of(order[i].prompt), i))
            req = self.running.pop(order[rid].rid)
        elif self.mixed_priorities:
            worst = max(r.priority for r in self.running.values())
            rid = next(r.rid for r in reversed(self.running.values()) if r.priority == worst)
            req = self.running.pop(rid)
        else:
            _, req = self.running.popitem()
        if req.decoding:
            self._leave_decoding(req)
        else:
            self.prefilling.remove(req)
            self.kv_pre -= req.need
            req.epoch += 1
        req.preemptions += 1
        req.drop_kv()
        return self.engine.requeue_front(self, req, t)

    def _start_round(self, t: float) -> list[Event]:
        """Form the next round at time t and schedule its end (module docstring)."""
        out: list[Event] = []
        cap = self.kv_cap
        role = self.role
        # 1. the decode tokens of this round must fit in the KV cache
        preempted = False
        while self.n_dec and self.ctx_base + self.n_dec * (self.clock + 1) + self.kv_pre > cap:
            out += self._preempt_last(t)
            preempted = True
        n_dec = self.n_dec
        full = self.engine.batch_tokens(t) * self.pp  # the local loop's threshold (module docstring)
        budget = full - n_dec if role == "both" else (full if role == "prefill" else 0)
        chunks: list[tuple[Request, int]] = []
        pre_tokens = pre_ctx = 0
        # With length buckets (scheduler/buckets.py) a round that mixes short and long prompts is
        # split: shorter buckets first, each bucket within its share of the budget.
        buckets = self.engine.host.length_buckets
        room: list[int] | None = None
        prefilling = self.prefilling
        if buckets is not None and (prefilling or self.waiting):
            lengths = [r.prompt for r in prefilling]
            if self.waiting:
                lengths.append(self.waiting[0].prompt)
            if buckets.split(min(lengths), max(lengths)):
                room = [buckets.cap(b, full) for b in range(len(buckets.shares))]
                prefilling = sorted(prefilling, key=lambda r: buckets.of(r.prompt))
        # 2. prefill passes in progress, first come first served (by bucket when split)
        for req in prefilling:
            if budget <= 0:
                break
            c = min(req.need - req.done, budget)
            if room is not None:
                b = buckets.of(req.prompt)  # type: ignore[union-attr]
                c = min(c, room[b])
                room[b] -= c
                if c <= 0:
                    continue
            chunks.append((req, c))
            pre_ctx += req.done
            pre_tokens += c
            budget -= c
        # 3. admit waiting sequences while the budget, the sequence cap and the KV allow - the KV
        # check counts this round's decode tokens. Not after a preemption (vLLM does the same):
        # the sequence just preempted would be readmitted at once and thrash.
        waiting, running = self.waiting, self.running
        restore_s = 0.0  # KV tiers: this round first waits for the blocks its admissions restore
        if waiting and not preempted:
            # KV this round needs so far: what is held plus one token per decoding sequence
            need_kv = self.ctx_base + n_dec * (self.clock + 1) + self.kv_pre
            seq_cap = self.seq_cap
            while waiting and len(running) < seq_cap:
                req = waiting[0]
                if req.has_kv:
                    ctx = req.prompt + req.generated
                    if need_kv + ctx + 1 > cap or (role == "both" and budget < 1):
                        break
                    waiting.popleft()
                    running[req.rid] = req
                    self._join_decoding(req)
                    need_kv += ctx + 1
                    budget -= 1
                    continue
                if budget <= 0 or role == "decode":
                    break
                need = req.need
                if need > cap:
                    waiting.popleft()
                    out += self.engine.host.failed(
                        req, t, f"needs {need} KV tokens; plan {self.engine.plan.plan_id} holds {cap}")
                    continue
                if need_kv + need > cap:
                    break
                waiting.popleft()
                running[req.rid] = req
                self.prefilling.append(req)
                self.kv_pre += need
                need_kv += need
                if req.priority:
                    self.mixed_priorities = True
                if self.cache is not None and req.blocks and not req.done:
                    restore_s += admit_prefix(self.cache, self.tiers, req, t)  # GPU hit, then the tiers'
                c = min(need - req.done, budget)
                if room is not None:
                    b = buckets.of(req.prompt)  # type: ignore[union-attr]
                    c = min(c, room[b])
                    room[b] -= c
                    if c <= 0:
                        continue  # admitted: its prefill starts next round, in its bucket's share
                chunks.append((req, c))
                pre_ctx += req.done
                pre_tokens += c
                budget -= c
        n = self.n_dec
        if not chunks and not n:
            return out
        ctx = self.ctx_base + n * self.clock
        self.engine.update_share(t)  # the plans busy beside it on a shared GPU slow this round
        if chunks:
            k = 1
            step = self._round_s(pre_tokens, len(chunks), pre_ctx, n, ctx) + restore_s
        else:
            k_fin = self._next_finish() - self.clock
            k_kv = (cap - ctx - self.kv_pre) // n
            k = max(1, min(k_fin, k_kv, self.max_run))
            step = self._round_s(0, 0, 0, n, ctx + n * (k - 1) // 2)
        self.busy = True
        self.t0 = t
        self.step = step
        self.k = k
        self.run_n = n
        self.chunks = chunks
        self.version += 1
        out.append((t + k * step, KIND_BOUNDARY, self.on_boundary, self.version))
        return out

    def _next_finish(self) -> int:
        fin = self.fin
        while fin:
            d, _, epoch, req = fin[0]
            if req.epoch == epoch and req.decoding and req.pipe is self:
                return d
            heapq.heappop(fin)
        return self.clock + MAX_RUN_ROUNDS

    def _round_s(self, pre_tokens: int, pre_seqs: int, pre_ctx: int, dec: int, dec_ctx: int) -> float:
        """A round's time by the cost model, slowed by `engine.share` when busy plans share its GPU."""
        pp = self.pp
        if pp == 1:
            return self.prof.latency_interval(pre_tokens, pre_seqs, pre_ctx, dec, dec_ctx)[0] * self.engine.share
        latency, interval = self.prof.latency_interval(
            -(-pre_tokens // pp), -(-pre_seqs // pp), pre_ctx // pp, -(-dec // pp), dec_ctx // pp)
        return max(latency, min(pp, max(1, dec + pre_seqs)) * interval) * self.engine.share

    # --- leaving ------------------------------------------------------------------------------
    def settle(self, t: float) -> list[Event]:
        """Bring a run in flight up to t (rounds completed by then are credited; the round in
        flight is lost). Used when the pipe is stopped between boundaries."""
        if not self.busy:
            return []
        out: list[Event] = []
        if self.chunks or self.step <= 0:
            done = 1 if t >= self.t0 + self.step * self.k - TIME_EPS else 0
        else:
            done = max(0, min(self.k, int((t - self.t0) / self.step + TIME_EPS)))
        self.busy = False
        self.version += 1
        if done:
            end = self.t0 + done * self.step
            out += self._finish_round(end, done)
            self.busy_s += t - end
        else:
            self.busy_s += t - self.t0
            self.chunks = []
            self.run_n = 0
        return out

    def evict(self, keep_kv: bool) -> list[Request]:
        """Take every sequence out (running in admission order, then the queue). Without
        `keep_kv` their KV is gone and they will be recomputed."""
        out: list[Request] = []
        for req in self.running.values():
            if req.decoding:
                self._leave_decoding(req)
            else:
                req.epoch += 1
            out.append(req)
        out.extend(self.waiting)
        self.running = {}
        self.prefilling = []
        self.waiting = WaitQueue(self.engine.host.length_buckets)
        self.kv_pre = 0
        self.fin = []
        self.chunks = []
        for req in out:
            req.pipe = None
            req.engine_id = 0
            if not (keep_kv and req.has_kv):
                req.drop_kv()
        return out

    def take_running(self, keep: Callable[[Request], bool]) -> list[Request]:
        """At a boundary: take the sequences that `keep` does not keep (decoding ones keep their
        KV flag, prefilling ones restart their pass). Nothing may be in flight."""
        out: list[Request] = []
        for rid, req in list(self.running.items()):
            if req.decoding:
                if keep(req):
                    continue
                self._leave_decoding(req)
            else:
                self.prefilling.remove(req)
                self.kv_pre -= req.need
                req.epoch += 1
                req.drop_kv()
            del self.running[rid]
            req.pipe = None
            req.engine_id = 0
            out.append(req)
        return out
