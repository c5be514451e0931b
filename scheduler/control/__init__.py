"""The gear control loop (DESIGN.md: scheduler/control/): observe -> step(now) -> ControlOutput.

The rules live in one docstring: scheduler/control/loop.py.
"""

from __future__ import annotations

from scheduler.control.loop import (
    BRING_UP_REASON,
    ControlLoop,
    decision_snapshot,
    fold_backoff,
    has_lost_gpus,
    unreported,
)
from scheduler.control.state import (
    ControlOutput,
    DeploymentState,
    Finished,
    FirstStage,
    FleetState,
    LoopConfig,
    Running,
    Staged,
    Start,
    Step,
)

__all__ = [
    "BRING_UP_REASON", "ControlLoop", "ControlOutput", "DeploymentState", "Finished", "FirstStage",
    "FleetState", "LoopConfig", "Running", "Staged", "Start", "Step", "decision_snapshot", "fold_backoff",
    "has_lost_gpus", "unreported",
]
