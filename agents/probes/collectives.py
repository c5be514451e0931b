"""Timed copies and collectives on this node's devices: what scheduler.collectives curves are made of.

Three measurements, each a sweep of message sizes (the shape of nccl-tests: `SIZES`, 8 KiB to
256 MiB by factors of 4), each size the median of `repeats` timed runs after a warm-up:

* `copy_sweep(src, dst)` - device-to-device (or host-to-device from pinned memory) copies with
  torch, timed with CUDA events on a GPU (the wall clock on a CPU) - the intra-node link;
* `distributed_sweep(...)` - inside a torch.distributed group of `world` processes, one per GPU
  (nccl) or per CPU stand-in (gloo): all-reduce of the whole message, and send/recv between rank 0
  and rank 1; ranks synchronise with a barrier before each timed run and rank 0's time counts;
* `node_collectives(devices)` - spawns that group on this node (one process per device), returns
  the all-reduce and send/recv curves as agent protocol `CollectiveReport`s (scope intra).

The node agent measures its GPUs this way at start where torch sees them (`--collectives auto`
with `--probe nvml`); CPU stand-ins are never reported as GPU curves (their numbers would be a
CPU's). Bus bandwidth, as nccl-tests define it, is derived where it is shown (`bus_gbps`): an
all-reduce moves 2 (n - 1) / n of the message per rank.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from agents.protocol import CollectiveReport

SIZES = tuple(8 * 1024 * 4**i for i in range(9))  # 8 KiB .. 128 MiB (x4), nccl-tests' -f 4 shape
METHOD = "torch.distributed"


def bus_gbps(op: str, ranks: int, nbytes: int, seconds: float) -> float:
    """nccl-tests' bus bandwidth (Gb/s): algorithm bandwidth x 2(n-1)/n for all-reduce, x 1 for send/recv."""
    factor = 2 * (ranks - 1) / ranks if op == "all_reduce" else 1.0
    return nbytes / seconds * factor * 8 / 1e9


def _timer(device: Any) -> Callable[[Callable[[], None]], float]:
    """A function that times one call of `fn` on `device`: CUDA events on a GPU, else the wall clock."""
    import torch

    if getattr(device, "type", str(device)).startswith("cuda"):
        def cuda_time(fn: Callable[[], None]) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end)) / 1e3

        return cuda_time

    def wall_time(fn: Callable[[], None]) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return wall_time


def copy_sweep(src: str, dst: str, *, sizes: Sequence[int] = SIZES, repeats: int = 5) -> list[tuple[int, float]]:
    """(bytes, median seconds) of copying a buffer from device `src` to `dst` ("cpu" pinned for a
    host-to-device copy, "cuda:0", ...)."""
    import torch

    s, d = torch.device(src), torch.device(dst)
    timer = _timer(d if d.type == "cuda" else s)
    out = []
    for n in sizes:
        a = torch.empty(n, dtype=torch.uint8, device=s, pin_memory=s.type == "cpu" and d.type == "cuda")
        b = torch.empty(n, dtype=torch.uint8, device=d)
        b.copy_(a, non_blocking=True)  # warm-up (first-touch, peer access set-up)
        if d.type == "cuda" or s.type == "cuda":
            torch.cuda.synchronize()
        times = [timer(lambda a=a, b=b: b.copy_(a, non_blocking=True)) for _ in range(repeats)]
        out.append((n, statistics.median(times)))
    return out


def distributed_sweep(rank: int, world: int, device: Any, *, sizes: Sequence[int] = SIZES,
                      repeats: int = 5) -> dict[str, list[tuple[int, float]]]:
    """Inside an initialised torch.distributed group: {"all_reduce": [...], "send_recv": [...]}
    of (bytes, median seconds) - the same on every rank for all-reduce (rank 0's are kept)."""
    import torch
    import torch.distributed as dist

    timer = _timer(device)
    out: dict[str, list[tuple[int, float]]] = {"all_reduce": [], "send_recv": []}
    for n in sizes:
        t = torch.ones(max(1, n // 4), dtype=torch.float32, device=device)  # float32: 4 bytes an element
        dist.all_reduce(t)  # warm-up
        times = []
        for _ in range(repeats):
            dist.barrier()
            times.append(timer(lambda t=t: dist.all_reduce(t)))
        out["all_reduce"].append((t.numel() * 4, statistics.median(times)))
        times = []
        for _ in range(repeats):
            dist.barrier()
            if rank == 0:
                times.append(timer(lambda t=t: dist.send(t, dst=1)))
            elif rank == 1:
                times.append(timer(lambda t=t: dist.recv(t, src=0)))
        if rank == 0:
            out["send_recv"].append((t.numel() * 4, statistics.median(times)))
    return out


def _worker(rank: int, world: int, port: int, backend: str, devices: Sequence[str], sizes: Sequence[int],
            repeats: int, results: Any) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    device = torch.device(devices[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        got = distributed_sweep(rank, world, device, sizes=sizes, repeats=repeats)
        if rank == 0:
            results.put(got)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def node_collectives(devices: Sequence[str], *, backend: str | None = None, sizes: Sequence[int] = SIZES,
                     repeats: int = 5, wall: Callable[[], float] = time.time,
                     start_method: str = "spawn") -> list[CollectiveReport]:
    """All-reduce and send/recv sweeps across `devices` of this node (one process each), as the
    agent reports them. `backend`: nccl for GPUs, gloo for CPU stand-ins (default: by device).
    `start_method`: spawn (CUDA needs it, and a process with threads must not fork); fork is
    quicker from a single-threaded process with no CUDA."""
    import torch.multiprocessing as mp

    world = len(devices)
    if world < 2:
        return []
    chosen = backend or ("nccl" if all(d.startswith("cuda") for d in devices) else "gloo")
    ctx = mp.get_context(start_method)
    results = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(world, _free_port(), chosen, list(devices), list(sizes), repeats, results),
                       nprocs=world, join=True, start_method=start_method)
    got = results.get()
    at = round(wall(), 3)
    return [CollectiveReport(op=op, scope="intra", ranks=world if op == "all_reduce" else 2, points=tuple(pts),
                             backend=chosen, measured_at=at, method=METHOD)
            for op, pts in sorted(got.items()) if pts]


__all__ = ["METHOD", "SIZES", "bus_gbps", "copy_sweep", "distributed_sweep", "node_collectives"]
