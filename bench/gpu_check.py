"""What one real GPU says about the cost model: measured, next to what the model predicts.

    python -m bench.gpu_check --json OUT [--calibration-out DIR] [--device auto|cuda|cpu]
                              [--shape llama3-8b|tiny] [--layers N] [--spec GPU]

One script, well under 8 minutes on one GPU, that records:

1. the NVML probe's report of the GPU (agents/probes/nvml.py: what an agent registers and reports);
2. the link probe's copies (agents/probes/collectives.copy_sweep): device-to-device (GPU 0 to
   GPU 1 when there are two, else within GPU 0) and host-to-device from pinned memory, in GB/s
   per message size;
3. the torch reference engine (agents/engines/torch) serving a random-weights model of a real
   shape - Llama-3-8B's config (32 layers, hidden 4096, GQA 32/8, vocab 128256) - at batch 1
   and 32: the prefill of the batch's prompts and the decode step, measured, next to
   scheduler.costmodel's prediction for that GPU and that model (the engine computes in float32,
   so the prediction is for float32 weights and KV: the ModelSpec is read from the model
   folder's own config.json, as the console's registry reads one);
4. a KV export and import of one sequence (TorchEngine.export_kv / import_kv): its bytes, the
   time each way, and that the imported sequence goes on with the very tokens it would have.

Without a GPU (`--device auto` and no NVIDIA driver) it says so, writes that to OUT, and exits
0. `--device cpu --shape tiny` runs the same code on this machine's CPU at a tiny shape (the
project's test model): the structure and the arithmetic, not a GPU's figures - what the tests
run. `--calibration-out DIR` appends the measured step rows to DIR/measured/<gpu>/steps.csv,
marked as measured by this project with the date and the GPU; bench.fidelity reads that file
shape as out-of-sample rows.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

BUDGET_S = 8 * 60  # the whole check must stay under this on one GPU
SHAPES = {
    # Llama-3-8B's config.json (https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json)
    "llama3-8b": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                  "head_dim": 128, "intermediate_size": 14336, "vocab_size": 128256,
                  "max_position_embeddings": 8192, "rope_theta": 500000.0},
    "tiny": {},  # agents/engines/torch/weights.py's TinyLlamaShape defaults
}
STEPS_FIELDS = ("gpu", "model", "layers", "phase", "batch", "prompt_tokens", "context_tokens", "measured_s",
                "predicted_s", "dtype_bytes", "date", "source")
SOURCE = "flexpipe bench.gpu_check (measured by this project)"


class NoGpu(Exception):
    pass


def nvml_report() -> dict[str, Any]:
    """The NVML probe's registration and report of this machine's GPUs (NoGpu without a driver)."""
    from agents.probes import NoGpuError
    from agents.probes.nvml import NvmlProbe

    try:
        probe = NvmlProbe.open()
    except NoGpuError as exc:
        raise NoGpu(str(exc)) from None
    try:
        return {"gpus": [asdict(g) for g in probe.gpus()], "report": [asdict(r) for r in probe.report()]}
    finally:
        probe.close()


def copy_report(device: str, sizes: Sequence[int]) -> dict[str, Any]:
    """Device-to-device and host-to-device copy sweeps, GB/s per size."""
    import torch

    from agents.probes.collectives import copy_sweep

    if device == "cuda":
        dst = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
        d2d = copy_sweep("cuda:0", dst, sizes=sizes)
        h2d = copy_sweep("cpu", "cuda:0", sizes=sizes)
    else:  # the CPU stand-in: memory copies, so the path is exercised
        dst = "cpu"
        d2d = copy_sweep("cpu", "cpu", sizes=sizes)
        h2d = d2d

    def rows(points: Iterable[tuple[int, float]]) -> list[dict[str, float]]:
        return [{"bytes": b, "seconds": s, "gb_per_s": round(b / s / 1e9, 3)} for b, s in points]

    return {"d2d": {"src": "cuda:0" if device == "cuda" else "cpu", "dst": dst, "points": rows(d2d),
                    "best_gb_per_s": round(max(b / s for b, s in d2d) / 1e9, 3)},
            "h2d": {"points": rows(h2d), "best_gb_per_s": round(max(b / s for b, s in h2d) / 1e9, 3)}}


def make_model(folder: Path, shape: str, layers: int | None) -> Path:
    """A random-weights model folder of that shape (float32, as the torch engine computes)."""
    from agents.engines.torch.weights import TinyLlamaShape, make_tiny_llama

    dims = dict(SHAPES[shape])
    if layers is not None:
        dims["num_hidden_layers"] = layers
    make_tiny_llama(folder, seed=0, shape=TinyLlamaShape(**dims))  # type: ignore[arg-type]
    return folder


def shape_model(shape: str, layers: int | None = None) -> Any:
    """The ModelSpec of a check's model (float32, as the engine computes): what its folder's
    config.json says, without writing the folder (bench.fidelity reads measured rows with it)."""
    from agents.engines.torch.weights import TinyLlamaShape, hf_config
    from scheduler.modelspec import from_hf_config

    dims = dict(SHAPES[shape])
    if layers is not None:
        dims["num_hidden_layers"] = layers
    return from_hf_config(hf_config(TinyLlamaShape(**dims)), name=f"gpu-check-{shape}")  # type: ignore[arg-type]


def predict(model: Any, spec_name: str, batch: int, prompt_tokens: int, context_tokens: int
            ) -> tuple[float, float, int]:
    """(prefill of `batch` prompts, one decode step of `batch` sequences at `context_tokens`,
    dtype bytes) by scheduler.costmodel on one GPU of `spec_name`, for `model` (a ModelSpec)."""
    from scheduler.costmodel import MAX_BATCHED_TOKENS, PlanProfile
    from scheduler.hardware import CATALOG
    from scheduler.plan import Plan, Stage
    from scheduler.topology import GpuState, NodeState, Snapshot

    spec = CATALOG[spec_name]
    snap = Snapshot(now_s=0.0, nodes=(NodeState("n", "r"),),
                    gpus=(GpuState("g0", "n", 0, spec_name, spec.mem_bytes, 0),))
    plan = Plan(model.name, "colocated", (Stage(0, model.num_layers, ("g0",)),), kv_reserve_tokens=4096)
    pipe = PlanProfile.build(plan, model, snap).pipeline("prefill")
    # the batch's prompts in chunks of the engine's token budget (set to the cost model's)
    total = batch * prompt_tokens
    prefill = 0.0
    done = 0
    while done < total:
        chunk = min(MAX_BATCHED_TOKENS, total - done)
        seqs = max(1, math.ceil(chunk / prompt_tokens))
        prefill += pipe.latency_interval(chunk, seqs, 0)[0]
        done += chunk
    return prefill, pipe.decode_step_s(batch, context_tokens), model.dtype_bytes


def engine_report(model_dir: Path, model: Any, device: str, spec_name: str, batches: Sequence[int],
                  prompt_tokens: int, decode_steps: int) -> dict[str, Any]:
    """The torch engine's prefill and decode step at each batch size, measured and predicted."""
    from agents.engines.torch.engine import TorchEngine
    from agents.engines.torch.layout import Layout
    from agents.engines.torch.model import ModelConfig
    from agents.engines.torch.sampling import SamplingParams
    from scheduler.costmodel import MAX_BATCHED_TOKENS

    cfg = ModelConfig.from_dir(model_dir)
    greedy = SamplingParams(ignore_eos=True)
    out: dict[str, Any] = {"layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
                           "batches": []}
    blocks = max(batches) * (prompt_tokens + decode_steps + 8) // 16 + 64
    engine = TorchEngine(model_dir, Layout.pipeline(cfg.num_layers, pp=1, tp=1), device=device,
                         gpus=[0] if device == "cuda" else None, num_kv_blocks=blocks,
                         max_tokens_per_step=MAX_BATCHED_TOKENS, timeout_s=600.0)
    try:
        for batch in batches:
            ids = [f"b{batch}-{i}" for i in range(batch)]
            for i, sid in enumerate(ids):
                prompt = [(7 * i + j) % (cfg.vocab_size - 3) + 3 for j in range(prompt_tokens)]
                engine.add_request(sid, prompt, max_new_tokens=decode_steps + 2, sampling=greedy)
            t0 = time.perf_counter()
            first: set[str] = set()  # a sequence's first token ends its prefill (its TTFT)
            while len(first) < batch:
                first.update(sid for sid, _, _ in engine.step())
            prefill_s = time.perf_counter() - t0
            steps = []
            for _ in range(decode_steps):
                t = time.perf_counter()
                engine.step()
                steps.append(time.perf_counter() - t)
            for sid in ids:
                engine.drop(sid)
            decode_s = statistics.median(steps)
            pred_prefill, pred_decode, dtype_bytes = predict(model, spec_name, batch, prompt_tokens,
                                                             prompt_tokens + decode_steps // 2)
            out["batches"].append({
                "batch": batch, "prompt_tokens": prompt_tokens, "decode_steps": decode_steps,
                "prefill_s": {"measured": prefill_s, "predicted": pred_prefill},
                "decode_step_s": {"measured": decode_s, "predicted": pred_decode},
                "dtype_bytes": dtype_bytes,
            })
        out["kv"] = kv_roundtrip(engine, cfg.vocab_size, prompt_tokens, greedy)
    finally:
        engine.shutdown()
    return out


def kv_roundtrip(engine: Any, vocab: int, prompt_tokens: int, sampling: Any) -> dict[str, Any]:
    """Export one decoding sequence's KV, import it back as another, and check it continues with
    the very tokens the original would have produced."""
    prompt = [(11 * j) % (vocab - 3) + 3 for j in range(prompt_tokens)]
    engine.add_request("kv-a", prompt, max_new_tokens=12, sampling=sampling)
    engine.add_request("kv-ref", prompt, max_new_tokens=12, sampling=sampling)
    tokens: dict[str, list[int]] = {"kv-a": [], "kv-ref": []}
    while len(tokens["kv-a"]) < 4:
        for sid, tok, _ in engine.step():
            tokens.setdefault(sid, []).append(tok)
    t0 = time.perf_counter()
    state = engine.export_kv("kv-a")
    export_s = time.perf_counter() - t0
    engine.drop("kv-a")
    t1 = time.perf_counter()
    engine.import_kv("kv-b", replace(state, seq_id="kv-b"))
    import_s = time.perf_counter() - t1
    tokens["kv-b"] = list(tokens["kv-a"])
    while engine.has_unfinished():
        for sid, tok, _ in engine.step():
            tokens.setdefault(sid, []).append(tok)
    return {"kv_bytes": state.kv_bytes, "cached_tokens": state.num_cached_tokens, "export_s": export_s,
            "import_s": import_s, "same_tokens_after_import": tokens["kv-b"] == tokens["kv-ref"]}


def write_calibration(root: Path, gpu: str, model: str, engine: dict[str, Any], date: str) -> Path:
    """Append the measured step rows to root/measured/<gpu>/steps.csv (bench.fidelity reads it)."""
    path = root / "measured" / gpu / "steps.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    with path.open("a", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=STEPS_FIELDS)
        if new:
            w.writeheader()
        for b in engine["batches"]:
            for phase, key, ctx in (("prefill", "prefill_s", 0), ("decode", "decode_step_s",
                                                                   b["prompt_tokens"] + b["decode_steps"] // 2)):
                w.writerow({"gpu": gpu, "model": model, "layers": engine["layers"], "phase": phase, "batch": b["batch"],
                            "prompt_tokens": b["prompt_tokens"], "context_tokens": ctx,
                            "measured_s": f"{b[key]['measured']:.6g}", "predicted_s": f"{b[key]['predicted']:.6g}",
                            "dtype_bytes": b["dtype_bytes"], "date": date, "source": SOURCE})
    return path


def _catalog_name(nvml_name: str) -> str | None:
    from agents.probes.gpu_names import catalog_name

    return catalog_name(nvml_name)


def main(argv: Iterable[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("--json", required=True, help="write the results here")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--shape", choices=tuple(SHAPES), default="llama3-8b")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's (a quicker check)")
    p.add_argument("--spec", default=None, help="catalog GPU to predict for (default: the GPU NVML names)")
    p.add_argument("--batches", default="1,32", help="batch sizes (default 1,32)")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--calibration-out", default=None, help="append the measured rows to DIR/measured/<gpu>/steps.csv")
    args = p.parse_args(list(argv) if argv is not None else None)
    try:
        batches = [int(x) for x in args.batches.split(",") if x.strip()]
        if not batches or min(batches) < 1:
            raise ValueError
    except ValueError:
        p.error("--batches: comma-separated integers >= 1, e.g. 1,32")
    if args.layers is not None and args.layers < 1:
        p.error("--layers: must be >= 1")
    started = time.monotonic()
    out_path = Path(args.json)
    result: dict[str, Any] = {"started_at": datetime.now(UTC).isoformat(timespec="seconds"), "device": args.device,
                              "shape": args.shape}
    if args.device in ("auto", "cuda"):
        try:
            result["nvml"] = nvml_report()
            device = "cuda"
        except NoGpu as exc:
            if args.device == "cuda":
                print(f"gpu_check: --device cuda but {exc}", file=sys.stderr)
                return 2
            result["skipped"] = f"no GPU: {exc}"
            out_path.write_text(json.dumps(result, indent=2) + "\n")
            print(f"gpu_check: no GPU here ({exc}); nothing measured, wrote {out_path}")
            return 0
    else:
        device = "cpu"
    gpu_name = (result["nvml"]["gpus"][0]["model"] if "nvml" in result else "cpu")
    spec_name = args.spec or _catalog_name(gpu_name) or (gpu_name if device == "cuda" else "A100-80G")
    from scheduler.hardware import CATALOG

    if spec_name not in CATALOG:
        print(f"gpu_check: --spec {spec_name!r} is not in scheduler.hardware's catalog; give one with --spec",
              file=sys.stderr)
        return 2
    result["predicted_for"] = spec_name
    sizes = tuple(8 * 1024 * 4**i for i in range(9)) if device == "cuda" else (4096, 1 << 16, 1 << 20)
    result["copies"] = copy_report(device, sizes)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        t0 = time.monotonic()
        folder = make_model(Path(tmp) / "model", args.shape, args.layers)
        result["model_written_s"] = round(time.monotonic() - t0, 2)
        result["engine"] = engine_report(folder, shape_model(args.shape, args.layers), device, spec_name, batches,
                                         args.prompt_tokens, args.decode_steps)
    result["wall_s"] = round(time.monotonic() - started, 2)
    result["within_budget"] = result["wall_s"] < BUDGET_S
    if args.calibration_out and device == "cuda":
        result["calibration_file"] = str(write_calibration(Path(args.calibration_out), spec_name, args.shape,
                                                           result["engine"], result["started_at"][:10]))
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    for b in result["engine"]["batches"]:
        print(f"batch {b['batch']:>3}: prefill {b['prefill_s']['predicted'] * 1e3:8.2f} ms predicted ->"
              f" {b['prefill_s']['measured'] * 1e3:8.2f} ms measured; decode step"
              f" {b['decode_step_s']['predicted'] * 1e3:7.2f} ms -> {b['decode_step_s']['measured'] * 1e3:7.2f} ms")
    kv = result["engine"]["kv"]
    print(f"KV of one sequence: {kv['kv_bytes']} bytes, export {kv['export_s'] * 1e3:.1f} ms, import"
          f" {kv['import_s'] * 1e3:.1f} ms, continues with the same tokens: {kv['same_tokens_after_import']}")
    print(f"copies: d2d {result['copies']['d2d']['best_gb_per_s']} GB/s, h2d {result['copies']['h2d']['best_gb_per_s']}"
          f" GB/s; whole check {result['wall_s']} s; wrote {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
