"""The routing bench: a trace's format read from the file, the time scale found by bisection so
least-loaded meets the SLO for 80%, every policy at that scale, the router's own time per
decision at 8 and 64 plans, the JSON fields the issue names."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from bench import route as bench

FIELDS = {"goodput_rps", "ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "tpot_p99_s", "slo_attainment", "tokens", "lost"}


def mooncake_like(path: Path, n: int = 48) -> Path:
    """Conversations of 4-12k-token prompts that grow turn by turn (shared block ids)."""
    rng = random.Random(5)
    lines, t, next_id = [], 0, 0
    for _ in range(n // 4):
        head = list(range(next_id, next_id + rng.randint(8, 16)))
        next_id += len(head)
        for _turn in range(4):
            blocks = head + list(range(next_id, next_id + 2))
            next_id += 2
            head = blocks
            lines.append(json.dumps({"timestamp": t, "input_length": 512 * len(blocks) - 100,
                                     "output_length": rng.randint(10, 200), "hash_ids": blocks}))
            t += rng.randint(50, 400)
    path.write_text("\n".join(lines) + "\n")
    return path


def azure_like(path: Path, n: int = 48) -> Path:
    rng = random.Random(6)
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i in range(n):
        ms = 200 * i + rng.randint(0, 150)
        rows.append(f"2023-11-16 18:{17 + ms // 60000:02d}:{(ms // 1000) % 60:02d}.{ms % 1000:03d}0000,"
                    f"{rng.randint(300, 6000)},{rng.randint(5, 300)}")
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.mark.parametrize(("make", "fmt"), [(mooncake_like, "mooncake"), (azure_like, "azure")])
def test_it_runs_every_policy_at_the_scale_where_least_loaded_meets_the_slo_for_80_percent(
        tmp_path: Path, make: object, fmt: str) -> None:
    trace = make(tmp_path / ("t.jsonl" if fmt == "mooncake" else "t.csv"))  # type: ignore[operator]
    result = bench.bench(str(trace), decision_samples=40)
    assert result["format"] == fmt and result["requests"] == 48
    pols = result["policies"]
    assert list(pols) == ["round-robin", "least-loaded", "prefix-only", "flexpipe"]
    for name, r in pols.items():
        assert FIELDS <= set(r), name
        assert r["lost"] == 0 and r["tokens"] > 0
    factor = result["time_scale"]
    assert any(f == pytest.approx(factor, rel=1e-5) for f, _ in result["bisection"])
    assert abs(pols["least-loaded"]["slo_attainment"] - 0.8) <= 0.11  # 48 requests: ~2% a request
    for n in ("8", "64"):
        d = result["decision_us"][n]
        assert 0 < d["p50"] <= d["p99"] and d["samples"] == 36 and d["rounds"] == 5
    t = result["targets"]
    assert "decision_p99_us_at_64" in t
    assert ("goodput_over_round_robin" in t) == (fmt == "mooncake")
    assert ("goodput_over_least_loaded" in t) == (fmt == "azure")
    if fmt == "mooncake":
        assert pols["flexpipe"]["cache_hit_share"] > 0  # prefix reuse reaches the simulated engines


def test_the_same_seed_gives_the_same_figures(tmp_path: Path) -> None:
    trace = mooncake_like(tmp_path / "t.jsonl", n=24)
    tr = bench.read_trace(trace)
    a = bench.run_policy(tr, "flexpipe", 1.0, seed=3).summary
    b = bench.run_policy(tr, "flexpipe", 1.0, seed=3).summary
    assert a == b


def test_bad_flags_are_argparse_errors_naming_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = azure_like(tmp_path / "t.csv")
    with pytest.raises(SystemExit) as policies:
        bench.main(["--trace", str(trace), "--policies", "flexpipe,random"])
    assert policies.value.code == 2 and "--policies: unknown random" in capsys.readouterr().err
    with pytest.raises(SystemExit) as missing:
        bench.main(["--trace", str(tmp_path / "nope.csv")])
    assert missing.value.code == 2 and "--trace:" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    assert bench.main(["--trace", str(bad)]) == 2
    assert "line 1.input_length" in capsys.readouterr().err


def test_it_writes_the_json_it_prints(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "DECISION_SAMPLES", 30)
    trace = azure_like(tmp_path / "t.csv", n=24)
    out = tmp_path / "r.json"
    assert bench.main(["--trace", str(trace), "--json", str(out), "--policies", "least-loaded,flexpipe"]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert set(result["policies"]) == {"least-loaded", "flexpipe"}
    assert f"time scale {result['time_scale']:.4f}" in printed and "targets (issue 15" in printed


def test_decisions_only_times_the_router_and_runs_no_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = mooncake_like(tmp_path / "t.jsonl", n=24)
    out = tmp_path / "r.json"
    assert bench.main(["--trace", str(trace), "--decisions-only", "--decision-samples", "20", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["policies"] == {} and "time_scale" not in result and "time scale" not in printed
    assert [result["decision_us"][n]["samples"] for n in ("8", "64")] == [18, 18]  # (the first tenth warms up)
    assert "decision_p99_us_at_64" in result["targets"] and "goodput_over_round_robin" not in result["targets"]
    with pytest.raises(SystemExit) as few:
        bench.main(["--trace", str(trace), "--decisions-only", "--decision-samples", "3"])
    assert few.value.code == 2 and "--decision-samples" in capsys.readouterr().err


def test_the_learned_and_bucket_variants_and_the_drift_case_report_their_fields(tmp_path: Path) -> None:
    a, b = mooncake_like(tmp_path / "a.jsonl", n=24), mooncake_like(tmp_path / "b.jsonl", n=24)
    result = bench.bench("", policies=["round-robin", "flexpipe+learned", "flexpipe+buckets"], decision_samples=20,
                         drift=f"{a},{b}")
    assert result["requests"] == 48 and result["drift_shift_s"] > 0
    pols = result["policies"]
    for name, r in pols.items():
        assert {"sla_violation_rate", "ttft_p99_short_s", "slo_attainment_before_shift",
                "slo_attainment_after_shift"} <= set(r), name
        assert r["lost"] == 0
        assert r["sla_violation_rate"] == pytest.approx(1 - r["slo_attainment"], abs=1e-4)
    learned = pols["flexpipe+learned"]
    assert {"rollbacks", "worst_window_violations_vs_rr", "weights", "stages"} <= set(learned)
    assert learned["stages"] and learned["stages"][0]["to"] == "canary"  # out of the cold start on round-robin
    assert sum(learned["weights"].values()) == pytest.approx(4.0, abs=1e-3)  # Hedge keeps the weights' total



def test_kv_tiers_run_each_policy_again_with_tiers_and_compare_them(tmp_path: Path) -> None:
    trace = mooncake_like(tmp_path / "t.jsonl")
    result = bench.bench(str(trace), policies=("flexpipe",), decision_samples=40, kv_tiers=True)
    pols = result["policies"]
    assert list(pols) == ["flexpipe", "flexpipe+tiers"]
    on = pols["flexpipe+tiers"]
    assert FIELDS <= set(on) and on["lost"] == 0 and "kv_tiers" not in pols["flexpipe"]
    assert set(on["kv_tiers"]) >= {"host_hit_share", "ssd_hit_share", "offloaded_blocks", "dropped_blocks"}
    cmp = result["kv_tiers"]["flexpipe"]
    assert cmp["ttft_p99_s"] == {"off": pols["flexpipe"]["ttft_p99_s"], "on": on["ttft_p99_s"]}
    assert cmp["slo_attainment"]["on"] == on["slo_attainment"]
    assert "host tier hit share" in bench.table(result)


def test_every_policy_reports_its_spills_and_spillover_timeouts_at_a_given_time_scale(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = mooncake_like(tmp_path / "t.jsonl", n=24)
    out = tmp_path / "r.json"
    assert bench.main(["--trace", str(trace), "--policies", "flexpipe", "--kv-budget", "--time-scale", "0.5",
                       "--spill-timeout", "inf", "--decision-samples", "20", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["spill_timeout_s"] is None  # off
    assert result["time_scale"] == 0.5 and result["bisection"] == [] and "finding the time scale" not in printed
    pols = result["policies"]
    assert pols["flexpipe"]["spills"] is None and pols["flexpipe"]["spill_timeouts"] is None  # no bands
    budget = pols["flexpipe+budget"]
    assert isinstance(budget["spills"], int) and budget["spill_timeouts"] == 0  # the timeout is off
    assert "spillover timeouts" in printed
    for flag, value in (("--time-scale", "0"), ("--spill-timeout", "-1")):
        with pytest.raises(SystemExit) as bad:
            bench.main(["--trace", str(trace), flag, value])
        assert bad.value.code == 2 and flag in capsys.readouterr().err
