"""The words of a transition: its phases and the edges between them, kinds, steps and their
states, command kinds, the forward and rollback tables (`TABLE`, `ROLLBACK_TABLE`), the crash
points, and `TransitionConfig`."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

JsonDict = dict[str, object]


# --- vocabulary -----------------------------------------------------------------------------------
class Phase(enum.StrEnum):
    PREPARE = "prepare"
    SWITCH = "switch"
    CLEANUP = "cleanup"
    ROLLBACK = "rollback"
    DONE = "done"  # terminal: to_gear serves
    ROLLED_BACK = "rolled_back"  # terminal: from_gear serves (as it did before)


ACTIVE_PHASES = (Phase.PREPARE, Phase.SWITCH, Phase.CLEANUP, Phase.ROLLBACK)
TERMINAL_PHASES = (Phase.DONE, Phase.ROLLED_BACK)
# phase changes a transition may make (the invariant checker holds every log to them)
PHASE_EDGES: Mapping[Phase, tuple[Phase, ...]] = {
    Phase.PREPARE: (Phase.SWITCH, Phase.ROLLBACK),
    Phase.SWITCH: (Phase.CLEANUP, Phase.ROLLBACK),
    Phase.CLEANUP: (Phase.DONE,),
    Phase.ROLLBACK: (Phase.ROLLED_BACK,),
    Phase.DONE: (),
    Phase.ROLLED_BACK: (),
}


class Kind(enum.StrEnum):
    AUTO = "auto"  # the gearbox decided, the deployment is in auto mode
    APPROVED = "approved"  # advisory mode: an operator approved the gearbox's decision
    MANUAL = "manual"  # an operator asked for a gear
    EMERGENCY = "emergency"  # an operator's downshift to the baseline
    ROLLOUT = "rollout"  # an operator rolls a new version of the model out (new plans load it)


class Step(enum.StrEnum):
    RESERVE = "reserve"
    PREPARE = "prepare"
    CANARY = "canary"
    FLIP = "flip"
    FREEZE = "freeze"
    MOVE = "move"
    UNROUTE = "unroute"
    RELEASE = "release"
    UNRESERVE = "unreserve"
    RB_THAW = "rb_thaw"
    RB_ROUTE = "rb_route"
    RB_FREEZE = "rb_freeze"
    RB_MOVE = "rb_move"
    RB_UNROUTE = "rb_unroute"
    RB_ABORT = "rb_abort"
    RB_UNRESERVE = "rb_unreserve"


class StepState(enum.StrEnum):
    RUNNING = "running"  # saved, effects under way
    OK = "ok"
    FAILED = "failed"  # this attempt failed; the next is a retry or the rollback
    ABANDONED = "abandoned"  # CLEANUP/ROLLBACK only: given up after its attempts; the transition goes on


class CommandKind(enum.StrEnum):
    """Agent protocol v1 commands a transition sends (payloads: agents/protocol/)."""

    PREPARE_PLAN = "prepare_plan"
    ABORT_PLAN = "abort_plan"
    FREEZE_PLAN = "freeze_plan"
    THAW_PLAN = "thaw_plan"
    MOVE_SEQUENCES = "move_sequences"
    RELEASE_PLAN = "release_plan"


Effect = Literal["reserve", "unreserve", "routing", "agents"]


@dataclass(frozen=True)
class StepDef:
    """One row of the transition table."""

    step: Step
    phase: Phase
    effect: Effect  # what kind of effect it has
    does: str  # what it does, in words (shown in the console)
    undo: str  # how a rollback undoes it


TABLE: tuple[StepDef, ...] = (
    StepDef(Step.RESERVE, Phase.PREPARE, "reserve",
            "book the new plans' GPU memory in the ledger (no other plan or scheduler sees it)", "rb_unreserve"),
    StepDef(Step.PREPARE, Phase.PREPARE, "agents",
            "prepare_plan on every node of the new plans: memory, weights, comm groups, warm-up (shadow plan)",
            "rb_abort"),
    StepDef(Step.CANARY, Phase.SWITCH, "routing",
            "routing +1: a small share of new requests to the new plans, the rest to the old ones", "rb_route"),
    StepDef(Step.FLIP, Phase.SWITCH, "routing",
            "routing +1 (atomic flip): all new requests to the target gear; leaving plans frozen", "rb_route"),
    StepDef(Step.FREEZE, Phase.SWITCH, "agents",
            "freeze_plan on the leaving plans' leaders: stop admitting, list in-flight sequences", "rb_thaw"),
    StepDef(Step.MOVE, Phase.SWITCH, "agents",
            "move_sequences: per sequence finish, migrate or replay (cost model), long first, idle lazily",
            "rb_freeze + rb_move"),
    StepDef(Step.UNROUTE, Phase.CLEANUP, "routing",
            "routing +1 without the leaving plans (never route to a released plan)", "none: rolls forward"),
    StepDef(Step.RELEASE, Phase.CLEANUP, "agents",
            "release_plan on the leaving plans' nodes: drain what was left to finish, free the GPUs",
            "none: rolls forward"),
    StepDef(Step.UNRESERVE, Phase.CLEANUP, "unreserve", "drop the leaving plans' reservations",
            "none: rolls forward"),
)
ROLLBACK_TABLE: tuple[StepDef, ...] = (
    StepDef(Step.RB_THAW, Phase.ROLLBACK, "agents", "thaw_plan on leaving plans that were frozen", "-"),
    StepDef(Step.RB_ROUTE, Phase.ROLLBACK, "routing",
            "routing +1: the old gear's plans and weights again; new plans frozen", "-"),
    StepDef(Step.RB_FREEZE, Phase.ROLLBACK, "agents", "freeze_plan on routed new plans: their in-flight sequences",
            "-"),
    StepDef(Step.RB_MOVE, Phase.ROLLBACK, "agents", "move_sequences from the new plans back to the old ones", "-"),
    StepDef(Step.RB_UNROUTE, Phase.ROLLBACK, "routing", "routing +1 without the new plans", "-"),
    StepDef(Step.RB_ABORT, Phase.ROLLBACK, "agents",
            "abort_plan on every node of the new plans (safe if never prepared)", "-"),
    StepDef(Step.RB_UNRESERVE, Phase.ROLLBACK, "unreserve", "drop the new plans' reservations", "-"),
)
STEP_DEFS: Mapping[Step, StepDef] = {d.step: d for d in TABLE + ROLLBACK_TABLE}
CRASH_WHERE = ("persisted", "effected", "completed")


def crash_points(*, rollback: bool = False) -> tuple[str, ...]:
    """Every point where the executor probes, in the order a transition passes them:
    `<step>.persisted` (the step is saved as running, nothing done yet), `<step>.effected`
    (its effects are issued, the outcome not yet saved), `<step>.completed` (its outcome is
    saved, the next step not yet started). `rollback=True` lists the rollback path's points."""
    steps = ROLLBACK_TABLE if rollback else TABLE
    return tuple(f"{d.step.value}.{w}" for d in steps for w in CRASH_WHERE)


