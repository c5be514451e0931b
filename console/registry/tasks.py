"""Celery tasks of the registry: thin, idempotent, ids not objects."""

from __future__ import annotations

from celery import shared_task

from console.registry import actions


@shared_task(name="registry.verify_weights", acks_late=True, ignore_result=False)
def verify_weights(*, version_id: int, **kwargs: object) -> str:
    """Stream a big local weights file through SHA256: verified or quarantined. Idempotent: a version
    that is no longer `verifying` is left alone, so a redelivered task does nothing."""
    return actions.verify_local_weights(version_id)
