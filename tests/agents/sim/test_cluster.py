from __future__ import annotations

import copy
import random

from agents.sim.cluster import FAILED, TENANT, SimCluster
from agents.sim.scenario import parse_scenario
from tests.agents.sim.test_scenario import BASE


def make(events: list[dict]) -> SimCluster:  # type: ignore[type-arg]
    doc = copy.deepcopy(BASE)
    doc["events"] = events
    s = parse_scenario(doc)
    return SimCluster(s, random.Random(s.seed))


def owners(c: SimCluster, node: str) -> list[str]:
    return [g.owner for g in c.nodes[node].gpus]


def test_gpus_not_free_at_the_start_belong_to_another_tenant() -> None:
    c = make([])
    assert owners(c, "b1").count(TENANT) == 2 and owners(c, "a1").count(TENANT) == 0


def test_a_timed_preemption_takes_gpus_and_gives_them_back() -> None:
    c = make([{"at_s": 10, "kind": "preempt", "node": "a1", "gpus": 3, "duration_s": 50}])
    (change,) = c.advance_to(20)
    assert len(change.gpus) == 3 and owners(c, "a1").count(TENANT) == 3
    (back,) = c.advance_to(60)
    assert back.kind == "return" and back.gpus == change.gpus and TENANT not in owners(c, "a1")


def test_a_failure_lasts_until_a_restore_and_shows_an_xid() -> None:
    c = make([{"at_s": 10, "kind": "fail", "node": "a1", "gpus": 1},
              {"at_s": 90, "kind": "restore", "node": "a1"}])
    c.advance_to(50)
    failed = [g for g in c.nodes["a1"].gpus if g.owner == FAILED]
    assert len(failed) == 1 and failed[0].xid_errors == 1
    c.advance_to(100)
    assert FAILED not in owners(c, "a1")


def test_join_leave_and_link_degradation() -> None:
    c = make([{"at_s": 10, "kind": "join", "node": {"id": "c1", "gpu": "L40S", "gpus": 2, "nvlink": False}},
              {"at_s": 20, "kind": "degrade_link", "a": "a1", "b": "c1", "gbps": 5, "duration_s": 10},
              {"at_s": 40, "kind": "leave", "node": "c1"}])
    c.advance_to(25)
    assert "c1" in c.nodes and c.link_gbps("a1", "c1") == 5
    c.advance_to(35)
    assert c.link_gbps("a1", "c1") == 100  # different racks: inter-rack bandwidth again
    c.advance_to(45)
    assert "c1" not in c.nodes


def test_the_same_seed_takes_the_same_gpus_and_another_seed_may_not() -> None:
    ev = [{"at_s": 1, "kind": "preempt", "node": "a1", "gpus": 4}]
    runs = {tuple(make(ev).advance_to(5)[0].gpus) for _ in range(3)}
    assert len(runs) == 1
    doc = copy.deepcopy(BASE)
    doc["events"] = ev
    picks = set()
    for seed in range(20):
        doc["seed"] = seed
        s = parse_scenario(doc)
        picks.add(tuple(SimCluster(s, random.Random(seed)).advance_to(5)[0].gpus))
    assert len(picks) > 1  # not always the first GPUs
