"""A whole in-memory world for transition tests: the ports, a simulated fleet, load, a clock.

`World` is the executor's surroundings without a database: the store, routing table and
agent mailbox of scheduler.transition_memory, and the one simulator (agents.sim.world.SimWorld:
agents.sim.fleet.FleetSim with agents.sim.simagents) playing every agent, engine and the gateway. Tests say what happens (crash here, lose these GPUs) and check the
event log with scheduler.invariants.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from agents.sim.world import SimWorld
from scheduler.invariants import EventLog, assert_clean
from scheduler.modelspec import model_spec
from scheduler.plan import Gear, Plan, Stage
from scheduler.topology import Snapshot
from scheduler.transition import (
    Advance,
    Executor,
    Kind,
    Route,
    TransitionConfig,
    TransitionRecord,
    plan_memory,
    plan_nodes,
)
from scheduler.transition_memory import ManualClock, MemoryWorld
from tests.scheduler.builders import NodeSpec, make_fleet

M8 = model_spec("Llama-3-8B")
DEP = "chat"
FAST = TransitionConfig(canary_dwell_s=0.5, retry_backoff_s=0.5, step_timeout_s=5.0, move_timeout_s=20.0,
                        release_timeout_s=20.0, prepare_timeout_s=20.0, drain_budget_s=2.0)


class Crash(BaseException):
    """The executor's process dies here (BaseException: nothing in the executor catches it)."""


def two_nodes() -> Snapshot:
    return make_fleet([NodeSpec("a1", "H100-SXM", gpus=8), NodeSpec("b1", "H100-SXM", gpus=8, rack="B")],
                      now_s=0.0)


def tp_gear(uuids: list[str], kv_tokens: int = 200_000) -> Gear:
    plan = Plan(M8.name, "colocated", (Stage(0, M8.num_layers, tuple(uuids)),), kv_reserve_tokens=kv_tokens)
    return Gear(M8.name, (plan,), (1.0,))


GEAR_A = tp_gear(["a1-g0", "a1-g1"])  # where it runs before the test
GEAR_B = tp_gear(["b1-g0", "b1-g1"])  # another node: KV crosses the link
GEAR_C = tp_gear(["a1-g2", "a1-g3", "a1-g4", "a1-g5"])  # same node, wider TP


@dataclass
class Load:
    rate_rps: float = 8.0
    prompt: tuple[int, int] = (100, 3000)
    output: tuple[int, int] = (20, 400)


class World:
    def __init__(self, snapshot: Snapshot | None = None, *, seed: int = 7,
                 config: TransitionConfig = FAST, dt_s: float = 0.05,
                 known: Callable[[Snapshot], Snapshot] | None = None) -> None:
        """`known`: what the controller's snapshot makes of the cluster's (default: all of it)."""
        base = snapshot or two_nodes()
        self.clock = ManualClock(base.now_s)
        self.log = EventLog()
        self.rng = random.Random(seed)
        self.config = config
        self.dt_s = dt_s
        seen = known or (lambda snap: snap)
        self.mw = MemoryWorld(self.clock, lambda: seen(self.fleet.snapshot()), self.log)
        self.fleet = SimWorld(base, self.mw.agents, self.mw.routing.current, self.log, seed=seed + 1,
                              start_s=self.clock.now_s, config=config)
        self.load: dict[str, Load] = {}
        self._arrival_debt: dict[str, float] = {}
        self.crashes = 0

    @property
    def store(self):  # type: ignore[no-untyped-def]
        return self.mw.store

    @property
    def routing(self):  # type: ignore[no-untyped-def]
        return self.mw.routing

    def executor(self, probe: Callable[[str], None] | None = None, config: TransitionConfig | None = None) -> Executor:
        return Executor(self.mw.store, self.mw.agents, self.mw.routing, self.clock, config=config or self.config,
                        probe=probe or (lambda point: None))

    def seed_gear(self, deployment: str, gear: Gear) -> None:
        """The deployment already runs `gear` (a past transition brought it up)."""
        snap = self.fleet.snapshot()
        self.mw.store.gears[deployment] = gear
        for plan in gear.plans:
            for u, b in plan_memory(plan, M8).items():
                self.mw.store.bookings.setdefault(u, {})[(deployment, plan.plan_id)] = b
            self.fleet.seed_plan(plan, deployment)
        self.mw.routing.seed(deployment, [Route(p, w, False, plan_nodes(p, snap))
                                          for p, w in zip(gear.plans, gear.weights, strict=True)])

    def step(self, dt_s: float | None = None) -> None:
        dt = self.dt_s if dt_s is None else dt_s
        t = self.clock.advance(dt)
        for dep, load in self.load.items():
            self._arrival_debt[dep] = self._arrival_debt.get(dep, 0.0) + load.rate_rps * dt
            while self._arrival_debt[dep] >= 1.0:
                self._arrival_debt[dep] -= 1.0
                self.fleet.submit(dep, self.rng.randint(*load.prompt), self.rng.randint(*load.output))
        self.fleet.advance_to(t)

    def run(self, seconds: float) -> None:
        end = self.clock.now_s + seconds
        while self.clock.now_s < end - 1e-9:
            self.step()

    def drive(self, deployment: str, executor: Executor | None = None, *, max_s: float = 120.0,
              restart: Callable[[], Executor] | None = None) -> TransitionRecord:
        """Advance the transition (and the world) until it ends. A Crash from the executor is a
        process dying: `restart` makes the next one (default: a fresh executor over the world)."""
        ex = executor or self.executor()
        end = self.clock.now_s + max_s
        seq = self.mw.store.active(deployment).seq  # type: ignore[union-attr]
        while self.clock.now_s < end:
            try:
                out: Advance = ex.advance(deployment, seq)
            except Crash:
                self.crashes += 1
                ex = restart() if restart is not None else self.executor()
                continue
            if out.record is not None and not out.record.active:
                return out.record
            self.step()
        rec = self.mw.store.load(deployment, seq)
        raise AssertionError(f"transition did not end within {max_s} s: {rec.phase if rec else None} "
                             f"{rec.current.step if rec and rec.current else None}")

    def drain(self, max_s: float = 120.0) -> None:
        """Stop the load and run until every admitted sequence ended."""
        self.load.clear()
        end = self.clock.now_s + max_s
        while self.fleet.open_sequences() and self.clock.now_s < end:
            self.step(0.25)

    def assert_clean(self) -> None:
        assert_clean(self.log)

    def start(self, deployment: str, gear: Gear, kind: Kind = Kind.AUTO) -> TransitionRecord:
        self.fleet.add_deployment(deployment, model_spec(gear.model))
        rec = self.executor().start(deployment, gear, kind=kind)
        assert rec is not None
        return rec
