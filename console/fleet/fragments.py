"""The fragment history in production: each atomic block's trajectory, bounded, kept in the database.

Seed 000 section 4.1: the fragment monitor keeps how every block's size moved over the past hours,
so that latency-critical plans stay off blocks that keep shrinking. The history itself is
scheduler.topology.FragmentHistory (pure, bounded: only changes are stored, at most `max_points`
per block within `horizon_s`); this module keeps it in `BlockTrajectory` rows:

* `do_observe_blocks(snapshot, now)` - once per gearbox tick, before any decision: the blocks of
  the snapshot are observed and the rows that changed are written (one row per block).
* `load_history()` - what every decision reads (console/gearbox/actions.py passes it to
  scheduler.gearbox.decide).
* `blocks_of(gpus, snapshot, history, now)` - for the deployment page: the blocks a deployment's
  plans use, with their size now and their stability score.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from types import MappingProxyType

from django.conf import settings
from django.db import IntegrityError, transaction

from console.fleet.models import BlockTrajectory
from scheduler.topology import FragmentHistory, Snapshot, block_of, partition

log = logging.getLogger(__name__)


def load_history() -> FragmentHistory:
    trajectories = {}
    for row in BlockTrajectory.objects.all():
        points = tuple((float(t), int(n)) for t, n in row.points if isinstance(n, int) and n >= 0)
        if points:
            trajectories[row.block_id] = points
    return FragmentHistory(horizon_s=float(settings.FLEXPIPE_FRAGMENT_HORIZON_S),
                           trajectories=MappingProxyType(trajectories))


def do_observe_blocks(snapshot: Snapshot, *, now: datetime) -> FragmentHistory:
    """The history after seeing `snapshot`'s blocks now; the rows that changed are written.
    A tick that comes in late (an older `now` than the last point: two workers, a slow one), or
    that races another tick writing the same rows, changes nothing and returns what it read."""
    before = load_history()
    try:
        after = before.observe(partition(snapshot).blocks, now.timestamp())
    except ValueError as exc:
        log.info("fragment history not updated: %s", exc)
        return before
    try:
        with transaction.atomic():
            changed = [BlockTrajectory(block_id=block_id, points=[[t, n] for t, n in points], updated_at=now)
                       for block_id, points in after.trajectories.items()
                       if before.trajectories.get(block_id) != points]
            # one upsert, not a query or two per block: a fleet coming up changes a thousand at once
            BlockTrajectory.objects.bulk_create(changed, update_conflicts=True, unique_fields=["block_id"],
                                                update_fields=["points", "updated_at"], batch_size=500)
            gone = set(before.trajectories) - set(after.trajectories)
            if gone:
                BlockTrajectory.objects.filter(block_id__in=gone).delete()
    except IntegrityError:
        log.info("fragment history: another tick wrote it first")
        return before
    return after


@dataclass(frozen=True)
class BlockUse:
    """One block a deployment's plans use, as the deployment page shows it."""

    block_id: str
    gpus_used: int  # GPUs of the deployment's plans in it
    size_now: int  # GPUs in the block now (0: gone)
    stability: float  # 0..1 (FragmentHistory.stability: 1 = has not shrunk within the hour)
    shrinks: int  # how many times it shrank within the horizon


def blocks_of(gpus: Iterable[str], snapshot: Snapshot, history: FragmentHistory, now: datetime) -> list[BlockUse]:
    where = block_of(partition(snapshot).blocks)
    counts: dict[str, int] = {}
    for u in gpus:
        b = where.get(u)
        if b is not None:
            counts[b] = counts.get(b, 0) + 1
    sizes = {b.id: b.size for b in partition(snapshot).blocks}
    out = []
    for b, n in sorted(counts.items()):
        points = history.sizes(b)
        shrinks = sum(1 for (_, x), (_, y) in zip(points, points[1:], strict=False) if y < x)
        out.append(BlockUse(b, n, sizes.get(b, 0), round(history.stability(b, now.timestamp()), 3), shrinks))
    return out


__all__ = ["BlockUse", "blocks_of", "do_observe_blocks", "load_history"]
