"""Celery: evaluate the alert rules on beat, so an alert's "since" (and its `for`) counts from when it
began to hold, not from when someone first opened the Alerts page (console/metrics/alerts.py)."""

from __future__ import annotations

import time

from celery import shared_task


@shared_task(name="metrics.evaluate_alerts", ignore_result=False)
def evaluate_alerts(**kwargs: object) -> list[str]:
    """Stamp what holds now, clear what resolved; the names of the firing alerts. Idempotent: the stamps
    are set-if-absent, so a second run changes nothing but the resolved ones."""
    from console.metrics import alerts

    _, states = alerts.current(time.time())
    return [s.active.rule.name for s in states if s.state == "firing"]
