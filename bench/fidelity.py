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

This module holds the report (`report`, the issue-13 groups in `resolution`, `targets`, the decode
anchors) and the command line; the rows and their readers live in bench._fidelity_rows, the fit in
bench._fidelity_fit, and every name is importable from here as before.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path as FsPath

import numpy as np

from bench._fidelity_fit import fit, fit_compute, fit_links, fit_p2p, leave_one_model_out
from bench._fidelity_rows import (
    GPU_FOLDERS,
    IN_SAMPLE_GPUS,
    IN_SAMPLE_MODELS,
    IN_SAMPLE_SETUPS,
    NETWORK_SETUPS,
    OPS,
    Row,
    predict,
    read_compute,
    read_measured,
    read_network,
    rel_errors,
    row_path,
    summary,
)
from scheduler import costmodel
from scheduler.costmodel import DEFAULT_EFFICIENCY, Efficiency
from scheduler.hardware import CATALOG
from scheduler.modelspec import model_spec

# everything bench.fidelity offered before the rows and the fit moved out (tests and
# bench.gpu_check's docs name bench.fidelity), the re-exported names with this module's own
__all__ = [
    "GPU_FOLDERS", "IN_SAMPLE_GPUS", "IN_SAMPLE_MODELS", "IN_SAMPLE_SETUPS", "NETWORK_SETUPS", "OPS", "Row",
    "fit", "fit_compute", "fit_links", "fit_p2p", "leave_one_model_out", "predict", "read_compute",
    "read_measured", "read_network", "rel_errors", "row_path", "summary",
    "ANCHOR_CONTEXT_TOKENS", "DECODE_ANCHORS", "RESOLUTION_TARGETS", "SIZE_RANGES", "TOKEN_RANGES",
    "curve_errors", "decode_anchors", "main", "plan_row", "report", "resolution", "targets",
]

TOKEN_RANGES = ((1, 64), (64, 512), (512, 4096), (4096, 1 << 30))
SIZE_RANGES = ((0, 1 << 20), (1 << 20, 16 << 20), (16 << 20, 1 << 40))

# Single-stream decode, Llama-3-8B BF16, measured with vLLM (issue 3): seconds per token.
DECODE_ANCHORS = (("H100-SXM", 6.5e-3), ("A100-40G", 13.0e-3))
ANCHOR_CONTEXT_TOKENS = 512


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



# --- printing ----------------------------------------------------------------------------------
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
