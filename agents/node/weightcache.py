"""The node's host-memory weight cache: model folders kept in RAM so a plan loads without the disk.

Seed 004 section 3.3 ("hot plug"): what makes a model come up in a fraction of a second is that
its weights are already in host memory, not the engine. Here the cache is a folder on a RAM file
system (tmpfs, `/dev/shm` by default): an entry is a copy of a model folder, keyed by the weights'
SHA256, so every worker process of every plan on this node maps the same pages (one copy in RAM,
whatever the TP degree) and a GPU upload reads RAM at host-link speed instead of the disk's.

    cache = HostWeightCache("/dev/shm/flexpipe-weights-node-a", capacity_bytes=64 << 30)
    with cache.use(folder, digest) as got:        # got.folder: where the engine loads from
        start_engine(got.folder)                  # got.source: "host_cache" | "disk"

Rules:
* A fetch is a lease, held while a plan that loads from the entry runs (a supervised engine reads
  its folder again when it restarts): a leased entry is never evicted. Eviction is least recently
  used first, down to `capacity_bytes`; a folder that does not fit even so (larger than the cache,
  or everything else leased) is not cached: the plan loads from the disk folder (`source` "disk").
* A miss copies the folder in (that copy is the disk read; `source` "disk"), into a temporary
  name first and renamed whole, so a half-copied entry is never seen - not even by an agent that
  restarts: entries left by an earlier run of the agent (tmpfs outlives the process) are adopted
  at start, oldest first in the LRU order.
* The digest is the caller's (agents.node.plans.ModelStore hashed the disk copy); the cache never
  changes the bytes it was given. Two plans of one model missing at once copy it once.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)

Source = Literal["host_cache", "disk"]
DEFAULT_CACHE_ROOT = Path("/dev/shm")
_PARTIAL = ".partial-"


def default_capacity_bytes() -> int:
    """A quarter of this host's RAM: room for the weights of a few models beside the engines'
    own host buffers (FLEXPIPE_WEIGHT_CACHE_BYTES overrides it; 0 turns the cache off)."""
    raw = os.environ.get("FLEXPIPE_WEIGHT_CACHE_BYTES", "")
    if raw.strip():
        value = int(raw)
        if value < 0:
            raise ValueError(f"FLEXPIPE_WEIGHT_CACHE_BYTES: must be >= 0, got {value}")
        return value
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError):
        return 0


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


@dataclass(frozen=True)
class Fetched:
    folder: Path  # where the engine loads the model from
    source: Source  # host_cache: the weights were in RAM already; disk: they were read from the disk now
    weights_bytes: int  # the folder's size
    copy_s: float  # time spent copying it in (0 on a hit)


class HostWeightCache:
    """Model folders in RAM, LRU by bytes (module docstring). Thread-safe."""

    def __init__(self, root: str | Path, capacity_bytes: int) -> None:
        if not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(f"capacity_bytes: must be an integer >= 0, got {capacity_bytes!r}")
        self.root = Path(root)
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, int] = OrderedDict()  # digest -> bytes, least recently used first
        self._leases: dict[str, int] = {}  # digest -> plans loading or holding it now
        self._copying: dict[str, threading.Event] = {}
        self.hits = 0
        self.misses = 0
        if capacity_bytes > 0:
            self.root.mkdir(parents=True, exist_ok=True)
            self._adopt()

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(self._entries.values())

    def holds(self, digest: str) -> bool:
        with self._lock:
            return digest in self._entries

    def _adopt(self) -> None:
        """Entries an earlier run of this agent left (tmpfs outlives it); half copies are removed."""
        found = []
        for p in self.root.iterdir():
            if p.name.startswith(_PARTIAL):
                shutil.rmtree(p, ignore_errors=True)
            elif p.is_dir() and len(p.name) == 64:
                found.append((p.stat().st_mtime, p.name, folder_bytes(p)))
        for _, digest, size in sorted(found):
            self._entries[digest] = size
        self._evict(0)

    @contextmanager
    def use(self, folder: str | Path, digest: str) -> Iterator[Fetched]:
        """Lease the model's cached copy (made now on a miss) while the caller loads from it."""
        got = self.fetch(folder, digest)
        try:
            yield got
        finally:
            if got.folder != Path(folder):
                self.release(digest)

    def fetch(self, folder: str | Path, digest: str) -> Fetched:
        """The folder to load from, leased while it is not the source folder itself: call
        `release(digest)` when the plan that loads from it stops (a supervised engine may read it
        again when it restarts). Prefer `use` where the load is all that reads it."""
        src = Path(folder)
        size = folder_bytes(src)
        if self.capacity_bytes == 0 or size > self.capacity_bytes:
            return Fetched(src, "disk", size, 0.0)
        while True:
            with self._lock:
                if digest in self._entries:
                    self._entries.move_to_end(digest)
                    self._leases[digest] = self._leases.get(digest, 0) + 1
                    self.hits += 1
                    return Fetched(self.root / digest, "host_cache", self._entries[digest], 0.0)
                waiting = self._copying.get(digest)
                if waiting is None:
                    if not self._evict(size):  # every entry is leased: load from the disk folder itself
                        return Fetched(src, "disk", size, 0.0)
                    self._copying[digest] = threading.Event()
                    self._leases[digest] = self._leases.get(digest, 0) + 1
                    break
            waiting.wait()  # another plan of this model is copying it in: take its copy
        try:
            t0 = time.perf_counter()
            self._copy_in(src, digest)
            copy_s = time.perf_counter() - t0
        except BaseException:
            with self._lock:
                self._leases[digest] -= 1
                self._copying.pop(digest).set()
            raise
        with self._lock:
            self._entries[digest] = size
            self.misses += 1
            self._copying.pop(digest).set()
        log.info("weight cache: %s (%.1f MB) copied in in %.2f s", digest[:12], size / 1e6, copy_s)
        return Fetched(self.root / digest, "disk", size, copy_s)

    def release(self, digest: str) -> None:
        with self._lock:
            left = self._leases.get(digest, 0) - 1
            if left > 0:
                self._leases[digest] = left
            else:
                self._leases.pop(digest, None)

    def _copy_in(self, src: Path, digest: str) -> None:
        tmp = self.root / f"{_PARTIAL}{digest}-{os.getpid()}-{threading.get_ident()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            for p in sorted(src.iterdir()):
                if p.is_file():
                    shutil.copyfile(p, tmp / p.name)
            tmp.rename(self.root / digest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _evict(self, incoming_bytes: int) -> bool:
        """Least recently used entries out (never a leased one) until `incoming_bytes` fits; False
        when it cannot fit even so. Called with the lock held."""
        used = sum(self._entries.values())
        for digest in list(self._entries):
            if used + incoming_bytes <= self.capacity_bytes:
                break
            if self._leases.get(digest):
                continue
            used -= self._entries.pop(digest)
            shutil.rmtree(self.root / digest, ignore_errors=True)
            log.info("weight cache: evicted %s", digest[:12])
        return used + incoming_bytes <= self.capacity_bytes
