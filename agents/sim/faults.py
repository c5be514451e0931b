"""Injected agent faults: a command that fails, hangs, or loses its GPUs half way.

`Fault` says which commands it strikes (a node, a command kind or "*", how many times);
`take_fault` draws the one that strikes a command. `agents.sim.executor.SimAgents` - the one
executor of agent protocol v1's transition commands on the simulator, which the replay's
`TransitionDriver`, the live fleet (`python -m agents.sim --fault ...`) and the tests' worlds
feed - applies them:

* fail: the command runs, and its answer says failed (reason `Fault.reason`, default failed);
* hang: the command runs, and is never answered (the controller's step timeout must act);
* lose_gpus: half way through the command (a prepare's load, or `COMMAND_S` for the others) the
  GPUs it names on its node - `uuids`, or the first `gpus` of the command's plan there, or all of
  them - crash every plan on them (with `taken`, another tenant takes them, until they are given
  back); the command, which runs until then, fails "preempted" (a move_sequences answers as its
  hand-overs went).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal

from scheduler.transition import CommandIntent

FaultAction = Literal["fail", "hang", "lose_gpus"]
FAULT_ACTIONS: tuple[FaultAction, ...] = ("fail", "hang", "lose_gpus")
COMMAND_S = 0.2  # sim seconds a command other than prepare_plan is taken to run (where lose_gpus strikes)


@dataclass(frozen=True)
class Fault:
    """Make the next matching command misbehave."""

    node: str  # which agent
    kind: str  # which command kind (agents/protocol/), or "*"
    action: FaultAction
    times: int = 1  # how many matching commands it hits
    gpus: int = 0  # lose_gpus: how many (0: every GPU of the command's plan on that node)
    uuids: tuple[str, ...] = ()  # lose_gpus: exactly these GPUs instead
    reason: str = ""  # fail: the reason the ack carries (default: failed)
    taken: bool = False  # lose_gpus: the GPUs stay another tenant's (else only the plans on them crash)

    def __post_init__(self) -> None:
        if self.action not in FAULT_ACTIONS:
            raise ValueError(f"action: must be one of {', '.join(FAULT_ACTIONS)}, got {self.action!r}")
        if self.times < 1:
            raise ValueError(f"times: must be >= 1, got {self.times}")


def take_fault(faults: list[Fault], cmd: CommandIntent) -> Fault | None:
    """The first fault that strikes `cmd` (its node, its kind or "*"), used up by one."""
    for i, f in enumerate(faults):
        if f.node == cmd.node_id and f.kind in ("*", cmd.kind.value):
            if f.times <= 1:
                faults.pop(i)
            else:
                faults[i] = replace(f, times=f.times - 1)
            return f
    return None


def through_fault(fault: Fault | None, cmd: CommandIntent, ok: bool, detail: str,
                  result: Mapping[str, object]) -> tuple[bool, str, dict[str, object]] | None:
    """The answer to `cmd` as its fault makes it: None when it hangs (never answered); a failure
    with the fault's reason in place of a success when it fails; else unchanged."""
    if fault is not None and fault.action == "hang":
        return None
    if fault is not None and fault.action == "fail" and ok:
        return False, f"injected failure of {cmd.kind.value}", {"reason": fault.reason or "failed"}
    return ok, detail, dict(result)


def lost_gpus(fault: Fault, plan_gpus: list[str], node_gpus: list[str]) -> list[str]:
    """The GPUs a lose_gpus fault takes: its `uuids`, else the first `gpus` of the command's plan on
    the node (all of them with 0), else - a command naming no plan there - every GPU of the node."""
    if fault.uuids:
        return list(fault.uuids)
    gpus = plan_gpus or node_gpus
    return gpus[:fault.gpus] if fault.gpus else gpus


__all__ = ["COMMAND_S", "FAULT_ACTIONS", "Fault", "FaultAction", "lost_gpus", "take_fault", "through_fault"]
