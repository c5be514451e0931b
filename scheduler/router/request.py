"""What the router is asked: one request's shape, its priority class and deadline, and the hashes
of its prompt's token blocks.

Priority follows vLLM's convention (its `priority` request field, lower is served first), so the
value passes to a vLLM engine unchanged: 0 is the default class, a negative value is more urgent,
a positive one is low priority (batch traffic, retries that may wait). A deadline is the time,
counted from the request's arrival, by which its first token should be out: within one priority
class an engine serves the earliest deadline first, and the router prefers plans predicted to
meet it.

Prompt blocks: the prompt's token ids cut into blocks of `BLOCK_TOKENS`, each hashed together
with the hash of the block before it, so two prompts share a block hash exactly when they share
every token up to the end of that block (the chained keys of vLLM's automatic prefix caching).
The Mooncake trace's `hash_ids` are such ids for 512-token blocks (../shared/traces/README.md),
which is why 512 is the default: a trace's ids and the gateway's own hashes mean the same thing.
Only full blocks are hashed - a cache keeps only full blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

BLOCK_TOKENS = 512  # tokens per hashed block (the Mooncake trace's hash_ids granularity)
PRIORITY_MIN = -1000  # most urgent class a request may ask for
PRIORITY_MAX = 1000  # lowest class
DEFAULT_PRIORITY = 0
_ROOT_HASH = 0x46_6C_65_78  # the chain's seed: the "hash of the block before the first"


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """One request as the router sees it."""

    prompt_tokens: int  # prompt length
    max_tokens: int  # most tokens it may generate (the KV it may grow to)
    priority: int = DEFAULT_PRIORITY  # lower is more urgent; > 0 is low priority (module docstring)
    deadline_s: float | None = None  # first token wanted this long after arrival; None: the SLO's
    blocks: tuple[int, ...] = ()  # chained hashes of its full prompt blocks, in order

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1:
            raise ValueError(f"prompt_tokens: must be >= 1, got {self.prompt_tokens}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {self.max_tokens}")
        if not PRIORITY_MIN <= self.priority <= PRIORITY_MAX:
            raise ValueError(f"priority: must be in [{PRIORITY_MIN}, {PRIORITY_MAX}], got {self.priority}")
        if self.deadline_s is not None and not self.deadline_s > 0:
            raise ValueError(f"deadline_s: must be > 0, got {self.deadline_s}")

    @property
    def kv_tokens(self) -> int:
        """The most KV it can hold: its prompt plus everything it may generate."""
        return self.prompt_tokens + self.max_tokens

    @property
    def low_priority(self) -> bool:
        return self.priority > DEFAULT_PRIORITY


def block_hashes(token_ids: Sequence[int], block_tokens: int = BLOCK_TOKENS) -> tuple[int, ...]:
    """Chained hashes of the full blocks of `token_ids` (module docstring).

    Python hashes tuples of ints the same way in every process (only str and bytes hashing is
    salted per process), so two gateway processes agree on every id."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens: must be >= 1, got {block_tokens}")
    out: list[int] = []
    h = _ROOT_HASH
    ids = tuple(token_ids)
    for start in range(0, len(ids) - block_tokens + 1, block_tokens):
        h = hash((h, ids[start:start + block_tokens]))
        out.append(h)
    return tuple(out)
