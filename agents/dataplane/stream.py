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
from collections.abc import Callable, Iterable, Iterator
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


def check_slo_ms(slo_ms: tuple[float, float] | None) -> tuple[float, float] | None:
    """A plan host's `slo_ms` argument: the deployment's (TTFT, TPOT) objectives in ms, or None."""
    if slo_ms is not None and not (len(slo_ms) == 2 and all(v > 0 for v in slo_ms)):
        raise ValueError(f"slo_ms: must be (ttft_ms, tpot_ms), both > 0; got {slo_ms!r}")
    return slo_ms


def slo_misses(finished: Iterable[SeqStream], slo_ms: tuple[float, float] | None) -> int:
    """How many of these finished streams missed the (TTFT, TPOT) objectives `slo_ms` (ms; None:
    nothing counted) - EngineReport.slo_violations, what the global correction reads.

    Each is judged on what this node did: its TTFT only where its first token was made here
    (admission to first token; a handed-over sequence's came elsewhere), its TPOT over the tokens
    made here (the mean gap, first to last local token). A stream with neither is no miss."""
    if slo_ms is None:
        return 0
    misses = 0
    for s in finished:
        local = s.token_s[s.first_local:]
        ttft = 1000.0 * (s.token_s[0] - s.admitted_s) if s.first_local == 0 and s.token_s else None
        tpot = 1000.0 * (local[-1] - local[0]) / (len(local) - 1) if len(local) > 1 else None
        misses += int((ttft is not None and ttft > slo_ms[0]) or (tpot is not None and tpot > slo_ms[1]))
    return misses
