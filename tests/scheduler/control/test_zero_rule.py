"""The control loop's scale-to-zero rule (9b) and its wake-up (rule 9 at zero), stepped by hand; no database."""

from __future__ import annotations

from dataclasses import replace

from scheduler.control import ControlLoop, DeploymentState, FleetState, LoopConfig
from scheduler.gearbox import LoadSample, LoadWindow, Mode, Outcome
from tests.scheduler.control.test_loop import NOW, fleet, state, tp8


def quiet_window(last_busy_s: float, *, start_s: float = NOW - 3000, every_s: float = 15.0,
                 until_s: float = NOW) -> LoadWindow:
    """Samples every `every_s` from `start_s` to `until_s`: arrivals up to `last_busy_s`, none after."""
    n = int((until_s - start_s) // every_s) + 1
    return LoadWindow(tuple(LoadSample(start_s + i * every_s, 2.0 if start_s + i * every_s <= last_busy_s else 0.0,
                                       512, 200) for i in range(n)))


def idle(**changes: object) -> DeploymentState:
    base = replace(state(current=tp8("a1")), load=quiet_window(NOW - 750), idle_to_zero_s=600.0, min_replicas=0)
    return replace(base, **changes)  # type: ignore[arg-type]


def one(st: DeploymentState, now: float = NOW, config: LoopConfig | None = None):  # type: ignore[no-untyped-def]
    loop = ControlLoop(config)
    loop.observe([st], FleetState(snapshot=fleet()))
    return loop.step(now).steps[0]


def test_rule_9b_a_deployment_quiet_past_its_idle_time_releases_its_gear_without_a_decision() -> None:
    s = one(idle())
    assert s.release is not None and "no arrivals for 750 s" in s.release and "(600 s) is up" in s.release
    assert s.decision is None and s.start is None


def test_rule_9b_within_its_idle_time_it_keeps_its_gear_and_wakes_the_loop_when_the_time_runs_out() -> None:
    loop = ControlLoop()
    runs_out = NOW - 510 + 600
    loop.observe([idle(load=quiet_window(NOW - 510, until_s=runs_out))], FleetState(snapshot=fleet()))
    out = loop.step(NOW)
    assert out.steps[0].release is None and out.steps[0].decision is not None
    assert out.next_wake_s is not None and out.next_wake_s <= runs_out
    assert loop.step(runs_out - 1).steps[0].release is None
    assert loop.step(runs_out).steps[0].release is not None  # stepped to the time it runs out: it goes


def test_rule_9b_operators_win_and_the_bounds_hold() -> None:
    for mode in (Mode.PINNED, Mode.EMERGENCY, Mode.ADVISORY):
        st = idle()
        assert one(replace(st, deployment=replace(st.deployment, mode=mode))).release is None, mode
    assert one(idle(min_replicas=1)).release is None
    assert one(idle(idle_to_zero_s=None)).release is None


def test_rule_9b_silence_and_a_gear_that_just_came_up_are_not_idleness() -> None:
    assert one(idle(load=quiet_window(NOW - 2000, until_s=NOW - 120))).release is None  # reports stopped
    assert one(idle(up_since_s=NOW - 30)).release is None  # woke a moment ago: its first request is on its way
    assert one(idle(load=replace(quiet_window(NOW - 2000), samples=(*quiet_window(NOW - 2000).samples[:-1],
                                                                   LoadSample(NOW, 0.0, 512, 200, backlog=1))))
               ).release is None  # one request waits: not idle


def test_rule_9_at_zero_it_stays_until_a_request_is_held_then_wakes_the_baseline() -> None:
    zero = idle(current=None, at_zero=True)
    s = one(zero, config=LoopConfig())
    assert s.decision is None and s.start is None and s.release is None and not s.wake
    s = one(replace(zero, waiting=2), config=LoopConfig())
    assert s.wake and s.start is not None and s.start.target == tp8("a2")
    assert s.decision is not None and s.decision.outcome is Outcome.SWITCH
    assert "2 request(s) held: wake up" in s.decision.reasons[0]
    # an operator who sets min_replicas 1 on a deployment at zero brings it back with nothing held
    back = one(replace(zero, min_replicas=1))
    assert back.wake and back.start is not None and "may not rest there" in back.decision.reasons[0]  # type: ignore[union-attr]


def test_a_deployment_scales_to_zero_and_its_next_request_is_held_and_served() -> None:
    """The whole cycle, stepped by hand the way a driver would: release, hold, wake, serve, stay."""
    st = idle()
    s = one(st)
    assert s.release is not None  # the driver drains and frees the gear
    st = replace(st, current=None, at_zero=True)  # ... and observes it at zero
    assert one(st, NOW + 15).start is None  # nothing waits: nothing comes up
    st = replace(st, waiting=1)  # a request arrives and is held
    s = one(st, NOW + 30)
    assert s.wake and s.start is not None
    # the gear came up (the driver's transition is done) and serves the held request
    st = replace(st, current=s.start.target, at_zero=False, waiting=0, up_since_s=NOW + 60,
                 load=quiet_window(NOW - 750, until_s=NOW + 700))
    s = one(st, NOW + 75)
    assert s.release is None and not s.wake  # the idle time counts from the wake-up, not the old quiet
    assert one(st, NOW + 60 + 600).release is not None  # idle again for its whole idle time: back to zero
