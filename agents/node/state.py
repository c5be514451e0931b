"""What a node agent holds and its command handlers share: the plans it runs (PlanSlot), the state of
its registration and reports (NodeState), and the outcome a handler returns before it becomes an
ack (_Outcome). Apart so that agents/node/daemon.py and the handlers' modules
(agents/node/plan_commands.py, agents/node/node_commands.py) import them without a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agents.node.plans import PlanEngine


@dataclass
class PlanSlot:
    """One plan this node holds part of."""

    deployment: str
    plan_id: str
    role: str  # leader | member
    reserve_bytes: dict[str, int]  # GPU uuid -> bytes booked for it
    engine: PlanEngine | None = None  # the leader's engine
    part: Any = None  # a member's stage workers of the plan (torch: agents.dataplane.stages.MemberStages)
    frozen: bool = False
    ready: bool = False  # the engine started (a vLLM server can take a minute): it has metrics to report
    load_s: float = 0.0
    prepared_at_s: float = 0.0


@dataclass
class NodeState:
    epoch: int = 0
    seq: int = 0
    report_interval_s: float = 15.0
    dirty: bool = True
    last_report_s: float = -1e18
    after_command: int = 0


@dataclass
class _Outcome:
    status: str
    detail: str = ""
    result: dict[str, Any] = field(default_factory=dict)


__all__ = ["NodeState", "PlanSlot", "_Outcome"]
