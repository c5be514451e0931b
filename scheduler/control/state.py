"""What the control loop observes and what one step hands back (scheduler.control.loop).

Plain frozen dataclasses, built by the drivers (the console's tick from the database, the
simulator's FlexPipe policy from its state), never by the loop. Each field says what it is;
the loop reads nothing else (no clock, no I/O).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from scheduler.backoff import Backoff
from scheduler.gearbox import DEFAULT_CONFIG, Decision, Deployment, GearboxConfig, LoadWindow, Trigger
from scheduler.modelspec import ModelSpec
from scheduler.plan import Gear
from scheduler.planner import PlannerOptions
from scheduler.pool.autoscale import DEFAULT_SCALE, AdmissionShares, ScaleConfig, TwuSample, check_weights
from scheduler.pool.jobs import JobState
from scheduler.pool.priority import Takeover
from scheduler.pool.sharing import MAX_MODELS_PER_GPU, check_max_models
from scheduler.topology import FragmentHistory, Snapshot
from scheduler.transition import Kind, TransitionRecord


class FirstStage(enum.StrEnum):
    """Where the first stage of a staged switch is (the transition that started it)."""

    RUNNING = "running"  # still running: nothing to do yet
    DONE = "done"  # done: the second stage is decided now
    ENDED = "ended"  # rolled back (or gone): the staged path is off


@dataclass(frozen=True)
class LoopConfig:
    """The knobs of the loop; the only place the drivers may differ, each one documented."""

    gearbox: GearboxConfig = DEFAULT_CONFIG  # hysteresis, cooldowns, windows (scheduler.gearbox)
    # rule 10: a valid, serving gear inside its cooldown stays on a periodic step whatever the
    # candidates are (gearbox rule 3) - unless it is overloaded (`gearbox.overloaded`: the
    # cooldown holds no upshift out of it) - so the call is skipped and nothing is recorded. The
    # console keeps every "stay" (its page and audit show them: False); the simulator only
    # needs the switches and blocks (True: the replay calls the planner far less)
    skip_cooldown_stays: bool = False
    scale: ScaleConfig = DEFAULT_SCALE  # rule 11: the TWU watermarks (its windows and cooldown are the gearbox's)
    # how many deployments may share one GPU by memory fraction (scheduler.pool.sharing; seed 004
    # section 4.2: 2). 1: every GPU another deployment holds is unschedulable (exclusive GPUs)
    max_models_per_gpu: int = MAX_MODELS_PER_GPU
    take_from_lower: bool = True  # rule 13: a deployment that cannot stand takes GPUs from lower priorities
    # rule 14: the soft-limit weights by model name (seed 004 section 3.2: Phi-3-mini 1.0, Llama-3-8B 2.3,
    # Qwen2-72B 8.7; the console's FLEXPIPE_POOL_MODEL_WEIGHTS). A model not named weighs 1.0; empty: no
    # soft limits, deployments of one priority decide in `index` order whatever the pool's TWU
    model_weights: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_max_models(self.max_models_per_gpu)
        check_weights(self.model_weights, "model_weights")


@dataclass(frozen=True)
class Staged:
    """A staged switch on its way (scheduler.staging): where its second stage goes."""

    target: Gear  # the gear the second stage goes to
    kind: Kind  # the kind of its first stage (an operator's, or the gearbox's): the second's too
    first_stage: FirstStage  # where its first stage is


@dataclass(frozen=True)
class Running:
    """The deployment's transition that runs now."""

    seq: int
    kind: Kind
    phase: str  # prepare | switch | cleanup | rollback (scheduler.transition.Phase values)
    abort_requested: bool = False  # someone already asked it to roll back


@dataclass(frozen=True)
class Finished:
    """A transition that ended since the back-off was last folded (oldest first)."""

    record: TransitionRecord
    at_s: float  # when it ended
    snapshot: Snapshot | None = None  # the fleet when it ended (None: the step's snapshot)


