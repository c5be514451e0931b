"""The calibration rows bench.fidelity scores, read from folders of Vidur's profiling shape.

Holds the tables that map those folders to our catalog (`GPU_FOLDERS`, `NETWORK_SETUPS`, the
in-sample set, `OPS`), the `Row` one measured operator or collective time becomes, the readers
(`read_compute`, `read_network` with its emulated link probe `_probe`, and `read_measured` for the
engine steps bench.gpu_check measured), and the cost-model prediction of a row with its relative
error (`row_path`, `predict`, `rel_errors`, `summary`), which both the report and the fit use.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path as FsPath

import numpy as np

from scheduler import costmodel
from scheduler.costmodel import Efficiency, Path
from scheduler.hardware import CATALOG

# Vidur's GPU folder names -> our catalog (calibration/README.md)
GPU_FOLDERS = {"a100": "A100-80G", "h100": "H100-SXM", "h200": "H200", "l40s": "L40S", "a10g": "A10G"}
# network setups: (catalog GPU, GPUs per NVLink domain, network cards per node for the
# cluster fabric). DGX A100: 8 single-port ConnectX-6 200 Gb/s cards, one per GPU (NVIDIA DGX
# A100 User Guide DU-09821-001, section 1.1.1; https://developer.nvidia.com/blog/defining-ai-innovation-with-dgx-a100).
# DGX H100: 8 single-port ConnectX-7 behind 4 OSFP cages (NVIDIA DGX H100 User Guide, "Hardware
# Overview"). Pair-NVLink hosts are not profiled across nodes; one card is assumed.
NETWORK_SETUPS = {
    "a100_dgx": ("A100-80G", 8, 8),
    "a100_pairwise_nvlink": ("A100-80G", 2, 1),
    "a100_pair_nvlink": ("A100-80G", 2, 1),
    "h100_dgx": ("H100-SXM", 8, 8),
    "h100_pair_nvlink": ("H100-SXM", 2, 1),
}
# the set the factors were fitted on
IN_SAMPLE_GPUS = {"A100-80G"}
IN_SAMPLE_MODELS = {"Meta-Llama-3-8B", "Meta-Llama-3-70B"}
IN_SAMPLE_SETUPS = {"a100_dgx", "a100_pairwise_nvlink"}

OPS = {
    "attn_pre_proj": "QKV",
    "attn_post_proj": "O",
    "mlp_up_proj": "MLP up",
    "mlp_down_proj": "MLP down",
}


@dataclass(frozen=True)
class Row:
    group: str  # QKV, O, MLP up, MLP down, all_reduce, send_recv
    source: str  # gpu/model or setup
    in_sample: bool
    x: int  # tokens or bytes
    tp: int  # TP degree or number of workers
    measured_s: float
    # compute rows
    flops: float = 0.0
    bytes_moved: float = 0.0
    spec_name: str = ""
    # network rows
    workers: int = 0
    link: Path | None = None  # nominal link; across nodes the probed path (latency: see `probe_latency_s`)
    collective: str = ""
    probe_latency_s: float = 0.0  # across nodes: the probe's whole small-message time
    lanes: int = 1  # across nodes: network cards the ranks of one node drive in parallel


def _gemm_shapes(h: int, heads: int, kv_heads: int, inter: int, gated: bool, tp: int) -> dict[str, tuple[int, int]]:
    hd = h // heads
    kv = kv_heads * hd // min(tp, kv_heads)
    return {
        "attn_pre_proj": (h, heads * hd // tp + 2 * kv),
        "attn_post_proj": (heads * hd // tp, h),
        "mlp_up_proj": (h, (2 if gated else 1) * inter // tp),
        "mlp_down_proj": (inter // tp, h),
    }


def read_compute(root: FsPath, skipped: list[str]) -> list[Row]:
    rows: list[Row] = []
    for path in sorted(root.glob("**/compute/*/*/*/mlp.csv")):
        gpu_folder = path.parts[-4]
        model_name = path.parts[-2]
        spec_name = GPU_FOLDERS.get(gpu_folder)
        if spec_name is None:
            skipped.append(f"{path}: GPU folder {gpu_folder!r} maps to no catalog GPU")
            continue
        in_sample = spec_name in IN_SAMPLE_GPUS and model_name in IN_SAMPLE_MODELS
        with path.open() as f:
            for rec in csv.DictReader(f):
                tokens = int(rec["num_tokens"])
                tp = int(rec["num_tensor_parallel_workers"])
                h, heads = int(rec["n_embd"]), int(rec["n_head"])
                kv_heads, inter = int(rec["n_kv_head"]), int(rec["n_expanded_embd"])
                gated = rec["use_gated_mlp"].strip().lower() == "true"
                for op, (k, n) in _gemm_shapes(h, heads, kv_heads, inter, gated, tp).items():
                    key = f"time_stats.{op}.median"
                    if key not in rec or not rec[key]:
                        continue
                    rows.append(
                        Row(
                            group=OPS[op],
                            source=f"{spec_name}/{model_name}",
                            in_sample=in_sample,
                            x=tokens,
                            tp=tp,
                            measured_s=float(rec[key]) * 1e-3,
                            flops=2.0 * tokens * k * n,
                            bytes_moved=2.0 * (k * n + tokens * k + tokens * n),
                            spec_name=spec_name,
                        )
                    )
    return rows


def read_measured(root: FsPath, skipped: list[str]) -> list[dict[str, object]]:
    """Whole engine steps measured by this project (bench.gpu_check's measured/<gpu>/steps.csv),
    each predicted again with the cost model as it is now: out-of-sample rows (the factors were
    never fitted on them)."""
    from bench.gpu_check import predict, shape_model

    out: list[dict[str, object]] = []
    for path in sorted(root.glob("**/measured/*/steps.csv")):
        with path.open() as fh:
            for i, rec in enumerate(csv.DictReader(fh)):
                try:
                    model = shape_model(rec["model"], int(rec["layers"]))
                    pre, dec, _ = predict(model, rec["gpu"], int(rec["batch"]), int(rec["prompt_tokens"]),
                                          int(rec["context_tokens"]) or int(rec["prompt_tokens"]))
                    measured = float(rec["measured_s"])
                except (KeyError, ValueError) as exc:
                    skipped.append(f"{path} row {i + 2}: {exc}")
                    continue
                predicted = pre if rec["phase"] == "prefill" else dec
                out.append({"gpu": rec["gpu"], "model": rec["model"], "phase": rec["phase"], "batch": int(rec["batch"]),
                            "measured_s": measured, "predicted_s": predicted, "date": rec.get("date", ""),
                            "error": (predicted - measured) / measured})
    return out


def _probe(path: FsPath) -> Path | None:
    """Emulate the agents' link probe from the 2-node send/recv: large-message bandwidth,
    small-message latency."""
    f = path.parent / "send_recv.csv"
    if not f.exists():
        return None
    pts = []
    with f.open() as fh:
        for rec in csv.DictReader(fh):
            if int(rec["num_workers"]) == 2 and int(rec["devices_per_node"]) == 1:
                pts.append((int(rec["size"]), float(rec["time_stats.send_recv.median"]) * 1e-3))
    if len(pts) < 2:
        return None
    pts.sort()
    small_size, small_s = pts[0]
    big_size, big_s = pts[-1]
    return Path(bytes_per_s=big_size / big_s, latency_s=small_s, measured=True)


def read_network(root: FsPath, skipped: list[str]) -> list[Row]:
    rows: list[Row] = []
    for path in sorted(root.glob("**/network/*/*.csv")):
        setup = path.parts[-2]
        collective = path.stem
        if collective not in ("all_reduce", "send_recv"):
            continue
        if setup not in NETWORK_SETUPS:
            skipped.append(f"{path}: setup {setup!r} maps to no catalog GPU")
            continue
        spec_name, domain, nics = NETWORK_SETUPS[setup]
        spec = CATALOG[spec_name]
        probe = _probe(path)
        with path.open() as f:
            for rec in csv.DictReader(f):
                n = int(rec["num_workers"])
                per_node = int(rec["devices_per_node"])
                probe_latency_s, lanes = 0.0, 1
                if n > per_node:
                    if probe is None:
                        continue
                    # one card per GPU up to the node's cards: NCCL spreads its ring channels
                    # over the cards nearest to the GPUs it uses
                    link = Path(probe.bytes_per_s, None, True)
                    probe_latency_s, lanes = probe.latency_s or 0.0, max(1, min(per_node, nics))
                elif n <= domain:
                    link = Path(spec.intra_link_bytes_per_s)
                else:
                    link = Path(spec.host_link_bytes_per_s)
                rows.append(
                    Row(
                        group=collective,
                        source=setup,
                        in_sample=setup in IN_SAMPLE_SETUPS,
                        x=int(rec["size"]),
                        tp=n,
                        measured_s=float(rec[f"time_stats.{collective}.median"]) * 1e-3,
                        workers=n,
                        link=link,
                        collective=collective,
                        probe_latency_s=probe_latency_s,
                        lanes=lanes,
                    )
                )
    return rows


def row_path(row: Row, eff: Efficiency) -> Path:
    """The path as an agent would report it. Across nodes the probe's latency is its whole
    small-message time, of which the model's own fixed cost of a transfer is a part."""
    assert row.link is not None
    if not row.link.measured:
        return row.link
    beyond = row.probe_latency_s - eff.kernel_overhead_s - eff.p2p_latency_s - eff.link_latency_s
    return replace(row.link, latency_s=max(0.0, beyond))


def predict(row: Row, eff: Efficiency) -> float:
    if row.collective == "all_reduce":
        spec = CATALOG[NETWORK_SETUPS[row.source][0]]
        return costmodel.allreduce_time_s(row.workers, row.x, row_path(row, eff), eff, spec.hbm_bytes_per_s,
                                          lanes=row.lanes)
    if row.collective == "send_recv":
        return costmodel.transfer_time_s(row.x, row_path(row, eff), eff)
    return costmodel.kernel_time_s(row.flops, row.bytes_moved, CATALOG[row.spec_name], eff)


def rel_errors(rows: Sequence[Row], eff: Efficiency) -> np.ndarray:
    return np.array([abs(predict(r, eff) - r.measured_s) / r.measured_s for r in rows])


def summary(errors: np.ndarray) -> dict[str, float]:
    if errors.size == 0:
        return {"n": 0, "median": math.nan, "p90": math.nan}
    return {"n": int(errors.size), "median": float(np.median(errors)), "p90": float(np.percentile(errors, 90))}
