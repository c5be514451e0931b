"""In-memory implementations of the transition ports, for tests and simulators.

`MemoryWorld` bundles a store, a routing table and an agent mailbox that share one state and
one `EventLog`, so a test can "crash" an executor (drop it mid-step) and start a new one over
the same world, exactly as a new Celery worker starts over the same database. Every effect
checks its `Guard` against the store, the way the Django ports check it inside their database
transaction, and every write is logged for `scheduler.invariants.check`.

Agents are whoever drains the mailbox: `take(node_id)` hands out the commands queued for a
node (each once), `ack(key, status, ...)` records the answer. `agents.sim.world.SimWorld` (the
simulator, agents.sim.fleet.FleetSim, playing every agent) is a full simulated fleet that does
so; a test may also answer by hand.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from scheduler.invariants import EventLog, LogEvent
from scheduler.plan import Gear
from scheduler.pool.sharing import MAX_MODELS_PER_GPU, sharing_conflicts
from scheduler.topology import Snapshot
from scheduler.transition import (
    CommandIntent,
    CommandResult,
    CommandStatus,
    Guard,
    Route,
    RoutingState,
    StaleGuard,
    TransitionEvent,
    TransitionRecord,
)


class ManualClock:
    """A clock that moves only when told to."""

    def __init__(self, now_s: float = 0.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, dt_s: float) -> float:
        if dt_s < 0:
            raise ValueError(f"dt_s: must be >= 0, got {dt_s}")
        self.now_s += dt_s
        return self.now_s

    def set(self, t_s: float) -> float:
        self.now_s = max(self.now_s, t_s)
        return self.now_s


class InMemoryStore:
    """TransitionStore over dicts (see transition.TransitionStore for the contract)."""

    def __init__(self, log: EventLog | None = None, clock: Callable[[], float] | None = None, *,
                 max_models_per_gpu: int = MAX_MODELS_PER_GPU) -> None:
        self.log = log if log is not None else EventLog()
        self.clock = clock or (lambda: 0.0)
        self.max_models_per_gpu = max_models_per_gpu  # deployments that may book one GPU (scheduler.pool.sharing)
        self.records: dict[tuple[str, int], TransitionRecord] = {}
        self.gears: dict[str, Gear | None] = {}
        self.seqs: dict[str, int] = {}
        # gpu uuid -> (deployment, plan_id) -> bytes
        self.bookings: dict[str, dict[tuple[str, str], int]] = {}

    # -- reads ---------------------------------------------------------------------------------
    def active(self, deployment_id: str) -> TransitionRecord | None:
        for (dep, _), rec in self.records.items():
            if dep == deployment_id and rec.active:
                return rec
        return None

    def load(self, deployment_id: str, seq: int) -> TransitionRecord | None:
        return self.records.get((deployment_id, seq))

    def last_seq(self, deployment_id: str) -> int:
        return self.seqs.get(deployment_id, 0)

    def current_gear(self, deployment_id: str) -> Gear | None:
        return self.gears.get(deployment_id)

    def history(self, deployment_id: str) -> list[TransitionRecord]:
        return sorted((r for (d, _), r in self.records.items() if d == deployment_id), key=lambda r: r.seq)

    # -- writes --------------------------------------------------------------------------------
    @staticmethod
    def _storable(record: TransitionRecord) -> None:
        """Refuse what the Django store's database would refuse: a record that is not strict
        JSON (NaN, Infinity). Tests and the simulator then fail where production would wedge."""
        json.dumps(record.to_dict(), allow_nan=False)

    def create(self, record: TransitionRecord, events: Sequence[TransitionEvent]) -> bool:
        self._storable(record)
        dep = record.deployment_id
        if self.active(dep) is not None or record.seq <= self.last_seq(dep):
            return False
        self.records[(dep, record.seq)] = record
        self.seqs[dep] = record.seq
        for ev in events:
            self.log.transition(ev)
        return True

    def save(self, record: TransitionRecord, *, expected_version: int,
             events: Sequence[TransitionEvent]) -> TransitionRecord | None:
        key = (record.deployment_id, record.seq)
        stored = self.records.get(key)
        if stored is None or stored.version != expected_version:
            return None
        self._storable(record)
        # the store owns abort requests: a save never erases one made meanwhile
        saved = replace(record, version=expected_version + 1, abort_reason=record.abort_reason or stored.abort_reason)
        self.records[key] = saved
        if saved.phase.value == "done":
            self.gears[record.deployment_id] = record.to_gear
        for ev in events:
            self.log.transition(ev)
        return saved

    def request_abort(self, deployment_id: str, seq: int, reason: str) -> bool:
        rec = self.records.get((deployment_id, seq))
        if rec is None or not rec.active:
            return False
        if not rec.abort_reason:
            self.records[(deployment_id, seq)] = replace(rec, abort_reason=reason, version=rec.version + 1)
        return True

    def check_guard(self, guard: Guard) -> TransitionRecord:
        rec = self.records.get((guard.deployment_id, guard.seq))
        if rec is None or rec.version != guard.version:
            raise StaleGuard(f"{guard.deployment_id}/{guard.seq}: record is at version "
                             f"{rec.version if rec else None}, not {guard.version}")
        return rec

    def effect(self, guard: Guard, kind: str, **fields: object) -> None:
        """Log an effect under the step that is running at the guard's version."""
        rec = self.check_guard(guard)
        cur = rec.current
        self.log.add(LogEvent(self.clock(), kind, deployment=guard.deployment_id, seq=guard.seq,  # type: ignore[arg-type]
                              step=cur.step.value if cur else "", attempt=cur.attempt if cur else 0,
                              **fields))  # type: ignore[arg-type]

    def reserve(self, guard: Guard, needs: Mapping[str, Mapping[str, int]]) -> list[str]:
        self.check_guard(guard)
        dep = guard.deployment_id
        uuids = sorted({u for per_gpu in needs.values() for u in per_gpu})
        holders = {u: {d for (d, _) in self.bookings.get(u, {})} for u in uuids}
        conflicts = sharing_conflicts(dep, holders, self.max_models_per_gpu)
        if conflicts:
            return conflicts
        for plan_id, gpus in needs.items():
            for u, b in gpus.items():
                self.bookings.setdefault(u, {})[(dep, plan_id)] = b
            self.effect(guard, "reserved", plan_id=plan_id, detail=",".join(sorted(gpus)))
        return []

    def unreserve(self, guard: Guard, plan_ids: Sequence[str]) -> None:
        self.check_guard(guard)
        for plan_id in plan_ids:
            for u in list(self.bookings):
                self.bookings[u].pop((guard.deployment_id, plan_id), None)
                if not self.bookings[u]:
                    del self.bookings[u]
            self.effect(guard, "unreserved", plan_id=plan_id)

    def booked(self, deployment_id: str | None = None) -> dict[str, set[str]]:
        """plan_id -> GPUs booked (for one deployment, or all)."""
        out: dict[str, set[str]] = {}
        for u, holders in self.bookings.items():
            for d, p in holders:
                if deployment_id is None or d == deployment_id:
                    out.setdefault(p, set()).add(u)
        return out


