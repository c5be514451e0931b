"""Gear transitions: the three-phase state machine (PREPARE -> SWITCH -> CLEANUP, or ROLLBACK).

A transition moves one deployment from its current gear (`from_gear`, None before its first
plan runs) to `to_gear`. It never drops or duplicates a request, never double-books a GPU and
survives the crash of any process at any step (DESIGN.md invariants 1-3; seed 000 sections
3.1-3.3, 4.3, 4.4 and 5.3). It is pure: no I/O, no wall clock. It talks to the world through
three ports (below) and is advanced by whoever holds them (a Celery task, a test, the
simulator), as often as they like: every call is idempotent.

Plans of the two gears fall into three sets: *new* plans (in to_gear only) are prepared,
*leaving* plans (in from_gear only) are drained and released, *kept* plans (in both, equal
content, hence equal plan_id) keep running and only see their routing weight change.

The transition table
--------------------

Forward steps, in order (`TABLE`). Each is keyed by (transition seq, step, attempt); every
effect carries that key, so running a step again re-issues the same commands, the same
reservation and the same routing commit, and nothing happens twice.

| phase   | step      | what it does                                                        | its undo (rollback step)   |
|---------|-----------|---------------------------------------------------------------------|----------------------------|
| PREPARE | reserve   | books the memory of the new plans' GPUs in the reservation ledger,  | rb_unreserve               |
|         |           | so no other plan or scheduler sees it (no agent is involved)        |                            |
| PREPARE | prepare   | `prepare_plan` to every node of every new plan: reserve the memory, | rb_abort (`abort_plan`,    |
|         |           | load the weights into the shadow plan, build its communication      | safe even if it never ran) |
|         |           | groups, warm up. No request reaches it yet                          |                            |
| SWITCH  | canary    | routing version +1: the new plans take `canary_share` of the new    | rb_route                   |
|         |           | requests while the old plans keep the rest; holds `canary_dwell_s`  |                            |
| SWITCH  | flip      | routing version +1, the atomic flip: every new request goes to the  | rb_route                   |
|         |           | target gear; leaving plans stay listed but frozen (weight 0)        |                            |
| SWITCH  | freeze    | `freeze_plan` to each leaving plan's leader: stop admitting; the    | rb_thaw (`thaw_plan`)      |
|         |           | ack lists its in-flight sequences                                   |                            |
| SWITCH  | move      | per sequence the cost model picks finish (stay on the old plan),    | rb_freeze + rb_move (hand  |
|         |           | migrate (KV over the link, bandwidth capped) or replay (re-prefill  | the sequences back)        |
|         |           | on the new plan); long sequences first, idle ones lazily;           |                            |
|         |           | `move_sequences` to each leaving plan's leader                      |                            |
| CLEANUP | unroute   | routing version +1 without the leaving plans (before they go: the   | - (roll forward)           |
|         |           | routing table never points at a released plan)                      |                            |
| CLEANUP | release   | `release_plan` to every node of the leaving plans: finish the       | - (roll forward)           |
|         |           | sequences left to finish (what cannot - drain timeout, lost GPUs -  |                            |
|         |           | is replayed on the target gear), then free the GPUs                 |                            |
| CLEANUP | unreserve | drops the leaving plans' reservations                               | - (roll forward)           |

The end of SWITCH is the commit point: until then ROLLBACK returns to `from_gear` (the last
stable gear); from CLEANUP on, `to_gear` is the stable gear and CLEANUP rolls forward
(failed steps are retried, then given up with the error recorded). ROLLBACK runs
`ROLLBACK_TABLE` in order; each step does nothing when its forward step never started:

| step         | what it does                                                                   |
|--------------|--------------------------------------------------------------------------------|
| rb_thaw      | `thaw_plan` to leaving plans that were frozen: they admit again                |
| rb_route     | routing version +1: the old gear's plans and weights; new plans frozen at 0    |
| rb_freeze    | `freeze_plan` to the new plans that were routed: their in-flight sequences     |
| rb_move      | `move_sequences` from the new plans back to the old ones (same cost model)     |
| rb_unroute   | routing version +1 without the new plans                                       |
| rb_abort     | `abort_plan` to every node of every new plan (a sequence still there ends with |
|              | an explicit error); safe for a plan that was never prepared                    |
| rb_unreserve | drops the new plans' reservations                                              |

Failures: a PREPARE step that fails or times out rolls back. A SWITCH step that fails, times
out or loses GPUs of the new plans (preemption) is retried `switch_retries` times (after
`retry_backoff_s`), then rolled back. CLEANUP and ROLLBACK steps are retried up to
`cleanup_attempts` times, then given up (ABANDONED, the error kept) so a transition always
ends. An operator's abort (emergency downshift) rolls back a transition in PREPARE or
SWITCH; one in CLEANUP or ROLLBACK finishes first.

Persistence (invariant 3): a step is saved as RUNNING, with everything it will do (its
commands, routing target, reservations), *before* any effect; effects carry a `Guard`
(deployment, seq, record version) and the ports refuse them once the record has moved on,
so a worker that woke up late cannot act for a step that someone else already finished or
rolled back. Every save is conditional on the version it read (`expected_version`).

Sequence ownership (invariant 2): every sequence holds a lease (plan_id, routing version).
A hand-over carries a new lease whose version is the routing version of the flip (or of
rb_route); the receiving engine accepts a sequence only when the lease is newer than the one
it had, and only at the end of a decode iteration (or while it is idle).

Crash points: the executor calls `probe(point)` after each save and each effect
(`crash_points()` lists them); tests and the Celery crash test stop the process there.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol

from scheduler.booking import plan_memory
from scheduler.costmodel import (
    DEFAULT_EFFICIENCY,
    Efficiency,
    KvRoute,
    PlanProfile,
    kv_route,
    migrate_or_replay,
)
from scheduler.modelspec import ModelSpec, model_spec
from scheduler.plan import Gear, Plan, Stage
from scheduler.topology import Snapshot

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
    """Agent protocol v1 commands a transition sends (payloads: agents/protocol.py)."""

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


# --- values ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Route:
    """One plan in a deployment's routing table."""

    plan: Plan  # the plan
    weight: float  # share of new requests, 0..1
    frozen: bool = False  # frozen: admits nothing new; its sequences finish or move
    nodes: tuple[str, ...] = ()  # nodes that host it, its leader (first stage) first

    @property
    def plan_id(self) -> str:
        return self.plan.plan_id

    def key(self) -> tuple[str, float, bool]:
        return (self.plan_id, round(self.weight, 9), self.frozen)

    def to_dict(self) -> JsonDict:
        return {"plan_id": self.plan_id, "plan": self.plan.to_dict(), "weight": self.weight, "frozen": self.frozen,
                "nodes": list(self.nodes)}

    @classmethod
    def from_dict(cls, d: object, path: str = "route") -> Route:
        m = _obj(d, path)
        plan = Plan.from_dict(m.get("plan"), f"{path}.plan")
        return cls(plan=plan, weight=_float(m.get("weight"), f"{path}.weight"),
                   frozen=bool(m.get("frozen", False)),
                   nodes=tuple(_str_list(m.get("nodes", []), f"{path}.nodes")))


@dataclass(frozen=True)
class RoutingState:
    """A deployment's routing table at one version (version 0: empty, nothing routed yet)."""

    deployment_id: str
    version: int
    routes: tuple[Route, ...] = ()

    def same_routes(self, routes: Sequence[Route]) -> bool:
        return sorted(r.key() for r in self.routes) == sorted(r.key() for r in routes)

    def route(self, plan_id: str) -> Route | None:
        for r in self.routes:
            if r.plan_id == plan_id:
                return r
        return None

    def to_dict(self) -> JsonDict:
        return {"deployment": self.deployment_id, "version": self.version, "routes": [r.to_dict() for r in self.routes]}

    @classmethod
    def from_dict(cls, d: object, path: str = "routing") -> RoutingState:
        m = _obj(d, path)
        routes = m.get("routes", [])
        if not isinstance(routes, list):
            raise ValueError(f"{path}.routes: must be a list")
        return cls(deployment_id=str(m.get("deployment", "")), version=_int(m.get("version"), f"{path}.version"),
                   routes=tuple(Route.from_dict(r, f"{path}.routes[{i}]") for i, r in enumerate(routes)))


@dataclass(frozen=True)
class Guard:
    """An effect is valid only while the transition record is still at this version."""

    deployment_id: str
    seq: int
    version: int


class StaleGuard(Exception):
    """A port refused an effect: the transition record moved on (another worker, a rollback)."""


