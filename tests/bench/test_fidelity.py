"""The fidelity bench reads any folder of Vidur's profiling shape and scores what it reads.

The folders here are synthetic: their times are the cost model's own predictions scaled by a
known factor, so the error the bench must report is known exactly. A bench that misread a
shape column, swapped an operator or mixed up the setups would report something else.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from bench import fidelity
from scheduler import costmodel
from scheduler.costmodel import DEFAULT_EFFICIENCY
from scheduler.hardware import CATALOG

# Llama-3-8B's shape, as Vidur's CSV columns spell it
SHAPE = {"n_head": 32, "n_kv_head": 8, "n_embd": 4096, "n_expanded_embd": 14336, "vocab_size": 128256,
         "use_gated_mlp": "True"}
TOKENS = (1, 16, 128, 1024, 8192)
SIZES = (4096, 1 << 20, 64 << 20)


def gemm_shape(op: str, tp: int) -> tuple[int, int]:
    """(k, n) of one operator's GEMM on one of `tp` GPUs, written out for Llama-3-8B (head_dim 128;
    Q has 32 heads, K and V 8 each; the gated MLP's up projection is gate and up together)."""
    return {
        "attn_pre_proj": (4096, (32 + 2 * 8) * 128 // tp),
        "attn_post_proj": (32 * 128 // tp, 4096),
        "mlp_up_proj": (4096, 2 * 14336 // tp),
        "mlp_down_proj": (14336 // tp, 4096),
    }[op]


def predicted_gemm_s(gpu: str, op: str, tokens: int, tp: int) -> float:
    k, n = gemm_shape(op, tp)
    return costmodel.gemm_time_s(tokens, k, n, 2, CATALOG[gpu], DEFAULT_EFFICIENCY)


def write_compute(root: Path, gpu_folder: str, gpu: str, model: str, scale: float) -> None:
    folder = root / "vidur" / "compute" / gpu_folder / "meta-llama" / model
    folder.mkdir(parents=True)
    with (folder / "mlp.csv").open("w", newline="") as f:
        fields = [f"time_stats.{op}.median" for op in fidelity.OPS] + list(SHAPE) + [
            "num_tokens", "num_tensor_parallel_workers"]
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for tp in (1, 2, 4):
            for tokens in TOKENS:
                row: dict[str, object] = dict(SHAPE, num_tokens=tokens, num_tensor_parallel_workers=tp)
                for op in fidelity.OPS:
                    row[f"time_stats.{op}.median"] = predicted_gemm_s(gpu, op, tokens, tp) * scale * 1e3
                writer.writerow(row)


def write_network(root: Path, setup: str, scale: float) -> None:
    """A node's all-reduce and send/recv inside its NVLink domain, times = prediction x scale."""
    folder = root / "vidur" / "network" / setup
    folder.mkdir(parents=True)
    spec = CATALOG[fidelity.NETWORK_SETUPS[setup][0]]
    link = costmodel.Path(spec.intra_link_bytes_per_s)
    for collective in ("all_reduce", "send_recv"):
        with (folder / f"{collective}.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=[f"time_stats.{collective}.median", "num_workers", "size",
                                                   "devices_per_node"])
            writer.writeheader()
            for workers in ((2, 4, 8) if collective == "all_reduce" else (2,)):
                for size in SIZES:
                    if collective == "all_reduce":
                        t = costmodel.allreduce_time_s(workers, size, link, DEFAULT_EFFICIENCY, spec.hbm_bytes_per_s)
                    else:
                        t = costmodel.transfer_time_s(size, link, DEFAULT_EFFICIENCY)
                    writer.writerow({f"time_stats.{collective}.median": t * scale * 1e3, "num_workers": workers,
                                     "size": size, "devices_per_node": workers})


def run(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[dict[str, object], str]:
    out = tmp_path / "fidelity.json"
    assert fidelity.main(["--calibration", str(root), "--json", str(out)]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def test_it_reports_the_error_it_was_given_per_group_and_setup(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "cal"
    write_compute(root, "a100", "A100-80G", "Meta-Llama-3-8B", 1.25)  # the model predicts 20% short
    write_network(root, "a100_dgx", 0.8)  # ... and 25% long
    result, printed = run(root, tmp_path, capsys)
    ins = result["in_sample"]
    assert isinstance(ins, dict)
    groups = ins["groups"]
    for op in ("QKV", "O", "MLP up", "MLP down"):
        assert groups[op]["all"]["n"] == 3 * len(TOKENS)
        assert groups[op]["all"]["median"] == pytest.approx(0.2)
        assert groups[op]["all"]["p90"] == pytest.approx(0.2)
    assert groups["all_reduce"]["all"]["n"] == 3 * len(SIZES)
    assert groups["all_reduce"]["intra-node"]["median"] == pytest.approx(0.25)
    assert groups["send_recv"]["all"]["p90"] == pytest.approx(0.25)
    assert ins["sources"]["A100-80G/Meta-Llama-3-8B"]["median"] == pytest.approx(0.2)
    assert "out_of_sample" not in result
    assert "IN SAMPLE" in printed and "OUT OF SAMPLE" not in printed


def test_other_gpus_and_models_are_scored_apart_with_the_same_factors(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "cal"
    write_compute(root, "a100", "A100-80G", "Meta-Llama-3-8B", 1.0)
    write_compute(root, "h100", "H100-SXM", "Some-Other-8B", 1.1)
    result, printed = run(root, tmp_path, capsys)
    assert result["in_sample"]["overall"]["median"] == pytest.approx(0.0, abs=1e-9)  # type: ignore[index]
    out = result["out_of_sample"]
    assert out["overall"]["n"] == 4 * 3 * len(TOKENS)  # type: ignore[index]
    assert out["overall"]["median"] == pytest.approx(0.1 / 1.1)  # type: ignore[index]
    assert list(out["sources"]) == ["H100-SXM/Some-Other-8B"]  # type: ignore[index]
    assert "OUT OF SAMPLE" in printed


def test_a_folder_that_names_no_catalog_gpu_is_reported_and_skipped(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "cal"
    write_compute(root, "a100", "A100-80G", "Meta-Llama-3-8B", 1.0)
    write_compute(root, "b300", "A100-80G", "Meta-Llama-3-8B", 3.0)
    result, printed = run(root, tmp_path, capsys)
    skipped = result["skipped"]
    assert isinstance(skipped, list) and len(skipped) == 1 and "'b300'" in skipped[0]
    assert "skipped:" in printed and "b300" in printed
    assert result["in_sample"]["overall"]["n"] == 4 * 3 * len(TOKENS)  # type: ignore[index]


def test_the_decode_anchors_are_printed_with_their_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "cal"
    write_compute(root, "a100", "A100-80G", "Meta-Llama-3-8B", 1.0)
    result, _ = run(root, tmp_path, capsys)
    anchors = result["decode_anchors"]
    assert isinstance(anchors, list)
    assert [a["gpu"] for a in anchors] == ["H100-SXM", "A100-40G"]
    for a in anchors:
        assert a["error"] == pytest.approx((a["predicted_ms"] - a["measured_ms"]) / a["measured_ms"])
        assert abs(a["error"]) <= 0.10  # issue 3: both anchors within +-10%


@pytest.mark.parametrize("make", ["missing", "empty"])
def test_a_calibration_folder_without_data_is_an_error_naming_the_flag(
        make: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "cal"
    if make == "empty":
        root.mkdir()
    assert fidelity.main(["--calibration", str(root)]) == 2
    assert capsys.readouterr().err.startswith("--calibration:")