class InMemoryRouting:
    """RoutingTable over a dict; commits check the routing version and the transition guard."""

    def __init__(self, store: InMemoryStore) -> None:
        self.store = store
        self.tables: dict[str, RoutingState] = {}

    def current(self, deployment_id: str) -> RoutingState:
        return self.tables.get(deployment_id, RoutingState(deployment_id, 0, ()))

    def commit(self, deployment_id: str, expected_version: int, routes: Sequence[Route],
               guard: Guard) -> RoutingState | None:
        self.store.check_guard(guard)
        cur = self.current(deployment_id)
        if cur.version != expected_version:
            return None
        new = RoutingState(deployment_id, expected_version + 1, tuple(routes))
        self.tables[deployment_id] = new
        self.store.effect(guard, "routing_committed", version=new.version,
                          plans=tuple((r.plan_id, r.weight, r.frozen) for r in routes))
        return new

    def seed(self, deployment_id: str, routes: Sequence[Route]) -> RoutingState:
        """Set a table without a transition (a deployment that was already running)."""
        cur = self.current(deployment_id)
        new = RoutingState(deployment_id, cur.version + 1, tuple(routes))
        self.tables[deployment_id] = new
        self.store.log.add(LogEvent(self.store.clock(), "routing_committed", deployment=deployment_id,
                                    version=new.version, plans=tuple((r.plan_id, r.weight, r.frozen) for r in routes)))
        return new


@dataclass
class _Queued:
    command: CommandIntent
    taken: bool = False
    result: CommandResult | None = None


@dataclass
class InMemoryAgents:
    """AgentPort as a mailbox: commands wait per node until an agent takes them."""

    store: InMemoryStore
    snapshot_fn: Callable[[], Snapshot]
    addrs: dict[str, str] = field(default_factory=dict)
    queued: dict[str, _Queued] = field(default_factory=dict)

    def send(self, commands: Sequence[CommandIntent], guard: Guard) -> None:
        self.store.check_guard(guard)
        for c in commands:
            if c.key in self.queued:
                continue
            self.queued[c.key] = _Queued(c)
            self.store.effect(guard, "command_issued", node=c.node_id, plan_id=str(c.payload.get("plan_id", "")),
                              detail=c.kind.value)

    def results(self, keys: Sequence[str]) -> Mapping[str, CommandResult]:
        out = {}
        for k in keys:
            q = self.queued.get(k)
            if q is not None:
                out[k] = q.result or CommandResult(k, "running" if q.taken else "pending")
        return out

    def snapshot(self) -> Snapshot:
        return self.snapshot_fn()

    def data_addr(self, node_id: str) -> str:
        return self.addrs.get(node_id, f"{node_id}:7070")

    def inject(self, command: CommandIntent) -> None:
        """Queue a command outside any transition (benches, tests of the agents alone)."""
        self.queued.setdefault(command.key, _Queued(command))

    # -- the agents' side --------------------------------------------------------------------------
    def take(self, node_id: str) -> list[CommandIntent]:
        out = []
        for q in self.queued.values():
            if q.command.node_id == node_id and not q.taken:
                q.taken = True
                out.append(q.command)
        return out

    def ack(self, key: str, status: CommandStatus, detail: str = "", result: Mapping[str, object] | None = None
            ) -> None:
        q = self.queued[key]
        if q.result is not None and q.result.status in ("ok", "failed"):
            return  # the first final answer stands (as in console.fleet.actions.do_ack_command)
        q.result = CommandResult(key, status, detail, dict(result or {}))

    def open_commands(self) -> list[CommandIntent]:
        return [q.command for q in self.queued.values() if q.result is None or q.result.status == "running"]


class MemoryWorld:
    """A store, a routing table and an agent mailbox sharing one log and one clock."""

    def __init__(self, clock: ManualClock, snapshot_fn: Callable[[], Snapshot], log: EventLog | None = None, *,
                 max_models_per_gpu: int = MAX_MODELS_PER_GPU) -> None:
        self.clock = clock
        self.log = log if log is not None else EventLog()
        self.store = InMemoryStore(self.log, clock, max_models_per_gpu=max_models_per_gpu)
        self.routing = InMemoryRouting(self.store)
        self.agents = InMemoryAgents(self.store, snapshot_fn)


__all__ = ["InMemoryAgents", "InMemoryRouting", "InMemoryStore", "ManualClock", "MemoryWorld"]
