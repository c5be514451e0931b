"""Back-off in the simulator's FlexPipe policy: an agent that refuses every PREPARE is not
hammered (scheduler.backoff, driven the same way by the console's tick)."""

from __future__ import annotations

from agents.sim.faults import Fault
from agents.sim.fleet import FleetSim
from agents.sim.flexpolicy import FlexPipePolicy
from agents.sim.workload import build_workload
from scheduler.gearbox import Trigger
from tests.agents.sim.worlds import one_deployment

NODES = [{"id": "a1", "gpu": "H100-SXM", "gpus": 2, "nvlink": True, "rack": "A"},
         {"id": "b1", "gpu": "H100-SXM", "gpus": 4, "nvlink": True, "rack": "A"}]


def run(minutes: float = 10.0) -> FlexPipePolicy:
    # the baseline's node is taken for good at t=30 s: the gear must move to b1, whose agent
    # refuses every prepare (say its node lacks the weights)
    scenario = one_deployment(rate_rps=1.0, duration_s=60 * minutes + 60, tp=2, nodes=NODES,
                              events=[{"at_s": 30, "kind": "preempt", "node": "a1", "gpus": 2}])
    policy = FlexPipePolicy()
    sim = FleetSim(scenario, listener=policy)
    sim.feed(build_workload(scenario).arrivals)
    policy.attach(sim)
    assert policy.driver is not None
    policy.driver.inject(Fault("b1", "prepare_plan", "fail", times=10**6, reason="failed"))
    sim.advance_to(30 + 60 * minutes)
    return policy


def test_an_agent_refusing_every_prepare_gets_at_most_six_transitions_in_ten_minutes() -> None:
    policy = run()
    assert policy.driver is not None
    tried = [s for s in policy.driver.sim.recorder.switches if s.started_s >= 30]
    assert 2 <= len(tried) <= 6, [round(s.started_s) for s in tried]
    assert all(s.outcome == "rolled_back" for s in tried)
    # the waits double: 30 s, 60 s, 120 s, ... between the attempts
    gaps = [b.started_s - a.started_s for a, b in zip(tried, tried[1:], strict=False)]
    assert all(g2 > g1 for g1, g2 in zip(gaps, gaps[1:], strict=False)), gaps
    book = policy.backoff["d"]
    assert book.streak == len(tried) and book.entries
    # the decisions in between say so
    assert policy.driver.world.store.history("d")[-1].phase.value == "rolled_back"


def test_a_topology_change_that_touches_a_backed_off_plan_resets_it() -> None:
    policy = run(minutes=2)
    assert policy.driver is not None
    sim = policy.driver.sim
    book = policy.backoff["d"]
    assert book.entries and book.holding(sim.now_s) is not None
    gpu = next(iter(book.entries.values())).gpus[0]
    sim.break_gpus([gpu])  # (a crash: the GPU stays ours) - nothing about it changed in the snapshot
    assert policy.backoff["d"].entries == book.entries
    node = sim.cluster.nodes["b1"]
    node.gpus[0].owner = "tenant"  # another tenant takes a GPU of the refused plan
    sim._snapshot = None
    policy._step(sim, sim.now_s, Trigger.TOPOLOGY)  # the loop folds the book before it decides
    after = policy.backoff["d"]
    assert len(after.entries) < len(book.entries)