@dataclass(frozen=True)
class CommandIntent:
    """One command a step sends to one agent; `key` makes sending it idempotent."""

    key: str  # "<deployment>/<seq>/<step>/<attempt>/<node>/<plan_id>"
    node_id: str  # the agent that executes it
    kind: CommandKind
    payload: JsonDict  # agents/protocol.py documents it per kind
    deployment_id: str
    seq: int
    step: Step
    attempt: int

    def to_dict(self) -> JsonDict:
        return {"key": self.key, "node": self.node_id, "kind": self.kind.value, "payload": self.payload,
                "deployment": self.deployment_id, "seq": self.seq, "step": self.step.value, "attempt": self.attempt}

    @classmethod
    def from_dict(cls, d: object, path: str = "command") -> CommandIntent:
        m = _obj(d, path)
        payload = m.get("payload", {})
        if not isinstance(payload, dict):
            raise ValueError(f"{path}.payload: must be an object")
        return cls(key=str(m.get("key")), node_id=str(m.get("node")), kind=CommandKind(str(m.get("kind"))),
                   payload=payload, deployment_id=str(m.get("deployment")),
                   seq=_int(m.get("seq"), f"{path}.seq"), step=Step(str(m.get("step"))),
                   attempt=_int(m.get("attempt"), f"{path}.attempt"))


CommandStatus = Literal["pending", "running", "ok", "failed"]


@dataclass(frozen=True)
class CommandResult:
    """What an agent answered to one command (pending: not answered yet)."""

    key: str
    status: CommandStatus
    detail: str = ""
    result: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class Intent:
    """Everything a step will do, saved with the step before any of it happens."""

    commands: tuple[CommandIntent, ...] = ()
    pre: tuple[CommandIntent, ...] = ()  # must all be acked ok before the step's own effect (re-prepare)
    routes: tuple[Route, ...] | None = None  # routing steps: the table to commit
    base_version: int = 0  # ... on top of this routing version
    needs: Mapping[str, Mapping[str, int]] = field(default_factory=dict)  # reserve: plan_id -> gpu -> bytes
    plan_ids: tuple[str, ...] = ()  # unreserve: whose reservations go
    noop: bool = False  # nothing to do (the step completes at once)
    note: str = ""  # what was decided, in words
    timeout_s: float = 0.0  # how long the step may take

    def to_dict(self) -> JsonDict:
        return {
            "commands": [c.to_dict() for c in self.commands],
            "pre": [c.to_dict() for c in self.pre],
            "routes": None if self.routes is None else [r.to_dict() for r in self.routes],
            "base_version": self.base_version,
            "needs": {p: dict(g) for p, g in self.needs.items()},
            "plan_ids": list(self.plan_ids),
            "noop": self.noop,
            "note": self.note,
            "timeout_s": self.timeout_s,
        }

    @classmethod
    def from_dict(cls, d: object, path: str = "intent") -> Intent:
        m = _obj(d, path)
        cmds = m.get("commands", [])
        pre = m.get("pre", [])
        routes = m.get("routes")
        needs_raw = _obj(m.get("needs", {}), f"{path}.needs")
        if not isinstance(cmds, list) or not isinstance(pre, list):
            raise ValueError(f"{path}.commands/pre: must be lists")
        if routes is not None and not isinstance(routes, list):
            raise ValueError(f"{path}.routes: must be a list or null")
        needs = {str(p): {str(u): _int(b, f"{path}.needs.{p}.{u}") for u, b in _obj(g, f"{path}.needs.{p}").items()}
                 for p, g in needs_raw.items()}
        return cls(
            commands=tuple(CommandIntent.from_dict(c, f"{path}.commands[{i}]") for i, c in enumerate(cmds)),
            pre=tuple(CommandIntent.from_dict(c, f"{path}.pre[{i}]") for i, c in enumerate(pre)),
            routes=None if routes is None else tuple(Route.from_dict(r, f"{path}.routes[{i}]")
                                                     for i, r in enumerate(routes)),
            base_version=_int(m.get("base_version", 0), f"{path}.base_version"),
            needs=needs,
            plan_ids=tuple(_str_list(m.get("plan_ids", []), f"{path}.plan_ids")),
            noop=bool(m.get("noop", False)),
            note=str(m.get("note", "")),
            timeout_s=_float(m.get("timeout_s", 0.0), f"{path}.timeout_s"),
        )


@dataclass(frozen=True)
class StepRecord:
    """One attempt of one step."""

    step: Step
    attempt: int  # 1, 2, ...
    state: StepState
    started_s: float  # when it was saved as running
    intent: Intent  # what it does (saved before it does it)
    not_before_s: float = 0.0  # a retry waits until then
    finished_s: float | None = None
    error: str = ""
    reason: str = ""  # machine-readable failure reason: preempted, timeout, failed, node_lost, aborted, ...
    result: Mapping[str, object] = field(default_factory=dict)  # what the agents reported, merged

    @property
    def phase(self) -> Phase:
        return STEP_DEFS[self.step].phase

    @property
    def deadline_s(self) -> float:
        return max(self.started_s, self.not_before_s) + self.intent.timeout_s

    def to_dict(self) -> JsonDict:
        return {"step": self.step.value, "attempt": self.attempt, "state": self.state.value,
                "started_s": self.started_s, "not_before_s": self.not_before_s, "finished_s": self.finished_s,
                "error": self.error, "reason": self.reason, "intent": self.intent.to_dict(),
                "result": dict(self.result)}

    @classmethod
    def from_dict(cls, d: object, path: str = "step") -> StepRecord:
        m = _obj(d, path)
        finished = m.get("finished_s")
        result = m.get("result", {})
        if not isinstance(result, dict):
            raise ValueError(f"{path}.result: must be an object")
        return cls(step=Step(str(m.get("step"))), attempt=_int(m.get("attempt"), f"{path}.attempt"),
                   state=StepState(str(m.get("state"))), started_s=_float(m.get("started_s"), f"{path}.started_s"),
                   intent=Intent.from_dict(m.get("intent", {}), f"{path}.intent"),
                   not_before_s=_float(m.get("not_before_s", 0.0), f"{path}.not_before_s"),
                   finished_s=None if finished is None else _float(finished, f"{path}.finished_s"),
                   error=str(m.get("error", "")), reason=str(m.get("reason", "")), result=result)


@dataclass(frozen=True)
class MoveStats:
    """What moved between plans: KV migrated against tokens replayed, and sequence counts."""

    kv_bytes_migrated: int = 0
    tokens_replayed: int = 0
    seqs_migrated: int = 0
    seqs_replayed: int = 0
    seqs_finished: int = 0  # left to finish on the old plan
    seqs_failed: int = 0  # could not be handed over (they end with an explicit error)
    stall_s_total: float = 0.0  # sum over moved sequences of the time each stood still
    stall_s_max: float = 0.0

    def add(self, other: MoveStats) -> MoveStats:
        return MoveStats(
            self.kv_bytes_migrated + other.kv_bytes_migrated, self.tokens_replayed + other.tokens_replayed,
            self.seqs_migrated + other.seqs_migrated, self.seqs_replayed + other.seqs_replayed,
            self.seqs_finished + other.seqs_finished, self.seqs_failed + other.seqs_failed,
            self.stall_s_total + other.stall_s_total, max(self.stall_s_max, other.stall_s_max))

    def to_dict(self) -> JsonDict:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: object, path: str = "moved") -> MoveStats:
        m = _obj(d, path)
        return cls(**{k: (_float if k.startswith("stall") else _int)(m.get(k, 0), f"{path}.{k}")  # type: ignore[arg-type]
                      for k in cls.__dataclass_fields__})

    @classmethod
    def from_ack(cls, result: Mapping[str, object]) -> MoveStats:
        """Totals of one `move_sequences` ack (agents/protocol.py: MOVE result)."""
        out = cls()
        moved = result.get("moved", [])
        if not isinstance(moved, list):
            return out
        for item in moved:
            if not isinstance(item, Mapping):
                continue
            action, ok = item.get("action"), item.get("ok", True) is not False
            stall = _num_or(item.get("stall_s"), 0.0)
            if item.get("outcome") == "gone":
                continue
            if not ok:
                out = out.add(cls(seqs_failed=1))
            elif action == "migrate":
                out = out.add(cls(kv_bytes_migrated=int(_num_or(item.get("kv_bytes"), 0)), seqs_migrated=1,
                                  stall_s_total=stall, stall_s_max=stall))
            elif action == "replay":
                out = out.add(cls(tokens_replayed=int(_num_or(item.get("replay_tokens"), 0)), seqs_replayed=1,
                                  stall_s_total=stall, stall_s_max=stall))
            elif action == "finish":
                out = out.add(cls(seqs_finished=1))
        return out


