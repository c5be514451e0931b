"""How well scheduler.costmodel predicts measured operator and collective times.

    python -m bench.fidelity --calibration ../shared/calibration [--json PATH] [--fit]

Reads every folder of Vidur's profiling shape under the calibration directory:

* `compute/<gpu>/<org>/<model>/mlp.csv`: per (num_tokens, TP) the time of each token-parallel
  operator of one layer. We predict QKV (attn_pre_proj), O (attn_post_proj), MLP up
  (mlp_up_proj, gate+up) and MLP down (mlp_down_proj) with `costmodel.gemm_time_s`; the
  model's shape comes from the CSV's own columns.
* `network/<setup>/{all_reduce,send_recv}.csv`: per (size, workers, devices per node) the
  collective's time. Inside a node we use the catalog's link (NVLink / PCIe) with the
  model's link efficiency; across nodes, the measured node-to-node path, as an agent's probe
  would report it: bandwidth from the largest 2-node send/recv message, latency from the
  smallest (so cross-node send/recv is not an independent test; cross-node all-reduce is).
  The ranks of one node drive min(devices per node, network cards per node) cards at once
  (`NETWORK_SETUPS`, from the system's datasheet).

Prints median and 90th-percentile relative error per operator group and per token (or
message-size) range, the three groups of issue 13 - `physical_all` (every row, the physical model
alone), `plan_rows` (the rows a FlexPipe plan runs: TP stays in a block, so no cross-node
all-reduce) and `measured_curve` (every collective row predicted from a curve of the same setup's
other message sizes, leave-one-size-out: what production does once an agent measured its links,
scheduler.collectives) - each with median and p90, and their targets; for the rows of the A100 set the factors were fitted on ("in sample")
and separately for any other GPU or model found ("out of sample"), plus the two single-stream
decode anchors measured with vLLM. `--fit` re-runs the least-error grid search that produced
`costmodel.DEFAULT_EFFICIENCY` and prints the factors it finds. Folder names that map to no
catalog GPU are reported and skipped.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path as FsPath

import numpy as np

from scheduler import costmodel
from scheduler.costmodel import DEFAULT_EFFICIENCY, Efficiency, Path
from scheduler.hardware import CATALOG
from scheduler.modelspec import model_spec

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
TOKEN_RANGES = ((1, 64), (64, 512), (512, 4096), (4096, 1 << 30))
SIZE_RANGES = ((0, 1 << 20), (1 << 20, 16 << 20), (16 << 20, 1 << 40))

# Single-stream decode, Llama-3-8B BF16, measured with vLLM (issue 3): seconds per token.
DECODE_ANCHORS = (("H100-SXM", 6.5e-3), ("A100-40G", 13.0e-3))
ANCHOR_CONTEXT_TOKENS = 512


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


def _range_label(lo: int, hi: int, unit: str) -> str:
    def fmt(v: int) -> str:
        if unit == "B":
            return f"{v >> 20}MiB" if v >= 1 << 20 else f"{v >> 10}KiB" if v else "0"
        return str(v)

    return f"[{fmt(lo)}, {fmt(hi)})" if hi < (1 << 30) else f">= {fmt(lo)}"


def report(rows: Sequence[Row], eff: Efficiency) -> dict[str, object]:
    errors = rel_errors(rows, eff)
    out: dict[str, object] = {"overall": summary(errors)}
    groups: dict[str, object] = {}
    for group in list(OPS.values()) + ["all_reduce", "send_recv"]:
        mask = np.array([r.group == group for r in rows], dtype=bool)
        if not mask.any():
            continue
        entry: dict[str, object] = {"all": summary(errors[mask])}
        ranges = SIZE_RANGES if group in ("all_reduce", "send_recv") else TOKEN_RANGES
        unit = "B" if group in ("all_reduce", "send_recv") else "tok"
        for lo, hi in ranges:
            m = mask & np.array([lo <= r.x < hi for r in rows], dtype=bool)
            entry[_range_label(lo, hi, unit)] = summary(errors[m])
        if group in ("all_reduce", "send_recv"):
            for scope, test in (("intra-node", lambda r: not r.link.measured), ("cross-node", lambda r: r.link.measured)):
                m = mask & np.array([r.link is not None and test(r) for r in rows], dtype=bool)
                entry[scope] = summary(errors[m])
        groups[group] = entry
    out["groups"] = groups
    scopes: dict[str, object] = {}
    for scope, test in (
        ("operators (QKV, O, MLP up, MLP down)", lambda r: not r.collective),
        ("collectives inside a node", lambda r: bool(r.collective) and r.link is not None and not r.link.measured),
        ("collectives across nodes", lambda r: bool(r.collective) and r.link is not None and r.link.measured),
        ("all but cross-node all-reduce (which no plan runs: TP stays in a block)",
         lambda r: not (r.collective == "all_reduce" and r.link is not None and r.link.measured)),
    ):
        m = np.array([test(r) for r in rows], dtype=bool)
        scopes[scope] = summary(errors[m])
    out["scopes"] = scopes
    sources: dict[str, object] = {}
    for src in sorted({r.source for r in rows}):
        m = np.array([r.source == src for r in rows], dtype=bool)
        sources[src] = summary(errors[m])
    out["sources"] = sources
    return out


# issue 13's targets for the three groups (reported, never asserted: they are benchmark results)
RESOLUTION_TARGETS = {
    "plan_rows": {"p90": 0.15, "median": 0.05},
    "measured_curve": {"p90": 0.15},
    "out_of_sample_physical_all": {"median": 0.10},
    "out_of_sample_measured_curve": {"p90": 0.15},
}


def plan_row(r: Row) -> bool:
    """A row a FlexPipe plan can run: TP stays inside a block, so no all-reduce crosses nodes."""
    return not (r.collective == "all_reduce" and r.link is not None and r.link.measured)


def curve_errors(rows: Sequence[Row]) -> tuple[np.ndarray, list[Row]]:
    """Every collective row predicted from a measured curve built out of its own setup's other
    message sizes (leave-one-size-out): what production predicts once an agent measured the
    collective (scheduler.collectives.CollectiveCurve.time_s - the same function)."""
    from scheduler.collectives import CollectiveCurve

    groups: dict[tuple[object, ...], dict[int, list[float]]] = {}
    for r in rows:
        if r.collective and r.link is not None:
            key = (r.source, r.collective, r.workers, r.link.measured, r.lanes)
            groups.setdefault(key, {}).setdefault(r.x, []).append(r.measured_s)
    curves = {}
    for key, by_size in groups.items():
        pts = tuple((x, float(np.median(ts))) for x, ts in sorted(by_size.items()))
        if len(pts) >= 2:
            curves[key] = CollectiveCurve("all_reduce" if key[1] == "all_reduce" else "send_recv", "intra", "n",
                                          max(2, int(key[2])), pts)  # type: ignore[call-overload]
    errs, used = [], []
    for r in rows:
        if not (r.collective and r.link is not None):
            continue
        full = curves.get((r.source, r.collective, r.workers, r.link.measured, r.lanes))
        held_out = full.without(r.x) if full is not None else None
        if held_out is None:
            continue
        errs.append(abs(held_out.time_s(r.x) - r.measured_s) / r.measured_s)
        used.append(r)
    return np.array(errs), used


def resolution(rows: Sequence[Row], eff: Efficiency) -> dict[str, object]:
    """The three groups (issue 13): (a) every row with the physical model alone, (b) the rows a
    plan can run, (c) every collective row from a measured curve (leave one size out), with the
    scopes of (c)."""
    errors = rel_errors(rows, eff)
    mask = np.array([plan_row(r) for r in rows], dtype=bool)
    curve, used = curve_errors(rows)
    scopes = {}
    for name, test in (("in-node", lambda r: not r.link.measured), ("cross-node", lambda r: r.link.measured)):
        m = np.array([test(r) for r in used], dtype=bool)
        scopes[name] = summary(curve[m] if m.size else curve)
    return {"physical_all": summary(errors), "plan_rows": summary(errors[mask] if mask.any() else np.array([])),
            "measured_curve": {**summary(curve), "scopes": scopes}}


def _print_resolution(title: str, res: dict[str, object]) -> None:
    print(f"\n{title}")
    for key, label in (("physical_all", "(a) physical model, every row"),
                       ("plan_rows", "(b) rows a FlexPipe plan runs (no cross-node all-reduce)"),
                       ("measured_curve", "(c) collectives from a measured curve (leave one size out)")):
        sm = res[key]
        assert isinstance(sm, dict)
        if sm["n"]:
            print(f"  {label:<62} n={sm['n']:>6}  median {sm['median']:6.1%}  p90 {sm['p90']:6.1%}")


def decode_anchors(eff: Efficiency) -> list[dict[str, object]]:
    from scheduler.plan import Plan, Stage
    from scheduler.topology import GpuState, NodeState, Snapshot

    model = model_spec("Llama-3-8B")
    out = []
    for gpu_name, measured_s in DECODE_ANCHORS:
        spec = CATALOG[gpu_name]
        snap = Snapshot(
            now_s=0.0,
            nodes=(NodeState(id="n", rack="r"),),
            gpus=(GpuState(uuid="g0", node_id="n", index=0, model=gpu_name, mem_total_bytes=spec.mem_bytes,
                           mem_used_bytes=0),),
        )
        plan = Plan(model=model.name, mode="colocated", stages=(Stage(0, model.num_layers, ("g0",)),),
                    kv_reserve_tokens=4096)
        predicted = costmodel.decode_step_s(plan, model, snap, 1, ANCHOR_CONTEXT_TOKENS, eff)
        out.append({
            "gpu": gpu_name,
            "model": model.name,
            "measured_ms": measured_s * 1e3,
            "predicted_ms": predicted * 1e3,
            "error": (predicted - measured_s) / measured_s,
        })
    return out


def targets(res: dict[str, object], out_res: dict[str, object] | None) -> dict[str, dict[str, object]]:
    """Each target with its measured value (None: no rows of that kind) and whether it is met."""
    out: dict[str, dict[str, object]] = {}

    def put(name: str, value: object, limit: float) -> None:
        v = None if not isinstance(value, float) or math.isnan(value) else round(value, 4)
        out[name] = {"value": v, "limit": limit, "met": v is not None and v <= limit}

    for group in ("plan_rows", "measured_curve"):
        sm = res[group]
        assert isinstance(sm, dict)
        for stat, limit in RESOLUTION_TARGETS[group].items():
            put(f"{group}.{stat}", sm[stat], limit)
    for group, key in (("physical_all", "out_of_sample_physical_all"), ("measured_curve",
                                                                         "out_of_sample_measured_curve")):
        sm = out_res[group] if out_res is not None else {"median": math.nan, "p90": math.nan}
        assert isinstance(sm, dict)
        for stat, limit in RESOLUTION_TARGETS[key].items():
            put(f"{key}.{stat}", sm[stat], limit)
    return out


# --- the fit -----------------------------------------------------------------------------------
def fit_compute(comp: Sequence[Row]) -> tuple[float, float, float]:
    """(mfu, mbu, kernel_overhead_s) with the least median + p90 relative error on `comp`."""
    flops = np.array([r.flops for r in comp])
    nbytes = np.array([r.bytes_moved for r in comp])
    peak = np.array([CATALOG[r.spec_name].bf16_flops for r in comp])
    hbm = np.array([CATALOG[r.spec_name].hbm_bytes_per_s for r in comp])
    meas = np.array([r.measured_s for r in comp])
    best: tuple[float, float, float, float] | None = None
    for mfu in np.arange(0.60, 0.85, 0.005):
        tc = flops / (mfu * peak)
        for mbu in np.arange(0.60, 0.95, 0.01):
            tm = nbytes / (mbu * hbm)
            base = np.sqrt(tc * tc + tm * tm)
            for overhead in np.arange(0.0, 10.5e-6, 0.5e-6):
                e = np.abs(base + overhead - meas) / meas
                score = float(np.median(e) + np.percentile(e, 90))
                if best is None or score < best[0]:
                    best = (score, float(mfu), float(mbu), float(overhead))
    assert best is not None
    return best[1], best[2], best[3]


def _score(errors: np.ndarray) -> float:
    return float(np.median(errors) + np.percentile(errors, 90))


def fit_p2p(net: Sequence[Row], kernel_overhead_s: float, link_latency_s: float) -> tuple[float, float]:
    """(p2p_link_efficiency, p2p_latency_s) with the least median + p90 relative error on the
    in-node send/recv rows (a copy over the datasheet link: no ring, no reduction)."""
    p2p = [r for r in net if r.collective == "send_recv" and r.link is not None and not r.link.measured]
    if not p2p:
        return DEFAULT_EFFICIENCY.p2p_link_efficiency, DEFAULT_EFFICIENCY.p2p_latency_s
    size = np.array([r.x for r in p2p], dtype=float)
    bw = np.array([r.link.bytes_per_s for r in p2p if r.link is not None])
    meas = np.array([r.measured_s for r in p2p])
    best: tuple[float, float, float] | None = None
    for p2p_eff in np.arange(0.60, 1.0, 0.01):
        for lat in np.arange(0.0, 20.1e-6, 0.5e-6):
            pred = kernel_overhead_s + link_latency_s + lat + size / (p2p_eff * bw)
            score = _score(np.abs(pred - meas) / meas)
            if best is None or score < best[0]:
                best = (score, float(p2p_eff), float(lat))
    assert best is not None
    return best[1], best[2]


def fit_links(net: Sequence[Row], comp_errors: np.ndarray, mbu: float,
              kernel_overhead_s: float | None = None, p2p: tuple[float, float] | None = None
              ) -> tuple[float, float, float]:
    """(link_efficiency, link_latency_s, allreduce_latency_s) with the least median + p90
    relative error over the network rows together with the operator rows' errors (so the
    score is the one the report prints for all rows), by a coarse grid and then a fine one."""
    size = np.array([r.x for r in net], dtype=float)
    workers = np.array([r.workers for r in net], dtype=float)
    is_ar = np.array([r.collective == "all_reduce" for r in net])
    measured = np.array([r.link is not None and r.link.measured for r in net])
    bw = np.array([r.link.bytes_per_s if r.link is not None else 0.0 for r in net])
    lanes = np.array([r.lanes for r in net], dtype=float)
    probe = np.array([r.probe_latency_s for r in net])
    meas = np.array([r.measured_s for r in net])
    hbm = np.array([CATALOG[NETWORK_SETUPS[r.source][0]].hbm_bytes_per_s for r in net])
    share = (workers - 1) / workers * size
    reduce_s = costmodel.REDUCE_HBM_TOUCHES * share / (mbu * hbm)

    launch = DEFAULT_EFFICIENCY.kernel_overhead_s if kernel_overhead_s is None else kernel_overhead_s
    p2p_eff, p2p_lat = p2p if p2p is not None else (DEFAULT_EFFICIENCY.p2p_link_efficiency,
                                                     DEFAULT_EFFICIENCY.p2p_latency_s)

    def errors(link_eff: float, lat: float, ar_lat: float) -> np.ndarray:
        # one hop over the path (Path.latency of row_path's path); a copy adds one kernel launch
        # and the send/recv handshake
        hop = lat + np.where(measured, np.maximum(0.0, probe - launch - p2p_lat - lat), 0.0)
        copy = launch + p2p_lat + hop + size / np.where(measured, bw, p2p_eff * bw)
        ar = ar_lat + 2 * (workers - 1) * hop + 2 * share / (link_eff * lanes * bw) + reduce_s
        pred = np.where(is_ar, ar, copy)
        return np.concatenate([comp_errors, np.abs(pred - meas) / meas])

    def search(effs: np.ndarray, lats: np.ndarray, ar_lats: np.ndarray) -> tuple[float, float, float, float]:
        best: tuple[float, float, float, float] | None = None
        for link_eff in effs:
            for lat in lats:
                for ar_lat in ar_lats:
                    score = _score(errors(float(link_eff), float(lat), float(ar_lat)))
                    if best is None or score < best[0]:
                        best = (score, float(link_eff), float(lat), float(ar_lat))
        assert best is not None
        return best

    _, e0, l0, a0 = search(np.arange(0.50, 1.0, 0.04), np.arange(0.0, 31e-6, 3e-6), np.arange(0.0, 91e-6, 6e-6))
    _, e1, l1, a1 = search(np.arange(max(0.3, e0 - 0.04), min(1.0, e0 + 0.041), 0.01),
                           np.arange(max(0.0, l0 - 3e-6), l0 + 3.1e-6, 1e-6),
                           np.arange(max(0.0, a0 - 6e-6), a0 + 6.1e-6, 1e-6))
    return e1, l1, a1


def fit(rows: Sequence[Row]) -> Efficiency:
    """Least (median + p90) relative error over the in-sample rows, by grid search: compute
    factors on the operator rows, then link factors on the collective rows (scored together
    with the operator rows, as the report scores all rows)."""
    comp = [r for r in rows if r.in_sample and not r.collective]
    net = [r for r in rows if r.in_sample and r.collective and r.link is not None]
    mfu, mbu, overhead = fit_compute(comp)
    compute_eff = replace(DEFAULT_EFFICIENCY, mfu=mfu, mbu=mbu, kernel_overhead_s=overhead)
    p2p = fit_p2p(net, overhead, DEFAULT_EFFICIENCY.link_latency_s)
    link_eff, lat, ar_lat = fit_links(net, rel_errors(comp, compute_eff), mbu, overhead, p2p)
    return replace(
        compute_eff,
        mfu=round(mfu, 3),
        mbu=round(mbu, 3),
        kernel_overhead_s=round(overhead, 7),
        link_efficiency=round(link_eff, 3),
        link_latency_s=round(lat, 7),
        allreduce_latency_s=round(ar_lat, 7),
        p2p_link_efficiency=round(p2p[0], 3),
        p2p_latency_s=round(p2p[1], 7),
    )


# --- printing ----------------------------------------------------------------------------------
def leave_one_model_out(rows: Sequence[Row]) -> list[dict[str, object]]:
    """Fit the compute factors on one in-sample model, predict the other(s): a check that the
    factors carry to a model they were not fitted on."""
    comp = [r for r in rows if r.in_sample and not r.collective]
    models = sorted({r.source for r in comp})
    out: list[dict[str, object]] = []
    if len(models) < 2:
        return out
    print("\nleave one model out (compute factors fitted on one model, errors on the other):")
    for held in models:
        train = [r for r in comp if r.source != held]
        test = [r for r in comp if r.source == held]
        mfu, mbu, overhead = fit_compute(train)
        eff = replace(DEFAULT_EFFICIENCY, mfu=mfu, mbu=mbu, kernel_overhead_s=overhead)
        s = summary(rel_errors(test, eff))
        print(f"  held out {held:<36} fit mfu {mfu:.3f} mbu {mbu:.3f} overhead {overhead * 1e6:.1f} us"
              f" -> median {s['median']:.1%}  p90 {s['p90']:.1%}")
        out.append({"held_out": held, "mfu": mfu, "mbu": mbu, "kernel_overhead_s": overhead, **s})
    return out


def _print_report(title: str, rep: dict[str, object]) -> None:
    print(f"\n{title}")
    overall = rep["overall"]
    assert isinstance(overall, dict)
    print(f"  all rows: n={overall['n']:>6}  median {overall['median']:6.1%}  p90 {overall['p90']:6.1%}")
    scopes = rep.get("scopes", {})
    assert isinstance(scopes, dict)
    for scope, sm in scopes.items():
        if sm["n"]:
            print(f"  {scope:<72} n={sm['n']:>6}  median {sm['median']:6.1%}  p90 {sm['p90']:6.1%}")
    groups = rep["groups"]
    assert isinstance(groups, dict)
    print(f"  {'group':<11}{'range':<22}{'n':>7}{'median':>9}{'p90':>9}")
    for group, entry in groups.items():
        for label, s in entry.items():
            if s["n"] == 0:
                continue
            print(f"  {group:<11}{label:<22}{s['n']:>7}{s['median']:>9.1%}{s['p90']:>9.1%}")
    sources = rep["sources"]
    assert isinstance(sources, dict)
    print(f"  {'source':<40}{'n':>7}{'median':>9}{'p90':>9}")
    for src, s in sources.items():
        print(f"  {src:<40}{s['n']:>7}{s['median']:>9.1%}{s['p90']:>9.1%}")


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calibration", required=True, help="folder with vidur/compute and vidur/network")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--fit", action="store_true", help="re-fit the efficiency factors on the in-sample rows")
    args = parser.parse_args(list(argv) if argv is not None else None)
    root = FsPath(args.calibration)
    if not root.is_dir():
        print(f"--calibration: {root} is not a directory", file=sys.stderr)
        return 2
    skipped: list[str] = []
    rows = read_compute(root, skipped) + read_network(root, skipped)
    if not rows:
        print(f"--calibration: no compute/ or network/ CSVs under {root}", file=sys.stderr)
        return 2
    eff = DEFAULT_EFFICIENCY
    result: dict[str, object] = {"efficiency": eff.__dict__.copy(), "skipped": skipped}
    if args.fit:
        fitted = fit(rows)
        result["fitted"] = fitted.__dict__.copy()
        print("fitted on the in-sample rows:", fitted)
        print("in use (costmodel.DEFAULT_EFFICIENCY):", eff)
        result["leave_one_model_out"] = leave_one_model_out(rows)
    print("efficiency factors:", eff)
    for note in skipped:
        print("skipped:", note)
    ins = [r for r in rows if r.in_sample]
    outs = [r for r in rows if not r.in_sample]
    rep_in = report(ins, eff)
    _print_report("IN SAMPLE (A100-80GB, Llama-3-8B/70B, a100 network setups): relative error", rep_in)
    result["in_sample"] = rep_in
    if outs:
        rep_out = report(outs, eff)
        _print_report("OUT OF SAMPLE (other GPUs / models, same factors): relative error", rep_out)
        result["out_of_sample"] = rep_out
    res = resolution(rows, eff)
    _print_resolution("RESOLUTION (every row; issue 13's groups)", res)
    result.update(res)  # physical_all, plan_rows, measured_curve: each with median and p90
    if outs:
        res_out = resolution(outs, eff)
        _print_resolution("RESOLUTION, OUT OF SAMPLE (GPUs and models not fitted on)", res_out)
        result["out_of_sample_resolution"] = res_out
    result["targets"] = targets(res, resolution(outs, eff) if outs else None)
    print("targets (reported, never asserted):")
    for name, t in result["targets"].items():  # type: ignore[union-attr]
        print(f"  {name:<48} {t['value'] if t['value'] is not None else '-':>8}  limit {t['limit']}  "
              f"{'met' if t['met'] else ('no data' if t['value'] is None else 'NOT met')}")
    measured = read_measured(root, skipped)
    if measured:
        print("\nengine steps measured by this project (bench.gpu_check; out of sample):")
        for m in measured:
            print(f"  {m['gpu']:<10} {m['model']:<10} {m['phase']:<8} batch {m['batch']:>3}  measured"
                  f" {float(m['measured_s']) * 1e3:8.2f} ms  predicted {float(m['predicted_s']) * 1e3:8.2f} ms"  # type: ignore[arg-type]
                  f"  error {float(m['error']):+6.1%}")  # type: ignore[arg-type]
        errs = np.array([abs(float(m["error"])) for m in measured])  # type: ignore[arg-type]
        result["measured_steps"] = {"rows": measured, **summary(errs)}
    anchors = decode_anchors(eff)
    print(f"\nsingle-stream decode anchors (Llama-3-8B BF16, vLLM, context {ANCHOR_CONTEXT_TOKENS}):")
    for a in anchors:
        print(f"  {a['gpu']:<10} measured {a['measured_ms']:6.2f} ms  predicted {a['predicted_ms']:6.2f} ms"
              f"  error {a['error']:+6.1%}")
    result["decode_anchors"] = anchors
    if args.json:
        FsPath(args.json).write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
