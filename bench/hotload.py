"""Hot load on the torch engine: weights from the node's host-memory cache against the disk, and
the first requests' latency with and without a warm-up.

    python -m bench.hotload [--layers 8] [--repeat 3] [--warmup-tokens 16] [--json PATH]

The model is a random-weights Llama of a few hundred MB (float32, written to a temporary folder
on the disk). Two ways to bring a plan up, alternated `--repeat` times, medians reported:

* disk: the weights file is first dropped from the kernel's page cache (fsync, then
  posix_fadvise DONTNEED), so the engine reads it from the device as a node that never loaded the
  model would;
* host_cache: the folder is in agents.node.weightcache.HostWeightCache (a RAM file system), as
  after a first load or on a node that keeps the model warm for a scale-from-zero.

For each: the raw read rate of the weights file (GB/s) and the time to an engine that serves
(TorchEngine: worker start and its shard of the weights; the node's model store hashed the
weights once before, as in production, so the engine does not hash them again), and the ratio
host_cache / disk of both. The baseline is the disk path measured in the same run.

Warm-up: `--starts` fresh engines (from the cache) with `warmup_tokens` 0 and N, then the same
`--requests` requests one after another; per request the time from admission to its first token.
The spread (std) of those first-token times is what a warm-up is for: the first forward passes
of a new process pay for allocations and thread pools that later ones do not.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from agents.engines.torch.engine import TorchEngine
from agents.engines.torch.layout import Layout
from agents.engines.torch.sampling import SamplingParams
from agents.engines.torch.weights import WEIGHTS_FILE, TinyLlamaShape, make_tiny_llama
from agents.node.weightcache import HostWeightCache

CHUNK_BYTES = 8 << 20


def model_shape(layers: int, hidden: int = 1024) -> TinyLlamaShape:
    """Llama proportions (head_dim 64, GQA 2:1, MLP 2.75x): at hidden 1024, about 55 MB of float32
    weights per layer plus 67 MB of embeddings."""
    heads = max(2, hidden // 64)
    return TinyLlamaShape(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                          num_key_value_heads=heads // 2, head_dim=64, intermediate_size=hidden * 11 // 4,
                          vocab_size=8192, max_position_embeddings=2048)


def drop_page_cache(path: Path) -> None:
    """Ask the kernel to forget the file's cached pages (its next read comes from the device)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_gbps(path: Path) -> float:
    size = path.stat().st_size
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as fh:
        while fh.read(CHUNK_BYTES):
            pass
    return size / (time.perf_counter() - t0) / 1e9


def engine_start_s(folder: Path, digest: str) -> float:
    """Worker start and each rank's shard of the weights; the digest is the node's (not re-hashed)."""
    t0 = time.perf_counter()
    engine = TorchEngine(folder, Layout.pipeline(_layers(folder)), device="cpu", num_kv_blocks=64, timeout_s=300,
                         verified_sha256=digest)
    dt = time.perf_counter() - t0
    engine.shutdown()
    return dt


def _layers(folder: Path) -> int:
    return int(json.loads((folder / "config.json").read_text())["num_hidden_layers"])


def first_token_s(folder: Path, warmup_tokens: int, requests: int, prompt_tokens: int) -> list[float]:
    """A fresh engine, its warm-up, then `requests` requests one after another: each one's time
    from admission to its first token."""
    engine = TorchEngine(folder, Layout.pipeline(_layers(folder)), device="cpu", num_kv_blocks=64, timeout_s=300)
    try:
        engine.warm_up(warmup_tokens)
        out = []
        prompt = [(7 * i) % 8000 + 3 for i in range(prompt_tokens)]
        for r in range(requests):
            t0 = time.perf_counter()
            engine.add_request(f"r{r}", prompt, 1, SamplingParams(ignore_eos=True))
            while engine.has_unfinished():
                engine.step()
            out.append(time.perf_counter() - t0)
        return out
    finally:
        engine.shutdown()


