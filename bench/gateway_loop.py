"""How long the gateway's event loop stands still while huge prompts are tokenized.

    python -m bench.gateway_loop [--prompts 3] [--chars 2400000] [--json PATH]

daphne's one event loop serves every request of the process: the agents' long polls, websockets,
API calls and /healthz. A probe on the loop wakes every 5 ms; how much later than that it wakes is
how long a request arriving then waits for the loop while --prompts prompts of --chars characters
are tokenized by the tiny model's tokenizer (agents.engines.torch.weights, made here, no download):

    on the loop  the baseline: what the gateway did before issue 18 (encode() inside the async view)
    pool         console.gateway.cpu.run(tokens.ModelTokenizer.encode): the gateway now

Printed: the probe's longest and 99th-percentile wait for each, and the baseline against the pool.
The gateway now also refuses a prompt too long for the context before tokenizing it
(tokens.ModelTokenizer.max_prompt_chars); the last line is how long that refusal takes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")


PING_S = 0.005


async def _probe(stop: asyncio.Event, waits: list[float]) -> None:
    """Wakes every PING_S; how much later than that it woke is how long a request would have waited."""
    last = time.monotonic()
    while not stop.is_set():
        await asyncio.sleep(PING_S)
        now = time.monotonic()
        waits.append(max(0.0, now - last - PING_S))
        last = now


async def _run(tok: Any, text: str, prompts: int, *, on_loop: bool) -> dict[str, float]:
    from console.gateway import cpu

    async def one() -> int:
        if on_loop:
            return len(tok.encode(text))
        return len(await cpu.run(tok.encode, text))

    stop, waits = asyncio.Event(), []
    probe = asyncio.ensure_future(_probe(stop, waits))
    await asyncio.sleep(0.05)
    t0 = time.monotonic()
    await asyncio.gather(*(one() for _ in range(prompts)))
    took_s = time.monotonic() - t0
    stop.set()
    await probe
    waits.sort()
    return {"max_wait_ms": 1000 * waits[-1], "p99_wait_ms": 1000 * waits[int(0.99 * (len(waits) - 1))],
            "median_wait_ms": 1000 * statistics.median(waits), "pings": len(waits), "took_s": took_s}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gateway_loop", description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--chars", type=int, default=2_400_000)
    p.add_argument("--json", default=None, help="write the figures here too")
    args = p.parse_args(argv)
    if args.prompts < 1 or args.chars < 1:
        p.error("--prompts and --chars must be >= 1")
    import django

    django.setup()
    from agents.engines.torch.weights import make_tiny_llama
    from console.gateway import tokens

    with tempfile.TemporaryDirectory() as tmp:
        make_tiny_llama(Path(tmp))
        tok = tokens.load(tmp)
        text = ("The quick brown fox jumps over the lazy dog. 12345 " * (args.chars // 40 + 1))[:args.chars]
        base = asyncio.run(_run(tok, text, args.prompts, on_loop=True))
        pool = asyncio.run(_run(tok, text, args.prompts, on_loop=False))
        t0 = time.monotonic()
        refused = len(text) > tok.max_prompt_chars()
        refuse_ms = 1000 * (time.monotonic() - t0)
    print(f"{args.prompts} prompts of {args.chars:,} characters, tiny model tokenizer")
    print(f"{'':12} {'longest wait':>13} {'p99 wait':>10} {'median':>8} {'pings':>6} {'tokenizing':>11}")
    for name, r in (("on the loop", base), ("pool", pool)):
        print(f"{name:12} {r['max_wait_ms']:10.1f} ms {r['p99_wait_ms']:7.1f} ms {r['median_wait_ms']:5.2f} ms "
              f"{r['pings']:6d} {r['took_s']:9.2f} s")
    print(f"longest wait, on the loop / pool: {base['max_wait_ms'] / max(pool['max_wait_ms'], 1e-3):.0f}x")
    print(f"size check refuses it before tokenizing: {refused} ({refuse_ms:.3f} ms; limit "
          f"{tok.max_prompt_chars():,} characters)")
    if args.json:
        Path(args.json).write_text(json.dumps({"on_loop": base, "pool": pool, "refused_by_size": refused}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
