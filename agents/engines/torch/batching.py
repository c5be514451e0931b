"""The torch engine's batching: which tokens of which sequences the next step feeds.

Continuous batching, group by group (agents/engines/torch/engine.py runs one `Batcher` over all
its worker groups): every decoding sequence feeds its one token first, then prefill chunks take
what is left of the step's token budget in (priority, arrival) order - lower priority is more
urgent, as in vLLM's priority policy - so within one class it is first come, first served
(chunked prefill: a long prompt goes on over several steps). Every chunk has its KV blocks
allocated before it is chosen.

Length buckets (scheduler/buckets.py, the same semantics as the simulated engine): when the prompts
being prefilled plus the first waiting one mix buckets past `LengthBuckets.split`, the step orders
its prefills by (bucket, priority, arrival) and caps each bucket at `LengthBuckets.cap(b, budget)`,
so short prompts queued behind a long one are prefilled at once and the long one goes on in the
room they leave; alone, a bucket takes the whole budget.

Preemption (recompute): a decode that cannot get a block preempts a sequence of its group that is
not already in the step - the least urgent class first, then (with length buckets) its longest
bucket, then the latest arrived; possibly itself,
so never a more urgent one. A prefill that cannot get blocks preempts sequences of less urgent
classes only (never its own class or a more urgent one), and only when that makes it fit. A
preempted sequence's blocks are freed and it is prefilled again later from its tokens; its
sampler state - the seed and the count of draws - survives, so the tokens it goes on to produce
are the ones it would have produced: it is late, never lost.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from agents.engines.torch.kvcache import BlockAllocator
from agents.engines.torch.model import SeqChunk
from agents.engines.torch.sampling import SamplingParams, draws_after
from agents.engines.torch.worker import StepPlan
from scheduler.buckets import LengthBuckets
from scheduler.router.request import PRIORITY_MAX, PRIORITY_MIN

__all__ = ["Batch", "Batcher", "Chunk", "Seq", "check_length", "check_priority", "check_request", "sampling_params", "step_plan"]


@dataclass
class Seq:
    seq_id: str
    token_ids: list[int]
    num_prompt: int
    max_new_tokens: int
    sampling: SamplingParams
    draws: int
    arrival: int  # admission order: FCFS within a class for prefill, latest-first for preemption
    group: str  # the worker group holding (or about to hold) its KV
    priority: int = 0  # the request's class: lower is more urgent (vLLM's priority policy)
    num_computed: int = 0  # tokens whose KV is cached in `group`
    paused: bool = False  # held still (KV kept, never scheduled) while it is being moved away

    @property
    def pending(self) -> int:
        """Tokens still to feed; 1 = decoding (only the last sampled token)."""
        return len(self.token_ids) - self.num_computed

    @property
    def decoding(self) -> bool:
        """Prefilled: only the last sampled token is left to feed."""
        return self.pending == 1 and self.num_computed > 0

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt

    def took(self, token: int, eos_token_ids: Iterable[int]) -> bool:
        """Append the token a step sampled for it; whether the sequence is finished."""
        self.token_ids.append(token)
        self.draws = draws_after(self.sampling, self.num_generated)
        return self.num_generated >= self.max_new_tokens or (
            token in eos_token_ids and not self.sampling.ignore_eos
        )


Chunk = tuple[Seq, int, bool]  # a sequence, how many of its tokens the step feeds, whether it samples


@dataclass
class Batch:
    """One group's share of a step."""

    chunks: list[Chunk] = field(default_factory=list)
    preempted: list[Seq] = field(default_factory=list)  # lost their KV to make room; prefilled again later


def check_request(prompt: Sequence[object], generated: Sequence[object], max_new_tokens: object,
                  vocab_size: int) -> None:
    """Refuse a new sequence's tokens and cap before anything changes (ValueError naming the field)."""
    if not prompt:
        raise ValueError("prompt_ids: must hold at least one token")
    for name, ids in (("prompt_ids", prompt), ("generated_ids", generated)):
        for i, t in enumerate(ids):
            if not isinstance(t, int | np.integer) or isinstance(t, bool) or not 0 <= t < vocab_size:
                raise ValueError(f"{name}[{i}]: must be a token id in [0, {vocab_size}), got {t!r}")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: must be a positive integer, got {max_new_tokens!r}")
    if len(generated) >= max_new_tokens:
        raise ValueError(
            f"generated_ids: {len(generated)} tokens already reach max_new_tokens {max_new_tokens}: nothing to do"
        )


