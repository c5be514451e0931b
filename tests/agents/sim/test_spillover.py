"""The spillover timeout in the simulator's gateway (scheduler/router/spillover.py has the rule):
flexpipe+budget over bench.route's six-plan pool, one shared 12K-token prefix drawing every request
to the plan that caches it until its KV saturates and requests spill."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from agents.sim.fleet import FleetSim, SimOptions
from agents.sim.workload import Arrival
from bench import route as bench
from scheduler.invariants import EventLog, check
from scheduler.router import RouterConfig, make_router
from scheduler.router.spillover import SpillConfig

N = 300


def run(timeout_s: float) -> FleetSim:
    router = make_router("flexpipe+budget", RouterConfig(spill=SpillConfig(spill_timeout_s=timeout_s)), seed=0)
    sim = FleetSim(bench.pool_scenario(60, 0), router=router, options=SimOptions(prefix_block_tokens=512))
    sim.events = EventLog(record_decodes=False)
    for plan in bench.pool_plans(sim):
        sim.launch(bench.DEPLOYMENT, plan, source="warm", accepting=True)
    sim.feed([Arrival(0.05 * i, bench.DEPLOYMENT, 512 * 24 + 100, 300, blocks=(*range(24), 10_000 + i))
              for i in range(N)])
    sim.run_to_completion()
    return sim


def moved(sim: FleetSim) -> Counter[str]:
    """Per request, how many times a plan took it after the first."""
    assert sim.events is not None
    took = Counter(e.seq_id for e in sim.events.events if e.kind == "seq_assigned")
    return Counter({sid: n - 1 for sid, n in took.items() if n > 1})


def test_with_the_timeout_off_requests_spill_and_none_is_re_routed() -> None:
    sim = run(math.inf)
    assert sim.spill_watch is not None
    assert sim.spill_watch.spills > 0 and sim.spill_watch.timeouts == 0
    assert not moved(sim)  # a fixed pool: nothing moves a request once routed


@pytest.mark.parametrize("timeout_s", [2.0, 0.1, 0.0])
def test_spilled_requests_not_admitted_in_time_are_re_routed_once_and_none_is_lost(timeout_s: float) -> None:
    sim = run(timeout_s)
    watch = sim.spill_watch
    assert watch is not None and 0 < watch.timeouts <= watch.spills
    re_routed = moved(sim)
    assert re_routed and max(re_routed.values()) == 1  # exactly once each, never bounced again
    assert sum(re_routed.values()) <= watch.timeouts  # (one with nowhere better keeps its place)
    assert len(sim.recorder.f_ttft) == N and not sim.recorder.failed  # every request finished
    assert watch.waiting == 0
    assert sim.events is not None and not check(sim.events.events)  # invariants 1-2: owned, never lost


def test_the_rule_does_not_touch_a_policy_without_bands() -> None:
    sim = FleetSim(bench.pool_scenario(60, 0), router=make_router("flexpipe", seed=0))
    assert sim.spill_watch is None
