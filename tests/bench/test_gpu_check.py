"""python -m bench.gpu_check: without a GPU it says so and exits 0; on this machine's CPU, at the
project's tiny shape, the same code measures the engine and predicts it (the GPU run is the same
path with device cuda and Llama-3-8B's shape)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import fidelity
from bench.gpu_check import main, write_calibration


def _has_gpu() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:  # noqa: BLE001 - any NVML failure means: no GPU here
        return False


@pytest.mark.skipif(_has_gpu(), reason="a GPU is here: the no-GPU path is not what runs")
def test_without_a_gpu_it_says_so_writes_it_and_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "check.json"
    assert main(["--json", str(out)]) == 0
    body = json.loads(out.read_text())
    assert body["skipped"].startswith("no GPU") and "engine" not in body
    assert "no GPU here" in capsys.readouterr().out
    assert main(["--json", str(out), "--device", "cuda"]) == 2  # asked for a GPU explicitly: an error


def test_on_the_cpu_at_the_tiny_shape_it_measures_predicts_and_moves_kv(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    assert main(["--json", str(out), "--device", "cpu", "--shape", "tiny", "--batches", "1,4",
                 "--prompt-tokens", "24", "--decode-steps", "3"]) == 0
    body = json.loads(out.read_text())
    engine = body["engine"]
    assert [b["batch"] for b in engine["batches"]] == [1, 4]
    for b in engine["batches"]:
        for key in ("prefill_s", "decode_step_s"):
            assert b[key]["measured"] > 0 and b[key]["predicted"] > 0
        assert b["dtype_bytes"] == 4  # the engine computes in float32: so is the prediction
    assert engine["kv"]["same_tokens_after_import"] is True and engine["kv"]["kv_bytes"] > 0
    assert body["copies"]["d2d"]["points"] and body["within_budget"] is True
    # the measured rows land where bench.fidelity reads them, marked as this project's
    path = write_calibration(tmp_path / "cal", "A100-80G", "tiny", engine, "2026-12-01")
    assert "measured by this project" in path.read_text()
    rows = fidelity.read_measured(tmp_path / "cal", skipped := [])
    assert not skipped and len(rows) == 4 and {r["phase"] for r in rows} == {"prefill", "decode"}


def test_bad_arguments_are_refused_naming_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--json", str(tmp_path / "x.json"), "--batches", "0,a"])
    assert "--batches" in capsys.readouterr().err