def check_priority(priority: object, name: str = "priority") -> int:
    """A request's class: an integer, lower is more urgent (the data plane's range)."""
    if not isinstance(priority, int) or isinstance(priority, bool) or not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise ValueError(f"{name}: must be an integer in [{PRIORITY_MIN}, {PRIORITY_MAX}], got {priority!r}")
    return priority


def check_length(num_prompt: int, max_new_tokens: int, max_positions: int,
                 allocators: Mapping[str, BlockAllocator], *, max_context: int | None = None) -> None:
    """Refuse a sequence that could never fit: past the model's positions, past the registry's
    max_context for the model version (`max_context`, when it is the lower), or more KV blocks than
    a group holds in all."""
    total = num_prompt + max_new_tokens
    if max_context is not None and max_context < max_positions and total > max_context:
        raise ValueError(
            f"max_new_tokens: prompt ({num_prompt}) + max_new_tokens ({max_new_tokens}) = {total} exceeds "
            f"the registered max_context {max_context}"
        )
    if total > max_positions:
        raise ValueError(
            f"max_new_tokens: prompt ({num_prompt}) + max_new_tokens ({max_new_tokens}) = {total} exceeds "
            f"max_position_embeddings {max_positions}"
        )
    for name, alloc in allocators.items():
        if alloc.blocks_for(total) > alloc.num_blocks:
            raise ValueError(
                f"max_new_tokens: a sequence of {total} tokens needs {alloc.blocks_for(total)} KV blocks, "
                f"group {name!r} has {alloc.num_blocks} in all (raise num_kv_blocks or shorten it)"
            )


def sampling_params(sampling: SamplingParams | dict[str, object] | None) -> SamplingParams:
    """A request's sampling as SamplingParams (None: greedy defaults)."""
    if sampling is None:
        return SamplingParams()
    if isinstance(sampling, dict):
        return SamplingParams.from_dict(sampling)
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling: must be SamplingParams, a dict or None, got {type(sampling).__name__}")
    return sampling


