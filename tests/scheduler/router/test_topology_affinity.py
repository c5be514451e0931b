"""topology_affinity: long prompts to dense, NVLinked plans; short and low-priority to cheap."""

from __future__ import annotations

import pytest

from scheduler.router.topology_affinity import LONG_TOKENS, SHORT_TOKENS, longness, score, static_scores
from tests.scheduler.router.builders import gpu_of, idle, mixed_pool, req, router


def test_a_30k_token_prompt_goes_to_the_h100_plan() -> None:
    pool = idle(mixed_pool())
    s = score(req(30_000), pool)
    assert gpu_of(pool, int(s.argmax())) == "H100-SXM"
    d = router().route(req(30_000, 200), pool, 0.0)  # the whole router, idle pool
    assert d.chosen is not None and gpu_of(pool, d.chosen) == "H100-SXM"


def test_short_prompts_and_low_priority_long_ones_prefer_the_cheaper_cards() -> None:
    pool = idle(mixed_pool())
    for r in (req(500), req(30_000, priority=5)):
        assert gpu_of(pool, int(score(r, pool).argmax())) == "L40S"


def test_density_weighs_compute_and_link_apart_and_price_by_the_plans_gpus() -> None:
    pool = mixed_pool()
    dense, cheap = static_scores(pool.facts)
    by = {gpu_of(pool, i): (round(float(dense[i]), 1), round(float(cheap[i]), 1)) for i in range(pool.n)}
    # H100: best compute and NVLink; A100: 312/989 of it, NVLink 300/450 GB/s; L40S: 362/989, PCIe 32/450
    assert by["H100-SXM"][0] == 100.0
    assert by["A100-80G"][0] == pytest.approx(50 * 312 / 989 + 50 * 300 / 450, abs=0.1)
    assert by["L40S"][0] == pytest.approx(50 * 362 / 989 + 50 * 32 / 450, abs=0.1)
    assert by["L40S"][1] == 100.0 and by["H100-SXM"][1] == pytest.approx(100 * 30.13 / 98.32, abs=0.1)


def test_longness_is_log_linear_between_the_seeds_buckets() -> None:
    assert longness(SHORT_TOKENS) == 0.0 and longness(LONG_TOKENS) == 1.0
    assert longness(8192) == pytest.approx(0.5)
