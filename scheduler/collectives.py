"""Measured collective curves: what an agent timed, and how the cost model reads them.

Where torch.distributed runs across a node's GPUs (or across nodes), an agent times all-reduce
and send/recv over a sweep of message sizes - the shape of nccl-tests - and reports each sweep
as a small table of (message bytes, seconds). A measured curve beats the physical model where
one exists: the alpha-beta ring fitted on A100 NVLink misses other NVLink generations' in-node
all-reduce by several times its A100 error (bench.fidelity shows both), while a curve measured
on the very GPUs is right by construction at its sizes and close in between.

`CollectiveCurve.time_s(bytes)` interpolates linearly between the two measured sizes around
`bytes` (a collective's time is close to affine in the size between neighbouring sizes: a fixed
part plus bytes over a bandwidth), extends the last segment's slope beyond the largest size (the
bandwidth-bound regime continues), and keeps the smallest size's time below it (the
latency-bound floor). `bench.fidelity` scores exactly this function, leaving each size out of
its own curve.

Keys: an all-reduce inside one node is looked up by (node, ranks); a collective between two
nodes by (the node pair, ranks) - send/recv across nodes is what a PP hand-off, a KV hand-off
and a KV migration do.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

Op = Literal["all_reduce", "send_recv"]
Scope = Literal["intra", "inter"]
OPS = ("all_reduce", "send_recv")
SCOPES = ("intra", "inter")


@dataclass(frozen=True)
class CollectiveCurve:
    """One measured sweep (module docstring)."""

    op: Op  # all_reduce | send_recv
    scope: Scope  # intra: GPUs of `node`; inter: `node` and `peer`
    node: str  # where it was measured (for inter, one end)
    ranks: int  # GPUs (processes) taking part
    points: tuple[tuple[int, float], ...]  # (message bytes, seconds), increasing bytes, at least one
    peer: str | None = None  # inter: the other node
    backend: str = ""  # nccl | gloo
    measured_at_s: float = 0.0  # when (snapshot clock)
    method: str = ""  # how it was measured

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"op: must be one of {', '.join(OPS)}; got {self.op!r}")
        if self.scope not in SCOPES:
            raise ValueError(f"scope: must be one of {', '.join(SCOPES)}; got {self.scope!r}")
        if self.scope == "inter" and not self.peer:
            raise ValueError("peer: an inter-node curve needs the other node")
        if self.ranks < 2:
            raise ValueError(f"ranks: a collective needs at least 2; got {self.ranks}")
        if not self.points:
            raise ValueError("points: at least one (bytes, seconds) point")
        last = 0
        for i, (size, t) in enumerate(self.points):
            if size <= last:
                raise ValueError(f"points[{i}]: sizes must increase and be >= 1; got {size} after {last}")
            if not (math.isfinite(t) and t > 0):
                raise ValueError(f"points[{i}]: seconds must be a finite number > 0; got {t}")
            last = size

    @property
    def key(self) -> tuple[str, str, str, str, int]:
        a, b = (self.node, self.peer or "") if self.scope == "intra" else tuple(sorted((self.node, self.peer or "")))
        return (self.op, self.scope, a, b, self.ranks)

    def time_s(self, nbytes: float) -> float:
        """Predicted seconds for a message of `nbytes` (module docstring: interpolation)."""
        pts = self.points
        if len(pts) == 1 or nbytes <= pts[0][0]:
            if len(pts) == 1 and nbytes > pts[0][0]:
                return pts[0][1] * nbytes / pts[0][0]  # one point: proportional above it
            return pts[0][1]
        lo = 0
        hi = len(pts) - 1
        if nbytes >= pts[hi][0]:
            lo = hi - 1
        else:
            while hi - lo > 1:  # bisect for the segment around nbytes
                mid = (lo + hi) // 2
                if pts[mid][0] <= nbytes:
                    lo = mid
                else:
                    hi = mid
        (x0, t0), (x1, t1) = pts[lo], pts[lo + 1]
        slope = max(0.0, (t1 - t0) / (x1 - x0))  # (noise can make a measured curve dip: never negative)
        return t0 + (nbytes - x0) * slope

    def bandwidth_bytes_per_s(self) -> float:
        """Bytes per second the largest sizes reach (the last segment's inverse slope; for one
        point, its size over its time)."""
        pts = self.points
        if len(pts) == 1:
            return pts[0][0] / pts[0][1]
        (x0, t0), (x1, t1) = pts[-2], pts[-1]
        return (x1 - x0) / (t1 - t0) if t1 > t0 else x1 / t1

    def latency_s(self) -> float:
        """The smallest message's time (the latency-bound floor)."""
        return self.points[0][1]

    def without(self, nbytes: int) -> CollectiveCurve | None:
        """The curve without the point at `nbytes` (leave-one-size-out); None when none is left."""
        pts = tuple(p for p in self.points if p[0] != nbytes)
        if not pts:
            return None
        return CollectiveCurve(self.op, self.scope, self.node, self.ranks, pts, self.peer, self.backend,
                               self.measured_at_s, self.method)

    def to_dict(self) -> dict[str, object]:
        return {"op": self.op, "scope": self.scope, "node": self.node, "peer": self.peer, "ranks": self.ranks,
                "backend": self.backend, "points": [[b, t] for b, t in self.points],
                "measured_at_s": self.measured_at_s, "method": self.method}

    @classmethod
    def from_dict(cls, d: object, path: str = "collective") -> CollectiveCurve:
        if not isinstance(d, Mapping):
            raise ValueError(f"{path}: must be an object")
        unknown = sorted(set(d) - {"op", "scope", "node", "peer", "ranks", "backend", "points", "measured_at_s",
                                   "method"})
        if unknown:
            raise ValueError(f"{path}.{unknown[0]}: unknown key")
        raw = d.get("points")
        if not isinstance(raw, list):
            raise ValueError(f"{path}.points: must be a list of [bytes, seconds]")
        points = []
        for i, p in enumerate(raw):
            if not (isinstance(p, list | tuple) and len(p) == 2 and isinstance(p[0], int) and not isinstance(p[0], bool)
                    and isinstance(p[1], int | float) and not isinstance(p[1], bool)):
                raise ValueError(f"{path}.points[{i}]: must be [bytes, seconds]")
            points.append((int(p[0]), float(p[1])))
        ranks = d.get("ranks")
        if isinstance(ranks, bool) or not isinstance(ranks, int):
            raise ValueError(f"{path}.ranks: must be an integer")
        try:
            return cls(op=d.get("op"), scope=d.get("scope"), node=str(d.get("node") or ""), ranks=ranks,  # type: ignore[arg-type]
                       points=tuple(points), peer=None if d.get("peer") in (None, "") else str(d.get("peer")),
                       backend=str(d.get("backend") or ""), measured_at_s=float(d.get("measured_at_s") or 0.0),
                       method=str(d.get("method") or ""))
        except ValueError as exc:
            raise ValueError(f"{path}.{exc}") from None


def index(curves: Sequence[CollectiveCurve]) -> dict[tuple[str, str, str, str, int], CollectiveCurve]:
    """Curves by key; where two share one, the newer measurement wins."""
    out: dict[tuple[str, str, str, str, int], CollectiveCurve] = {}
    for c in curves:
        prev = out.get(c.key)
        if prev is None or c.measured_at_s >= prev.measured_at_s:
            out[c.key] = c
    return out


__all__ = ["OPS", "SCOPES", "CollectiveCurve", "Op", "Scope", "index"]
