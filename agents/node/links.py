"""The node agent's link probe: bandwidth and latency to each peer it was told about.

Measured over the same path the KV cache takes between agents: an HTTP upload to the peer's
data server (agents/dataplane: POST /data/v1/probe, through the pooled client that sends KV
frames to /data/v1/accept), so what the cost model prices a migration with is what a migration
gets. Per peer:

* latency: half the fastest of `pings` tiny uploads (a round trip: request out, answer back);
* bandwidth: the bytes of `rounds` bulk uploads of `bulk_bytes` each over their time less that
  round trip (the fixed part every upload pays), the best round kept (the link, not the noise of
  a busy moment); reported in Gb/s like the rest of the protocol.

When: at start (the controller sends `probe_links` with the peers when a node registers), every
`interval_s` (FLEXPIPE_LINK_PROBE_S, default 600 s) to the peers it knows, and whenever the
controller asks again. Each report carries the latest measurement per peer with `measured_at`
and `method`; a peer that cannot be reached is left out (the console ages the old figure out).
Pure I/O around one arithmetic (`link_from_timings`), tested without a network.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from agents.protocol import LinkReport

log = logging.getLogger("agents.node")

METHOD = "dataplane-bulk"  # what `LinkReport.method` says for these measurements
DEFAULT_INTERVAL_S = 600.0
DEFAULT_BULK_BYTES = 32 * 2**20


def interval_from_env() -> float:
    raw = os.environ.get("FLEXPIPE_LINK_PROBE_S", "")
    try:
        value = float(raw) if raw else DEFAULT_INTERVAL_S
    except ValueError:
        log.warning("FLEXPIPE_LINK_PROBE_S=%r is not a number; probing every %g s", raw, DEFAULT_INTERVAL_S)
        return DEFAULT_INTERVAL_S
    return value if value > 0 else DEFAULT_INTERVAL_S


def link_from_timings(peer: str, bulk_bytes: int, bulk_s: list[float], ping_s: list[float], measured_at: float
                      ) -> LinkReport | None:
    """The link a probe's timings describe (module docstring), or None without a usable bulk round."""
    rtt = min(ping_s) if ping_s else 0.0
    best = None
    for t in bulk_s:
        moving = t - rtt
        if moving > 0 and (best is None or moving < best):
            best = moving
    if best is None:
        return None
    gbps = bulk_bytes * 8 / best / 1e9
    return LinkReport(peer=peer, bw_gbps=round(gbps, 4), latency_us=round(rtt / 2 * 1e6, 2) if ping_s else None,
                      measured_at=round(measured_at, 3), method=METHOD)


Upload = Callable[[str, int], float]  # (peer data address, bytes) -> seconds


def _upload(addr: str, nbytes: int) -> float:
    from agents.dataplane.client import probe_upload

    return probe_upload(addr, nbytes)


@dataclass
class LinkProber:
    """The peers to probe and the latest measurement of each (thread-safe)."""

    bulk_bytes: int = DEFAULT_BULK_BYTES
    rounds: int = 3
    pings: int = 5
    interval_s: float = field(default_factory=interval_from_env)
    upload: Upload = _upload
    wall: Callable[[], float] = time.time  # measured_at stamps
    clock: Callable[[], float] = time.monotonic  # when the next round is due
    peers: dict[str, str] = field(default_factory=dict)  # node id -> data address
    latest: dict[str, LinkReport] = field(default_factory=dict)
    _next_s: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _running: bool = False

    def tell(self, peers: Mapping[str, str]) -> None:
        """Peers the controller named (they replace the list; a peer no longer named is dropped)."""
        with self._lock:
            self.peers = {n: a for n, a in peers.items() if a}
            self.latest = {n: r for n, r in self.latest.items() if n in self.peers}

    def due(self) -> bool:
        with self._lock:
            return bool(self.peers) and not self._running and self.clock() >= self._next_s

    def reports(self) -> tuple[LinkReport, ...]:
        with self._lock:
            return tuple(self.latest[n] for n in sorted(self.latest))

    def probe(self, peers: Mapping[str, str] | None = None) -> list[LinkReport]:
        """Measure every peer (or these), keep and return what was measured."""
        with self._lock:
            targets = dict(peers if peers is not None else self.peers)
            self._running = True
        out: list[LinkReport] = []
        try:
            for node, addr in sorted(targets.items()):
                rep = self._probe_one(node, addr)
                if rep is not None:
                    out.append(rep)
        finally:
            with self._lock:
                for rep in out:
                    if rep.peer in self.peers or peers is not None:
                        self.latest[rep.peer] = rep
                self._running = False
                self._next_s = self.clock() + self.interval_s
        return out

    def _probe_one(self, node: str, addr: str) -> LinkReport | None:
        try:
            pings = [self.upload(addr, 1) for _ in range(self.pings)]
            bulk = [self.upload(addr, self.bulk_bytes) for _ in range(self.rounds)]
        except OSError as exc:
            log.warning("link probe to %s (%s) failed: %s", node, addr, exc)
            return None
        rep = link_from_timings(node, self.bulk_bytes, bulk, pings, self.wall())
        if rep is not None:
            log.info("link to %s: %.2f Gb/s, %s us (%s)", node, rep.bw_gbps, rep.latency_us, METHOD)
        return rep


__all__ = ["DEFAULT_INTERVAL_S", "METHOD", "LinkProber", "interval_from_env", "link_from_timings"]
