"""python -m agents.node: run this node's agent until Ctrl-C or SIGTERM.

Exit status: 0 after a clean stop; 2 when it cannot start - no GPU/driver for `--probe nvml`
(one line on stderr, what agents/probes/nvml.py says), a bad `--static-gpus`, a missing token.
SIGTERM and Ctrl-C stop every engine it started before it exits: nothing is left behind.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType

from agents.node.daemon import NodeAgent, default_node_id
from agents.node.plans import Backend, ModelStore, TorchBackend, VllmBackend
from agents.node.weightcache import DEFAULT_CACHE_ROOT, HostWeightCache, default_capacity_bytes
from agents.probes import Probe
from agents.protocol import NODE_ID_RE
from agents.schema import SchemaError
from scheduler.buckets import LengthBuckets

PROG = "agents.node"
DEFAULT_BUCKET_EDGES = ",".join(str(e) for e in LengthBuckets().edges)


def _fail(message: str) -> int:
    print(f"{PROG}: {message}", file=sys.stderr)
    return 2


def length_buckets(edges: str) -> LengthBuckets:
    """--length-buckets: comma-separated token edges; each bucket past the first gets half the
    share of the one before, as the default's 1, 1/2, 1/4 (scheduler/buckets.py)."""
    try:
        parsed = tuple(int(e) for e in edges.split(","))
    except ValueError:
        raise ValueError(f"--length-buckets {edges!r}: expected comma-separated token counts, e.g. 2048,32768") from None
    try:
        return LengthBuckets(edges=parsed, shares=tuple(0.5**i for i in range(len(parsed) + 1)))
    except ValueError as exc:
        raise ValueError(f"--length-buckets {edges!r}: {exc}") from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m agents.node", description="The FlexPipe agent of one GPU node.")
    p.add_argument("--controller", required=True, help="console base URL, e.g. http://console:8000")
    p.add_argument("--token", default=os.environ.get("FLEXPIPE_ENROLL_TOKEN", ""),
                   help="the cluster's join token, or this node's own agent token (default: $FLEXPIPE_ENROLL_TOKEN)")
    p.add_argument("--token-file", default=os.environ.get("FLEXPIPE_AGENT_TOKEN_FILE") or None,
                   help="where the node keeps its own agent token once enrolled, and reads it at start (a restart "
                        "then needs no join token; re-enrolling an enrolled node with the join token is refused)")
    p.add_argument("--backend", choices=("torch", "vllm"), required=True, help="the engine that runs plans")
    p.add_argument("--probe", choices=("nvml", "static"), required=True,
                   help="nvml: this machine's NVIDIA GPUs; static: GPUs described by --static-gpus")
    p.add_argument("--node-id", default=None, help="stable node name (default: the host name)")
    p.add_argument("--data-addr", default=None,
                   help="HOST:PORT where peers and the gateway reach this node's data plane (default: 127.0.0.1:7070)")
    p.add_argument("--static-gpus", default=None,
                   help="with --probe static: a spec such as 2xA100-80G (CPU stand-ins) or a static probe file")
    p.add_argument("--gpu-namespace", default="static",
                   help="with a --static-gpus spec: the namespace of the GPU UUIDs (a scenario's name gives that "
                        "scenario's GPUs)")
    p.add_argument("--models-dir", default=".run/models", help="model folders by name (tiny-llama is made here)")
    p.add_argument("--weight-cache-bytes", type=int, default=None,
                   help="host-memory weight cache size (default: $FLEXPIPE_WEIGHT_CACHE_BYTES, else a quarter of "
                        "RAM; 0: off - every prepare reads the disk)")
    p.add_argument("--host-kv-bytes", type=int, default=2 << 30,
                   help="torch: each plan's host KV tier - finished sequences' KV kept in host memory for the next "
                        "turn of their conversation (default 2 GiB; 0: off)")
    p.add_argument("--length-buckets", nargs="?", const=DEFAULT_BUCKET_EDGES, default=None, metavar="EDGES",
                   help="torch: split batches by prompt length at these token edges (e.g. 2048,32768, the "
                        "default when the flag is given alone; scheduler/buckets.py); off without the flag")
    p.add_argument("--weight-cache-dir", default=None,
                   help="where the cache keeps its copies: a RAM file system (default: /dev/shm/flexpipe-weights-NODE)")
    p.add_argument("--rack", default=None)
    p.add_argument("--report-interval", type=float, default=None,
                   help="seconds between reports (default: what the controller asks)")
    p.add_argument("--long-poll", type=float, default=10.0, help="seconds a command poll waits on the controller")
    p.add_argument("--vllm-port-base", type=int, default=8200, help="first port of this node's vLLM servers")
    p.add_argument("--wait-for-controller", type=float, default=120.0,
                   help="seconds to wait for the controller to answer at start")
    p.add_argument("--collectives", choices=("auto", "off"), default="auto",
                   help="auto: with --probe nvml and two or more GPUs torch sees, time all-reduce and send/recv "
                        "across them at start (agents/probes/collectives.py) and report the curves; off: never")
    p.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    return p


