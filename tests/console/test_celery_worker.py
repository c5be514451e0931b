"""A task runs on a real Celery worker, through the real Redis broker, against the real database."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from console.fleet.models import Node
from console.fleet.tasks import sweep_heartbeats
from tests.console.conftest import enroll

pytestmark = pytest.mark.django_db(transaction=True)




def test_the_heartbeat_sweep_runs_on_a_worker(worker: None, client) -> None:  # type: ignore[no-untyped-def]
    enroll(client, "a1")
    Node.objects.filter(node_id="a1").update(last_seen_at=timezone.now() - timedelta(minutes=10))
    result = sweep_heartbeats.delay()
    assert result.get(timeout=20) == ["a1"]
    assert not Node.objects.get(node_id="a1").schedulable
