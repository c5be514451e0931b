"""Stage workers on another host: the leader's listener, the member's processes, and the hello between.

A worker group whose ranks span several nodes is still one torch.distributed world with one store
and one control connection per rank, all owned by the leader's WorkerGroup. What changes for a
rank on another node:

- the leader binds its TCPStore and a `multiprocessing.connection.Listener` (random 32-byte
  authkey) on an address the members reach, and asks each member (a `RemoteSite`: over HTTP in
  production, agents/dataplane/stages.py) to start the ranks it holds;
- the member starts them as its own processes (`StageProcesses`); each connects back with
  `Client`, says who it is (`hello`), receives its WorkerSpec and then runs the unchanged
  `worker_main` loop over that connection (a Client connection has a Pipe end's send/recv);
- the model folder is the member's own (resolved and SHA256-checked by its ModelStore), so the
  spec's `model_dir` is replaced on arrival; the GPU is the member's too (its CUDA index in the
  hello, copied into the group's `rank_gpus` by the leader before any spec is sent).

The spec is sent only after every remote rank said hello, so the leader picks the collective
backend knowing every rank's host and GPU (nccl only when each rank has a GPU of its own on its
host; gloo otherwise).
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Client, Connection, Listener
from typing import Any, Protocol

from agents.engines.torch.worker import WorkerSpec, worker_main

AUTHKEY_BYTES = 32


@dataclass(frozen=True)
class RemoteStart:
    """What a leader asks of a member: start those of `ranks` it holds and connect them back."""

    group: str  # the engine's group name: main | prefill | decode (a plan's pipeline)
    ranks: tuple[tuple[int, int], ...]  # (stage index, tp rank) of every rank not on the leader
    listener_addr: tuple[str, int]  # where the ranks connect back
    authkey: bytes  # the listener's; never logged
    timeout_s: float  # the group's: how long a member may take to be ready, and a worker to connect
    num_threads: int


class RemoteSite(Protocol):
    """A node that can start a group's ranks (the leader's view of one member)."""

    @property
    def name(self) -> str:
        """The node id, in error messages and as the host key of its ranks."""
        ...

    def start_workers(self, request: RemoteStart) -> list[tuple[int, int]]:
        """Start those of request.ranks placed on this node; return them. Raises RuntimeError
        (with the member's reason) when it will not, after retrying while it is not ready yet."""
        ...


@dataclass(frozen=True)
class Placement:
    """Where one group's ranks run: `local` ranks here, every other one on one of `sites`."""

    local: frozenset[int]  # global ranks of the group started on this node
    sites: tuple[RemoteSite, ...]
    bind_host: str = "127.0.0.1"  # the store and the listener: an address every site can reach


@dataclass(frozen=True)
class Hello:
    """The first message of a remote rank on its connection."""

    stage_index: int
    tp_rank: int
    host: str  # the member's node id: ranks of one host must have distinct GPUs for nccl
    gpu: int | None  # its CUDA index on that host; None on a CPU node
    pid: int


def remote_worker_main(
    address: tuple[str, int], authkey: bytes, hello: Hello, model_dir: str, timeout_s: float
) -> None:
    """Process entry point on the member: connect back, say hello, take the spec, serve."""
    conn = Client(address, authkey=authkey)
    conn.send(("hello", replace(hello, pid=os.getpid())))
    if not conn.poll(timeout_s):
        conn.close()  # the leader never answered: nothing to serve
        return
    try:
        kind, spec = conn.recv()
    except (EOFError, OSError):
        return
    if kind != "spec" or not isinstance(spec, WorkerSpec):
        conn.close()
        return
    # The leader's spec names its own folder; the weights here were checked against the same digest.
    worker_main(replace(spec, model_dir=model_dir), conn)


class Rendezvous:
    """The leader's listener: accepts remote ranks' connections and reads their hellos.

    An accept thread hands authenticated connections to a queue; `wait` reads hellos until every
    expected rank is in or the deadline passes. `close` stops the thread by closing the listener
    and poking it with one plain connection (accept() has no timeout of its own).
    """

    def __init__(self, host: str) -> None:
        self.authkey = os.urandom(AUTHKEY_BYTES)
        self._listener = Listener((host, 0), authkey=self.authkey)
        self.address: tuple[str, int] = self._listener.address
        self._conns: queue.Queue[Connection] = queue.Queue()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, name=f"rendezvous-{self.address[1]}", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn = self._listener.accept()
            except Exception:  # noqa: BLE001 - a stranger failing the challenge must not stop accepting
                if self._closed.is_set():
                    return
                continue
            if self._closed.is_set():
                conn.close()
                return
            self._conns.put(conn)

    def wait(self, expected: set[tuple[int, int]], deadline: float) -> dict[tuple[int, int], tuple[Hello, Connection]]:
        """Connections of every expected (stage, tp rank); those still missing at the deadline are
        left out (the caller names them)."""
        got: dict[tuple[int, int], tuple[Hello, Connection]] = {}
        while set(got) != expected:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                conn = self._conns.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            hello = _read_hello(conn, max(0.0, deadline - time.monotonic()))
            key = (hello.stage_index, hello.tp_rank) if hello is not None else None
            if hello is None or key not in expected or key in got:
                conn.close()  # not one we asked for, or a second one for the same rank
                continue
            got[key] = (hello, conn)
        return got

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            with socket.create_connection(self.address, timeout=1.0):
                pass
        except OSError:
            pass
        self._listener.close()
        self._thread.join(2.0)
        while not self._conns.empty():
            self._conns.get_nowait().close()


def _read_hello(conn: Connection, timeout_s: float) -> Hello | None:
    try:
        if not conn.poll(timeout_s):
            return None
        kind, hello = conn.recv()
    except (EOFError, OSError, ValueError, TypeError):
        return None
    return hello if kind == "hello" and isinstance(hello, Hello) else None


@dataclass
class StageProcesses:
    """A member's worker processes for one plan: started on the leader's request, stopped with the
    plan (release, abort) - or on their own when the leader's connection ends (EOF)."""

    start_method: str = "forkserver"
    procs: list[Any] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self, request: RemoteStart, mine: Sequence[tuple[int, int, int | None]], *, host: str,
              model_dir: str) -> list[int]:
        """Start one process per (stage index, tp rank, CUDA index or None); their pids."""
        from agents.engines.torch.group import _context

        ctx = _context(self.start_method)
        pids = []
        with self._lock:
            for si, r, gpu in mine:
                hello = Hello(si, r, host, gpu, 0)
                proc = ctx.Process(
                    target=remote_worker_main,
                    args=(request.listener_addr, request.authkey, hello, model_dir, request.timeout_s),
                    name=f"flexpipe-{request.group}-s{si}t{r}@{host}",
                    daemon=True,
                )
                proc.start()
                self.procs.append(proc)
                pids.append(int(proc.pid))
        return pids

    @property
    def pids(self) -> list[int]:
        with self._lock:
            return [int(p.pid) for p in self.procs if p.is_alive()]

    def stop(self) -> None:
        """Terminate and reap every process; idempotent. A worker still serving gets SIGTERM: its
        leader's group sees EOF and fails, which is what releasing a plan under it means."""
        with self._lock:
            procs, self.procs = self.procs, []
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)