@dataclass(frozen=True)
class TransitionRecord:
    """A transition as the store keeps it: the source of truth for resuming it anywhere."""

    deployment_id: str
    seq: int  # strictly increasing per deployment
    kind: Kind
    model: str  # model name (modelspec catalog, or resolved by the caller's resolver)
    from_gear: Gear | None  # the last stable gear (None: nothing ran yet)
    to_gear: Gear
    phase: Phase
    created_s: float
    steps: tuple[StepRecord, ...] = ()  # every attempt of every step, oldest first
    version: int = 1  # bumped by every save; saves are conditional on it
    finished_s: float | None = None
    decision_ref: str | None = None  # the Decision that caused it (a row id, or a simulator's label)
    error: str = ""  # why it rolled back, or what was given up
    abort_reason: str = ""  # an operator asked to roll back (emergency); set by the store
    moved: MoveStats = MoveStats()  # forward hand-overs
    moved_back: MoveStats = MoveStats()  # rollback hand-overs

    # -- derived ----------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        return self.phase in ACTIVE_PHASES

    @property
    def current(self) -> StepRecord | None:
        return self.steps[-1] if self.steps else None

    @property
    def new_plans(self) -> tuple[Plan, ...]:
        old = set(self.from_gear.plans) if self.from_gear else set()
        return tuple(p for p in self.to_gear.plans if p not in old)

    @property
    def leaving_plans(self) -> tuple[Plan, ...]:
        if self.from_gear is None:
            return ()
        keep = set(self.to_gear.plans)
        return tuple(p for p in self.from_gear.plans if p not in keep)

    def attempts(self, step: Step) -> tuple[StepRecord, ...]:
        return tuple(s for s in self.steps if s.step is step)

    def started(self, step: Step) -> bool:
        return any(s.step is step for s in self.steps)

    def done(self, step: Step) -> bool:
        return any(s.step is step and s.state in (StepState.OK, StepState.ABANDONED) for s in self.steps)

    def ok_result(self, step: Step) -> Mapping[str, object]:
        for s in reversed(self.steps):
            if s.step is step and s.state is StepState.OK:
                return s.result
        return {}

    def guard(self) -> Guard:
        return Guard(self.deployment_id, self.seq, self.version)

    def to_dict(self) -> JsonDict:
        return {
            "deployment": self.deployment_id, "seq": self.seq, "kind": self.kind.value, "model": self.model,
            "from_gear": self.from_gear.to_dict() if self.from_gear else None, "to_gear": self.to_gear.to_dict(),
            "phase": self.phase.value, "created_s": self.created_s, "steps": [s.to_dict() for s in self.steps],
            "version": self.version, "finished_s": self.finished_s, "decision_ref": self.decision_ref,
            "error": self.error, "abort_reason": self.abort_reason, "moved": self.moved.to_dict(),
            "moved_back": self.moved_back.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: object, path: str = "transition") -> TransitionRecord:
        m = _obj(d, path)
        steps = m.get("steps", [])
        if not isinstance(steps, list):
            raise ValueError(f"{path}.steps: must be a list")
        fg = m.get("from_gear")
        fin = m.get("finished_s")
        ref = m.get("decision_ref")
        return cls(
            deployment_id=str(m.get("deployment")), seq=_int(m.get("seq"), f"{path}.seq"),
            kind=Kind(str(m.get("kind"))), model=str(m.get("model")),
            from_gear=None if fg is None else Gear.from_dict(fg, f"{path}.from_gear"),
            to_gear=Gear.from_dict(m.get("to_gear"), f"{path}.to_gear"), phase=Phase(str(m.get("phase"))),
            created_s=_float(m.get("created_s"), f"{path}.created_s"),
            steps=tuple(StepRecord.from_dict(s, f"{path}.steps[{i}]") for i, s in enumerate(steps)),
            version=_int(m.get("version"), f"{path}.version"),
            finished_s=None if fin is None else _float(fin, f"{path}.finished_s"),
            decision_ref=None if ref is None else str(ref), error=str(m.get("error", "")),
            abort_reason=str(m.get("abort_reason", "")),
            moved=MoveStats.from_dict(m.get("moved", {}), f"{path}.moved"),
            moved_back=MoveStats.from_dict(m.get("moved_back", {}), f"{path}.moved_back"),
        )


@dataclass(frozen=True)
class TransitionEvent:
    """Something a save makes true; the Django store audits each, the memory store logs each."""

    kind: Literal["created", "step_started", "step_ok", "step_failed", "step_abandoned", "phase", "finished"]
    deployment_id: str
    seq: int
    t_s: float
    phase: Phase
    step: Step | None = None
    attempt: int = 0
    detail: str = ""

    def to_dict(self) -> JsonDict:
        return {"kind": self.kind, "deployment": self.deployment_id, "seq": self.seq, "t_s": self.t_s,
                "phase": self.phase.value, "step": self.step.value if self.step else None, "attempt": self.attempt,
                "detail": self.detail}


# --- ports ----------------------------------------------------------------------------------------
class TransitionStore(Protocol):
    """Where transitions live. Every write is conditional; nothing is visible before it is saved."""

    def active(self, deployment_id: str) -> TransitionRecord | None:
        """The deployment's transition in PREPARE, SWITCH, CLEANUP or ROLLBACK, if any (at most one)."""

    def load(self, deployment_id: str, seq: int) -> TransitionRecord | None: ...

    def last_seq(self, deployment_id: str) -> int:
        """The highest seq ever used for the deployment (0: none)."""

    def current_gear(self, deployment_id: str) -> Gear | None:
        """The deployment's stable gear: what a new transition starts from."""

    def create(self, record: TransitionRecord, events: Sequence[TransitionEvent]) -> bool:
        """Save a new transition. False (and nothing saved) when another one is active or `seq`
        is not above every seq used before: the claim that keeps one active per deployment."""

    def save(self, record: TransitionRecord, *, expected_version: int,
             events: Sequence[TransitionEvent]) -> TransitionRecord | None:
        """Save `record` as version expected_version + 1 if the stored one is still at
        `expected_version`; return what was saved, or None (someone else saved first). Saving
        phase DONE makes to_gear the deployment's current gear in the same write."""

    def request_abort(self, deployment_id: str, seq: int, reason: str) -> bool:
        """Ask an active transition to roll back (bumps its version); False if it is not active."""

    def reserve(self, guard: Guard, needs: Mapping[str, Mapping[str, int]]) -> list[str]:
        """Book GPU memory for the deployment's plans (plan_id -> gpu -> bytes). Idempotent.
        Returns conflicts (a GPU booked by another deployment), booking nothing then.
        Raises StaleGuard when the record moved past `guard.version`."""

    def unreserve(self, guard: Guard, plan_ids: Sequence[str]) -> None:
        """Drop these plans' bookings (safe when there are none). Raises StaleGuard likewise."""


class AgentPort(Protocol):
    """The agents: commands out, acks in, and the cluster as they last reported it."""

    def send(self, commands: Sequence[CommandIntent], guard: Guard) -> None:
        """Queue the commands; a key already queued is not queued again. Raises StaleGuard
        (queueing nothing) when the record moved past `guard.version`."""

    def results(self, keys: Sequence[str]) -> Mapping[str, CommandResult]:
        """The agents' answers so far (a key never sent is absent)."""

    def snapshot(self) -> Snapshot:
        """The cluster as the agents last reported it."""

    def data_addr(self, node_id: str) -> str:
        """Where that node's agent receives KV cache from its peers ('' if unknown)."""


class RoutingTable(Protocol):
    """Versioned routing per deployment. A commit names the version it builds on."""

    def current(self, deployment_id: str) -> RoutingState: ...

    def commit(self, deployment_id: str, expected_version: int, routes: Sequence[Route],
               guard: Guard) -> RoutingState | None:
        """Replace the routes and bump the version if it is still `expected_version` (None
        otherwise). Raises StaleGuard when the record moved past `guard.version`."""


Clock = Callable[[], float]
Probe = Callable[[str], None]
ModelResolver = Callable[[str], ModelSpec]
# What the new plans of a transition load (the registry's version of its model): a mapping with
# weights_sha256 (hex, or None: unknown, nothing to check) and, optionally, model_version (the
# version's id, label, tokenizer and warm-up tokens, for the agent's checks on the shadow plan) and
# slo ({ttft_ms, tpot_ms}: the deployment's, for an agent that simulates it).
WeightsResolver = Callable[["TransitionRecord"], "Mapping[str, object] | None"]


def _no_probe(point: str) -> None:
    return None


def _no_digest(record: TransitionRecord) -> Mapping[str, object] | None:
    return None


