"""python -m bench.pool: rate series in, the JSON it promises out, the dedicated sizing it states,
and a tidal two-model pool where sizing for the peak costs GPU-hours that scaling does not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agents.sim.poolscenario import PoolSpec, build_pool_scenario, pool_model
from agents.sim.rateseries import read_rate_series
from bench.pool import main


def write_series(path: Path, rates: list[float], start_s: float = 86400.0) -> Path:
    rows = ["window_start_s,rate_rps"] + [f"{start_s + 600 * i:.0f},{r}" for i, r in enumerate(rates)]
    path.write_text("\n".join(rows) + "\n")
    return path


def test_a_series_is_shifted_to_start_at_zero_and_a_bad_line_is_named(tmp_path: Path) -> None:
    good = write_series(tmp_path / "a.csv", [5.0, 7.5, 1.0], start_s=3000.0)
    assert read_rate_series(good) == ((0.0, 5.0), (600.0, 7.5), (1200.0, 1.0))
    bad = tmp_path / "b.csv"
    bad.write_text("window_start_s,rate_rps\n0,1\n600,fast\n")
    with pytest.raises(ValueError, match=r"b.csv line 3.rate_rps: not a number: 'fast'"):
        read_rate_series(bad)
    wrong = tmp_path / "c.csv"
    wrong.write_text("t,rps\n0,1\n")
    with pytest.raises(ValueError, match="header must be window_start_s,rate_rps"):
        read_rate_series(wrong)


def test_each_series_is_scaled_so_its_own_peak_needs_the_dedicated_gpus(tmp_path: Path) -> None:
    small = pool_model("Phi-3-mini", read_rate_series(write_series(tmp_path / "s.csv", [2.0, 8.0, 4.0])), gpus=2)
    large = pool_model("Llama-3-70B", read_rate_series(write_series(tmp_path / "l.csv", [300.0, 100.0, 50.0])))
    built = build_pool_scenario(PoolSpec((small, large), span_s=1800.0, compress=6.0))
    by_name = {m.spec.deployment: m for m in built.models}
    for m in built.models:
        assert m.peak_rps == pytest.approx(m.spec.gpus // m.spec.tp * m.replica_capacity_rps / 1.25, rel=1e-5)
    # the shape is the trace's, the level the sizing's; the time axis compressed 6x, mid-window
    assert [r for _, r in by_name["Phi-3-mini"].rate_points] == pytest.approx(
        [by_name["Phi-3-mini"].peak_rps * x for x in (0.25, 1.0, 0.5)])
    assert [t for t, _ in by_name["Llama-3-70B"].rate_points] == [50.0, 150.0, 250.0]
    assert built.duration_s == 300.0 and built.scenario.extra["jobs"] == []
    with pytest.raises(ValueError, match="gpus.Llama-3-70B: must be a multiple of the replica's tp"):
        pool_model("Llama-3-70B", ((0.0, 1.0),), gpus=6)


def test_a_tidal_two_model_pool_writes_the_json_and_sizing_for_the_peak_holds_more(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # two models whose tides are out of phase: each peaks for a sixth of the span
    day = write_series(tmp_path / "day.csv", [1.0, 1.0, 1.0, 6.0, 1.0, 1.0])
    night = write_series(tmp_path / "night.csv", [6.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    out = tmp_path / "pool.json"
    assert main(["--rates", f"Phi-3-mini={day}", f"Llama-3-8B={night}", "--gpus", "Phi-3-mini=3", "Llama-3-8B=3",
                 "--hours", "1", "--compress", "3", "--job-gpus", "20", "--job-hours", "0.5", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "GPU-hours held" in printed and "flexpipe_over_dedicated_gpu_hours" in printed
    result = json.loads(out.read_text())
    pols = result["policies"]
    assert set(pols) == {"dedicated", "reactive", "flexpipe"}
    for r in pols.values():
        for key in ("gpu_hours_held", "slo_attainment", "ttft_p99_s", "cold_starts", "cold_start_ttft_p99_s",
                    "gpus_reclaimed_from_jobs", "lost"):
            assert key in r
        assert set(r["per_model"]) == {"Phi-3-mini", "Llama-3-8B"}
        assert all("slo_attainment" in m for m in r["per_model"].values())
        assert r["lost"] == 0 and r["sequence_violations"] == [] and r["memory_violations"] == []
    # the fine-tune job of the busiest hour: 20 GPUs never fit beside dedicated's 6 of 24, it waits;
    # beside the policies that follow the tides it runs to the end
    [job] = result["scenario"]["jobs"]
    assert job["gpus"] == 20 and job["priority"] == 1 and job["arrive_s"] <= result["scenario"]["busiest_s"]
    assert pols["dedicated"]["jobs"]["finetune"]["state"] == "queued" and pols["dedicated"]["job_gpu_hours"] == 0
    for name in ("reactive", "flexpipe"):
        assert pols[name]["jobs"]["finetune"]["state"] == "done" and pols[name]["job_gpu_hours"] > 0
    # dedicated holds what it was sized for all the time; the others follow the tides
    assert [pols["dedicated"]["per_model"][m]["peak_gpus"] for m in ("Phi-3-mini", "Llama-3-8B")] == [3, 3]
    assert pols["dedicated"]["gpu_hours_held"] > pols["reactive"]["gpu_hours_held"]
    assert pols["dedicated"]["gpu_hours_held"] > pols["flexpipe"]["gpu_hours_held"]
    assert set(result["ratios"]) >= {"flexpipe_over_dedicated_gpu_hours", "flexpipe_over_reactive_gpu_hours",
                                     "flexpipe_minus_dedicated_attainment_points"}
    assert result["ratios"]["flexpipe_over_dedicated_gpu_hours"] == pytest.approx(
        pols["flexpipe"]["gpu_hours_held"] / pols["dedicated"]["gpu_hours_held"], abs=1e-4)
    for key in ("flexpipe_over_dedicated_gpu_hours", "flexpipe_over_reactive_gpu_hours",
                "flexpipe_attainment_vs_dedicated_points", "flexpipe_lost"):
        assert result["targets"][key]["met"] in (True, False)


def test_bad_input_is_refused_naming_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    series = write_series(tmp_path / "s.csv", [1.0, 2.0])
    assert main(["--rates", f"Phi-3-mini={series}", "--gpus", "Llama-3-8B=2"]) == 2
    assert "--gpus.Llama-3-8B: no --rates entry of that name" in capsys.readouterr().err
    assert main(["--rates", f"GPT-9={series}"]) == 2
    assert "unknown" in capsys.readouterr().err
    assert main(["--rates", f"Phi-3-mini={series}", "--policies", "fastest"]) == 2
    assert "policy: unknown 'fastest'" in capsys.readouterr().err
    assert main(["--rates", f"Phi-3-mini={series}", "--weights", "Phi-3-mini=heavy"]) == 2
    assert "--weights: 'Phi-3-mini=heavy' is not model=weight" in capsys.readouterr().err
