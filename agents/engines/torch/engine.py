"""TorchEngine: the in-process facade the agent daemon drives.

    engine = TorchEngine(model_dir, Layout.pipeline(4, pp=2, tp=1), device="cpu")
    engine.add_request("r1", prompt_ids, max_new_tokens=32, sampling=SamplingParams())
    while engine.has_unfinished():
        for seq_id, token_id, finished in engine.step(): ...
    state = engine.export_kv("r1")        # between two steps = at a safe boundary
    other.import_kv("r1", state); engine.drop("r1")
    engine.offload("r2"); engine.restore("r2")   # KV to host memory and back (host_kv_bytes > 0)
    engine.shutdown()

The engine is a continuous-batching scheduler over one worker group (colocated) or two
(disaggregated: a prefill group hands each sequence's KV to a decode group after its first
token); which tokens each step feeds is agents/engines/torch/batching.py's choice. Not
thread-safe: drive it from one thread. Every public method runs between two steps, which is
exactly the safe boundary a gear switch needs (the end of a decode iteration).

With `host_kv_bytes` > 0 the engine has a host tier (agents/engines/torch/kvtier.py): `offload`
moves a sequence's KV off the GPU into host memory and `restore` brings it back, token-exact; a
finished sequence's KV goes there too, and a new prompt that starts with a held sequence's tokens
(the next turn of a conversation) takes that KV as its prefix instead of recomputing it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from agents.engines.torch.batching import (
    Batcher,
    Chunk,
    Seq,
    check_length,
    check_priority,
    check_request,
    sampling_params,
    step_plan,
)
from agents.engines.torch.comm import check_device, check_gpus
from agents.engines.torch.group import EngineError, WorkerGroup
from agents.engines.torch.kvcache import KVCacheFullError
from agents.engines.torch.kvstate import KVState
from agents.engines.torch.kvtier import HostKVTier
from agents.engines.torch.layout import Layout
from agents.engines.torch.model import ModelConfig
from agents.engines.torch.remote import Placement
from agents.engines.torch.sampling import SamplingParams, draws_after
from agents.engines.torch.weights import WEIGHTS_FILE, sha256_file
from scheduler.buckets import LengthBuckets

__all__ = ["EngineError", "KVCacheFullError", "KVState", "StepOutput", "TorchEngine"]


class StepOutput(NamedTuple):
    seq_id: str
    token_id: int
    finished: bool


@dataclass
class EngineStats:
    steps: int = 0
    tokens_generated: int = 0
    tokens_prefilled: int = 0  # tokens fed in chunks of more than one (prefill and re-prefill)
    preemptions: int = 0
    handoffs: int = 0  # disaggregated prefill -> decode hand-overs
    handoff_bytes: int = 0
    prefix_hit_tokens: int = 0  # prompt tokens whose KV came from the host tier instead of a prefill
    groups: dict[str, int] = field(default_factory=dict)  # steps run per group


class TorchEngine:
    def __init__(
        self,
        model_dir: str | Path,
        layout: Layout | dict[str, object],
        device: str = "cpu",
        *,
        gpus: Sequence[int] | None = None,
        backend: str = "auto",
        num_kv_blocks: int = 256,
        block_size: int = 16,
        max_tokens_per_step: int = 256,
        expected_sha256: str | None = None,
        timeout_s: float = 120.0,
        num_threads: int = 1,
        start_method: str = "forkserver",
        placement: Mapping[str, Placement] | None = None,
        host_kv_bytes: int = 0,
        verified_sha256: str | None = None,
        length_buckets: LengthBuckets | None = None,
        max_context: int | None = None,
    ) -> None:
        """`placement`: per group name (main, or prefill and decode), which of its ranks run here
        and which nodes to ask for the others (agents/engines/torch/remote.py). A group without
        an entry runs every rank on this node, as a one-node plan does. `host_kv_bytes`: the host
        tier's size (0: no host tier; module docstring). `verified_sha256`: the weights' digest when
        the caller has hashed this very file already (not hashed again). `length_buckets`: batching split
        by prompt length (agents/engines/torch/batching.py); None: one queue by (priority, arrival).
        `max_context`: the registry's cap on prompt + max tokens for this model version (prepare_plan's
        model_version.max_context); None: the model's own positions only."""
        if max_context is not None and (isinstance(max_context, bool) or not isinstance(max_context, int)
                                        or max_context < 1):
            raise ValueError(f"max_context: must be a positive integer, got {max_context!r}")
        self.max_context = max_context
        self.host_tier = HostKVTier(host_kv_bytes) if host_kv_bytes else None
        self.model_dir = str(model_dir)
        self.cfg = ModelConfig.from_dir(model_dir)
        self.layout = layout if isinstance(layout, Layout) else Layout.from_dict(layout)
        self.layout.validate(self.cfg)
        self.device = check_device(device)
        self.gpus = check_gpus(self.device, gpus)
        if not isinstance(max_tokens_per_step, int) or max_tokens_per_step < 1:
            raise ValueError(f"max_tokens_per_step: must be a positive integer, got {max_tokens_per_step!r}")
        if not isinstance(timeout_s, int | float) or timeout_s <= 0:
            raise ValueError(f"timeout_s: must be positive, got {timeout_s!r}")
        self.batcher = Batcher(self._entry_group, length_buckets)
        weights = Path(model_dir) / WEIGHTS_FILE
        if not weights.is_file():
            raise ValueError(f"model_dir: {model_dir} has no {WEIGHTS_FILE}")
        # A digest the caller computed for these very bytes (the node's ModelStore hashes a model
        # once, and its host-cache copy is a byte copy) is taken as it is: hashing tens of GB again
        # at every start would cost more than the load it checks.
        self.model_sha256 = verified_sha256 or sha256_file(weights)
        if expected_sha256 is not None and expected_sha256 != self.model_sha256:
            raise ValueError(
                f"expected_sha256: the weights in {model_dir} hash to {self.model_sha256}, not {expected_sha256}"
            )
        self.max_tokens_per_step = max_tokens_per_step
        self.stats = EngineStats()
        self.last_step_end_s = time.perf_counter()  # when the latest step returned (stall clock)
        self._seqs: dict[str, Seq] = {}
        self._arrivals = itertools.count()
        self._groups: dict[str, WorkerGroup] = {}
        self._forget: dict[str, list[str]] = {}
        # GPUs go round-robin over every worker of the engine, prefill group first, so a
        # disaggregated engine with enough GPUs keeps its two groups apart.
        # Ranks on other nodes take no GPU of this one (-1: their node fills in its own).
        where = dict(placement or {})
        for name in where:
            if name not in self.layout.groups:
                raise ValueError(f"placement: no group {name!r} in this layout ({sorted(self.layout.groups)})")
        turn = itertools.count()
        try:
            for name, stages in self.layout.groups.items():
                world = sum(s.tp for s in stages)
                here = where.get(name)
                rank_gpus = (
                    tuple(
                        self.gpus[next(turn) % len(self.gpus)] if here is None or rank in here.local else -1
                        for rank in range(world)
                    )
                    if self.gpus
                    else ()
                )
                self._groups[name] = WorkerGroup(
                    name,
                    self.model_dir,
                    self.cfg,
                    stages,
                    device=self.device,
                    rank_gpus=rank_gpus,
                    backend=backend,
                    num_blocks=num_kv_blocks,
                    block_size=block_size,
                    timeout_s=float(timeout_s),
                    num_threads=num_threads,
                    start_method=start_method,
                    placement=here,
                )
                self._forget[name] = []
        except BaseException:
            self.shutdown()
            raise

    # -- introspection ---------------------------------------------------------------------------

    @property
    def disaggregated(self) -> bool:
        return self.layout.mode == "disaggregated"

    @property
    def _entry_group(self) -> str:
        return "prefill" if self.disaggregated else "main"

    @property
    def backends(self) -> dict[str, str]:
        return {name: g.backend for name, g in self._groups.items()}

    @property
    def pids(self) -> list[int]:
        return [pid for g in self._groups.values() for pid in g.pids]

    def sequence_ids(self) -> list[str]:
        return list(self._seqs)

    def has_unfinished(self) -> bool:
        """Any sequence here that steps would advance (paused ones do not count)."""
        return any(not s.paused for s in self._seqs.values())

    def num_free_blocks(self) -> dict[str, int]:
        return {name: g.allocator.num_free_blocks for name, g in self._groups.items()}

    # -- admission -------------------------------------------------------------------------------

    def add_request(
        self,
        seq_id: str,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingParams | dict[str, object] | None = None,
        priority: int = 0,
    ) -> None:
        """Queue a new sequence; it joins the batch at the next step with room for it. `priority`:
        its class, lower is more urgent (agents/engines/torch/batching.py orders and preempts by it).

        With a host tier, the longest held sequence whose cached tokens start this prompt lends it
        their KV (it leaves the tier): only the rest of the prompt is computed."""
        prompt = list(prompt_ids)
        hit = self.host_tier.longest_prefix(prompt) if self.host_tier is not None and prompt else None
        if hit is None:
            self._admit(seq_id, prompt, [], max_new_tokens, sampling, priority)
            return
        donor = self.host_tier.take(hit[0])  # type: ignore[union-attr]
        assert donor is not None  # noqa: S101 - longest_prefix named it
        n = hit[1]
        params = sampling_params(sampling)
        try:
            if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
                raise ValueError(f"max_new_tokens: must be a positive integer, got {max_new_tokens!r}")
            state = KVState(seq_id=seq_id, model_sha256=self.model_sha256, token_ids=tuple(int(t) for t in prompt),
                            num_prompt_tokens=len(prompt), max_new_tokens=max_new_tokens, sampling=params,
                            sampler_draws=draws_after(params, 0), num_cached_tokens=n,
                            keys=donor.keys[:, :n].contiguous(), values=donor.values[:, :n].contiguous(),
                            priority=check_priority(priority))
            self._check_length(len(prompt), max_new_tokens)
            self.import_kv(seq_id, state)
        except BaseException:
            self.host_tier.put(donor)  # type: ignore[union-attr]  # refused: the donor stays held
            raise
        self.stats.prefix_hit_tokens += n

    def replay(
        self,
        seq_id: str,
        prompt_ids: Sequence[int],
        generated_ids: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingParams | dict[str, object] | None = None,
        priority: int = 0,
    ) -> None:
        """Continue a sequence from its tokens alone: re-prefill prompt + generated, then decode on.

        The sampler is rebuilt from the seed and the count of generated tokens, so the tokens
        that follow are the ones the original engine would have produced.
        """
        self._admit(seq_id, list(prompt_ids), list(generated_ids), max_new_tokens, sampling, priority)

    def _admit(
        self,
        seq_id: str,
        prompt: list[int],
        generated: list[int],
        max_new_tokens: int,
        sampling: SamplingParams | dict[str, object] | None,
        priority: int,
    ) -> Seq:
        self._check_open()
        params = sampling_params(sampling)
        self._check_seq_id(seq_id)
        check_request(prompt, generated, max_new_tokens, self.cfg.vocab_size)
        check_priority(priority)
        self._check_length(len(prompt), max_new_tokens)
        seq = Seq(
            seq_id=seq_id,
            token_ids=[int(t) for t in prompt + generated],
            num_prompt=len(prompt),
            max_new_tokens=max_new_tokens,
            sampling=params,
            draws=draws_after(params, len(generated)),
            arrival=next(self._arrivals),
            group=self._entry_group,
            priority=priority,
        )
        self._seqs[seq_id] = seq
        return seq

    def _check_length(self, num_prompt: int, max_new_tokens: int) -> None:
        allocators = {name: g.allocator for name, g in self._groups.items()}
        check_length(num_prompt, max_new_tokens, self.cfg.max_positions, allocators, max_context=self.max_context)

    def _check_seq_id(self, seq_id: str) -> None:
        if not isinstance(seq_id, str) or not seq_id:
            raise ValueError(f"seq_id: must be a non-empty string, got {seq_id!r}")
        if seq_id in self._seqs:
            raise ValueError(f"seq_id: {seq_id!r} is already in this engine")

    def _check_open(self) -> None:
        dead = [name for name, g in self._groups.items() if not g.alive]
        if dead or not self._groups:
            raise EngineError(f"engine is shut down (groups {dead or 'none'}); build a new one")

    # -- the iteration ---------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Run one iteration over every group that has work; return the tokens it produced.

        Invariants: a sequence is in exactly one group; every chunk scheduled has its blocks
        allocated before any worker sees it; groups run concurrently (submit all, then collect);
        a finished sequence's blocks are freed before this returns.
        """
        self._check_open()
        if self.disaggregated:
            self._hand_over()  # anything that could not move last time for lack of blocks
        scheduled: dict[str, list[Chunk]] = {}
        for name, group in self._groups.items():
            batch = self.batcher.schedule(name, self._seqs.values(), group.allocator, self.max_tokens_per_step)
            scheduled[name] = batch.chunks
            self.stats.preemptions += len(batch.preempted)
        submitted = []
        try:
            for name, work in scheduled.items():
                if not work:
                    continue
                forget, self._forget[name] = tuple(self._forget[name]), []
                self._groups[name].submit_step(step_plan(work, self._groups[name].allocator, forget))
                submitted.append(name)
            results = {name: self._groups[name].collect_step() for name in submitted}
        except EngineError:
            self.shutdown()
            raise
        outputs: list[StepOutput] = []
        for name in submitted:
            self.stats.groups[name] = self.stats.groups.get(name, 0) + 1
            for seq, n, sample in scheduled[name]:
                seq.num_computed += n
                if n > 1:
                    self.stats.tokens_prefilled += n
                if not sample:
                    continue
                token = int(results[name][seq.seq_id])
                self.stats.tokens_generated += 1
                finished = seq.took(token, self.cfg.eos_token_ids)
                if finished:
                    if self.host_tier is not None:
                        # its KV stays in host memory: the next turn of the conversation starts with it
                        self.host_tier.put(self._state(seq, seq.num_computed))
                    self._remove(seq)
                outputs.append(StepOutput(seq.seq_id, token, finished))
        if self.disaggregated:
            self._hand_over()
        self.stats.steps += 1
        self.last_step_end_s = time.perf_counter()
        return outputs

    def _hand_over(self) -> None:
        """Disaggregated: move every prefilled sequence's KV from the prefill to the decode group.

        Goes through this process (the agent), worker to engine to worker: both groups belong to
        the same agent. In arrival order; stops at the first that does not fit (tried again next
        step), leaving it in the prefill group with its KV intact.
        """
        prefill, decode = self._groups["prefill"], self._groups["decode"]
        ready = sorted(
            (s for s in self._seqs.values() if s.group == "prefill" and s.decoding and not s.paused),
            key=lambda s: s.arrival,
        )
        for seq in ready:
            if not decode.allocator.can_ensure(seq.seq_id, seq.num_computed + 1):
                break
            try:
                k, v = prefill.export_kv(seq.seq_id, seq.num_computed)
                decode.allocator.ensure(seq.seq_id, seq.num_computed + 1)
                decode.import_kv(seq.seq_id, k, v)
            except EngineError:
                self.shutdown()
                raise
            prefill.allocator.free(seq.seq_id)
            self._forget["prefill"].append(seq.seq_id)
            seq.group = "decode"
            self.stats.handoffs += 1
            self.stats.handoff_bytes += k.nbytes + v.nbytes

    def _remove(self, seq: Seq) -> None:
        self._groups[seq.group].allocator.free(seq.seq_id)
        self._forget[seq.group].append(seq.seq_id)
        del self._seqs[seq.seq_id]

    # -- moving sequences ------------------------------------------------------------------------

    def export_kv(self, seq_id: str, *, include_kv: bool = True) -> KVState:
        """Snapshot one sequence at this safe boundary; the engine keeps it (drop it once moved).

        include_kv=False gives the replay-only state: tokens and sampler, no KV (a few bytes).
        """
        self._check_open()
        seq = self._seq(seq_id)
        return self._state(seq, seq.num_computed if include_kv else 0)

    def _state(self, seq: Seq, n: int) -> KVState:
        """The sequence's tokens, sampler and its first `n` tokens' KV, read from its group's workers."""
        try:
            k, v = self._groups[seq.group].export_kv(seq.seq_id, n)
        except EngineError:
            self.shutdown()
            raise
        return KVState(
            seq_id=seq.seq_id,
            model_sha256=self.model_sha256,
            token_ids=tuple(seq.token_ids),
            num_prompt_tokens=seq.num_prompt,
            max_new_tokens=seq.max_new_tokens,
            sampling=seq.sampling,
            sampler_draws=seq.draws,
            num_cached_tokens=n,
            keys=torch.from_numpy(k),
            values=torch.from_numpy(v),
            priority=seq.priority,
        )

    # -- warm-up and the host tier ---------------------------------------------------------------

    def warm_up(self, tokens: int, seq_id: str = "__warmup__") -> None:
        """Generate `tokens` tokens (from a one-token prompt, past any end-of-sequence) and forget
        them: what a new plan does before it takes traffic, so the first requests do not pay for
        the first forward passes (allocations, thread pools, kernels). 0: nothing."""
        if tokens <= 0:
            return
        self.add_request(seq_id, [1], tokens, SamplingParams(ignore_eos=True))
        while seq_id in self._seqs:
            self.step()
        if self.host_tier is not None:
            self.host_tier.take(seq_id)  # not a conversation to continue


    def offload(self, seq_id: str) -> int:
        """Move a sequence's KV off the GPU into the host tier (it leaves the batch); the bytes moved.

        At a safe boundary, like export_kv: `restore` continues it token for token."""
        if self.host_tier is None:
            raise ValueError("host_kv_bytes: this engine has no host tier (build it with host_kv_bytes > 0)")
        state = self.export_kv(seq_id)
        self.drop(seq_id)
        self.host_tier.put(state)
        return state.kv_bytes

    def restore(self, seq_id: str) -> int:
        """Bring an offloaded sequence back from the host tier; the KV bytes copied back (0: its KV
        had been pushed out of the tier, so it is recomputed from its tokens). All or nothing."""
        state = self.host_tier.take(seq_id) if self.host_tier is not None else None
        if state is None:
            raise KeyError(f"seq_id: {seq_id!r} is not in this engine's host tier")
        try:
            self.import_kv(seq_id, state)
        except BaseException:
            self.host_tier.put(state)  # type: ignore[union-attr]
            raise
        return state.kv_bytes

    def import_kv(self, seq_id: str, state: KVState) -> None:
        """Adopt a sequence exported by any engine of the same weights, re-sharding its KV here.

        All-or-nothing: a bad state or a full cache raises before anything changes.
        """
        self._check_open()
        self._check_seq_id(seq_id)
        state.check(self.cfg, self.model_sha256)
        n_tokens = len(state.token_ids)
        decoding = 0 < state.num_cached_tokens == n_tokens - 1
        group_name = "decode" if self.disaggregated and decoding else self._entry_group
        group = self._groups[group_name]
        # Room for the cached tokens and the one the next step feeds.
        need = state.num_cached_tokens + 1
        group.allocator.ensure(seq_id, need)  # raises KVCacheFullError, allocating nothing
        try:
            group.import_kv(seq_id, state.keys.numpy(), state.values.numpy())
        except EngineError:
            self.shutdown()
            raise
        self._seqs[seq_id] = Seq(
            seq_id=seq_id,
            token_ids=list(state.token_ids),
            num_prompt=state.num_prompt_tokens,
            max_new_tokens=state.max_new_tokens,
            sampling=state.sampling,
            draws=state.sampler_draws,
            arrival=next(self._arrivals),
            group=group_name,
            num_computed=state.num_cached_tokens,
            priority=state.priority,
        )

    def pause(self, seq_id: str) -> None:
        """Hold a sequence still: it keeps its KV but takes no part in steps until `resume`.

        For a move to another agent: export, pause, send; drop once the other side imported it,
        resume if it could not (the rollback). The other sequences keep decoding meanwhile, and
        the paused one is never preempted (its KV is what is being moved).
        """
        self._seq(seq_id).paused = True

    def resume(self, seq_id: str) -> None:
        self._seq(seq_id).paused = False

    def drop(self, seq_id: str) -> bool:
        """Forget a sequence and free its KV; False when it is not here (idempotent)."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return False
        self._remove(seq)
        return True

    def _seq(self, seq_id: str) -> Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"seq_id: {seq_id!r} is not in this engine") from None

    # -- lifetime --------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop every worker process; idempotent. The engine cannot be used afterwards."""
        for group in self._groups.values():
            group.shutdown()

    def __enter__(self) -> TorchEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
