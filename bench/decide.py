"""Decision latency of the gearbox on synthetic fragmented clusters, against a naive planner.

    python -m bench.decide [--json PATH] [--repeat N] [--sizes 8,32,64,128] [--model Llama-3-70B]

For each size, a seeded cluster of that many nodes of 8 GPUs (mixed generations, racks of
8 nodes) is fragmented the way seed 000 describes: other tenants hold some GPUs of most
nodes, some GPUs fail, the rest carry other tenants' memory. That leaves roughly one atomic
block per node, so "64 blocks" is a 512-GPU cluster and "128 blocks" a 1,024-GPU one.

Measured: one full `gearbox.decide` for one deployment (snapshot -> blocks -> candidate gears
-> estimates -> switch costs -> decision), p50 and p99 over `--repeat` runs, in CPU time of
this process (what the decision costs) and wall-clock (what a caller waits, including time
the OS gives to other processes on a shared machine):

* cold: every memo cleared (cost model and planner) and a new snapshot object, so nothing a
  previous decision computed is reused, not even the snapshot's lookups and blocks;
* warm: a new snapshot object of equal content (the next tick) with the memos kept, as in
  production where successive ticks see the same block shapes.

Cold and warm runs alternate, so both see the same load on a shared machine, and each run
starts with a collected heap (as a tick 10-30 s after the last one would).

Baseline, in the same process: a naive enumeration over GPUs - every window of tp usable
GPUs of every node is a candidate plan, validated and estimated on its own (no block
shapes, no memo), then the same replica assembly and decision. The ratio is naive CPU p50
over FlexPipe cold CPU p50.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path

from scheduler import costmodel, planner
from scheduler.costmodel import PlanProfile, Workload, combine_estimates, estimate_plan, switch_cost
from scheduler.gearbox import Decision, Deployment, LoadSample, LoadWindow, Trigger, decide, gear_footprint
from scheduler.hardware import CATALOG
from scheduler.modelspec import ModelSpec, model_spec
from scheduler.plan import Gear, Plan, Stage, stage_bytes_per_gpu, usable_bytes, validate_plan
from scheduler.topology import GpuState, NodeState, Snapshot, partition

GPU_MIX = (("H100-SXM", 0.35), ("A100-80G", 0.25), ("A100-40G", 0.15), ("H200", 0.10), ("L40S", 0.15))
NOW_S = 10_000.0
GIB = 2**30


def make_cluster(nodes: int, seed: int) -> Snapshot:
    """`nodes` nodes of 8 GPUs, fragmented (module docstring)."""
    rng = random.Random(seed)
    node_states: list[NodeState] = []
    gpus: list[GpuState] = []
    names = [name for name, _ in GPU_MIX]
    weights = [w for _, w in GPU_MIX]
    for n in range(nodes):
        node_id = f"n{n:04d}"
        model = rng.choices(names, weights)[0]
        spec = CATALOG[model]
        node_states.append(NodeState(id=node_id, rack=f"r{n // 8:03d}", last_seen_s=NOW_S - rng.uniform(0, 20)))
        taken = set(rng.sample(range(8), rng.choice((0, 0, 1, 2, 3, 4, 5))))  # other tenants
        failed = {i for i in range(8) if rng.random() < 0.03}
        for i in range(8):
            used = int(spec.mem_bytes * rng.choice((0.0, 0.0, 0.05, 0.1, 0.3)))
            gpus.append(
                GpuState(
                    uuid=f"{node_id}-g{i}",
                    node_id=node_id,
                    index=i,
                    model=model,
                    mem_total_bytes=spec.mem_bytes,
                    mem_used_bytes=spec.mem_bytes if i in taken else used,
                    sm_util=rng.random() * 0.3,
                    temperature_c=rng.uniform(30, 70),
                    healthy=i not in failed,
                    schedulable=i not in taken,
                    nvlink_group=None if model == "L40S" else "0",
                    last_seen_s=NOW_S - rng.uniform(0, 20),
                )
            )
    snap = Snapshot(now_s=NOW_S, nodes=tuple(node_states), gpus=tuple(gpus), intra_rack_gbps=400.0,
                    inter_rack_gbps=100.0)
    snap.validate()
    return snap


def current_gear(snapshot: Snapshot, model: ModelSpec) -> Gear:
    """A valid single-plan gear on the first block that holds the model with TP <= 8."""
    for block in partition(snapshot).blocks:
        for tp in model.valid_tps(block.size):
            uuids = block.gpu_uuids[:tp]
            stage = Stage(0, model.num_layers, tuple(uuids))
            plan = Plan(model.name, "colocated", (stage,), kv_reserve_tokens=16384)
            if not validate_plan(plan, snapshot, model):
                return Gear(model.name, (plan,), (1.0,))
    raise SystemExit("no block can hold the model; change the seed")


def load_window(rate_rps: float) -> LoadWindow:
    return LoadWindow(tuple(LoadSample(NOW_S - 300 + 15 * i, rate_rps, 512, 200, 0.8, 0.6) for i in range(21)))


def timed(fn: Callable[[], object], repeat: int, before: Callable[[], None] | None = None
          ) -> tuple[list[float], list[float]]:
    """(wall seconds, CPU seconds of this process) per run."""
    wall, cpu = [], []
    for _ in range(repeat):
        w, c = timed_once(fn, before)
        wall.append(w)
        cpu.append(c)
    return wall, cpu


def timed_once(fn: Callable[[], object], before: Callable[[], None] | None = None) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one run; `before` and a garbage
    collection happen first, untimed."""
    if before is not None:
        before()
    gc.collect()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def pct(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


# --- the naive baseline -----------------------------------------------------------------------------
def naive_decide(deployment: Deployment, current: Gear, snapshot: Snapshot, workload: Workload,
                 model: ModelSpec) -> int:
    """Enumerate over GPUs: every window of tp usable GPUs of each node, each validated and
    estimated on its own; replicas assembled greedily; switch cost for the best few."""
    costmodel.clear_caches()
    reclaim = gear_footprint(current, model, snapshot)
    by_node: dict[str, list[GpuState]] = {}
    for g in snapshot.gpus:
        by_node.setdefault(g.node_id, []).append(g)
    blocks = partition(snapshot).blocks
    scored: list[tuple[float, Plan, float]] = []
    for node_id in sorted(by_node):
        gpus = sorted(by_node[node_id], key=lambda g: g.index)
        for tp in model.valid_tps(len(gpus)):
            for start in range(0, len(gpus) - tp + 1):
                window = gpus[start:start + tp]
                stage = Stage(0, model.num_layers, tuple(g.uuid for g in window))
                room = min(usable_bytes(g.mem_total_bytes, g.mem_used_bytes, reclaim.get(g.uuid, 0)) for g in window)
                weights = stage_bytes_per_gpu(stage, model, 0)
                per_token = model.kv_bytes_per_token // model.kv_shards(tp)
                kv = max(0, room - weights) // max(1, per_token)
                plan = Plan(model.name, "colocated", (stage,), kv_reserve_tokens=int(min(kv, 400_000)))
                if validate_plan(plan, snapshot, model, blocks=blocks, reclaimable_bytes=reclaim):
                    continue
                costmodel.clear_caches()  # nothing shared between candidates
                est = estimate_plan(PlanProfile.build(plan, model, snapshot), workload.scaled(0.0), deployment.slo)
                if est.capacity_rps > 0:
                    scored.append((est.capacity_rps / tp, plan, est.capacity_rps))
    scored.sort(key=lambda x: -x[0])
    taken: set[str] = set()
    chosen: list[tuple[Plan, float]] = []
    cap = 0.0
    for _, plan, c in scored:
        if cap >= workload.rate_rps * 1.25:
            break
        if taken.isdisjoint(plan.gpu_uuids):
            chosen.append((plan, c))
            taken.update(plan.gpu_uuids)
            cap += c
    if not chosen:
        return len(scored)
    total = sum(c for _, c in chosen)
    weights = tuple(c / total for _, c in chosen)
    gear = Gear(model.name, tuple(p for p, _ in chosen), weights)
    profiles = [PlanProfile.build(p, model, snapshot) for p in gear.plans]
    ests = [estimate_plan(p, workload.scaled(w), deployment.slo) for p, w in zip(profiles, weights, strict=True)]
    est = combine_estimates(ests, weights, workload)
    switch_cost(current, gear, model, snapshot, workload, target_estimate=est)
    return len(scored)


def measure(nodes: int, model: ModelSpec, rate_rps: float, repeat: int, naive_repeat: int) -> dict[str, object]:
    """One cluster size: FlexPipe cold and warm, then the naive baseline."""
    snap = make_cluster(nodes, seed=1000 + nodes)
    blocks = partition(snap).blocks
    gear = current_gear(snap, model)
    dep = Deployment(id="bench", model=model.name, slo=costmodel.Slo(2000, 100), baseline=gear)
    window = load_window(rate_rps)
    workload = Workload(rate_rps, 512, 200, 0.8, 0.6)

    tick = {"snap": snap}

    def one() -> Decision:
        return decide(dep, gear, tick["snap"], window, NOW_S, trigger=Trigger.PERIODIC)

    def next_tick() -> None:
        tick["snap"] = replace(snap)  # equal content, a new object: nothing cached on it

    def cold_start() -> None:
        next_tick()
        planner.clear_caches()

    decision = one()
    cold_wall, cold_cpu, warm_wall, warm_cpu = [], [], [], []
    for _ in range(repeat):  # alternate, so that both see the same machine load
        w, c = timed_once(one, cold_start)
        cold_wall.append(w)
        cold_cpu.append(c)
        w, c = timed_once(one, next_tick)
        warm_wall.append(w)
        warm_cpu.append(c)
    naive_counts: list[int] = []
    naive_wall, naive_cpu = timed(lambda: naive_counts.append(naive_decide(dep, gear, tick["snap"], workload, model)),
                                  naive_repeat, before=next_tick)
    row: dict[str, object] = {
        "blocks": len(blocks),
        "nodes": nodes,
        "gpus": len(snap.gpus),
        "usable_gpus": sum(b.size for b in blocks),
        "block_shapes": len({(b.gpu_model, b.size) for b in blocks}),
        "candidates": len(decision.candidates),
        "outcome": str(decision.outcome),
        "naive_candidates": naive_counts[0] if naive_counts else 0,
    }
    for name, xs in (("cold", cold_wall), ("warm", warm_wall), ("cold_cpu", cold_cpu), ("warm_cpu", warm_cpu)):
        row[f"{name}_p50_ms"] = 1e3 * pct(xs, 0.5)
        row[f"{name}_p99_ms"] = 1e3 * pct(xs, 0.99)
    row["naive_p50_ms"] = 1e3 * statistics.median(naive_wall)
    row["naive_cpu_p50_ms"] = 1e3 * statistics.median(naive_cpu)
    row["naive_over_cold"] = row["naive_cpu_p50_ms"] / row["cold_cpu_p50_ms"]  # type: ignore[operator]
    return row


def run(sizes: Iterable[int], repeat: int, model_name: str, rate_rps: float, naive_repeat: int) -> dict[str, object]:
    model = model_spec(model_name)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"model {model.name}, offered {rate_rps} rps; {repeat} runs per size; load average {load:.1f} on"
          f" {os.cpu_count()} CPUs (wall-clock p99 suffers when other work shares the CPUs; CPU time does less)")
    print(f"{'blocks':>7}{'GPUs':>6}{'usable':>7}{'shapes':>7} | {'cold p50':>8}{'p99':>7} {'warm p50':>8}{'p99':>7}"
          f" | {'CPU cold p50':>12}{'p99':>7} {'warm p50':>8}{'p99':>7} | {'naive':>8} {'ratio':>6}")
    rows = []
    for nodes in sizes:
        row = measure(nodes, model, rate_rps, repeat, naive_repeat)
        rows.append(row)
        print(f"{row['blocks']:>7}{row['gpus']:>6}{row['usable_gpus']:>7}{row['block_shapes']:>7} |"
              f" {row['cold_p50_ms']:>8.2f}{row['cold_p99_ms']:>7.2f} {row['warm_p50_ms']:>8.2f}{row['warm_p99_ms']:>7.2f} |"
              f" {row['cold_cpu_p50_ms']:>12.2f}{row['cold_cpu_p99_ms']:>7.2f} {row['warm_cpu_p50_ms']:>8.2f}"
              f"{row['warm_cpu_p99_ms']:>7.2f} | {row['naive_cpu_p50_ms']:>8.1f} {row['naive_over_cold']:>5.0f}x")
    print("(ms; naive = per-GPU enumeration, CPU p50; ratio = naive / FlexPipe cold, CPU p50)")
    targets: dict[str, dict[str, object]] = {}
    for row in rows:
        limit = {64: 5.0, 128: 20.0}.get(int(row["nodes"]))  # type: ignore[call-overload]
        if limit is None:
            continue
        targets[f"{row['nodes']} blocks p99 <= {limit:g} ms"] = {
            "wall_cold_p99_ms": row["cold_p99_ms"], "cpu_cold_p99_ms": row["cold_cpu_p99_ms"],
            "met_wall": row["cold_p99_ms"] <= limit,  # type: ignore[operator]
            "met_cpu": row["cold_cpu_p99_ms"] <= limit,  # type: ignore[operator]
        }
    for name, t in targets.items():
        print(f"target {name}: cold p99 wall {t['wall_cold_p99_ms']:.2f} ms ({'met' if t['met_wall'] else 'MISSED'}),"
              f" CPU {t['cpu_cold_p99_ms']:.2f} ms ({'met' if t['met_cpu'] else 'MISSED'})")
    return {"model": model.name, "rate_rps": rate_rps, "repeat": repeat, "load_average": load, "rows": rows,
            "targets": targets}


def _positive(text: str) -> int:
    """A count of runs: a whole number, at least 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _sizes(text: str) -> list[int]:
    """`--sizes`: comma-separated positive node counts."""
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated whole numbers, got {text!r}") from None
    if any(n < 1 for n in sizes):
        raise argparse.ArgumentTypeError(f"every size must be at least 1 node, got {text!r}")
    return sizes


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--repeat", type=_positive, default=200, help="timed runs per size")
    parser.add_argument("--naive-repeat", type=_positive, default=3, help="timed runs of the naive baseline per size")
    parser.add_argument("--sizes", type=_sizes, default="8,32,64,128", help="cluster sizes in nodes (~blocks)")
    parser.add_argument("--model", default="Llama-3-70B")
    parser.add_argument("--rate", type=float, default=6.0, help="offered load, requests/s")
    args = parser.parse_args(list(argv) if argv is not None else None)
    result = run(args.sizes, args.repeat, args.model, args.rate, args.naive_repeat)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