@dataclass(frozen=True)
class DeploymentState:
    """One deployment as the loop sees it."""

    deployment: Deployment  # the scheduler's view: SLO, baseline, priority, mode, switch times
    current: Gear | None  # the stable gear (None: nothing runs yet)
    load: LoadWindow  # its load samples
    model: ModelSpec  # its architecture (the planner's maths)
    planner_options: PlannerOptions | None = None  # its engine's limits (None: the planner's defaults)
    backoff: Backoff | None = None  # its back-off book before the finished transitions below
    finished: tuple[Finished, ...] = ()  # transitions ended since the book was folded
    staged: Staged | None = None  # a staged switch on its way
    running: Running | None = None  # the transition that runs, if one does
    reports_mirror_last: bool = True  # the agents reported what its last transition left
    # (the console checks report times against command acks; the simulator's reports are
    # instant, so it is always True there)
    emergency_target: Gear | None = None  # an operator's pending emergency downshift: go here
    deleting: bool = False  # being drained for deletion: the loop leaves it alone
    lost_plans: tuple[str, ...] = ()  # plans the driver just dropped (their agent no longer runs them)
    serving: bool = True  # every plan of its current gear serves (the simulator knows; the
    # console leaves it True and relies on lost GPUs): rule 10 needs it
    index: int = 0  # tie-break after priority (file order, or name order)
    twu: tuple[TwuSample, ...] | None = None  # its TWU per report interval (scheduler.pool.twu), rule 11;
    # None: the loop prices its load window over the current gear (autoscale.gear_twu_samples), as
    # both drivers leave it - the same inputs, the same samples
    idle_to_zero_s: float | None = None  # rule 9b: release the gear after this long without arrivals (None: never)
    min_replicas: int = 1  # rule 9b: only a deployment whose minimum is 0 scales to zero
    up_since_s: float | None = None  # when the current gear came up (the idle time counts from it, too)
    at_zero: bool = False  # rule 9b released its gear (current is None): it comes up only for held requests
    waiting: int = 0  # requests held for it while at zero (the gateway's cold-start wait, the simulator's
    # queue): rule 9 wakes it up
    keep_off: frozenset[str] = frozenset()  # GPUs it gave when it unloaded for a higher priority (rule 13):
    # kept from it while the driver's hold lasts, so it does not come back onto them before the taker switches


@dataclass(frozen=True)
class FleetState:
    """The fleet, once per step."""

    snapshot: Snapshot  # what the agents last reported
    history: FragmentHistory = field(default_factory=FragmentHistory)  # the blocks' trajectories
    held: Mapping[str, frozenset[str]] = field(default_factory=dict)  # deployment -> GPUs it holds
    # deployment -> GPU -> bytes its bookings hold there (the stores' reservations: every plan it
    # prepared and has not released); the loop adds its current gear's plans. A held GPU whose
    # bytes are known nowhere is not shared (scheduler.pool.sharing)
    booked: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    node_epochs: Mapping[str, object] | None = None  # node -> agent epoch (back-off fingerprints)
    jobs: tuple[JobState, ...] = ()  # fine-tune and batch jobs and the GPUs they hold (scheduler/pool/jobs.py)


@dataclass(frozen=True)
class Start:
    """A transition to start."""

    target: Gear
    kind: Kind
    stage: int = 0  # 1: the first stage of a staged switch (its second follows), 2: the second
    staged_target: Gear | None = None  # stage 1: remember this; the second stage goes there


@dataclass(frozen=True)
class Step:
    """What the loop decided for one deployment."""

    deployment_id: str
    trigger: Trigger  # the trigger it decided under (after rules 2, 8 and 11 promoted it)
    decision: Decision | None = None  # None: nothing decided (a transition runs, reports awaited)
    start: Start | None = None  # the transition to start
    abort: str | None = None  # ask the running transition to roll back, with this reason
    waiting_for_reports: bool = False  # decide again in a moment
    clear_staged: bool = False  # the staged path on its way is over (forget it)
    backoff: Backoff | None = None  # the folded book (rule 5 ran: persist it, `finished` is in it)
    emergency: bool = False  # this step served a pending emergency
    release: str | None = None  # rule 9b: scale to zero - drain the current gear and free its GPUs (the
    # driver's release path), with this reason
    wake: bool = False  # rule 9: `start` brings a deployment at zero back (a cold start)
    takes: Takeover | None = None  # rule 13: the GPUs it takes from lower priorities (it switches once released)
    gives_to: str | None = None  # rule 13: it decided with GPUs kept from it, given to this deployment
    given: tuple[str, ...] = ()  # rule 13: those GPUs (sorted); with `release`, the driver keeps them
    # from it for priority.UNLOAD_HOLD_S (`DeploymentState.keep_off`)


@dataclass(frozen=True)
class ControlOutput:
    """What one step decided, deployments in decision order."""

    now_s: float
    steps: tuple[Step, ...]
    next_wake_s: float | None = None  # the earliest time a step could decide differently without
    # a new observation (a cooldown or a back-off ending); None: only a new observation
    pool_twu: float | None = None  # rule 14: the pool's TWU this step decided under (None: not computed -
    # no soft-limit weights, or one model only)
    shares: AdmissionShares | None = None  # rule 14: each model's admission share and weight factor

    def by_id(self) -> dict[str, Step]:
        return {s.deployment_id: s for s in self.steps}

    @property
    def decisions(self) -> tuple[Decision, ...]:
        return tuple(s.decision for s in self.steps if s.decision is not None)

    @property
    def waiting(self) -> tuple[str, ...]:
        return tuple(s.deployment_id for s in self.steps if s.waiting_for_reports)
