"""SeqStream: the tokens of one sequence on one node, readable from any index by many threads.

The engine thread appends tokens and ends the stream (finished, moved away, or failed); readers
(the data server's HTTP handlers) block on `events(from_index)` and get every token from that
index on, then exactly one end event. A stream that arrived by hand-over starts with the tokens
generated before the move, so a reader that asks `from=N` (the tokens it already has) sees
nothing twice and misses nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SeqStream:
    seq_id: str
    prompt_tokens: int  # length of the original prompt
    max_tokens: int  # cap on generated tokens, counted from the original prompt
    lease_version: int  # the routing version under which this node holds the sequence
    admitted_s: float  # clock reading at admission here (hand-over: at acceptance)
    tokens: list[int] = field(default_factory=list)  # every generated token so far, from index 0
    token_s: list[float] = field(default_factory=list)  # clock reading at each token produced here
    first_local: int = 0  # index of the first token produced on this node (tokens before came with it)
    end: dict[str, Any] | None = None  # {"done", "finish_reason"} | {"moved": {...}} | {"error": ...}
    ended_s: float | None = None
    _cond: threading.Condition = field(default_factory=threading.Condition, repr=False)

    # -- writer side (the engine thread, or a hand-over) -----------------------------------------

    def append(self, token_id: int, now_s: float) -> None:
        with self._cond:
            self.tokens.append(int(token_id))
            self.token_s.append(now_s)
            self._cond.notify_all()

    def close(self, end: dict[str, Any], now_s: float) -> bool:
        """End the stream once; False if it had already ended (the first end wins)."""
        with self._cond:
            if self.end is not None:
                return False
            self.end = end
            self.ended_s = now_s
            self._cond.notify_all()
            return True

    # -- reader side ----------------------------------------------------------------------------

    @property
    def generated(self) -> int:
        return len(self.tokens)

    @property
    def started(self) -> bool:
        """A token was produced on this node (the sequence is decoding here, not queued)."""
        return len(self.tokens) > self.first_local

    def events(self, from_index: int = 0, *, idle_timeout_s: float = 300.0,
               alive: Callable[[], bool] = lambda: True) -> Iterator[dict[str, Any]]:
        """{"i", "token"} for each token from `from_index`, then the end event.

        Gives up with an error event when nothing happens for `idle_timeout_s` or `alive()`
        turns false (the host stopped under it).
        """
        i = max(0, from_index)
        while True:
            with self._cond:
                deadline = time.monotonic() + idle_timeout_s
                while i >= len(self.tokens) and self.end is None:
                    left = deadline - time.monotonic()
                    if left <= 0 or not alive():
                        yield {"error": f"sequence {self.seq_id}: no progress for {idle_timeout_s:g} s"}
                        return
                    self._cond.wait(min(left, 0.5))
                batch = self.tokens[i:]
                end = self.end if i + len(batch) >= len(self.tokens) else None
            for token in batch:
                yield {"i": i, "token": token}
                i += 1
            if end is not None and i >= len(self.tokens):
                yield dict(end)
                return
