"""Celery tasks of the fleet: thin, idempotent, ids not objects."""

from __future__ import annotations

from celery import shared_task
from django.utils import timezone

from console.fleet import actions, retention


@shared_task(name="fleet.sweep_heartbeats", acks_late=True, ignore_result=False)
def sweep_heartbeats(**kwargs: object) -> list[str]:
    """Mark silent nodes unschedulable. Idempotent: a second run finds nothing more to mark."""
    return actions.do_sweep_heartbeats(now=timezone.now())


@shared_task(name="fleet.prune_history", acks_late=True)
def prune_history(**kwargs: object) -> dict[str, int]:
    """Bound the GPU samples by the retention policy (console.fleet.retention). Idempotent."""
    return retention.prune_gpu_samples(now=timezone.now()).to_dict()
