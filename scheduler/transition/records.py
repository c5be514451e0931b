"""The values a transition persists and sends: routes and routing state, the guard on every
effect, command intents and results, a step's intent and record, move statistics, the
transition record and its events, and the readers that bring them back from JSON."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from scheduler.plan import Gear, Plan
from scheduler.transition.vocabulary import (
    ACTIVE_PHASES,
    STEP_DEFS,
    CommandKind,
    JsonDict,
    Kind,
    Phase,
    Step,
    StepState,
)


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
    payload: JsonDict  # agents/protocol/ documents it per kind
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
        """Totals of one `move_sequences` ack (agents/protocol/: MOVE result)."""
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
