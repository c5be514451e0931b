"""Golden test: one control loop, two drivers (issue 15).

The same scripted trace of world states - load samples, transition completions (with the
agents' reports after them), a GPU another tenant takes - is fed to the console's tick
(console/gearbox/ticks.py over the database, its transitions run by simulated agents) and to
the simulator's driver (agents.sim.flexpolicy.FlexPipePolicy, the code bench.replay runs, over a
stand-in for FleetSim and its TransitionDriver that shows it the console's snapshot). Both must
decide the same sequence: trigger, outcome, target gear (its id is a hash of its plans) and,
where the TWU rule led the decision, its reason.

The documented differences stay inputs of the loop, not code paths: the simulator's baseline is
seeded (the console's first tick brings it up, before the trace), its reports are instant, and
its cooldown short-cut (skip_cooldown_stays) only drops the stays - checked at the end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

import pytest
from django.utils import timezone

from agents.sim.flexpolicy import SIM_LOOP, FlexPipePolicy
from console.gearbox import ticks
from console.gearbox.models import Decision, Deployment
from console.gearbox.snapshot import fleet_snapshot
from scheduler.control import ControlLoop, ControlOutput
from scheduler.costmodel import Slo
from scheduler.gearbox import Deployment as SchedDeployment
from scheduler.gearbox import LoadSample, LoadWindow, Trigger
from scheduler.plan import Gear
from scheduler.topology import Snapshot
from scheduler.transition import Kind, Phase, TransitionRecord, lost_gpus
from tests.console.gearbox.harness import M8, SimAgents, enroll_fleet, gear, make_deployment, uuid
from tests.console.gearbox.test_gearbox_actions import bring_up, drive

pytestmark = pytest.mark.django_db

BASELINE = gear("a1", [0, 1], kv=20_000)  # small: a new plan beside it fits (reports say 600 MiB used)

# the world states, in order: "load R" adds four samples at R requests/s and steps; "finish" lets
# the running transition end (DONE) and the agents report what it left; "lose U" is another tenant
# taking GPU U (a topology step). Each is stamped with the wall clock when it is applied
# ("lose current": the last GPU of the gear that runs then)
TRACE: tuple[str, ...] = ("load 2", "load 60", "finish", "lose current", "finish", "load 60", "lose b1-0", "finish",
                          "load 2")


# --- the simulator's side: FleetSim and TransitionDriver as far as FlexPipePolicy reads them --------
@dataclass
class _Store:
    gears: dict[str, Gear | None]
    running: dict[str, TransitionRecord] = field(default_factory=dict)
    bookings: dict[str, set[tuple[str, int]]] = field(default_factory=dict)

    def active(self, name: str) -> TransitionRecord | None:
        return self.running.get(name)


@dataclass
class _World:
    store: _Store


class _Driver:
    def __init__(self, gears: dict[str, Gear | None]) -> None:
        self.world = _World(_Store(gears))
        self.seq = 1  # the console's bring-up was transition 1

    def running(self, name: str) -> bool:
        return name in self.world.store.running

    def current_gear(self, name: str) -> Gear | None:
        return self.world.store.gears.get(name)

    def drop_lost(self, name: str) -> list[str]:
        return []  # (TransitionDriver.drop_lost: here a plan stops only while its GPUs are gone)

    def start(self, name: str, target: Gear, trigger: str, decision_ref: str | None = None) -> TransitionRecord:
        self.seq += 1
        rec = TransitionRecord(name, self.seq, Kind.AUTO, M8.name, self.current_gear(name), target, Phase.PREPARE,
                               0.0, decision_ref=decision_ref)
        self.world.store.running[name] = rec
        return rec

    def finish(self, name: str) -> TransitionRecord:
        rec = self.world.store.running.pop(name)
        self.world.store.gears[name] = rec.to_gear
        return replace(rec, phase=Phase.DONE)


@dataclass
class _Runtime:
    name: str
    model: Any = M8
    index: int = 0
    priority: int = 0
    idle_to_zero_s: float | None = None  # (never scales to zero: the console's deployment neither)
    min_replicas: int = 1

    @property
    def spec(self) -> _Runtime:  # (FleetSim's runtime keeps the priority in its spec)
        return self


class _Engine:
    state = "serving"


class _Sim:
    """What FlexPipePolicy reads of FleetSim: the world is the console's snapshot."""

    def __init__(self) -> None:
        self.deployments = {"chat": _Runtime("chat")}
        self.now: datetime = timezone.now()
        self.later: list[tuple[float, Callable[[float], None]]] = []

    def snapshot(self) -> Snapshot:
        return fleet_snapshot(self.now)

    def engine_of(self, name: str, plan_id: str) -> _Engine | None:
        gear = self.driver.current_gear(name)
        plan = next((p for p in gear.plans if p.plan_id == plan_id), None) if gear else None
        return _Engine() if plan is not None and not lost_gpus(plan, self.snapshot()) else None

    def call_at(self, t: float, fn: Callable[[float], None]) -> None:
        self.later.append((t, fn))

    def job_states(self) -> tuple[()]:
        return ()  # no fine-tune job in this trace

    def booked_by_deployment(self) -> dict[str, dict[str, int]]:
        return {}  # one deployment: nobody else's bookings to share a GPU beside

    driver: _Driver


class _Recording(ControlLoop):
    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.outputs: list[ControlOutput] = []

    def step(self, now_s: float, trigger: Trigger = Trigger.PERIODIC) -> ControlOutput:
        out = super().step(now_s, trigger)
        self.outputs.append(out)
        return out


