"""The decision-latency bench times what it says on the clusters it says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import decide as bench
from scheduler.modelspec import model_spec
from scheduler.plan import validate_plan
from scheduler.topology import partition


def test_a_cluster_is_seeded_fragmented_and_about_one_block_per_node() -> None:
    a, b = bench.make_cluster(16, seed=7), bench.make_cluster(16, seed=7)
    assert a == b  # the same seed, the same cluster: runs compare
    assert bench.make_cluster(16, seed=8) != a
    assert len(a.gpus) == 16 * 8 and len(a.nodes) == 16
    blocks = partition(a).blocks
    assert len({b.node_id for b in blocks}) == len(blocks)  # TP units never span nodes
    assert 0.6 * 16 <= len(blocks) <= 16
    held = sum(1 for g in a.gpus if not g.schedulable)
    assert 0 < held < len(a.gpus)  # other tenants hold some GPUs, not all
    assert sum(b.size for b in blocks) < len(a.gpus)


def test_the_current_gear_is_a_valid_plan_on_the_cluster() -> None:
    snap = bench.make_cluster(8, seed=1008)
    model = model_spec("Llama-3-70B")
    gear = bench.current_gear(snap, model)
    assert [validate_plan(p, snap, model) for p in gear.plans] == [[]]


def test_it_times_each_size_and_writes_the_rows_and_targets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "decide.json"
    assert bench.main(["--sizes", "8,64", "--repeat", "3", "--naive-repeat", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [r["nodes"] for r in rows] == [8, 64]
    for row in rows:
        assert row["gpus"] == 8 * row["nodes"]
        assert row["candidates"] > 0 and row["naive_candidates"] > 0
        assert 0 < row["cold_cpu_p50_ms"] <= row["cold_cpu_p99_ms"]
        assert row["naive_over_cold"] == pytest.approx(row["naive_cpu_p50_ms"] / row["cold_cpu_p50_ms"])
    # per-GPU enumeration has more candidates than per-block shapes, and more with more GPUs
    assert rows[1]["naive_candidates"] > rows[0]["naive_candidates"]
    assert list(result["targets"]) == ["64 blocks p99 <= 5 ms"]
    target = result["targets"]["64 blocks p99 <= 5 ms"]
    assert target["met_cpu"] == (target["cpu_cold_p99_ms"] <= 5.0)
    assert "target 64 blocks" in capsys.readouterr().out


@pytest.mark.parametrize("sizes", ["8,x", "0", "-4", ""])
def test_bad_sizes_are_an_error_naming_the_flag(sizes: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--sizes", sizes, "--repeat", "1"])
    assert exit_.value.code == 2
    assert "--sizes" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--repeat", "--naive-repeat"])
@pytest.mark.parametrize("value", ["0", "two"])
def test_bad_run_counts_are_an_error_naming_the_flag(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--sizes", "8", flag, value])
    assert exit_.value.code == 2
    assert flag in capsys.readouterr().err
