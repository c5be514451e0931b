"""What a DataServer needs of a running plan: the face PlanHost (torch) and VllmPlanHost share.

The transition commands (freeze, thaw, move, release, report) are called by the node agent, not
by the server; both hosts have them with the same ack shapes (agents/protocol/).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from agents.dataplane.stream import SeqStream
from agents.engines.torch.engine import KVState
from agents.protocol import EngineReport


class HostedPlan(Protocol):
    deployment: str
    plan_id: str
    state: str  # new | ready | stopped | broken
    frozen: bool

    @property
    def model_sha256(self) -> str | None:
        """The weights hash a hand-over frame must carry to be accepted here (None: unchecked)."""
        ...

    def admit(self, seq_id: str, prompt_ids: Sequence[int], max_tokens: int, sampling: Any, *,
              routing_version: int = 0, priority: int = 0) -> SeqStream: ...

    def stream(self, seq_id: str) -> SeqStream | None: ...

    def cancel(self, seq_id: str) -> bool: ...

    def accept(self, state: KVState, lease: tuple[str, int], resume_from: int) -> None: ...

    def freeze(self, routing_version: int) -> dict[str, Any]: ...

    def thaw(self) -> None: ...

    def move(self, moves: list[dict[str, Any]], routing_version: int) -> dict[str, Any]: ...

    def release(self, drain_timeout_s: float, fallback: dict[str, Any] | None) -> dict[str, Any]: ...

    def report(self) -> EngineReport: ...

    def stop(self) -> None: ...


class DrainThenHandOver(ABC):
    """`release_plan`, the same for every host: stop admitting, let sequences finish for the
    drain budget, hand what is left to the fallback plan by replay (or end it with an explicit
    error), stop. Idempotent: a host that is not ready answers noop.

    A host implements the abstract `_live`, `move` and `stop` (a host missing one cannot be
    created), and may override `_end_released` when
    ending a stream needs more than closing it (VllmPlanHost abandons its vLLM request too).
    """

    plan_id: str
    state: str
    frozen: bool
    clock: Callable[[], float]
    _lock: Any

    @abstractmethod
    def _live(self) -> list[SeqStream]:
        """(the host's own)"""

    @abstractmethod
    def move(self, moves: list[dict[str, Any]], routing_version: int) -> dict[str, Any]:
        """(the host's own)"""

    @abstractmethod
    def stop(self) -> None:
        """(the host's own)"""

    def _end_released(self, stream: SeqStream, end: dict[str, Any]) -> None:
        stream.close(end, self.clock())

    def release(self, drain_timeout_s: float, fallback: dict[str, Any] | None) -> dict[str, Any]:
        """release_plan: let sequences finish for `drain_timeout_s`, hand the rest to `fallback` by
        replay (or end them with an explicit error), stop. Idempotent."""
        with self._lock:
            if self.state != "ready":
                return {"plan_id": self.plan_id, "noop": True, "freed_bytes": {}, "failed": [], "handed_over": []}
            self.frozen = True
        deadline = self.clock() + max(0.0, drain_timeout_s)
        while self._live() and self.clock() < deadline and self.state == "ready":
            time.sleep(0.02)
        failed: list[str] = []
        handed: list[str] = []
        for stream in self._live():
            if fallback is not None:
                res = self.move([{"seq_id": stream.seq_id, "action": "replay",
                                  "target_plan": fallback.get("target_plan", ""),
                                  "target_node": fallback.get("target_node", ""),
                                  "target_addr": fallback.get("target_addr", "")}],
                                int(fallback.get("routing_version", 0)))
                r = res["moved"][0]
                if r["ok"] and r.get("outcome") != "gone":
                    handed.append(stream.seq_id)
                    continue
                if r["ok"]:
                    continue  # it finished meanwhile
            failed.append(stream.seq_id)
            self._end_released(stream, {"error": f"plan {self.plan_id} was released before {stream.seq_id} finished"})
        self.stop()
        return {"plan_id": self.plan_id, "freed_bytes": {}, "failed": failed, "handed_over": handed}

def put_back(table: dict[Any, Any], key: Any, previous: Any) -> None:
    """Undo one write of a refused hand-over: `key` holds what it held before, or nothing."""
    if previous is None:
        table.pop(key, None)
    else:
        table[key] = previous