def measure_collectives(agent: NodeAgent, probe: Probe) -> None:
    """Time this node's GPUs' collectives in the background and report them (a GPU node only:
    CPU stand-ins would report a CPU's numbers as a GPU's)."""
    import threading

    def run() -> None:
        try:
            import torch

            if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
                return
            from agents.probes.collectives import copy_sweep, node_collectives
            from agents.protocol import CollectiveReport

            devices = [f"cuda:{g.index}" for g in sorted(probe.gpus(), key=lambda g: g.index)]
            curves = [c for c in node_collectives(devices[: torch.cuda.device_count()]) if c.op == "all_reduce"]
            # inside the node a hand-off is a device-to-device copy: that is the send/recv curve
            copies = copy_sweep(devices[0], devices[1])
            curves.append(CollectiveReport(op="send_recv", scope="intra", ranks=2, points=tuple(copies),
                                           backend="cuda", measured_at=round(time.time(), 3), method="torch.copy"))
            agent.collectives = tuple(curves)
            agent.state.dirty = True
        except Exception:  # noqa: BLE001 - a failed measurement leaves the physical model in charge
            logging.getLogger("agents.node").exception("collective sweep failed; the cost model's own model is used")

    threading.Thread(target=run, name="collectives", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s node %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    node_id = args.node_id or default_node_id()
    if not NODE_ID_RE.match(node_id):
        return _fail(f"--node-id {node_id!r}: 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit")
    if not args.token:
        return _fail("--token or FLEXPIPE_ENROLL_TOKEN is required (the node enrolls with it)")
    data_addr = args.data_addr or "127.0.0.1:7070"
    host, sep, port = data_addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return _fail(f"--data-addr {data_addr!r}: expected HOST:PORT")
    buckets = None
    if args.length_buckets is not None:
        if args.backend != "torch":
            return _fail("--length-buckets: only the torch backend splits batches by length (vLLM has one budget)")
        try:
            buckets = length_buckets(args.length_buckets)
        except ValueError as exc:
            return _fail(str(exc))

    probe: Probe
    if args.probe == "nvml":
        from agents.probes import NoGpuError
        from agents.probes.nvml import NvmlProbe

        try:
            probe = NvmlProbe.open()
        except NoGpuError as exc:
            print(str(exc), file=sys.stderr)  # one line: "no NVIDIA GPU/driver found: ..."
            return 2
    else:
        if not args.static_gpus:
            return _fail("--probe static needs --static-gpus (e.g. 2xA100-80G, or a static probe file)")
        from agents.node.gpuspec import open_static

        try:
            probe = open_static(args.static_gpus, node_id, args.gpu_namespace)
        except SchemaError as exc:
            return _fail(f"--static-gpus {args.static_gpus}: " + "; ".join(f"{k}: {v}" for k, v in exc.errors.items()))
        except ValueError as exc:
            return _fail(str(exc))

    try:
        cache_bytes = args.weight_cache_bytes if args.weight_cache_bytes is not None else default_capacity_bytes()
    except ValueError as exc:
        return _fail(str(exc))
    if cache_bytes < 0:
        return _fail(f"--weight-cache-bytes: must be >= 0, got {cache_bytes}")
    cache = None
    if cache_bytes > 0:
        cache_dir = Path(args.weight_cache_dir) if args.weight_cache_dir else DEFAULT_CACHE_ROOT / f"flexpipe-weights-{node_id}"
        if args.weight_cache_dir is None and not DEFAULT_CACHE_ROOT.is_dir():
            print(f"{PROG}: no {DEFAULT_CACHE_ROOT} on this host: the weight cache is off", file=sys.stderr)
        else:
            try:
                cache = HostWeightCache(cache_dir, cache_bytes)
            except OSError as exc:
                return _fail(f"--weight-cache-dir {cache_dir}: {exc.strerror or exc}")
    models = ModelStore(Path(args.models_dir), cache)
    backend: Backend
    if args.backend == "torch":
        if args.host_kv_bytes < 0:
            return _fail(f"--host-kv-bytes: must be >= 0, got {args.host_kv_bytes}")
        torch_backend = TorchBackend(models, data_addr, host_kv_bytes=args.host_kv_bytes, length_buckets=buckets)
        if args.probe == "nvml":  # real GPUs: the engine's workers run on the plan's CUDA devices
            torch_backend.device = "cuda"
            torch_backend.gpu_index = {g.uuid: g.index for g in probe.gpus()}
        try:
            torch_backend.server()  # bind the data address now: a taken port is a start-up error
        except OSError as exc:
            return _fail(f"--data-addr {data_addr}: {exc.strerror or exc}")
        backend = torch_backend
    else:
        vllm_backend = VllmBackend(models, data_addr, port_base=args.vllm_port_base, cpu=args.probe == "static",
                                   log_dir=str(Path(".run") / "vllm"))
        try:
            vllm_backend.server()  # bind the data address now: a taken port is a start-up error
        except OSError as exc:
            return _fail(f"--data-addr {data_addr}: {exc.strerror or exc}")
        backend = vllm_backend

    from agents.sim.live import wait_for_controller

    wait_for_controller(args.controller, args.wait_for_controller)
    agent = NodeAgent(controller=args.controller, join_token=args.token, probe=probe, backend=backend,
                      backend_name=args.backend, node_id=node_id, data_addr=data_addr, rack=args.rack,
                      long_poll_s=args.long_poll, report_interval_s=args.report_interval,
                      book_memory=args.probe == "static",
                      token_file=Path(args.token_file) if args.token_file else None)

    if args.collectives == "auto" and args.probe == "nvml":
        measure_collectives(agent, probe)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        agent.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    started = time.monotonic()
    try:
        while True:
            agent.step()
            if args.duration is not None and time.monotonic() - started >= args.duration:
                break
            if agent.wait(0.2):
                break
    finally:
        agent.close()
    return 0
