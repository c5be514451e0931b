"""/api/v1/jobs: operators submit and delete fine-tune and batch jobs; a bad field is a 400 naming it
and nothing is stored; the heatmap's holders show the GPUs a job holds (console/gearbox/jobs.py,
console/gearbox/api_jobs.py, console/gearbox/present.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.test import Client

from console.audit.models import AuditEntry
from console.gearbox import present
from console.gearbox.models import Job
from tests.console.people import Person

pytestmark = pytest.mark.django_db


def body(**over: Any) -> dict[str, Any]:
    return {"name": "ft-7b", "gpus": 4, "work_gpu_s": 4 * 3600, **over}


def post(client: Client, data: Any) -> Any:
    return client.post("/api/v1/jobs", json.dumps(data), content_type="application/json")


def stored() -> tuple[int, int]:
    return Job.objects.count(), AuditEntry.objects.count()


def test_an_operator_submits_a_job_at_priority_1_and_deletes_it(operator: Person, viewer: Person) -> None:
    resp = post(operator.api(), body(gpu_model="H100-SXM", grace_s=45))
    assert resp.status_code == 201, resp.json()
    got = resp.json()
    assert (got["state"], got["priority"], got["grace_s"], got["checkpoint_s"], got["progress"]) == \
        ("queued", 1, 45.0, 20.0, 0.0)
    assert [j["name"] for j in viewer.api().get("/api/v1/jobs").json()["results"]] == ["ft-7b"]
    assert viewer.api().get("/api/v1/jobs/ft-7b").json()["gpu_model"] == "H100-SXM"
    assert AuditEntry.objects.filter(event_type="gearbox.job_created").count() == 1
    assert post(operator.api(), body()).status_code == 409  # the name is taken
    assert viewer.api().delete("/api/v1/jobs/ft-7b").status_code == 403
    assert operator.api().delete("/api/v1/jobs/ft-7b").status_code == 204
    assert not Job.objects.exists() and AuditEntry.objects.filter(event_type="gearbox.job_deleted").count() == 1


def test_a_viewer_may_not_submit_a_job(viewer: Person) -> None:
    before = stored()
    assert post(viewer.api(), body()).status_code == 403
    assert stored() == before


@pytest.mark.parametrize(("over", "field", "words"), [
    ({"name": "no spaces"}, "name", "letters"),
    ({"gpus": 0}, "gpus", "from 1"),
    ({"gpus": "4"}, "gpus", "whole number"),
    ({"work_gpu_s": 0}, "work_gpu_s", "> 0"),
    ({"work_gpu_s": True}, "work_gpu_s", "a number"),
    ({"gpu_model": "B300"}, "gpu_model", "catalog"),
    ({"priority": 1.5}, "priority", "whole number"),
    ({"grace_s": 900}, "grace_s", "<= 300"),
    ({"checkpoint_s": -1}, "checkpoint_s", ">= 0"),
    ({"colour": "red"}, "colour", "unknown field"),
])
def test_bad_job_input_is_a_400_naming_the_field_and_stores_nothing(operator: Person, over: dict[str, Any],
                                                                     field: str, words: str) -> None:
    before = stored()
    resp = post(operator.api(), body(**over))
    assert resp.status_code == 400, resp.json()
    assert field in resp.json() and words in resp.json()[field][0], resp.json()
    assert stored() == before


def test_a_missing_field_is_named(operator: Person) -> None:
    resp = post(operator.api(), {"name": "ft"})
    assert resp.status_code == 400 and set(resp.json()) == {"gpus", "work_gpu_s"}
    assert not Job.objects.exists()


def test_the_heatmap_holders_show_the_gpus_a_job_holds(operator: Person) -> None:
    assert post(operator.api(), body(name="ft", gpus=2)).status_code == 201
    assert present.gpu_holders([], {}) == {}  # queued: it holds nothing
    # where it runs, as the tick writes it (console/gearbox/admission.py; test_job_admission.py runs it)
    Job.objects.filter(name="ft").update(state=Job.RUNNING, gpu_uuids=["GPU-a", "GPU-b"])
    holders = present.gpu_holders([], {})
    assert holders == {"GPU-a": [{"job": "ft", "role": "job"}], "GPU-b": [{"job": "ft", "role": "job"}]}
    Job.objects.filter(name="ft").update(state=Job.YIELDING)
    assert present.gpu_holders([], {})["GPU-a"] == [{"job": "ft", "role": "yielding"}]
