"""Batching split by prompt length (seed 003, corollary 3): short (< 2K), medium (2K-32K), long (> 32K).

Prompt length sets a sequence's prefill work, and one long prefill in a round holds every shorter
prompt behind it: with a single first-come-first-served queue a 30K-token prompt makes the 200-token
prompts that arrive just after it wait for its whole prefill. With length buckets each bucket has
its own share of a round's token budget when the round mixes buckets - the batch's length spread
passes the split threshold (a longest over shortest prompt ratio) - so short prompts are admitted
and prefilled first and a long prefill goes on in the room they leave. Alone in a round a
bucket takes the whole budget: splitting costs nothing when there is nothing to split. Admission
goes by bucket as well, split or not: within a priority class the shorter bucket's waiting prompts
are admitted first (agents/sim/queues.WaitQueue, the torch Batcher's prefill order), so a short
prompt that arrives behind a queue of 5K-token ones does not wait for all of them.

Used by the simulated engine (agents/sim/pipe.py) and the torch engine
(agents/engines/torch/batching.py) alike.

Preemption: when the KV runs out, the engine preempts the least urgent priority class first
(vLLM's priority policy), and within it the longest bucket first - a long
prompt's KV frees the most room, and its recompute is paid by the request whose TTFT is already
long - then the most recently admitted. A preempted sequence is queued again and recomputed,
never lost.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True)
class LengthBuckets:
    edges: tuple[int, ...] = (2048, 32768)  # prompt tokens: < 2K, 2K-32K, > 32K (seed 003)
    # each bucket's share of a round's batched-token budget when the round mixes buckets
    shares: tuple[float, ...] = (1.0, 0.5, 0.25)
    split_ratio: float = 4.0  # split when the longest prompt is this many times the shortest

    def __post_init__(self) -> None:
        if list(self.edges) != sorted(set(self.edges)) or not self.edges or self.edges[0] < 1:
            raise ValueError(f"edges: must be increasing positive token counts; got {self.edges}")
        if len(self.shares) != len(self.edges) + 1 or not all(0 < s <= 1 for s in self.shares):
            raise ValueError(f"shares: need {len(self.edges) + 1} shares in (0, 1]; got {self.shares}")
        if self.split_ratio < 1:
            raise ValueError(f"split_ratio: must be >= 1; got {self.split_ratio}")

    def of(self, prompt_tokens: int) -> int:
        """The bucket index of a prompt (0: shortest)."""
        return bisect.bisect_right(self.edges, prompt_tokens)

    def split(self, shortest: int, longest: int) -> bool:
        """Whether a round with these prompt lengths is split by bucket."""
        return self.of(shortest) != self.of(longest) and longest >= self.split_ratio * max(1, shortest)

    def cap(self, bucket: int, budget: int) -> int:
        """A bucket's tokens in a split round."""
        return max(1, int(self.shares[bucket] * budget))


__all__ = ["LengthBuckets"]
