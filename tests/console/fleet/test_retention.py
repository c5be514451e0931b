"""The retention policy (issue 19): GPU samples bounded by count and age by a beat task, Celery
results that expire. Real PostgreSQL (where it answers), real Redis, a real worker for results."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import redis
from django.conf import settings
from django.utils import timezone

from console.fleet.models import Gpu, GpuSample
from console.fleet.retention import prune_gpu_samples
from console.gearbox import tasks
from tests.conftest import TEST_REDIS_URL
from tests.console.gearbox.harness import enroll_fleet


def samples(gpu: Gpu, ages_s: list[float]) -> list[int]:
    """Store samples of `gpu` taken these many seconds ago, oldest first; their ids."""
    now = timezone.now()
    rows = GpuSample.objects.bulk_create([
        GpuSample(gpu=gpu, at=now - timedelta(seconds=age), mem_used_bytes=0, sm_util=0.0, temperature_c=40.0,
                  healthy=True, allocatable=True) for age in sorted(ages_s, reverse=True)])
    return [r.pk for r in rows]


@pytest.mark.django_db
def test_the_newest_per_gpu_within_the_age_are_kept_and_a_second_run_deletes_nothing() -> None:
    enroll_fleet({"a1": "A"}, gpus=2)
    GpuSample.objects.all().delete()
    a, b = Gpu.objects.order_by("index")
    a_ids = samples(a, [7200, 600, 500, 400, 300, 200, 100, 50])  # one too old, then seven recent
    b_ids = samples(b, [90000, 300, 60])  # one older than a day, two recent
    out = prune_gpu_samples(now=timezone.now(), keep=4, max_age_s=3600)
    assert out.to_dict() == {"over_count": 3, "too_old": 2}
    assert sorted(GpuSample.objects.filter(gpu=a).values_list("id", flat=True)) == a_ids[-4:]
    assert sorted(GpuSample.objects.filter(gpu=b).values_list("id", flat=True)) == b_ids[1:]
    assert prune_gpu_samples(now=timezone.now(), keep=4, max_age_s=3600).to_dict() == {"over_count": 0, "too_old": 0}


@pytest.mark.django_db
def test_the_defaults_come_from_the_settings(settings: Any) -> None:
    enroll_fleet({"a1": "A"}, gpus=1)
    GpuSample.objects.all().delete()
    (gpu,) = Gpu.objects.all()
    ids = samples(gpu, [10, 9, 8, 7, 6, 5])
    settings.FLEXPIPE_GPU_HISTORY = 2
    assert prune_gpu_samples(now=timezone.now()).over_count == 4
    assert sorted(GpuSample.objects.values_list("id", flat=True)) == ids[-2:]


def test_the_beat_prunes_and_results_expire_by_the_settings() -> None:
    beat = {e["task"]: e for e in settings.CELERY_BEAT_SCHEDULE.values()}
    assert beat["fleet.prune_history"]["schedule"] == max(10.0, settings.FLEXPIPE_PRUNE_S)
    assert settings.CELERY_RESULT_EXPIRES == 3600 and settings.FLEXPIPE_GPU_HISTORY_MAX_AGE_S == 86400


@pytest.mark.django_db(transaction=True)
def test_a_stored_task_result_carries_its_expiry_in_redis(worker: None) -> None:
    result = tasks.sweep.delay()  # a task that keeps its result, as the beat's do
    assert result.get(timeout=30) == []
    ttl_s = redis.Redis.from_url(TEST_REDIS_URL).ttl(f"celery-task-meta-{result.id}")
    assert 0 < ttl_s <= settings.CELERY_RESULT_EXPIRES  # was: Celery's default, a day
