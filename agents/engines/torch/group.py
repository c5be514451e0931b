"""The engine's side of one worker group: start the processes, talk to them, tear them down.

One group = one pipeline (a list of stages) = one torch.distributed world with its own store,
so several groups (a disaggregated engine's prefill and decode groups, or the old and the new
engine during a switch) live side by side in one agent process without sharing anything.

Workers start from a forkserver that has imported torch once, so each start costs a fork, not
an interpreter plus a torch import (~1.5 s on two cores). Neither the forkserver nor the
workers have touched CUDA before their own `set_device`, which keeps the CUDA path safe.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mpc
import time
import weakref
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import numpy as np
import torch.distributed as dist

from agents.engines.torch.comm import select_backend
from agents.engines.torch.kvcache import BlockAllocator
from agents.engines.torch.layout import StageSpec
from agents.engines.torch.model import ModelConfig, tp_shard
from agents.engines.torch.remote import Placement, RemoteStart, Rendezvous
from agents.engines.torch.worker import StepPlan, WorkerSpec, worker_main

START_METHODS = ("forkserver", "spawn")


class EngineError(RuntimeError):
    """A worker failed, died or did not answer; the group that held it has been shut down."""


def _context(start_method: str) -> Any:
    if start_method not in START_METHODS:
        raise ValueError(f"start_method: must be one of {list(START_METHODS)}, got {start_method!r}")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        # Only takes effect when the forkserver starts; later calls are harmless no-ops.
        ctx.set_forkserver_preload(["agents.engines.torch.worker"])
    return ctx


def _kill_all(procs: list[Any], conns: list[Any]) -> None:
    """Last-resort teardown (also run by the finalizer when an engine is garbage-collected)."""
    conns = [c for c in conns if c is not None]  # a group that failed while starting has gaps
    for conn in conns:
        try:
            conn.send(("shutdown", None))
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + 5.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)
    for conn in conns:
        conn.close()


class WorkerGroup:
    """Processes for `stages`, a block allocator shared by all of them, and request/reply calls.

    Invariant: every call sends one message to each addressed worker and reads exactly one reply
    from each before returning, so replies never get out of step with requests; any error,
    death or timeout shuts the whole group down (a worker stuck in a collective cannot be
    trusted with the next step) and raises EngineError.
    """

    def __init__(
        self,
        name: str,
        model_dir: str,
        cfg: ModelConfig,
        stages: tuple[StageSpec, ...],
        *,
        device: str,
        rank_gpus: tuple[int, ...],
        backend: str,
        num_blocks: int,
        block_size: int,
        timeout_s: float,
        num_threads: int,
        start_method: str,
        placement: Placement | None = None,
    ) -> None:
        """`placement`: where each rank runs when the group spans nodes (None: every rank here,
        the one-node path, with no listener at all). `rank_gpus` then holds -1 for remote ranks;
        their members fill in their own GPUs."""
        self.name = name
        self._num_threads = num_threads
        self.cfg = cfg
        self.stages = stages
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.timeout_s = timeout_s
        world = sum(s.tp for s in stages)
        if device == "cuda" and len(rank_gpus) != world:
            raise ValueError(f"rank_gpus: {len(rank_gpus)} GPUs for {world} ranks")
        remote = placement is not None and len(placement.local) < world
        # nccl only when the ranks' GPUs are all different (select_backend's rule); a group that
        # spans nodes on GPUs decides once every remote rank said which GPU it has on its host.
        if remote and device == "cuda":
            self.backend = "gloo"
        else:
            self.backend = select_backend(device, world, backend, num_gpus=len(set(rank_gpus)))
        self.rank_gpus = rank_gpus
        ctx = _context(start_method)
        # The store lives here, in the engine's process, on a port the OS picks: no port races
        # between groups. Workers only rendezvous through it (the server listens on every
        # interface; `store_host` is the address the workers dial).
        store_host = placement.bind_host if remote and placement is not None else "127.0.0.1"
        self._store = dist.TCPStore(  # type: ignore[attr-defined]
            store_host, 0, None, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
        )
        self.procs: list[Any] = []  # local processes only
        self.conns: list[Any] = [None] * world  # one per rank, rank order
        self.names: list[str] = [""] * world
        self.rank_pids: list[int] = [0] * world
        self._proc_of: dict[int, Any] = {}  # rank -> its local process (remote ranks have none)
        self.specs: list[WorkerSpec] = []
        self._pending: list[int] | None = None
        self._closed = False
        self._finalizer = weakref.finalize(self, _kill_all, self.procs, self.conns)
        keys = [(si, r) for si, stage in enumerate(stages) for r in range(stage.tp)]
        remote_conns: dict[int, Any] = {}
        if remote:
            assert placement is not None  # noqa: S101 - `remote` implies it
            remote_conns = self._connect_remote(placement, keys, device, backend)
        for rank, (si, r) in enumerate(keys):
            spec = WorkerSpec(
                model_dir=model_dir,
                stages=stages,
                stage_index=si,
                tp_rank=r,
                store_host=store_host,
                store_port=self._store.port,
                device=device,
                rank_gpus=self.rank_gpus,
                backend=self.backend,
                num_blocks=num_blocks,
                block_size=block_size,
                timeout_s=timeout_s,
                num_threads=num_threads,
            )
            self.specs.append(spec)
            if rank in remote_conns:
                try:
                    remote_conns[rank].send(("spec", spec))
                except (OSError, ValueError) as exc:
                    raise self._fail(f"start: rank {rank} ({self.names[rank]}) unreachable: {exc}") from exc
                continue
            parent, child = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=worker_main, args=(spec, child), name=f"flexpipe-{name}-s{si}t{r}", daemon=True)
            proc.start()
            child.close()
            self.procs.append(proc)
            self._proc_of[rank] = proc
            self.conns[rank] = parent
            self.names[rank] = proc.name
            self.rank_pids[rank] = int(proc.pid)
        self.infos = self._gather(range(world), expect="ready", what="start")

    def _connect_remote(
        self, placement: Placement, keys: list[tuple[int, int]], device: str, backend: str
    ) -> dict[int, Any]:
        """Ask every site for the ranks not placed here, take their connections, pick the backend.

        On return every remote rank is connected and has said hello; `rank_gpus` holds each
        remote rank's GPU on its host and `backend` what the whole world uses. Any failure (a site
        that refuses or never gets ready, a rank that does not connect within the timeout) shuts
        the group down and raises EngineError naming it.
        """
        wanted = {keys[rank]: rank for rank in range(len(keys)) if rank not in placement.local}
        deadline = time.monotonic() + self.timeout_s
        rendezvous = Rendezvous(placement.bind_host)
        try:
            request = RemoteStart(self.name, tuple(sorted(wanted)), rendezvous.address, rendezvous.authkey,
                                  self.timeout_s, self._num_threads)
            claimed: dict[tuple[int, int], str] = {}
            for site in placement.sites:
                try:
                    started = site.start_workers(request)
                except Exception as exc:  # noqa: BLE001 - any refusal is this group's failure
                    raise self._fail(f"start: node {site.name} did not start its ranks: {exc}") from exc
                for key in started:
                    claimed.setdefault(tuple(key), site.name)  # type: ignore[arg-type]
            unclaimed = sorted(wanted[k] for k in wanted if k not in claimed)
            if unclaimed:
                raise self._fail(f"start: no node started rank(s) {unclaimed} "
                                 f"(asked {[s.name for s in placement.sites]})")
            for key, rank in wanted.items():
                self.names[rank] = f"flexpipe-{self.name}-s{key[0]}t{key[1]}@{claimed[key]}"
            got = rendezvous.wait(set(wanted), deadline)
        finally:
            rendezvous.close()
        conns = {wanted[k]: conn for k, (_, conn) in got.items()}
        for rank, conn in conns.items():
            self.conns[rank] = conn
            self.rank_pids[rank] = got[keys[rank]][0].pid
        missing = sorted(rank for rank in wanted.values() if rank not in conns)
        if missing:
            names = [self.names[r] for r in missing]
            raise self._fail(f"start: no connection within {self.timeout_s:g} s from rank(s) {missing} {names}")
        hosts = ["" for _ in keys]  # "" = this node
        gpus: list[int | None] = list(self.rank_gpus) if self.rank_gpus else [None] * len(keys)
        for rank in conns:
            hello = got[keys[rank]][0]
            hosts[rank] = hello.host
            gpus[rank] = hello.gpu
        if device == "cuda":
            lacking = [self.names[r] for r, g in enumerate(gpus) if g is None or g < 0]
            if lacking:
                raise self._fail(f"start: device 'cuda' but rank(s) {lacking} have no GPU on their node")
            self.rank_gpus = tuple(int(g) for g in gpus)  # type: ignore[arg-type]
            try:
                self.backend = select_backend(device, len(keys), backend,
                                              num_gpus=len({(h, g) for h, g in zip(hosts, gpus, strict=True)}))
            except ValueError as exc:
                raise self._fail(f"start: {exc}") from exc
        return conns

    # -- plumbing --------------------------------------------------------------------------------

    @property
    def pids(self) -> list[int]:
        """Every rank's process id, rank order (a remote rank's is on its own node)."""
        return list(self.rank_pids)

    @property
    def local_pids(self) -> list[int]:
        return [int(p.pid) for p in self.procs]

    @property
    def alive(self) -> bool:
        return not self._closed

    def _fail(self, message: str) -> EngineError:
        self.shutdown()
        return EngineError(f"worker group {self.name!r}: {message}")

    def _send(self, ranks: Sequence[int], command: str, payloads: Sequence[object]) -> None:
        if self._closed:
            raise EngineError(f"worker group {self.name!r} is shut down")
        for rank, payload in zip(ranks, payloads, strict=True):
            try:
                self.conns[rank].send((command, payload))
            except (OSError, ValueError) as exc:
                raise self._fail(f"rank {rank} ({self.names[rank]}) unreachable: {exc}") from exc

    def _gather(self, ranks: Sequence[int] | range, *, expect: str = "ok", what: str) -> list[Any]:
        """One reply from each rank, watching for deaths and the timeout while waiting."""
        ranks = list(ranks)
        results: dict[int, Any] = {}
        deadline = time.monotonic() + self.timeout_s
        waiting = {self.conns[r]: r for r in ranks}
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                names = sorted(self.names[r] for r in waiting.values())
                raise self._fail(f"{what}: no answer within {self.timeout_s:g} s from {names}")
            # Local ranks also have a process sentinel; a remote rank's death shows as EOF only.
            sentinels = {self._proc_of[r].sentinel: r for r in waiting.values() if r in self._proc_of}
            ready = mpc.wait(list(waiting) + list(sentinels), timeout=left)
            for obj in ready:
                if obj not in waiting:
                    continue
                rank = waiting.pop(obj)
                try:
                    status, value = self.conns[rank].recv()
                except (EOFError, OSError) as exc:
                    raise self._fail(f"{what}: rank {rank} ({self.names[rank]}) died{self._exit(rank)}") from exc
                if status != expect:
                    raise self._fail(f"{what}: rank {rank} ({self.names[rank]}) failed:\n{value}")
                results[rank] = value
            for obj in ready:
                # A process that exited without answering; its pipe, if it still held a reply,
                # was read above.
                rank = sentinels.get(obj, -1)
                if rank in waiting.values() and not self.conns[rank].poll():
                    raise self._fail(f"{what}: rank {rank} ({self.names[rank]}) exited{self._exit(rank)}")
        return [results[r] for r in ranks]

    def _exit(self, rank: int) -> str:
        proc = self._proc_of.get(rank)
        if proc is None:
            return " (its connection from another node closed)"
        return f" (exit code {proc.exitcode})"

    def call(self, command: str, payload: object, *, what: str | None = None) -> list[Any]:
        ranks = range(len(self.conns))
        self._send(ranks, command, [payload] * len(self.conns))
        return self._gather(ranks, what=what or command)

    # -- commands --------------------------------------------------------------------------------

    def submit_step(self, plan: StepPlan) -> None:
        """Start a step on every worker; `collect_step` reads the result (groups overlap this way)."""
        assert self._pending is None, "collect_step() must follow every submit_step()"
        self._pending = list(range(len(self.conns)))
        self._send(self._pending, "step", [plan] * len(self.conns))

    def collect_step(self) -> dict[str, int]:
        ranks, self._pending = self._pending, None
        assert ranks is not None, "submit_step() first"
        results = self._gather(ranks, what="step")
        # The last stage's TP rank 0 samples; everyone else answers None.
        tokens: dict[str, int] = results[len(self.conns) - self.stages[-1].tp]
        return tokens

    def _kv_owners(self) -> list[tuple[int, StageSpec, Any]]:
        """(rank, stage, shard) of every worker, in rank order."""
        out = []
        rank = 0
        for stage in self.stages:
            for r in range(stage.tp):
                out.append((rank, stage, tp_shard(self.cfg, stage.tp, r)))
                rank += 1
        return out

    def export_kv(self, seq_id: str, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Full K/V [layers, length, kv_heads, head_dim] of a sequence, assembled from the shards."""
        cfg = self.cfg
        table = self.allocator.block_table(seq_id) if length else ()
        shape = (cfg.num_layers, length, cfg.num_kv_heads, cfg.head_dim)
        k = np.empty(shape, dtype=np.float32)
        v = np.empty(shape, dtype=np.float32)
        if length == 0:
            return k, v
        # Ask one holder per (stage, KV head range): replicas (tp > kv_heads) hold copies.
        asked, seen = [], set()
        for rank, stage, shard in self._kv_owners():
            key = (stage.layer_start, shard.kv_head_start)
            if key not in seen:
                seen.add(key)
                asked.append((rank, stage, shard))
        ranks = [a[0] for a in asked]
        self._send(ranks, "export", [(table, length)] * len(ranks))
        for (_, stage, shard), (k_part, v_part) in zip(
            asked, self._gather(ranks, what="export"), strict=True
        ):
            sl = (
                slice(stage.layer_start, stage.layer_end),
                slice(None),
                slice(shard.kv_head_start, shard.kv_head_end),
            )
            k[sl] = k_part
            v[sl] = v_part
        return k, v

    def import_kv(self, seq_id: str, k: np.ndarray, v: np.ndarray) -> None:
        """Write full K/V into the blocks already allocated to `seq_id`, each worker its slice."""
        length = k.shape[1]
        if length == 0:
            return
        table = self.allocator.block_table(seq_id)
        owners = self._kv_owners()
        payloads = []
        for _, stage, shard in owners:
            sl = (
                slice(stage.layer_start, stage.layer_end),
                slice(None),
                slice(shard.kv_head_start, shard.kv_head_end),
            )
            payloads.append((table, np.ascontiguousarray(k[sl]), np.ascontiguousarray(v[sl])))
        ranks = [o[0] for o in owners]
        self._send(ranks, "import", payloads)
        self._gather(ranks, what="import")

    def shutdown(self) -> None:
        """Stop every worker and reap it; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()