def run(layers: int, repeat: int, warmup_tokens: int, starts: int, requests: int, prompt_tokens: int,
        work: Path, hidden: int = 1024) -> dict[str, Any]:
    disk = work / "disk-model"
    digest = make_tiny_llama(disk, shape=model_shape(layers, hidden))
    weights = disk / WEIGHTS_FILE
    size = weights.stat().st_size
    cache = HostWeightCache(work / "host-cache", 4 * size)
    t0 = time.perf_counter()
    fetched = cache.fetch(disk, digest)
    copy_in_s = time.perf_counter() - t0
    cached = fetched.folder
    rows: dict[str, dict[str, list[float]]] = {"disk": {"read_gbps": [], "start_s": []},
                                              "host_cache": {"read_gbps": [], "start_s": []}}
    engine_start_s(cached, digest)  # the first engine of a process also starts the workers' forkserver: not counted
    for i in range(repeat):
        for source in (("disk", "host_cache") if i % 2 == 0 else ("host_cache", "disk")):
            folder = disk if source == "disk" else cached
            if source == "disk":
                drop_page_cache(weights)
            rows[source]["read_gbps"].append(read_gbps(folder / WEIGHTS_FILE))
            if source == "disk":
                drop_page_cache(weights)
            rows[source]["start_s"].append(engine_start_s(folder, digest))
    load: dict[str, Any] = {}
    for source, r in rows.items():
        start = statistics.median(r["start_s"])
        load[source] = {"read_gbps": round(statistics.median(r["read_gbps"]), 3), "start_s": round(start, 6),
                        "start_gbps": round(size / start / 1e9, 3), "start_s_all": [round(x, 6) for x in r["start_s"]]}
    warm: dict[str, Any] = {}
    for tokens in (0, warmup_tokens):
        firsts, alls = [], []
        for _ in range(starts):
            times = first_token_s(cached, tokens, requests, prompt_tokens)
            firsts.append(times[0])
            alls.extend(times)
        warm[str(tokens)] = {"first_request_ms_mean": round(1e3 * statistics.mean(firsts), 2),
                             "first_request_ms_std": round(1e3 * statistics.pstdev(firsts), 2),
                             "all_requests_ms_mean": round(1e3 * statistics.mean(alls), 2),
                             "all_requests_ms_std": round(1e3 * statistics.pstdev(alls), 2)}
    cache.release(digest)
    return {
        "weights_bytes": size, "layers": layers, "repeat": repeat, "copy_in_s": round(copy_in_s, 3),
        "load": load,
        "ratios": {"read_gbps_host_over_disk": round(load["host_cache"]["read_gbps"] / load["disk"]["read_gbps"], 3),
                   "start_speedup_host_over_disk": round(load["disk"]["start_s"] / load["host_cache"]["start_s"], 3)},
        "warmup": {"tokens": warmup_tokens, "starts": starts, "requests": requests, "prompt_tokens": prompt_tokens,
                   "by_warmup_tokens": warm},
    }


def render(r: dict[str, Any]) -> str:
    load = r["load"]
    lines = [f"weights: {r['weights_bytes'] / 1e6:.0f} MB float32 ({r['layers']} layers); copied into the "
             f"host cache once in {r['copy_in_s']:.2f} s; medians of {r['repeat']}",
             f"{'source':12}{'read GB/s':>12}{'engine up s':>14}{'engine GB/s':>14}"]
    for source in ("disk", "host_cache"):
        x = load[source]
        lines.append(f"{source:12}{x['read_gbps']:>12.3f}{x['start_s']:>14.3f}{x['start_gbps']:>14.3f}")
    lines.append(f"host_cache / disk: read {r['ratios']['read_gbps_host_over_disk']:.2f}x, engine up "
                 f"{r['ratios']['start_speedup_host_over_disk']:.2f}x faster")
    w = r["warmup"]
    lines.append(f"first-token latency over {w['starts']} fresh engines x {w['requests']} requests "
                 f"({w['prompt_tokens']}-token prompts):")
    for tokens, x in w["by_warmup_tokens"].items():
        lines.append(f"  warm-up {tokens:>4} tokens: first request {x['first_request_ms_mean']:.1f} ms "
                     f"(std {x['first_request_ms_std']:.1f}), all {x['all_requests_ms_mean']:.1f} ms "
                     f"(std {x['all_requests_ms_std']:.1f})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.hotload", description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8, help="model layers (about 55 MB each at hidden 1024, plus 67 MB)")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size (a multiple of 128)")
    p.add_argument("--repeat", type=int, default=3, help="loads per source (medians)")
    p.add_argument("--warmup-tokens", type=int, default=16)
    p.add_argument("--starts", type=int, default=5, help="fresh engines per warm-up setting")
    p.add_argument("--requests", type=int, default=4, help="requests after each start")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--dir", default=".run", help="a folder on the disk for the model's disk copy (default: .run; "
                                                 "not a RAM file system, or both sources are RAM)")
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)
    for name in ("layers", "repeat", "starts", "requests", "prompt_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be >= 1")
    if args.hidden < 128 or args.hidden % 128:
        p.error("--hidden: must be a multiple of 128")
    if args.warmup_tokens < 1:
        p.error("--warmup-tokens: must be >= 1 (it is compared with none)")
    if not Path("/dev/shm").is_dir():
        print("bench.hotload: no /dev/shm on this host: no RAM file system for the host cache", file=sys.stderr)
        return 2
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp, tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        work = Path(tmp)
        (work / "host-cache").symlink_to(shm, target_is_directory=True)
        result = run(args.layers, args.repeat, args.warmup_tokens, args.starts, args.requests, args.prompt_tokens, work,
                     args.hidden)
    print(render(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