class Batcher:
    """Chooses each group's chunks for the next step (module docstring)."""

    def __init__(self, entry_group: str, length_buckets: LengthBuckets | None = None) -> None:
        if length_buckets is not None and not isinstance(length_buckets, LengthBuckets):
            raise ValueError(f"length_buckets: must be a LengthBuckets or None, got {type(length_buckets).__name__}")
        self.entry_group = entry_group  # where a preempted sequence is prefilled again
        self.length_buckets = length_buckets  # batching split by prompt length; None: one queue

    def schedule(self, name: str, seqs: Iterable[Seq], alloc: BlockAllocator, budget: int) -> Batch:
        """Group `name`'s chunks within `budget` tokens: every decode first, then prefill chunks by
        (priority, arrival) - with length buckets by (priority, bucket, arrival), and by (bucket,
        priority, arrival), each bucket within its cap, when the step's prompts are split by length.

        Invariants: a chunk's blocks are allocated (`alloc.ensure`) before it is chosen; a sequence
        is settled (chosen, or preempted for a prefill) at most once; a preempted sequence holds no blocks and is in no chunk; a
        sequence is preempted only for one of its own class or a more urgent one, never for a less
        urgent one.
        """
        mine = sorted((s for s in seqs if s.group == name and not s.paused), key=lambda s: (s.priority, s.arrival))
        full = budget
        batch = Batch()
        chosen: set[str] = set()  # settled this step
        # A prefill group never decodes: its prefilled sequences wait for the hand-over.
        if name != "prefill":
            for seq in mine:
                if not (seq.decoding and seq.group == name):
                    continue
                while not alloc.can_ensure(seq.seq_id, seq.num_computed + 1):
                    # the victim is never more urgent than seq: seq itself is a candidate
                    victims = [s for s in mine if s.group == name and alloc.has(s.seq_id) and s.seq_id not in chosen]
                    if not victims:
                        break
                    victim = max(victims, key=self._victim_order)
                    self._preempt(victim, alloc, batch)
                    if victim is seq:
                        break
                # preempted itself (in a colocated engine it stays in this group, prefilled again
                # later), or everything else is already in this step
                if not seq.decoding or seq.group != name or not alloc.can_ensure(seq.seq_id, seq.num_computed + 1):
                    continue
                alloc.ensure(seq.seq_id, seq.num_computed + 1)
                batch.chunks.append((seq, 1, True))
                chosen.add(seq.seq_id)
                budget -= 1
        # Not prefilled again in the step that preempted it (vLLM does the same): it would take back
        # the room just made for another and thrash.
        chosen.update(s.seq_id for s in batch.preempted)
        prefills = [s for s in mine if not s.decoding and s.group == name and s.seq_id not in chosen]
        room = self._split(prefills, full)
        if room is not None:
            prefills.sort(key=lambda s: (self._bucket(s), s.priority, s.arrival))
        elif self.length_buckets is not None:  # the shorter bucket first within a class, as the simulator's queue
            prefills.sort(key=lambda s: (s.priority, self._bucket(s), s.arrival))
        for seq in prefills:
            if seq.seq_id in chosen:
                continue  # preempted for a more urgent prefill of this step
            if budget <= 0:
                break
            n = min(seq.pending, budget)
            if room is not None:
                n = min(n, room[self._bucket(seq)])
                if n <= 0:
                    continue  # its bucket's share of this step is spent
            if not alloc.can_ensure(seq.seq_id, seq.num_computed + n):
                budget += self._make_room(seq, n, mine, alloc, batch, chosen)
                if not alloc.can_ensure(seq.seq_id, seq.num_computed + n):
                    break  # a later prompt does not overtake one that waits for blocks
            alloc.ensure(seq.seq_id, seq.num_computed + n)
            batch.chunks.append((seq, n, n == seq.pending))
            chosen.add(seq.seq_id)
            budget -= n
            if room is not None:
                room[self._bucket(seq)] -= n
        return batch

    def _bucket(self, seq: Seq) -> int:
        return self.length_buckets.of(seq.num_prompt) if self.length_buckets is not None else 0

    def _split(self, prefills: list[Seq], full: int) -> list[int] | None:
        """Each bucket's tokens this step when its prompts are split by length, else None (one
        queue, the whole budget). The lengths are those of the prompts being prefilled and of the
        first waiting one, as in the simulated engine (agents/sim/pipe.py)."""
        buckets = self.length_buckets
        if buckets is None or not prefills:
            return None
        lengths = [s.num_prompt for s in prefills if s.num_computed]
        waiting = [s.num_prompt for s in prefills if not s.num_computed]
        lengths += waiting[:1]
        if not buckets.split(min(lengths), max(lengths)):
            return None
        return [buckets.cap(b, full) for b in range(len(buckets.shares))]

    def _victim_order(self, seq: Seq) -> tuple[int, int, int]:
        """Preempted first: the largest - the least urgent class, then (with length buckets) its
        longest bucket, whose KV frees the most room, then the latest arrived."""
        return seq.priority, self._bucket(seq), seq.arrival

    def _make_room(self, seq: Seq, n: int, mine: list[Seq], alloc: BlockAllocator, batch: Batch,
                   chosen: set[str]) -> int:
        """Preempt sequences of less urgent classes until `seq`'s next `n` tokens fit - only when
        they would: nobody loses its KV for a prefill that still waits. The budget it gives back
        (the decodes of this step it took out)."""
        victims = [s for s in mine if s.priority > seq.priority and s.group == seq.group and alloc.has(s.seq_id)
                   and (s.seq_id not in chosen or s.decoding)]  # a chosen prefill chunk keeps its place
        missing = alloc.missing_blocks(seq.seq_id, seq.num_computed + n)
        if alloc.num_free_blocks + sum(len(alloc.block_table(s.seq_id)) for s in victims) < missing:
            return 0
        freed = 0
        victims.sort(key=self._victim_order)
        while not alloc.can_ensure(seq.seq_id, seq.num_computed + n):
            victim = victims.pop()
            if victim.seq_id in chosen:  # a decode of this step: out of it
                batch.chunks = [c for c in batch.chunks if c[0] is not victim]
                freed += 1
            self._preempt(victim, alloc, batch)
            chosen.add(victim.seq_id)  # and not prefilled again in the room it just left
        return freed

    def _preempt(self, seq: Seq, alloc: BlockAllocator, batch: Batch) -> None:
        alloc.free(seq.seq_id)
        seq.num_computed = 0
        seq.group = self.entry_group
        batch.preempted.append(seq)


def step_plan(chunks: Sequence[Chunk], alloc: BlockAllocator, forget: tuple[str, ...]) -> StepPlan:
    """What the group's workers run: each chunk's tokens, block table and sampler state."""
    plan_chunks, token_ids, sampling = [], [], {}
    for seq, n, sample in chunks:
        start = seq.num_computed
        plan_chunks.append(SeqChunk(seq.seq_id, start, n, alloc.block_table(seq.seq_id), sample))
        token_ids.extend(seq.token_ids[start : start + n])
        if sample:
            sampling[seq.seq_id] = (seq.sampling, seq.draws)
    return StepPlan(tuple(plan_chunks), tuple(token_ids), sampling, forget)
