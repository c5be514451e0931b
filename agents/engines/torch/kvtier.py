"""The host tier of the torch engine's KV cache: sequences' KV kept in host memory, off the GPU.

Seed 004 section 3.3: the GPU holds the KV of the sequences that decode now; the KV of a sequence
that waits for its next turn (a chat between two user messages) or that was pushed out for room
moves to host memory, and comes back when it is needed - instead of being recomputed.

    tier = HostKVTier(capacity_bytes=8 << 30)
    tier.put(state)                    # a KVState (engine.export_kv), held here
    tier.take(seq_id)                  # ... and back, to import into an engine
    tier.longest_prefix(token_ids)     # the entry whose cached tokens start this prompt longest

Rules:
* Bounded by bytes, least recently used first out. An entry pushed out keeps its tokens and its
  sampler state and drops only its KV (a replay-only KVState, a few bytes): restoring it then
  recomputes the prefix instead of copying it back. Nothing put here is ever lost.
* KV is only ever reused by the engine whose weights computed it (the tier belongs to one engine,
  and the engine checks `model_sha256` at import): seed 004's reuse of KV across different
  models is not physical, and is not done.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agents.engines.torch.kvstate import KVState


def replay_only(state: KVState) -> KVState:
    """The state without its KV: the tokens and the sampler, to be recomputed on restore."""
    empty = state.keys[:, :0].clone()
    return replace(state, num_cached_tokens=0, keys=empty, values=state.values[:, :0].clone())


class HostKVTier:
    """KVStates by sequence id, bounded by `capacity_bytes` (module docstring). Not thread-safe:
    it belongs to one engine, driven from the engine's thread."""

    def __init__(self, capacity_bytes: int) -> None:
        if not isinstance(capacity_bytes, int) or isinstance(capacity_bytes, bool) or capacity_bytes < 0:
            raise ValueError(f"host_kv_bytes: must be an integer >= 0, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self._states: OrderedDict[str, KVState] = OrderedDict()  # least recently used first
        self.used_bytes = 0
        self.offloaded_bytes = 0  # KV bytes that came here (for the engine's stats)
        self.restored_bytes = 0  # ... and went back to an engine
        self.evictions = 0  # states pushed out to replay-only

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._states

    def __len__(self) -> int:
        return len(self._states)

    def seq_ids(self) -> list[str]:
        return list(self._states)

    def put(self, state: KVState) -> None:
        """Hold `state` (replacing an older one of the same sequence), pushing out the least
        recently used KV beyond the capacity; a state bigger than the whole tier is kept replay-only."""
        self.take(state.seq_id)
        if state.kv_bytes > self.capacity_bytes:
            state = replay_only(state)
            self.evictions += 1
        self._states[state.seq_id] = state
        self.used_bytes += state.kv_bytes
        self.offloaded_bytes += state.kv_bytes
        for seq_id in list(self._states):
            if self.used_bytes <= self.capacity_bytes:
                break
            old = self._states[seq_id]
            if old.kv_bytes == 0 or seq_id == state.seq_id:
                continue
            self.used_bytes -= old.kv_bytes
            self._states[seq_id] = replay_only(old)
            self.evictions += 1

    def take(self, seq_id: str) -> KVState | None:
        """Remove and return the sequence's state (None: not here)."""
        state = self._states.pop(seq_id, None)
        if state is not None:
            self.used_bytes -= state.kv_bytes
            self.restored_bytes += state.kv_bytes
        return state

    def longest_prefix(self, token_ids: list[int] | tuple[int, ...]) -> tuple[str, int] | None:
        """(seq id, cached tokens) of the entry whose cached tokens are the longest prefix of
        `token_ids`, leaving at least one token of it to compute (the one whose logits come next);
        None when no entry with KV starts it."""
        best: tuple[str, int] | None = None
        ids = tuple(int(t) for t in token_ids)
        for seq_id, st in self._states.items():
            n = st.num_cached_tokens
            if n == 0 or n >= len(ids) or (best is not None and n <= best[1]):
                continue
            if st.token_ids[:n] == ids[:n]:
                best = (seq_id, n)
        if best is not None:
            self._states.move_to_end(best[0])
        return best
