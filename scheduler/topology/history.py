"""Fragment history: each atomic block's size over time, and how stable that makes it.

`FragmentHistory` follows blocks by their stable ids (`blocks`) from one snapshot to the next,
keeps a bounded trajectory per block, scores its stability from its recent shrinks, and reads
and writes itself as plain JSON (with the snapshot's path-naming `_Reader`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from scheduler.topology.blocks import AtomicBlock
from scheduler.topology.snapshot import _Reader

# --- fragment history ----------------------------------------------------------------------
Trajectory = tuple[tuple[float, int], ...]  # ((t_s, size), ...), increasing t_s


@dataclass(frozen=True)
class FragmentHistory:
    """Per block, a bounded record of its size over time, and a stability score.

    Only changes are stored (a point when the size differs from the last one), so a block
    that never changes costs one point. Points older than `horizon_s` are dropped, except the
    last one before the cutoff (it is the block's size at the start of the horizon), and at
    most `max_points` are kept per block. A block that disappears is recorded at size 0;
    blocks unseen for longer than the horizon are forgotten. Pure: `observe` returns a new
    history.
    """

    horizon_s: float = 4 * 3600.0  # how far back trajectories reach
    max_points: int = 256  # per block
    trajectories: Mapping[str, Trajectory] = field(default_factory=dict)  # block id -> points

    def observe(self, blocks: Iterable[AtomicBlock], now_s: float) -> FragmentHistory:
        """The history after seeing `blocks` at `now_s` (older than every stored point)."""
        current = {b.id: b.size for b in blocks}
        cutoff = now_s - self.horizon_s
        out: dict[str, Trajectory] = {}
        for block_id in sorted(set(self.trajectories) | set(current)):
            points = list(self.trajectories.get(block_id, ()))
            if points and now_s < points[-1][0]:
                raise ValueError(f"now_s: {now_s} is older than the last observation {points[-1][0]}")
            size = current.get(block_id, 0)
            if not points or points[-1][1] != size:
                points.append((now_s, size))
            # keep the last point at or before the cutoff: it is the size at the window start
            first = 0
            while first + 1 < len(points) and points[first + 1][0] <= cutoff:
                first += 1
            points = points[first:][-self.max_points :]
            if size == 0 and points[-1][0] <= cutoff:
                continue  # gone for longer than the horizon: forget it
            out[block_id] = tuple(points)
        return FragmentHistory(self.horizon_s, self.max_points, MappingProxyType(out))

    def sizes(self, block_id: str) -> Trajectory:
        return self.trajectories.get(block_id, ())

    def stability(self, block_id: str, now_s: float, window_s: float = 3600.0) -> float:
        """1.0 for a block that has not shrunk within `window_s`; lower the more, the larger and
        the more recent its shrinks were; 0.0 when it is gone now.

        score = 1 / (1 + sum over shrinks of (lost / previous size) x (1 - age / window))

        A block never seen has no evidence against it and scores 1.0.
        """
        points = self.trajectories.get(block_id, ())
        if not points:
            return 1.0
        if points[-1][1] == 0:
            return 0.0
        penalty = 0.0
        for (_, before), (t_s, after) in zip(points, points[1:], strict=False):
            age = now_s - t_s
            if after < before and age < window_s:
                penalty += (before - after) / before * (1.0 - max(0.0, age) / window_s)
        return 1.0 / (1.0 + penalty)

    def stabilities(self, now_s: float, window_s: float = 3600.0) -> dict[str, float]:
        return {b: self.stability(b, now_s, window_s) for b in self.trajectories}

    def to_dict(self) -> dict[str, object]:
        return {
            "horizon_s": self.horizon_s,
            "max_points": self.max_points,
            "trajectories": {b: [[t, s] for t, s in pts] for b, pts in sorted(self.trajectories.items())},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> FragmentHistory:
        r = _Reader(d, "history", required=("trajectories",), optional=("horizon_s", "max_points"))
        raw = r.raw("trajectories")
        if not isinstance(raw, Mapping):
            raise ValueError("history.trajectories: must be an object of block id -> [[t_s, size], ...]")
        out: dict[str, Trajectory] = {}
        for block_id, points in raw.items():
            path = f"history.trajectories[{block_id!r}]"
            if not isinstance(points, list):
                raise ValueError(f"{path}: must be a list of [t_s, size]")
            parsed: list[tuple[float, int]] = []
            for j, point in enumerate(points):
                ok = (
                    isinstance(point, list | tuple)
                    and len(point) == 2
                    and isinstance(point[0], int | float)
                    and isinstance(point[1], int)
                    and not isinstance(point[1], bool)
                    and point[1] >= 0
                )
                if not ok:
                    raise ValueError(f"{path}[{j}]: must be [t_s, size >= 0], got {point!r}")
                if parsed and point[0] < parsed[-1][0]:
                    raise ValueError(f"{path}[{j}]: times must not decrease")
                parsed.append((float(point[0]), int(point[1])))
            out[str(block_id)] = tuple(parsed)
        return cls(
            horizon_s=r.number("horizon_s", 4 * 3600.0),
            max_points=r.integer("max_points", 256),
            trajectories=MappingProxyType(out),
        )
