"""Big local weights files are hashed by the Celery task `registry.verify_weights` on a real worker."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from console.audit.models import AuditEntry
from console.registry import actions
from console.registry.models import ModelVersion
from console.registry.tasks import verify_weights
from tests.console.people import Person
from tests.console.registry.conftest import OTHER_SHA256, TinyWeights, model_body


@pytest.fixture
def everything_is_big(settings: Any) -> None:
    settings.FLEXPIPE_REGISTRY_SYNC_VERIFY_BYTES = 0  # every local file goes to the task


def register(admin: Person, **overrides: Any) -> dict[str, Any]:
    resp = admin.api().post("/api/v1/models", json.dumps(model_body(**overrides)), content_type="application/json")
    assert resp.status_code == 201, resp.content
    return resp.json()


@pytest.mark.django_db(transaction=True)
def test_a_big_file_is_verifying_until_the_worker_has_hashed_it(everything_is_big: None, worker: None,
                                                                admin: Person, tiny_weights: TinyWeights) -> None:
    version = register(admin, weights_uri=tiny_weights.uri, sha256=tiny_weights.sha256)
    assert version["status"] == "verifying"
    # The registration enqueued the task on commit; the solo worker runs tasks in order, so this second
    # (redelivered-like) one runs after it, finds the version no longer verifying, and does nothing.
    assert verify_weights.delay(version_id=version["id"]).get(timeout=30) == "verified"
    stored = ModelVersion.objects.get(pk=version["id"])
    assert stored.status == "verified" and stored.verified_by == "system:registry"
    assert AuditEntry.objects.filter(event_type="registry.weights_verified").count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_big_file_with_a_wrong_sha256_is_quarantined_by_the_worker(everything_is_big: None, worker: None,
                                                                    admin: Person, tiny_weights: TinyWeights) -> None:
    version = register(admin, weights_uri=tiny_weights.uri, sha256=OTHER_SHA256)
    assert version["status"] == "verifying"
    assert verify_weights.delay(version_id=version["id"]).get(timeout=30) == "quarantined"
    stored = ModelVersion.objects.get(pk=version["id"])
    assert stored.observed_sha256 == tiny_weights.sha256
    body = json.loads(AuditEntry.objects.get(event_type="registry.version_quarantined").body)
    assert body["before"]["status"] == "verifying" and body["after"]["status"] == "quarantined"


@pytest.mark.django_db
def test_a_file_that_vanished_before_the_task_ran_is_quarantined(everything_is_big: None, admin: Person,
                                                                tmp_path: Path) -> None:
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"weights that will vanish")
    version = register(admin, weights_uri=str(weights), sha256=OTHER_SHA256)
    weights.unlink()
    assert actions.verify_local_weights(version["id"]) == "quarantined"
    stored = ModelVersion.objects.get(pk=version["id"])
    assert "no such file" in stored.status_detail and stored.observed_sha256 == ""
    assert AuditEntry.objects.filter(event_type="registry.version_quarantined").count() == 1


@pytest.mark.django_db
def test_the_task_leaves_a_version_retired_while_it_waited_alone(everything_is_big: None, admin: Person,
                                                                tiny_weights: TinyWeights) -> None:
    version = register(admin, weights_uri=tiny_weights.uri, sha256=tiny_weights.sha256)
    actions.do_retire_model_version(ModelVersion.objects.get(pk=version["id"]), actor="user:alice")
    assert actions.verify_local_weights(version["id"]) == "retired"
    assert not AuditEntry.objects.filter(event_type="registry.weights_verified").exists()


@pytest.mark.django_db
def test_the_task_for_a_version_that_does_not_exist_does_nothing() -> None:
    assert actions.verify_local_weights(12345) == "missing"
