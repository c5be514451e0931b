"""Gear switches of the torch reference engine, measured: stall per sequence and bytes moved.

    python -m bench.engine_switch [--json PATH] [--device cpu|cuda]

For each switch kind and both paths (migrate: KV over a real TCP socket and re-sharded; replay:
re-prefill from the tokens), sequences are switched one at a time while the old engine keeps
decoding the rest — a rolling hand-over. Per sequence it prints the stall (end of the old
engine's last step -> the sequence's first token on the new engine) and the bytes moved, and
checks the tokens against a run without a switch. The baseline in the same run: the engine's
decode throughput with 1 and 8 sequences on each layout, and its step time, so each stall is
also given in decode steps of the old layout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

from agents.engines.torch.engine import StepOutput, TorchEngine
from agents.engines.torch.layout import Layout
from agents.engines.torch.sampling import SamplingParams
from agents.engines.torch.switch import SwitchRecord, TcpLink, switch_sequences
from agents.engines.torch.weights import make_tiny_llama

LAYOUTS = {
    "TP1": Layout.pipeline(4),
    "TP2": Layout.pipeline(4, tp=2),
    "TP1xPP2": Layout.pipeline(4, pp=2),
    "TP2xPP2": Layout.pipeline(4, pp=2, tp=2),
    "disagg(P:TP1|D:TP2)": Layout.disaggregated(4, prefill_tp=1, decode_tp=2),
}
KINDS = [
    ("TP2", "TP1xPP2"),
    ("TP1xPP2", "TP2"),
    ("TP2", "disagg(P:TP1|D:TP2)"),
    ("disagg(P:TP1|D:TP2)", "TP2"),
    ("TP1", "TP2xPP2"),
]


@dataclass
class Throughput:
    layout: str
    seqs: int
    tokens_per_s: float  # decode tokens per second, prefill excluded
    step_ms: float  # mean decode step


@dataclass
class SwitchRow:
    kind: str
    path: str
    seq_id: str
    tokens_before: int  # generated on the old layout
    stall_ms: float
    stall_steps: float  # stall / the old layout's decode step with as many sequences
    bytes_moved: int
    kv_bytes: int
    tokens_recomputed: int


def prompts(n: int, length: int) -> list[list[int]]:
    return [[(7 * i + 13 * j + 3) % 509 + 3 for j in range(length)] for i in range(n)]


def sampling(i: int) -> SamplingParams:
    # Half greedy, half seeded: both must come through unchanged.
    if i % 2 == 0:
        return SamplingParams(ignore_eos=True)
    return SamplingParams(temperature=0.8, top_p=0.9, seed=1000 + i, ignore_eos=True)


def throughput(engine: TorchEngine, name: str, seqs: int, prompt_len: int, new_tokens: int) -> Throughput:
    for i, p in enumerate(prompts(seqs, prompt_len)):
        engine.add_request(f"t{i}", p, new_tokens, sampling(i))
    engine.step()  # the prefill (disaggregated: the prefill and the hand-over)
    tokens, steps = 0, 0
    start = time.perf_counter()
    while engine.has_unfinished():
        tokens += len(engine.step())
        steps += 1
    wall_s = time.perf_counter() - start
    return Throughput(name, seqs, tokens / wall_s, 1e3 * wall_s / steps)


def run_plain(engine: TorchEngine, seqs: int, prompt_len: int, new_tokens: int) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts(seqs, prompt_len)):
        engine.add_request(f"s{i}", p, new_tokens, sampling(i))
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.seq_id, []).append(o.token_id)
    return out


def rolling_switch(
    old: TorchEngine, new: TorchEngine, path: str, seqs: int, prompt_len: int, new_tokens: int, switch_at: int
) -> tuple[dict[str, list[int]], list[tuple[str, int, SwitchRecord]]]:
    """Start `seqs` sequences on old; after `switch_at` steps move them one by one to new, old
    stepping the rest between two moves; finish on new."""
    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts(seqs, prompt_len)):
        old.add_request(f"s{i}", p, new_tokens, sampling(i))

    def record(outputs: list[StepOutput]) -> None:
        for o in outputs:
            out.setdefault(o.seq_id, []).append(o.token_id)

    for _ in range(switch_at):
        record(old.step())
    records = []
    link = TcpLink(expect_model_sha256=new.model_sha256)
    try:
        for i in range(seqs):
            seq_id = f"s{i}"
            before = len(out.get(seq_id, []))
            result = switch_sequences(old, new, [seq_id], path=path, link=link)  # type: ignore[arg-type]
            record(result.outputs)
            records.append((seq_id, before, result.records[seq_id]))
            if old.has_unfinished():
                record(old.step())  # the old plan keeps serving the rest
    finally:
        link.close()
    while new.has_unfinished():
        record(new.step())
    return out, records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--seqs", type=int, default=4, help="sequences switched per run")
    parser.add_argument("--prompt-len", type=int, default=48)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--switch-at", type=int, default=12, help="old-engine steps before the first move")
    args = parser.parse_args(argv)
    if not 1 <= args.switch_at < args.new_tokens:
        parser.error("--switch-at: must be in [1, --new-tokens)")

    with tempfile.TemporaryDirectory() as tmp:
        sha = make_tiny_llama(tmp)
        print(f"model: tiny llama (4 layers, hidden 64, 4 heads / 2 KV heads), sha256 {sha[:16]}...")
        engines = {name: TorchEngine(tmp, layout, device=args.device) for name, layout in LAYOUTS.items()}
        try:
            rates = [
                throughput(engines[name], name, n, args.prompt_len, 64) for name in engines for n in (1, 8)
            ]
            step_ms = {(r.layout, r.seqs): r.step_ms for r in rates}
            print("\nbaseline: decode throughput (prefill excluded), 64 tokens per sequence")
            print(f"  {'layout':22} {'seqs':>4} {'tokens/s':>10} {'step ms':>8}")
            for rate in rates:
                print(f"  {rate.layout:22} {rate.seqs:>4} {rate.tokens_per_s:>10.0f} {rate.step_ms:>8.2f}")

            rows: list[SwitchRow] = []
            exact: dict[str, bool] = {}
            for old_name, new_name in KINDS:
                old, new = engines[old_name], engines[new_name]
                baseline = run_plain(old, args.seqs, args.prompt_len, args.new_tokens)
                for path in ("migrate", "replay"):
                    kind = f"{old_name} -> {new_name}"
                    out, records = rolling_switch(
                        old, new, path, args.seqs, args.prompt_len, args.new_tokens, args.switch_at
                    )
                    exact[f"{kind} / {path}"] = out == baseline
                    ref_step = step_ms.get((old_name, 8), 1.0)
                    for seq_id, before, rec in records:
                        rows.append(
                            SwitchRow(
                                kind,
                                path,
                                seq_id,
                                before,
                                1e3 * rec.stall_s,
                                1e3 * rec.stall_s / ref_step,
                                rec.bytes_moved,
                                rec.kv_bytes,
                                rec.tokens_recomputed,
                            )
                        )
        finally:
            for engine in engines.values():
                engine.shutdown()

    print(
        f"\nswitches: {args.seqs} sequences of {args.prompt_len} prompt tokens, moved one at a time "
        f"after {args.switch_at} steps; KV over TCP on this host"
    )
    print(
        f"  {'kind':36} {'path':8} {'seq':4} {'before':>6} {'stall ms':>9} {'x step':>7} "
        f"{'bytes moved':>12} {'recomputed':>10}"
    )
    for r in rows:
        print(
            f"  {r.kind:36} {r.path:8} {r.seq_id:4} {r.tokens_before:>6} {r.stall_ms:>9.2f} {r.stall_steps:>7.1f} "
            f"{r.bytes_moved:>12,} {r.tokens_recomputed:>10}"
        )
    print("\nsummary per kind and path (mean over sequences)")
    print(f"  {'kind':36} {'path':8} {'stall ms':>9} {'bytes/seq':>10} {'token-exact':>11}")
    summary = []
    for old_name, new_name in KINDS:
        kind = f"{old_name} -> {new_name}"
        for path in ("migrate", "replay"):
            mine = [r for r in rows if r.kind == kind and r.path == path]
            item: dict[str, object] = {
                "kind": kind,
                "path": path,
                "stall_ms_mean": statistics.mean(r.stall_ms for r in mine),
                "stall_ms_max": max(r.stall_ms for r in mine),
                "bytes_moved_mean": statistics.mean(r.bytes_moved for r in mine),
                "token_exact": exact[f"{kind} / {path}"],
            }
            summary.append(item)
            print(
                f"  {kind:36} {path:8} {item['stall_ms_mean']:>9.2f} {item['bytes_moved_mean']:>10,.0f} "
                f"{'yes' if item['token_exact'] else 'NO':>11}"
            )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "args": vars(args),
                    "throughput": [asdict(rate) for rate in rates],
                    "switches": [asdict(r) for r in rows],
                    "summary": summary,
                },
                fh,
                indent=2,
            )
        print(f"\nwrote {args.json}")
    return 0 if all(exact.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
