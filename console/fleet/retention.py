"""How long the fleet's history is kept: GPU samples, bounded by count and by age (issue 19).

Each report stores one GpuSample per GPU; what is kept is bounded by a policy that the beat task
`fleet.prune_history` (every FLEXPIPE_PRUNE_S) applies to the whole table at once - before, each
report pruned its own GPUs, one query per GPU every 16th report, in the request:

    FLEXPIPE_GPU_HISTORY            240     samples kept per GPU, newest first (~1 h at 15 s a report)
    FLEXPIPE_GPU_HISTORY_MAX_AGE_S  86400   and none older than this, whatever the count
    FLEXPIPE_PRUNE_S                300     how often the beat task runs

Between two runs a GPU holds at most FLEXPIPE_GPU_HISTORY + FLEXPIPE_PRUNE_S / report interval
samples. The other bounded tables prune themselves where they are written (ServingSample: an hour,
BlockTrajectory: scheduler.topology's horizon); a "stay" decision that repeats is counted, not stored
(console/gearbox/repeats.py); Celery results expire after CELERY_RESULT_EXPIRES; audit entries are
kept (DESIGN.md invariant 7) and read a page at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import F, Window
from django.db.models.functions import RowNumber

from console.fleet.models import GpuSample

BATCH = 5000  # rows per DELETE: a short lock on a big table, not one long one


@dataclass(frozen=True)
class Pruned:
    over_count: int  # beyond the newest FLEXPIPE_GPU_HISTORY of their GPU
    too_old: int  # older than FLEXPIPE_GPU_HISTORY_MAX_AGE_S

    def to_dict(self) -> dict[str, int]:
        return {"over_count": self.over_count, "too_old": self.too_old}


def _delete(ids: list[int]) -> int:
    """Delete these rows, BATCH at a time. The ids are read once (the window over the whole table is
    computed once a run): between two runs the excess is what FLEXPIPE_PRUNE_S of reports added."""
    done = 0
    for start in range(0, len(ids), BATCH):
        done += GpuSample.objects.filter(id__in=ids[start:start + BATCH]).delete()[0]
    return done


def prune_gpu_samples(*, now: datetime, keep: int | None = None, max_age_s: float | None = None) -> Pruned:
    """Apply the policy (module docstring) once; idempotent: a second run deletes nothing."""
    keep = int(settings.FLEXPIPE_GPU_HISTORY if keep is None else keep)
    max_age_s = float(settings.FLEXPIPE_GPU_HISTORY_MAX_AGE_S if max_age_s is None else max_age_s)
    old = GpuSample.objects.filter(at__lt=now - timedelta(seconds=max_age_s)).values_list("id", flat=True)
    too_old = _delete(list(old))
    ranked = GpuSample.objects.annotate(
        newest=Window(RowNumber(), partition_by=[F("gpu_id")], order_by=F("id").desc()))
    over = ranked.filter(newest__gt=max(0, keep)).values_list("id", flat=True)
    return Pruned(over_count=_delete(list(over)), too_old=too_old)