# --- sequences and the per-sequence choice -------------------------------------------------------
@dataclass(frozen=True)
class SeqInfo:
    """One in-flight sequence as a frozen plan reports it (freeze_plan's ack)."""

    seq_id: str
    context_tokens: int  # prompt + generated so far: what its KV cache holds
    generated_tokens: int
    max_tokens: int  # its output limit
    state: Literal["running", "waiting"] = "running"  # waiting = idle, not in the running batch
    kv_lost: bool = False  # its KV is gone (GPUs lost): it can only be replayed

    @property
    def remaining_tokens(self) -> int:
        return max(0, self.max_tokens - self.generated_tokens)

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> SeqInfo:
        state = d.get("state", "running")
        return cls(seq_id=str(d.get("seq_id")), context_tokens=int(_num_or(d.get("context_tokens"), 0)),
                   generated_tokens=int(_num_or(d.get("generated_tokens"), 0)),
                   max_tokens=int(_num_or(d.get("max_tokens"), 0)),
                   state="waiting" if state == "waiting" else "running", kv_lost=bool(d.get("kv_lost", False)))


@dataclass(frozen=True)
class MoveDirective:
    """What to do with one sequence of a leaving plan."""

    seq_id: str
    action: Literal["migrate", "replay", "finish"]
    target_plan: str  # plan_id ('' for finish)
    target_node: str  # the target plan's leader ('' for finish)
    context_tokens: int
    est_stall_s: float  # the cost model's estimate of how long it stands still
    lazy: bool = False  # idle sequence: move after the active ones

    def to_payload(self, target_addr: str, bw_cap_bytes_per_s: float) -> JsonDict:
        # the payload is saved in the record before it is sent, as strict JSON (PostgreSQL's jsonb
        # refuses Infinity): a figure the cost model has none for - a link never measured makes
        # both moves infinitely dear - goes as 0, "no cap" / "no estimate", as the protocol reads it
        return {"seq_id": self.seq_id, "action": self.action, "target_plan": self.target_plan,
                "target_node": self.target_node, "target_addr": target_addr,
                "bw_cap_bytes_per_s": bw_cap_bytes_per_s if math.isfinite(bw_cap_bytes_per_s) else 0.0,
                "lazy": self.lazy,
                "est_stall_s": round(self.est_stall_s, 6) if math.isfinite(self.est_stall_s) else 0.0}


def plan_moves(
    sequences: Sequence[SeqInfo],
    source: Plan,
    targets: Sequence[tuple[Plan, float]],
    model: ModelSpec,
    snapshot: Snapshot,
    *,
    drain_budget_s: float,
    bw_share: float,
    source_step_s: float | None = None,
    eff: Efficiency = DEFAULT_EFFICIENCY,
    kv_compatible: bool = True,
) -> list[MoveDirective]:
    """Per sequence of `source`, the cheapest of finishing there, migrating or replaying.

    `kv_compatible=False` (source and targets load different weights: a rollout) rules migration
    out - KV computed by other weights means nothing to the target - so a sequence that moves is
    replayed (its tokens re-prefilled there).

    Invariants of the result: every sequence appears once; active (running) sequences come
    before idle ones, each group longest context first (seed 000 section 5.3: long sequences
    move first, short ones are left to finish). A sequence stays to finish when the source
    still works and it finishes within `drain_budget_s` or sooner than it could move; else it
    goes to the target (weight > 0) where its move is cheapest; an idle sequence always moves - migrate when moving its KV
    over the link, capped at `bw_share` of it, beats re-prefilling it there
    (`costmodel.migrate_or_replay`); a sequence whose KV is lost is replayed. How long a
    sequence takes to finish uses `source_step_s`, the decode iteration the source engine
    measured (freeze_plan reports it), else the cost model's.
    """
    src_ok = _plan_usable(source, snapshot)
    src_stages = source.decode_stages if source.mode == "disaggregated" else source.stages
    src_profile = PlanProfile.build(source, model, snapshot, eff) if src_ok else None
    running = sum(1 for s in sequences if s.state == "running")
    usable = [(p, w) for p, w in targets if w > 0 and _plan_usable(p, snapshot)]
    if not usable:
        usable = [(p, w) for p, w in targets if _plan_usable(p, snapshot)]
    routes: dict[str, KvRoute] = {}
    pipes = {}
    for plan, _ in usable:
        dst_stages = plan.decode_stages if plan.mode == "disaggregated" else plan.stages
        route = kv_route(src_stages, dst_stages, model, snapshot, eff) if src_ok else KvRoute(math.inf, math.inf, 1)
        if math.isfinite(route.s_per_token):
            route = KvRoute(route.latency_s, route.s_per_token / bw_share, route.bytes_per_token)
        routes[plan.plan_id] = route
        pipes[plan.plan_id] = PlanProfile.build(plan, model, snapshot, eff).pipeline("prefill")
    assigned: dict[str, int] = {p.plan_id: 0 for p, _ in usable}
    weights = {p.plan_id: w for p, w in usable}
    ordered = sorted(sequences, key=lambda s: (s.state != "running", -s.context_tokens, s.seq_id))
    out: list[MoveDirective] = []
    for s in ordered:
        finish_s = math.inf  # idle (waiting) sequences always move: on the old plan they would wait first
        if src_profile is not None and not s.kv_lost and s.state == "running":
            step_s = source_step_s if source_step_s else src_profile.pipeline("decode").decode_step_s(
                max(1, running), max(1, s.context_tokens))
            finish_s = s.remaining_tokens * step_s
        best: tuple[float, float, str, Literal["migrate", "replay"]] | None = None
        for plan, _ in usable:
            pid = plan.plan_id
            route = routes[pid] if not s.kv_lost and kv_compatible else KvRoute(math.inf, math.inf, 1)
            move = migrate_or_replay(max(1, s.context_tokens), route, pipes[pid])
            choice: Literal["migrate", "replay"] = "replay" if move.choice == "replay" else "migrate"
            if move.choice == "stay":  # same GPUs, same layers: the KV is already in place
                cost = 0.0
            else:
                cost = move.migrate_s if choice == "migrate" else move.replay_s
            balance = assigned[pid] / max(weights[pid], 1e-9)
            cand = (cost, balance, pid, choice)
            if best is None or cand[:3] < best[:3]:
                best = cand
        if best is None or (finish_s <= max(drain_budget_s, best[0] if best else 0.0) and math.isfinite(finish_s)):
            out.append(MoveDirective(s.seq_id, "finish", "", "", s.context_tokens, 0.0, s.state == "waiting"))
            continue
        cost, _, pid, choice = best
        assigned[pid] += 1
        target = next(p for p, _ in usable if p.plan_id == pid)
        out.append(MoveDirective(s.seq_id, choice, pid, _leader_from_snapshot(target, snapshot), s.context_tokens,
                                 cost, s.state == "waiting"))
    return out


def _plan_usable(plan: Plan, snapshot: Snapshot) -> bool:
    """Every GPU of the plan is reported, healthy and ours (schedulable)."""
    gpus = snapshot.gpu_by_uuid
    nodes = snapshot.node_by_id
    for u in plan.gpu_uuids:
        g = gpus.get(u)
        if g is None or not g.healthy or not g.schedulable:
            return False
        n = nodes.get(g.node_id)
        if n is None or not n.schedulable:
            return False
    return True


def lost_gpus(plan: Plan, snapshot: Snapshot) -> list[str]:
    """GPUs of `plan` that are gone, unhealthy, taken by another tenant or on a cordoned node."""
    gpus = snapshot.gpu_by_uuid
    nodes = snapshot.node_by_id
    out = []
    for u in plan.gpu_uuids:
        g = gpus.get(u)
        n = nodes.get(g.node_id) if g is not None else None
        if g is None or not g.healthy or not g.schedulable or n is None or not n.schedulable:
            out.append(u)
    return out


def plan_nodes(plan: Plan, snapshot: Snapshot) -> tuple[str, ...]:
    """Nodes that host `plan`'s GPUs, the leader (its first stage's node) first; GPUs missing
    from the snapshot are skipped."""
    out: list[str] = []
    gpus = snapshot.gpu_by_uuid
    for u in plan.gpu_uuids:
        g = gpus.get(u)
        if g is not None and g.node_id not in out:
            out.append(g.node_id)
    return tuple(out)


def _leader_from_snapshot(plan: Plan, snapshot: Snapshot) -> str:
    nodes = plan_nodes(plan, snapshot)
    return nodes[0] if nodes else ""


def node_stages(plan: Plan, node_id: str, snapshot: Snapshot) -> list[JsonDict]:
    """The stages (or parts of stages) of `plan` on `node_id`, as prepare_plan names them."""
    out: list[JsonDict] = []
    gpus = snapshot.gpu_by_uuid
    for pipeline, stages in (("prefill" if plan.mode == "disaggregated" else "main", plan.stages),
                             ("decode", plan.decode_stages)):
        for i, st in enumerate(stages):
            ranks = [r for r, u in enumerate(st.gpu_uuids) if (g := gpus.get(u)) is not None and g.node_id == node_id]
            if ranks:
                out.append({"pipeline": pipeline, "index": i, "layers": [st.layer_start, st.layer_end],
                            "tp": st.tp, "gpus": list(st.gpu_uuids), "ranks": ranks})
    return out


