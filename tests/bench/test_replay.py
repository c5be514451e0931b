"""python -m bench.replay: the table, the JSON it promises, the offline HTML report, bad input."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from bench.replay import main
from tests.agents.sim.worlds import LIVELY


@pytest.fixture
def scenario_file(tmp_path: Path) -> Path:
    doc = copy.deepcopy(LIVELY)
    doc["duration_s"] = 400
    doc["events"] = [{"at_s": 150, "kind": "preempt", "node": "a1", "gpus": 4, "duration_s": 100}]
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_it_prints_the_table_and_writes_the_json_and_an_offline_html_report(
        scenario_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json, out_html = tmp_path / "r.json", tmp_path / "r.html"
    assert main([str(scenario_file), "--policies", "static,flexpipe,oracle", "--json", str(out_json),
                 "--html", str(out_html)]) == 0
    printed = capsys.readouterr().out
    for words in ("tokens", "goodput req/s", "ratios vs flexpipe", "ratios vs oracle", "targets (issue 4", "whole run"):
        assert words in printed
    result = json.loads(out_json.read_text())
    assert set(result["policies"]) == {"static", "flexpipe", "oracle"}
    assert result["wall_s"] > 0 and result["cpu_s"] > 0
    for r in result["policies"].values():
        for key in ("tokens", "finished", "lost", "goodput_rps", "ttft_p95_s", "e2e_p95_s",
                    "worst_p95_after_event_s", "steady_p95_s", "switches", "event_to_serving_s", "mem_util",
                    "compute_util", "peak_gpu_mem_fraction", "refused_prepares", "memory_violations"):
            assert key in r
        # invariant 4 per policy: the largest booked share of any GPU, checked from the bookings
        assert 0 < r["peak_gpu_mem_fraction"] <= 0.92 and r["memory_violations"] == []
    page = out_html.read_text()
    assert "lively" in page and "FlexPipe gear" in page
    # plotly.js is inlined (megabytes), no script is fetched: the report works offline
    assert "<script src=" not in page and "Plotly.newPlot" in page and len(page) > 1_000_000


def test_without_timing_the_json_is_byte_identical_across_runs(scenario_file: Path, tmp_path: Path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for path in (a, b):
        assert main([str(scenario_file), "--policies", "flexpipe", "--json", str(path), "--no-timing"]) == 0
    assert a.read_bytes() == b.read_bytes()
    assert "wall_s" not in json.loads(a.read_text())


def test_bad_input_is_refused_with_what_to_fix(scenario_file: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(scenario_file), "--policies", "flexpipe,fastest"]) == 2
    assert "--policies: policy: unknown 'fastest'" in capsys.readouterr().err
    broken = tmp_path / "broken.yaml"
    doc = yaml.safe_load(scenario_file.read_text())
    doc["events"][0]["node"] = "x9"
    broken.write_text(yaml.safe_dump(doc))
    assert main([str(broken)]) == 2
    assert "events[0].node: unknown node 'x9'" in capsys.readouterr().err
