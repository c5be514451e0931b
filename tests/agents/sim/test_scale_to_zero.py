"""Scale to zero in the simulator (control loop rules 9b and 9 through FlexPipePolicy): an idle
deployment releases its GPUs, its next request waits in the deployment's queue - not refused, not
lost - while the baseline comes back (a cold start), and is served. (A pinned deployment never goes:
tests/scheduler/control/test_zero_rule.py; the simulator's deployments are never pinned.)"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from agents.sim.fleet import FleetSim
from agents.sim.run import run_policy
from agents.sim.scenario import Scenario
from agents.sim.workload import Arrival, Workload
from tests.agents.sim.worlds import one_deployment

IDLE_S = 300.0
LATE_S = 1500.0  # the request that comes after the deployment went to zero


def idle_scenario() -> Scenario:
    s = one_deployment(rate_rps=0.0, duration_s=1800)
    return replace(s, models=tuple(replace(m, idle_to_zero_s=IDLE_S, min_replicas=0) for m in s.models))


def workload() -> Workload:
    busy = [Arrival(1.0 + 2.0 * i, "d", 500, 100) for i in range(50)]  # t = 1 .. 99 s
    return Workload(tuple(busy + [Arrival(LATE_S, "d", 500, 100)]), 0)


def run(scenario: Scenario, seen: dict[str, Any]) -> dict[str, Any]:
    def inspect(sim: FleetSim) -> None:
        seen["engines_left"] = len(sim.plans("d"))
    return run_policy(scenario, "flexpipe", workload=workload(), inspect=inspect)


def test_an_idle_deployment_scales_to_zero_and_its_next_request_is_held_and_served() -> None:
    seen: dict[str, Any] = {}
    r = run(idle_scenario(), seen)
    assert r["scaled_to_zero"] >= 1 and r["cold_starts"] >= 1
    first = next(d for d in r["decisions"] if d["outcome"] == "scale_to_zero")
    assert 100 + IDLE_S <= first["t_s"] < LATE_S and "no arrivals" in first["reason"]
    # every request - the late one too - was served, none lost, and the invariants held
    assert r["admitted"] == r["finished"] == 51 and r["lost"] == 0, r["failures"]
    assert r["transition_invariant_violations"] == [] and r["sequence_violations"] == []
    assert r["memory_violations"] == []
    # after the late request the deployment went idle again (drained to the end: zero again or up)
    assert seen["engines_left"] in (0, 1)


def test_a_deployment_without_an_idle_time_never_scales_to_zero() -> None:
    s = one_deployment(rate_rps=0.0, duration_s=1800)
    kept = replace(s, models=tuple(replace(m, idle_to_zero_s=None, min_replicas=1) for m in s.models))
    r = run(kept, {})
    assert "scaled_to_zero" not in r and r["finished"] == 51 and r["lost"] == 0
    assert not any(d["outcome"] == "scale_to_zero" for d in r["decisions"])