# --- the executor ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Advance:
    """What one `advance` call left behind."""

    record: TransitionRecord | None  # the transition now (None: none was active)
    wake_at_s: float | None = None  # call again at this time at the latest (a timeout, a dwell)
    waiting_for: tuple[str, ...] = ()  # command keys it waits on
    finished: bool = False  # the transition reached DONE or ROLLED_BACK in this call


@dataclass(frozen=True)
class _Wait:
    wake_at_s: float
    keys: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Ok:
    result: Mapping[str, object]
    note: str = ""


@dataclass(frozen=True)
class _Fail:
    reason: str  # preempted | timeout | failed | node_lost | conflict | routing_raced | aborted
    error: str


class Executor:
    """Advances transitions through the table. Stateless: everything is in the store.

    Decide apart from act: each pass reads the record, mirrors what the agents reported
    (acks, lost GPUs, routing), decides the next move with the table, saves it, and only then
    acts. Several executors may run at once for the same transition (two workers, a crashed
    one's redelivered task): conditional saves and guarded, idempotent effects make that safe.
    """

    def __init__(self, store: TransitionStore, agents: AgentPort, routing: RoutingTable, clock: Clock, *,
                 config: TransitionConfig = DEFAULT_TRANSITION_CONFIG, probe: Probe = _no_probe,
                 models: ModelResolver = model_spec, eff: Efficiency = DEFAULT_EFFICIENCY,
                 weights: WeightsResolver = _no_digest) -> None:
        self.store = store
        self.agents = agents
        self.routing = routing
        self.clock = clock
        self.config = config
        self.probe = probe
        self.models = models
        self.eff = eff
        self.weights = weights

    # -- starting --------------------------------------------------------------------------
    def start(self, deployment_id: str, to_gear: Gear, *, kind: Kind = Kind.AUTO, model: str | None = None,
              decision_ref: str | None = None) -> TransitionRecord | None:
        """Claim the next seq and create a transition from the current gear to `to_gear`.
        None when another transition is active (or a racing caller claimed the seq first)."""
        from_gear = self.store.current_gear(deployment_id)
        name = model or to_gear.model
        if to_gear.model != name:
            raise ValueError(f"to_gear.model: {to_gear.model!r} is not the deployment's model {name!r}")
        if from_gear is not None and from_gear.gear_id == to_gear.gear_id:
            raise ValueError(f"to_gear: the deployment already runs gear {to_gear.gear_id}")
        now = self.clock()
        record = TransitionRecord(deployment_id=deployment_id, seq=self.store.last_seq(deployment_id) + 1,
                                  kind=kind, model=name, from_gear=from_gear, to_gear=to_gear,
                                  phase=Phase.PREPARE, created_s=now, decision_ref=decision_ref)
        event = TransitionEvent("created", deployment_id, record.seq, now, Phase.PREPARE,
                                detail=f"{kind.value}: {_shape(from_gear)} -> {to_gear.shape()}")
        return record if self.store.create(record, [event]) else None

    def abort(self, deployment_id: str, reason: str) -> bool:
        """Ask the active transition to roll back (it does at its next advance, if in PREPARE or SWITCH)."""
        active = self.store.active(deployment_id)
        return active is not None and self.store.request_abort(deployment_id, active.seq, reason)

    # -- advancing -------------------------------------------------------------------------
    def advance(self, deployment_id: str, seq: int | None = None, *, max_passes: int = 200) -> Advance:
        """Take every step that can be taken now; return when the transition waits or ends."""
        record: TransitionRecord | None = None
        for _ in range(max_passes):
            record = self.store.load(deployment_id, seq) if seq is not None else self.store.active(deployment_id)
            if record is None:
                return Advance(None)
            if not record.active:
                return Advance(record)
            out = self._pass(record)
            if isinstance(out, _Wait):
                return Advance(self.store.load(deployment_id, record.seq), out.wake_at_s, out.keys)
            if out == "finished":
                return Advance(self.store.load(deployment_id, record.seq), finished=True)
        return Advance(record, self.clock())

    def _pass(self, rec: TransitionRecord) -> _Wait | str:
        """One decision and its action. Returns a wait, 'progressed', 'raced' or 'finished'."""
        now = self.clock()
        cur = rec.current
        running = cur is not None and cur.state is StepState.RUNNING
        if rec.abort_reason and rec.phase in (Phase.PREPARE, Phase.SWITCH):
            if cur is not None and running:
                return self._finish_step(rec, cur, _Fail("aborted", f"aborted: {rec.abort_reason}"), now)
            return self._enter_rollback(rec, now, f"aborted: {rec.abort_reason}")
        if cur is None or not running:
            return self._start_next(rec, now)
        if now < cur.not_before_s:
            return _Wait(cur.not_before_s)
        try:
            local = self._ensure(rec, cur)
        except StaleGuard:
            return "raced"
        self.probe(f"{cur.step.value}.effected")
        verdict = self._judge(rec, cur, now, local)
        if isinstance(verdict, _Wait):
            return verdict
        return self._finish_step(rec, cur, verdict, now)

    def _enter_rollback(self, rec: TransitionRecord, now: float, error: str) -> str:
        events = [TransitionEvent("phase", rec.deployment_id, rec.seq, now, Phase.ROLLBACK, detail=error)]
        saved = self.store.save(replace(rec, phase=Phase.ROLLBACK, error=error), expected_version=rec.version,
                                events=events)
        return "progressed" if saved is not None else "raced"

    # -- choosing and saving the next step ----------------------------------------------------
    def _start_next(self, rec: TransitionRecord, now: float) -> _Wait | str:
        nxt, attempt, phase = self._next_step(rec)
        if nxt is None:
            final = Phase.DONE if rec.phase is Phase.CLEANUP else Phase.ROLLED_BACK
            done = replace(rec, phase=final, finished_s=now)
            events = [TransitionEvent("phase", rec.deployment_id, rec.seq, now, final),
                      TransitionEvent("finished", rec.deployment_id, rec.seq, now, final,
                                      detail=rec.error or f"{final.value}: {_shape(rec.from_gear)} -> "
                                                          f"{rec.to_gear.shape()}")]
            if self.store.save(done, expected_version=rec.version, events=events) is None:
                return "raced"
            self.probe("finish.persisted")
            return "finished"
        intent = self._intent(rec, nxt, attempt)
        previous = rec.attempts(nxt)
        if phase is Phase.SWITCH and previous and previous[-1].reason == "preempted" and rec.new_plans:
            # the preemption killed the shadow plans: bring them back before trying again
            pre = self._commands(rec, nxt, attempt, CommandKind.PREPARE_PLAN,
                                 [(p, plan_nodes(p, self.agents.snapshot()), {}) for p in rec.new_plans],
                                 suffix="re")
            intent = replace(intent, pre=pre, noop=False, timeout_s=intent.timeout_s + self.config.prepare_timeout_s,
                             note=f"re-prepare {len(rec.new_plans)} new plan(s) first; " + intent.note)
        not_before = now + self.config.retry_backoff_s if attempt > 1 else 0.0
        step = StepRecord(step=nxt, attempt=attempt, state=StepState.RUNNING, started_s=now, intent=intent,
                          not_before_s=not_before)
        events = []
        if phase is not rec.phase:
            events.append(TransitionEvent("phase", rec.deployment_id, rec.seq, now, phase))
        events.append(TransitionEvent("step_started", rec.deployment_id, rec.seq, now, phase, nxt, attempt,
                                      intent.note))
        saved = self.store.save(replace(rec, phase=phase, steps=rec.steps + (step,)), expected_version=rec.version,
                                events=events)
        if saved is None:
            return "raced"
        self.probe(f"{nxt.value}.persisted")
        return "progressed"

    def _next_step(self, rec: TransitionRecord) -> tuple[Step | None, int, Phase]:
        """The next step to start (None: the phase path is complete), its attempt, its phase."""
        if rec.phase is Phase.ROLLBACK:
            for d in ROLLBACK_TABLE:
                if not rec.done(d.step):
                    return d.step, len(rec.attempts(d.step)) + 1, Phase.ROLLBACK
            return None, 0, Phase.ROLLBACK
        for d in TABLE:
            if not rec.done(d.step):
                return d.step, len(rec.attempts(d.step)) + 1, d.phase
        return None, 0, Phase.CLEANUP

    def _finish_step(self, rec: TransitionRecord, cur: StepRecord, verdict: _Ok | _Fail,
                     now: float) -> _Wait | str:
        phase = rec.phase
        error, moved, moved_back = rec.error, rec.moved, rec.moved_back
        events: list[TransitionEvent] = []
        if isinstance(verdict, _Ok):
            done = replace(cur, state=StepState.OK, finished_s=now, result=dict(verdict.result))
            if cur.step is Step.MOVE:
                moved = moved.add(MoveStats.from_ack(verdict.result))
            if cur.step is Step.RB_MOVE:
                moved_back = moved_back.add(MoveStats.from_ack(verdict.result))
            events.append(TransitionEvent("step_ok", rec.deployment_id, rec.seq, now, phase, cur.step, cur.attempt,
                                          verdict.note or cur.intent.note))
        else:
            state = StepState.FAILED
            if phase is Phase.PREPARE or (phase is Phase.SWITCH and (
                    verdict.reason == "aborted" or cur.attempt > self.config.switch_retries)):
                phase = Phase.ROLLBACK
                error = f"{cur.step.value} (attempt {cur.attempt}) {verdict.error}"
            elif phase in (Phase.CLEANUP, Phase.ROLLBACK) and cur.attempt >= self.config.cleanup_attempts:
                state = StepState.ABANDONED
                error = "; ".join(e for e in (error, f"{cur.step.value} given up: {verdict.error}") if e)
            done = replace(cur, state=state, finished_s=now, error=verdict.error, reason=verdict.reason)
            kind: Literal["step_failed", "step_abandoned"] = (
                "step_abandoned" if state is StepState.ABANDONED else "step_failed")
            events.append(TransitionEvent(kind, rec.deployment_id, rec.seq, now, rec.phase, cur.step, cur.attempt,
                                          verdict.error))
            if phase is not rec.phase:
                events.append(TransitionEvent("phase", rec.deployment_id, rec.seq, now, phase, detail=error))
        new = replace(rec, phase=phase, steps=rec.steps[:-1] + (done,), error=error, moved=moved,
                      moved_back=moved_back)
        if self.store.save(new, expected_version=rec.version, events=events) is None:
            return "raced"
        self.probe(f"{cur.step.value}.completed")
        return "progressed"

    # -- what a step will do (computed once, saved before it is done) ---------------------------
    def _intent(self, rec: TransitionRecord, step: Step, attempt: int) -> Intent:
        cfg = self.config
        model = self.models(rec.model)
        snap = self.agents.snapshot()
        routing = self.routing.current(rec.deployment_id)
        new_ids = {p.plan_id for p in rec.new_plans}

        def commands(kind: CommandKind, plans: Iterable[tuple[Plan, Sequence[str], JsonDict]]) -> tuple[
                CommandIntent, ...]:
            return self._commands(rec, step, attempt, kind, plans)

        if step is Step.RESERVE:
            needs = {p.plan_id: plan_memory(p, model) for p in rec.new_plans}
            return Intent(needs=needs, note=f"book {len(needs)} new plan(s)", noop=not needs)
        if step is Step.PREPARE:
            cmds = commands(CommandKind.PREPARE_PLAN, ((p, plan_nodes(p, snap), {}) for p in rec.new_plans))
            return Intent(commands=cmds, timeout_s=cfg.prepare_timeout_s, noop=not rec.new_plans,
                          note=f"prepare {len(rec.new_plans)} shadow plan(s) on {len({c.node_id for c in cmds})} node(s)")
        if step is Step.CANARY:
            # built from the stable gear, not from the table now: a retry must not compound the share
            old = [r for r in self._stable_routes(rec, routing, snap) if r.weight > 0]
            if not rec.new_plans or not old:
                return Intent(routes=routing.routes, base_version=routing.version, noop=True,
                              note="no canary: nothing else serves yet" if not old else "no canary: no new plan")
            share = cfg.canary_share
            routes = [replace(r, weight=r.weight * (1 - share)) for r in old]
            new_total = sum(w for p, w in zip(rec.to_gear.plans, rec.to_gear.weights, strict=True)
                            if p.plan_id in new_ids) or 1.0
            for p, w in zip(rec.to_gear.plans, rec.to_gear.weights, strict=True):
                if p.plan_id in new_ids:
                    routes.append(Route(p, share * (w / new_total if new_total else 1.0 / len(new_ids)),
                                        nodes=plan_nodes(p, snap)))
            return Intent(routes=tuple(routes), base_version=routing.version, timeout_s=cfg.canary_dwell_s + 60.0,
                          note=f"canary: {share:.0%} of new requests to the new plan(s)")
        if step is Step.FLIP:
            routes = self._target_routes(rec, routing, snap)
            routes += [replace(r, weight=0.0, frozen=True) for r in self._leaving_routes(rec, routing, snap)]
            return Intent(routes=tuple(routes), base_version=routing.version, timeout_s=60.0,
                          note=f"flip to {rec.to_gear.shape()}; {len(rec.leaving_plans)} leaving plan(s) frozen")
        if step is Step.FREEZE:
            leaving = self._leaving_routes(rec, routing, snap)
            cmds = commands(CommandKind.FREEZE_PLAN, ((r.plan, r.nodes[:1], {"routing_version": routing.version})
                                                      for r in leaving if r.nodes))
            return Intent(commands=cmds, timeout_s=cfg.step_timeout_s, noop=not cmds,
                          note=f"freeze {len(cmds)} leaving plan(s)")
        if step is Step.MOVE:
            return self._move_intent(rec, step, attempt, rec.ok_result(Step.FREEZE), self._leaving_routes(
                rec, routing, snap), [(p, w) for p, w in zip(rec.to_gear.plans, rec.to_gear.weights, strict=True)],
                model, snap, routing.version)
        if step is Step.UNROUTE:
            routes = self._target_routes(rec, routing, snap)
            return Intent(routes=tuple(routes), base_version=routing.version, timeout_s=60.0,
                          note=f"drop {len(rec.leaving_plans)} leaving plan(s) from the routing table")
        if step is Step.RELEASE:
            leaving = self._leaving_routes(rec, routing, snap, include_unrouted=True)
            # sequences left to finish get twice the budget they were chosen by (estimates err);
            # what cannot finish there (the drain ran out, or the plan lost its GPUs) is replayed
            # on the target gear's main plan rather than lost
            drain_s = 2 * cfg.drain_budget_s
            body: JsonDict = {"drain_timeout_s": drain_s}
            fallback = self._fallback(rec, routing)
            if fallback:
                body["fallback"] = fallback
            cmds = commands(CommandKind.RELEASE_PLAN, ((r.plan, _present(r.nodes, snap), body) for r in leaving))
            return Intent(commands=cmds, timeout_s=cfg.release_timeout_s + drain_s, noop=not cmds,
                          note=f"release {len(leaving)} leaving plan(s)")
        if step is Step.UNRESERVE:
            ids = tuple(p.plan_id for p in rec.leaving_plans)
            return Intent(plan_ids=ids, noop=not ids, note=f"unbook {len(ids)} leaving plan(s)")
        # -- rollback --
        # the new plans may have taken requests once a flip, or a real canary, was saved
        routed = rec.started(Step.FLIP) or any(not a.intent.noop for a in rec.attempts(Step.CANARY))
        if step is Step.RB_THAW:
            if not rec.started(Step.FREEZE):
                return Intent(noop=True, note="nothing was frozen")
            leaving = self._leaving_routes(rec, routing, snap, include_unrouted=True)
            cmds = commands(CommandKind.THAW_PLAN, ((r.plan, _present(r.nodes[:1], snap), {}) for r in leaving))
            return Intent(commands=cmds, timeout_s=cfg.step_timeout_s, noop=not cmds,
                          note=f"thaw {len(cmds)} leaving plan(s)")
        if step is Step.RB_ROUTE:
            if not routed:
                return Intent(routes=routing.routes, base_version=routing.version, noop=True,
                              note="routing was never changed")
            routes = self._stable_routes(rec, routing, snap)
            routes += [replace(r, weight=0.0, frozen=True) for r in routing.routes if r.plan_id in new_ids]
            return Intent(routes=tuple(routes), base_version=routing.version, timeout_s=60.0,
                          note=f"route back to {_shape(rec.from_gear)}; new plan(s) frozen")
        if step is Step.RB_FREEZE:
            new_routes = [r for r in routing.routes if r.plan_id in new_ids]
            if not routed or not new_routes:
                return Intent(noop=True, note="the new plans never took requests")
            cmds = commands(CommandKind.FREEZE_PLAN, ((r.plan, _present(r.nodes[:1], snap),
                                                       {"routing_version": routing.version}) for r in new_routes))
            return Intent(commands=cmds, timeout_s=cfg.step_timeout_s, noop=not cmds,
                          note=f"freeze {len(cmds)} new plan(s)")
        if step is Step.RB_MOVE:
            new_routes = [r for r in routing.routes if r.plan_id in new_ids]
            if not routed or not new_routes:
                return Intent(noop=True, note="the new plans never took requests")
            targets = list(zip(rec.from_gear.plans, rec.from_gear.weights, strict=True)) if rec.from_gear else []
            # nothing is left to finish on a plan that is about to be aborted, unless that is
            # cheaper than moving it (abort_plan drains those first)
            return self._move_intent(rec, step, attempt, rec.ok_result(Step.RB_FREEZE), new_routes, targets, model,
                                     snap, routing.version, drain_budget_s=0.0)
        if step is Step.RB_UNROUTE:
            if not routed:
                return Intent(routes=routing.routes, base_version=routing.version, noop=True,
                              note="routing was never changed")
            routes = [r for r in routing.routes if r.plan_id not in new_ids]
            return Intent(routes=tuple(routes), base_version=routing.version, timeout_s=60.0,
                          note="drop the new plan(s) from the routing table")
        if step is Step.RB_ABORT:
            if not rec.done(Step.RESERVE):
                # nothing was booked, so nothing was prepared: the plans on those GPUs (if any)
                # belong to someone else and must not be touched
                return Intent(noop=True, note="the booking never succeeded: nothing to abort")
            nodes_of = self._prepared_nodes(rec)
            why: JsonDict = {"reason": rec.error or "rolled back", "drain_timeout_s": 2 * cfg.drain_budget_s}
            plans = [(p, _present(nodes_of.get(p.plan_id, plan_nodes(p, snap)), snap), why) for p in rec.new_plans]
            cmds = commands(CommandKind.ABORT_PLAN, plans)
            return Intent(commands=cmds, timeout_s=cfg.step_timeout_s + 2 * cfg.drain_budget_s, noop=not cmds,
                          note=f"abort {len(rec.new_plans)} new plan(s)")
        if step is Step.RB_UNRESERVE:
            ids = tuple(p.plan_id for p in rec.new_plans)
            return Intent(plan_ids=ids, noop=not ids, note=f"unbook {len(ids)} new plan(s)")
        raise ValueError(f"step: unknown step {step!r}")

    def _commands(self, rec: TransitionRecord, step: Step, attempt: int, kind: CommandKind,
                  plans: Iterable[tuple[Plan, Sequence[str], JsonDict]], suffix: str = "") -> tuple[CommandIntent, ...]:
        """One command per (plan, node), keyed by (deployment, seq, step, attempt, node, plan)."""
        snap = self.agents.snapshot()
        model = self.models(rec.model)
        out = []
        for plan, nodes, payload in plans:
            for node in nodes:
                key = f"{rec.deployment_id}/{rec.seq}/{step.value}/{attempt}/{node}/{plan.plan_id}"
                body = dict(payload)
                body.setdefault("plan_id", plan.plan_id)
                body.setdefault("deployment", rec.deployment_id)
                if kind is CommandKind.PREPARE_PLAN:
                    body = self._prepare_payload(rec, plan, node, snap, model, body)
                out.append(CommandIntent(key + (f"/{suffix}" if suffix else ""), node, kind, body,
                                         rec.deployment_id, rec.seq, step, attempt))
        return tuple(out)

    def _prepare_payload(self, rec: TransitionRecord, plan: Plan, node: str, snap: Snapshot, model: ModelSpec,
                         body: JsonDict) -> JsonDict:
        memory = plan_memory(plan, model)
        stages = node_stages(plan, node, snap)
        mine = {u for st in stages for u in _str_list(st["gpus"], "gpus")
                if (g := snap.gpu_by_uuid.get(u)) is not None and g.node_id == node}
        nodes = plan_nodes(plan, snap)
        load = self.weights(rec) or {}
        if load.get("model_version"):
            body["model_version"] = load["model_version"]
        if load.get("slo"):
            body["slo"] = load["slo"]
        body.update({
            "plan": plan.to_dict(),
            "model": rec.model,
            # the shape reserve_bytes was sized with: an agent that does not know the model runs it from this
            "model_spec": model.to_dict(),
            "weights_sha256": load.get("weights_sha256"),
            "role": "leader" if nodes and nodes[0] == node else "member",
            "stages": stages,
            "reserve_bytes": {u: memory[u] for u in sorted(mine)},
            "peers": {n: self.agents.data_addr(n) for n in nodes if n != node},
        })
        return body

    def _move_intent(self, rec: TransitionRecord, step: Step, attempt: int, frozen: Mapping[str, object],
                     sources: Sequence[Route], targets: Sequence[tuple[Plan, float]], model: ModelSpec,
                     snap: Snapshot, routing_version: int, drain_budget_s: float | None = None) -> Intent:
        per_plan = frozen.get("sequences", {})
        if not isinstance(per_plan, Mapping):
            per_plan = {}
        steps = frozen.get("decode_step_s", {})
        if not isinstance(steps, Mapping):
            steps = {}
        cmds: list[CommandIntent] = []
        est_total = 0.0
        counts = {"migrate": 0, "replay": 0, "finish": 0}
        for r in sources:
            raw = per_plan.get(r.plan_id, [])
            seqs = [SeqInfo.from_dict(s) for s in raw if isinstance(s, Mapping)] if isinstance(raw, list) else []
            if not seqs or not r.nodes:
                continue
            measured = _num_or(steps.get(r.plan_id), 0.0)
            directives = plan_moves(seqs, r.plan, [(p, w) for p, w in targets if p.plan_id != r.plan_id], model,
                                    snap, drain_budget_s=self.config.drain_budget_s if drain_budget_s is None
                                    else drain_budget_s,
                                    bw_share=self.config.migrate_bw_share, source_step_s=measured or None,
                                    eff=self.eff, kv_compatible=rec.kind is not Kind.ROLLOUT)
            bw_cap = {d.target_node: self._bw_cap(r.nodes[0], d.target_node, snap) for d in directives}
            moves = [d.to_payload(self.agents.data_addr(d.target_node) if d.target_node else "",
                                  bw_cap.get(d.target_node, 0.0)) for d in directives]
            for d in directives:
                counts[d.action] += 1
                if d.action in ("migrate", "replay") and math.isfinite(d.est_stall_s):
                    est_total += d.est_stall_s  # an unknown cost leaves the step the base move timeout
            key = f"{rec.deployment_id}/{rec.seq}/{step.value}/{attempt}/{r.nodes[0]}/{r.plan_id}"
            cmds.append(CommandIntent(key, r.nodes[0], CommandKind.MOVE_SEQUENCES,
                                      {"plan_id": r.plan_id, "deployment": rec.deployment_id,
                                       "routing_version": routing_version,
                                       "boundary": "decode_end", "moves": moves},
                                      rec.deployment_id, rec.seq, step, attempt))
        note = (f"{counts['migrate']} to migrate, {counts['replay']} to replay, {counts['finish']} to finish"
                if cmds else "no sequence to move")
        return Intent(commands=tuple(cmds), timeout_s=self.config.move_timeout_s + 2 * est_total, noop=not cmds,
                      note=note)

    def _fallback(self, rec: TransitionRecord, routing: RoutingState) -> JsonDict | None:
        """Where a releasing plan replays what it cannot finish: the target gear's heaviest routed plan."""
        best: Route | None = None
        for r in routing.routes:
            if r.frozen or r.weight <= 0 or not r.nodes or r.plan not in rec.to_gear.plans:
                continue
            if best is None or r.weight > best.weight:
                best = r
        if best is None:
            return None
        return {"target_plan": best.plan_id, "target_node": best.nodes[0],
                "target_addr": self.agents.data_addr(best.nodes[0]), "routing_version": routing.version}

    def _bw_cap(self, src_node: str, dst_node: str, snap: Snapshot) -> float:
        if not dst_node or src_node == dst_node:
            return 0.0  # inside a node: NVLink/PCIe copies, no cap
        bw = snap.node_link_bytes_per_s(src_node, dst_node)
        return bw * self.config.migrate_bw_share if math.isfinite(bw) else 0.0

    def _target_routes(self, rec: TransitionRecord, routing: RoutingState, snap: Snapshot) -> list[Route]:
        out = []
        for p, w in zip(rec.to_gear.plans, rec.to_gear.weights, strict=True):
            existing = routing.route(p.plan_id)
            nodes = existing.nodes if existing is not None and existing.nodes else plan_nodes(p, snap)
            out.append(Route(p, w, False, nodes))
        return out

    def _stable_routes(self, rec: TransitionRecord, routing: RoutingState, snap: Snapshot) -> list[Route]:
        if rec.from_gear is None:
            return []
        out = []
        for p, w in zip(rec.from_gear.plans, rec.from_gear.weights, strict=True):
            existing = routing.route(p.plan_id)
            nodes = existing.nodes if existing is not None and existing.nodes else plan_nodes(p, snap)
            out.append(Route(p, w, False, nodes))
        return out

    def _leaving_routes(self, rec: TransitionRecord, routing: RoutingState, snap: Snapshot, *,
                        include_unrouted: bool = False) -> list[Route]:
        out = []
        for p in rec.leaving_plans:
            existing = routing.route(p.plan_id)
            if existing is not None:
                out.append(existing if existing.nodes else replace(existing, nodes=plan_nodes(p, snap)))
            elif include_unrouted:
                out.append(Route(p, 0.0, True, self._remembered_nodes(rec, p) or plan_nodes(p, snap)))
        return out

    def _remembered_nodes(self, rec: TransitionRecord, plan: Plan) -> tuple[str, ...]:
        """Nodes a plan was routed with earlier in this transition (its route may be gone now)."""
        for s in reversed(rec.steps):
            for r in s.intent.routes or ():
                if r.plan_id == plan.plan_id and r.nodes:
                    return r.nodes
        return ()

    def _prepared_nodes(self, rec: TransitionRecord) -> dict[str, tuple[str, ...]]:
        out: dict[str, list[str]] = {}
        for s in rec.attempts(Step.PREPARE):
            for c in s.intent.commands:
                pid = str(c.payload.get("plan_id", ""))
                if c.node_id not in out.setdefault(pid, []):
                    out[pid].append(c.node_id)
        return {k: tuple(v) for k, v in out.items()}

    # -- acting -----------------------------------------------------------------------------
    def _ensure(self, rec: TransitionRecord, cur: StepRecord) -> list[str] | RoutingState | None:
        """Make the step's effects happen (again: every one is idempotent). Returns what a local
        effect answered (reserve: conflicts; routing: the table after the commit)."""
        effect = STEP_DEFS[cur.step].effect
        guard = rec.guard()
        intent = cur.intent
        if intent.noop:
            return None
        if intent.pre:
            self.agents.send(intent.pre, guard)
            answers = self.agents.results([c.key for c in intent.pre])
            if not all((a := answers.get(c.key)) is not None and a.status == "ok" for c in intent.pre):
                return None  # the step's own effect waits for the re-prepare
        if effect == "reserve":
            return self.store.reserve(guard, intent.needs)
        if effect == "unreserve":
            self.store.unreserve(guard, intent.plan_ids)
            return None
        if effect == "routing":
            assert intent.routes is not None  # noqa: S101 - routing steps always carry routes
            now = self.routing.current(rec.deployment_id)
            if now.same_routes(intent.routes) or now.version != intent.base_version:
                return now  # done already, or raced (judged below)
            committed = self.routing.commit(rec.deployment_id, intent.base_version, intent.routes, guard)
            return committed if committed is not None else self.routing.current(rec.deployment_id)
        if intent.commands:
            self.agents.send(intent.commands[:1], guard)
            if len(intent.commands) > 1:
                self.probe(f"{cur.step.value}.partial")
                self.agents.send(intent.commands[1:], guard)
        return None

    # -- judging ----------------------------------------------------------------------------
    def _judge(self, rec: TransitionRecord, cur: StepRecord, now: float,
               local: list[str] | RoutingState | None) -> _Wait | _Ok | _Fail:
        step, intent = cur.step, cur.intent
        effect = STEP_DEFS[step].effect
        if intent.noop:
            return _Ok({}, intent.note)
        # preemption: GPUs of a new plan lost while it is brought in (rolled back in PREPARE,
        # retried in SWITCH)
        if rec.phase in (Phase.PREPARE, Phase.SWITCH) and step is not Step.RESERVE:
            lost = sorted({u for p in rec.new_plans for u in lost_gpus(p, self.agents.snapshot())})
            if lost:
                return _Fail("preempted", f"preempted: GPU(s) {', '.join(lost[:4])} of the new plan(s) lost")
        if intent.pre:
            before = self._judge_commands(rec, cur, intent.pre, now)
            if not isinstance(before, _Ok):
                return before
        if effect == "reserve":
            if isinstance(local, list) and local:
                return _Fail("conflict", "reservation refused: " + "; ".join(local[:3]))
            return _Ok({"booked": {p: len(g) for p, g in intent.needs.items()}})
        if effect == "unreserve":
            return _Ok({"unbooked": list(intent.plan_ids)})
        if effect == "routing":
            assert intent.routes is not None  # noqa: S101
            state = local if isinstance(local, RoutingState) else self.routing.current(rec.deployment_id)
            if not state.same_routes(intent.routes):
                return _Fail("routing_raced", f"routing moved to version {state.version} under the step "
                                              f"(it built on {intent.base_version})")
            if step is Step.CANARY and now < cur.started_s + self.config.canary_dwell_s:
                return _Wait(cur.started_s + self.config.canary_dwell_s)
            return _Ok({"routing_version": state.version})
        return self._judge_commands(rec, cur, intent.commands, now)

    def _judge_commands(self, rec: TransitionRecord, cur: StepRecord, commands: Sequence[CommandIntent],
                        now: float) -> _Wait | _Ok | _Fail:
        results = self.agents.results([c.key for c in commands])
        snap = self.agents.snapshot()
        merged: dict[str, object] = {}
        pending: list[str] = []
        for c in commands:
            res = results.get(c.key)
            if res is not None and res.status == "failed":
                reason = str(res.result.get("reason", "failed")) if isinstance(res.result, Mapping) else "failed"
                return _Fail(reason, f"{c.kind.value} on {c.node_id}: {res.detail or reason}")
            if res is not None and res.status == "ok":
                _merge(merged, c, res.result)
                continue
            if c.node_id not in snap.node_by_id:
                if rec.phase in (Phase.CLEANUP, Phase.ROLLBACK):
                    _merge(merged, c, {"node_lost": True})
                    continue  # the node left: its GPUs, and whatever ran there, are gone
                return _Fail("node_lost", f"{c.kind.value}: node {c.node_id} is gone")
            pending.append(c.key)
        if not pending:
            return _Ok(merged)
        if now > cur.deadline_s:
            return _Fail("timeout", f"timed out after {cur.intent.timeout_s:.0f} s waiting for {len(pending)} "
                                    f"ack(s) ({pending[0]})")
        return _Wait(cur.deadline_s, tuple(pending))


