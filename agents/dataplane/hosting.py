"""What a DataServer needs of a running plan: the face PlanHost (torch) and VllmPlanHost share.

The transition commands (freeze, thaw, move, release, report) are called by the node agent, not
by the server; both hosts have them with the same ack shapes (agents/protocol.py).
"""

from __future__ import annotations

from collections.abc import Sequence
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
              routing_version: int = 0) -> SeqStream: ...

    def stream(self, seq_id: str) -> SeqStream | None: ...

    def cancel(self, seq_id: str) -> bool: ...

    def accept(self, state: KVState, lease: tuple[str, int], resume_from: int) -> None: ...

    def freeze(self, routing_version: int) -> dict[str, Any]: ...

    def thaw(self) -> None: ...

    def move(self, moves: list[dict[str, Any]], routing_version: int) -> dict[str, Any]: ...

    def release(self, drain_timeout_s: float, fallback: dict[str, Any] | None) -> dict[str, Any]: ...

    def report(self) -> EngineReport: ...

    def stop(self) -> None: ...