def _sim_policy(skip_cooldown_stays: bool) -> tuple[FlexPipePolicy, _Sim, _Driver, _Recording]:
    policy = FlexPipePolicy()
    loop = _Recording(replace(SIM_LOOP, skip_cooldown_stays=skip_cooldown_stays))
    driver = _Driver({"chat": BASELINE})  # seeded, as FleetSim.start_baselines leaves it
    sim = _Sim()
    sim.driver = driver
    policy.loop, policy.driver, policy._sim = loop, driver, sim  # type: ignore[assignment]
    policy.deployments["chat"] = SchedDeployment(id="chat", model=M8.name, slo=Slo(ttft_ms=2000, tpot_ms=100),
                                                 baseline=BASELINE)
    policy.windows["chat"] = LoadWindow()
    return policy, sim, driver, loop


def _samples(rate: float, t: float) -> list[LoadSample]:
    return [LoadSample(t - 45 + 15 * i, rate, 512, 200) for i in range(4)]


def _twu_reason(reasons: Any) -> str:
    """The TWU rule's reason where it led the decision, else "" (other reasons carry times the two
    sides stamp apart, such as the end of a cooldown)."""
    return reasons[0] if reasons and str(reasons[0]).startswith("TWU asks") else ""


def _row(d: Any) -> tuple[str, str, str | None, str]:
    return (d.trigger.value, d.outcome.value, d.target_gear_id, _twu_reason(d.reasons))


def test_the_console_tick_and_the_simulator_policy_decide_the_same_on_one_trace() -> None:
    from console.gearbox.actions import do_record_load

    rep = enroll_fleet()
    make_deployment("chat", baseline=BASELINE)
    agents = SimAgents()
    bring_up(agents)  # the console's first tick brings the baseline up; the simulator seeds it
    rep.report("a1")
    rep.report("b1")
    assert Deployment.objects.get(name="chat").current_gear == BASELINE.to_dict()
    policies = {skip: _sim_policy(skip) for skip in (False, True)}
    console: list[tuple[str, str, str | None, str]] = []
    last_t = 0.0
    for what in TRACE:
        # (each state is stamped when it is applied: the agents' reports carry the wall clock,
        # and a snapshot far ahead of them would find every GPU stale)
        verb, _, arg = what.partition(" ")
        samples: list[LoadSample] = []
        if verb == "load":
            # (a window only takes samples newer than its last: the trace's states come seconds apart)
            samples = [s for s in _samples(float(arg), timezone.now().timestamp()) if s.t_s > last_t]
            last_t = samples[-1].t_s if samples else last_t
            for s in samples:
                do_record_load(Deployment.objects.get(name="chat"), s)
        elif verb == "lose":
            running = Gear.from_dict(Deployment.objects.get(name="chat").current_gear)
            assert all(p[2].current_gear("chat") == running for p in policies.values())  # the same gear runs
            node, _, i = arg.partition("-")
            gpu = running.gpu_uuids[-1] if arg == "current" else uuid(node, int(i))
            rep.gone.add(gpu)
            rep.report(gpu.split("-")[1])
        elif verb == "finish":
            ended = drive(agents)
            assert ended.phase == "done", (console, ended.error, ended.record.get("error"))
            rep.report("a1")
            rep.report("b1")
        now = timezone.now()
        t = now.timestamp()
        before = Decision.objects.count()
        if verb != "finish":
            ticks.tick(trigger="topology" if verb == "lose" else "periodic", now=now)
            newest = Decision.objects.filter(deployment__name="chat").order_by("-id").first()
            if newest is not None and (Decision.objects.count() > before or newest.last_at == now):
                console.append((newest.trigger, newest.outcome, newest.target_gear_id or None,
                                _twu_reason(newest.reasons)))
        for policy, sim, driver, _ in policies.values():
            sim.now = now
            if verb == "load":
                for s in samples:
                    policy.windows["chat"] = policy.windows["chat"].add(s, keep_s=3600.0)
                policy._step(sim, t, Trigger.PERIODIC)  # type: ignore[arg-type]
            elif verb == "lose":
                policy._topology(sim, t)  # type: ignore[arg-type]
            elif verb == "finish" and driver.running("chat"):
                policy._done(driver.finish("chat"), t)
                assert sim.later == []  # a valid gear, DONE: nothing owed (nor does the console tick)
    full = [_row(d) for out in policies[False][3].outputs for d in out.decisions]
    assert full == console, (full, console)
    assert any(r[1] == "switch" for r in console), console  # the trace moves the gear
    assert ("topology", "switch") in {r[:2] for r in console}, console  # the lost GPU moves the gear
    # the TWU rule (loop rule 11) reads the same load window on both sides: the low load of the
    # first state asks both for less capacity, and both give GPUs back on it
    assert any(r[:2] == ("load", "switch") and r[3].startswith("TWU asks for less capacity") for r in console), console
    # the cooldown short-cut drops periodic stays, and only those
    short = [_row(d) for out in policies[True][3].outputs for d in out.decisions]
    assert all(r[:2] == ("periodic", "stay") for r in missing(full, short)), (full, short)


def missing(full: list[Any], short: list[Any]) -> list[Any]:
    """`full` without the entries of `short`, in order (what the short-cut left out)."""
    left = list(short)
    out = []
    for r in full:
        if left and left[0] == r:
            left.pop(0)
        else:
            out.append(r)
    assert not left, short
    return out