def _merge(merged: dict[str, object], cmd: CommandIntent, result: Mapping[str, object]) -> None:
    """Fold one ack into the step result: freeze -> sequences per plan; move -> moved list."""
    pid = str(cmd.payload.get("plan_id", ""))
    if cmd.kind is CommandKind.FREEZE_PLAN:
        seqs = result.get("sequences", [])
        bucket = merged.setdefault("sequences", {})
        if isinstance(bucket, dict):
            bucket[pid] = list(seqs) if isinstance(seqs, list) else []
        step_s = result.get("decode_step_s")
        steps = merged.setdefault("decode_step_s", {})
        if isinstance(steps, dict) and isinstance(step_s, int | float) and not isinstance(step_s, bool):
            steps[pid] = float(step_s)
    elif cmd.kind is CommandKind.MOVE_SEQUENCES:
        moved = result.get("moved", [])
        bucket2 = merged.setdefault("moved", [])
        if isinstance(bucket2, list) and isinstance(moved, list):
            bucket2.extend(moved)
    else:
        bucket3 = merged.setdefault("acks", {})
        if isinstance(bucket3, dict):
            bucket3[f"{cmd.node_id}/{pid}"] = dict(result)


def _present(nodes: Sequence[str], snap: Snapshot) -> tuple[str, ...]:
    """Nodes still in the snapshot (a node that left has nothing left to undo)."""
    return tuple(n for n in nodes if n in snap.node_by_id)