@dataclass(frozen=True)
class TransitionConfig:
    """Timeouts, retries and shares of a transition (seed 000 sections 3.3, 4.3, 5.3)."""

    canary_share: float = 0.1  # share of new requests the new plans take during the canary
    canary_dwell_s: float = 2.0  # how long both run side by side before the flip
    prepare_timeout_s: float = 600.0  # weights of a 70B model from disk take minutes
    step_timeout_s: float = 30.0  # routing-free agent steps: freeze, thaw, abort
    move_timeout_s: float = 120.0  # plus 2x the estimated transfer time
    drain_budget_s: float = 10.0  # a sequence that finishes on the old plan within this stays there
    release_timeout_s: float = 60.0  # plus the drain budget
    switch_retries: int = 2  # a failed SWITCH step is retried this often, then rolled back
    cleanup_attempts: int = 3  # CLEANUP/ROLLBACK steps: attempts before giving up
    retry_backoff_s: float = 2.0  # wait before a retry (a preemption may end)
    migrate_bw_share: float = 0.5  # a migration may use this share of a link (serving is not starved)

    def __post_init__(self) -> None:
        if not 0.0 < self.canary_share < 1.0:
            raise ValueError(f"canary_share: must be in (0, 1), got {self.canary_share}")
        if not 0.0 < self.migrate_bw_share <= 1.0:
            raise ValueError(f"migrate_bw_share: must be in (0, 1], got {self.migrate_bw_share}")
        for name in ("canary_dwell_s", "prepare_timeout_s", "step_timeout_s", "move_timeout_s", "drain_budget_s",
                     "release_timeout_s", "retry_backoff_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0")
        if self.switch_retries < 0:
            raise ValueError("switch_retries: must be >= 0")
        if self.cleanup_attempts < 1:
            raise ValueError("cleanup_attempts: must be >= 1")


DEFAULT_TRANSITION_CONFIG = TransitionConfig()
