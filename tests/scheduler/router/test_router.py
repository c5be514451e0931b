"""The router as a whole: deterministic for a seed, every decision explained, settings checked;
the baselines behind the same interface."""

from __future__ import annotations

import random

import pytest

from scheduler.router import ROUTING_POLICIES, PlanLoad, Pool, RouterConfig, make_router
from tests.scheduler.router.builders import copies, facts, idle, mixed_pool, mixed_snapshot, req


def stream(seed: int, n: int = 300) -> list[tuple[int, int, tuple[int, ...]]]:
    rng = random.Random(seed)
    return [(rng.randint(50, 40_000), rng.randint(1, 500), tuple(range(rng.randint(0, 3) * 100, rng.randint(0, 3) * 100
                                                                        + rng.randint(0, 20))))
            for _ in range(n)]


def replay(policy: str, seed: int) -> list[int | None]:
    snap = mixed_snapshot()
    pool = Pool(copies(facts("h100", snap), 2) + copies(facts("l40s", snap), 2), model="Qwen2-72B")
    r = make_router(policy, seed=seed)
    held = [0] * pool.n
    out: list[int | None] = []
    for k, (prompt, max_tokens, blocks) in enumerate(stream(1)):
        pool.set_loads([PlanLoad(running=h, kv_used_tokens=0) for h in held])
        d = r.route(req(prompt, max_tokens, blocks=blocks), pool, float(k))
        out.append(d.chosen)
        if d.chosen is not None:
            r.admitted(d, d.chosen)
            held[d.chosen] = (held[d.chosen] + 1) % 5
    return out


@pytest.mark.parametrize("policy", list(ROUTING_POLICIES))
def test_every_policy_is_deterministic_for_a_seed(policy: str) -> None:
    assert replay(policy, 7) == replay(policy, 7)


def test_the_seed_only_breaks_ties_between_equal_plans() -> None:
    pool = idle(Pool(copies(facts("h100"), 4), model="Qwen2-72B"))
    firsts = {make_router("flexpipe", seed=s).route(req(), pool, 0.0).chosen for s in range(40)}
    assert firsts == {0, 1, 2, 3}


def test_a_decision_explains_each_plugins_score_and_each_filter() -> None:
    pool = idle(mixed_pool())
    cap = pool.facts[2].kv_capacity_tokens  # the L40S plan
    d = make_router().route(req(cap, 10, priority=-1, deadline_s=60.0), pool, 0.0)
    e = d.explain()
    assert e["policy"] == "flexpipe" and e["chosen"] == pool.ids[0]
    assert e["request"] == {"prompt_tokens": cap, "max_tokens": 10, "priority": -1, "deadline_ms": 60000.0,
                            "prompt_blocks": 0}
    assert e["weights"] == {"predicted_latency": 2.0, "prefix_affinity": 1.0, "topology_affinity": 1.0}
    h100, a100, l40s = e["plans"]
    assert set(h100["scores"]) == {"predicted_latency", "prefix_affinity", "topology_affinity"}
    assert h100["rank"] == 1 and h100["total"] == pytest.approx(sum(
        e["weights"][k] * v for k, v in h100["scores"].items()), abs=0.05)
    assert h100["predicted_ttft_ms"] < a100["predicted_ttft_ms"]
    assert h100["predicted_stall_ms"] == 0.0  # nothing runs there for its prefill to stall
    assert l40s["filtered"].startswith("memory_bound: needs") and l40s["rank"] is None


def test_settings_are_checked_and_name_the_bad_key() -> None:
    cfg = RouterConfig.from_dict({"weights": {"prefix_affinity": 2}, "top_k": 2, "jitter": {"window_s": 60},
                                  "prices": {"L40S": 1.5}})
    assert cfg.weights.prefix_affinity == 2.0 and cfg.top_k == 2 and cfg.jitter.window_s == 60.0
    for bad, msg in ((["x"], "FLEXPIPE_ROUTER: must be a dict"),
                     ({"wieghts": {}}, "FLEXPIPE_ROUTER.wieghts: unknown key"),
                     ({"weights": {"latency": 1}}, "FLEXPIPE_ROUTER.weights.latency: unknown key"),
                     ({"weights": {"prefix_affinity": -1}}, "FLEXPIPE_ROUTER.weights.prefix_affinity: must be >= 0"),
                     ({"top_k": 0}, "FLEXPIPE_ROUTER.top_k: must be >= 1"),
                     ({"top_k": "3"}, "FLEXPIPE_ROUTER.top_k: must be an integer"),
                     ({"jitter": {"min_samples": 2.5}}, "FLEXPIPE_ROUTER.jitter.min_samples: must be an integer"),
                     ({"prices": {"L40S": "cheap"}}, "FLEXPIPE_ROUTER.prices.L40S: must be a number")):
        with pytest.raises(ValueError, match=msg.replace(".", r"\.")):
            RouterConfig.from_dict(bad)  # type: ignore[arg-type]


def test_unknown_policies_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="routing policy: unknown 'random'; known: round-robin"):
        make_router("random")


def test_round_robin_turns_and_least_loaded_takes_the_emptiest() -> None:
    pool = idle(Pool(copies(facts("h100"), 3), model="Qwen2-72B"))
    rr = make_router("round-robin")
    assert [rr.route(req(), pool, 0.0).chosen for _ in range(4)] == [0, 1, 2, 0]
    pool.set_loads([PlanLoad(running=3), PlanLoad(running=1, waiting=1), PlanLoad(running=4)])
    assert make_router("least-loaded").route(req(), pool, 0.0).chosen == 1


def test_prefix_only_follows_sglangs_rules() -> None:
    pool = idle(Pool(copies(facts("h100"), 3), model="Qwen2-72B"))
    r = make_router("prefix-only")
    d = r.route(req(4000, blocks=tuple(range(7))), pool, 0.0)
    assert d.chosen is not None and d.note == "no match above the threshold: smallest cache"
    r.admitted(d, d.chosen)
    again = r.route(req(4000, blocks=tuple(range(7))), pool, 1.0)
    assert again.chosen == d.chosen and again.note == "longest prefix match"
    # imbalanced (max - min > 64 and max > 1.5 x min): the least loaded, whatever the cache
    loads = [PlanLoad(running=0)] * 3
    loads[d.chosen] = PlanLoad(running=100)
    pool.set_loads(loads)
    busy = r.route(req(4000, blocks=tuple(range(7))), pool, 2.0)
    assert busy.chosen != d.chosen and busy.note == "imbalanced: least loaded"