def _shape(gear: Gear | None) -> str:
    return gear.shape() if gear is not None else "nothing"


# --- small readers (records come back from JSON) ---------------------------------------------------
def _obj(d: object, path: str) -> Mapping[str, object]:
    if not isinstance(d, Mapping):
        raise ValueError(f"{path}: must be an object, got {type(d).__name__}")
    return d


def _int(v: object, path: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{path}: must be an integer, got {v!r}")
    return v


def _float(v: object, path: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ValueError(f"{path}: must be a number, got {v!r}")
    return float(v)


def _num_or(v: object, default: float) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return default
    return float(v)


def _str_list(v: object, path: str) -> list[str]:
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ValueError(f"{path}: must be a list of strings")
    return [str(x) for x in v]


__all__ = [
    "ACTIVE_PHASES", "Advance", "AgentPort", "CRASH_WHERE", "Clock", "CommandIntent", "CommandKind",
    "CommandResult", "DEFAULT_TRANSITION_CONFIG", "Executor", "Guard", "Intent", "Kind", "MoveDirective",
    "MoveStats", "PHASE_EDGES", "Phase", "Probe", "ROLLBACK_TABLE", "Route", "RoutingState", "RoutingTable",
    "STEP_DEFS", "SeqInfo", "StaleGuard", "Stage", "Step", "StepDef", "StepRecord", "StepState", "TABLE",
    "TERMINAL_PHASES", "TransitionConfig", "TransitionEvent", "TransitionRecord", "TransitionStore",
    "crash_points", "lost_gpus", "node_stages", "plan_memory", "plan_moves", "plan_nodes",
]
