"""Deployments from the registry: POST creates one from a model version (baseline "auto" or a spec),
PATCH changes its SLO, priority, replica bounds and idle time; a bad field is a 400 naming it and
nothing is stored; a model outside the built-in catalog is planned from its registered config
(console/gearbox/lifecycle.py, console/gearbox/api_lifecycle.py, console/registry/specs.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from agents.engines.torch.weights import write_tokenizer
from console.audit.models import AuditEntry
from console.gearbox import ticks
from console.gearbox.models import Deployment, Transition
from console.registry.models import ModelVersion
from console.registry.specs import spec_for
from scheduler.modelspec import from_hf_config, model_spec
from scheduler.plan import Gear
from tests.console.gearbox.harness import SimAgents, enroll_fleet
from tests.console.gearbox.ops import drive
from tests.console.people import Person

pytestmark = pytest.mark.django_db

# A ~51 B-parameter Llama-shaped model that the catalog does not know: 103 GB of bf16 weights, more
# than one 80 GB H100 holds, so any gear planned from this config needs TP >= 2.
BIG_CONFIG = {"model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 60, "num_attention_heads": 64,
              "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 32000,
              "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}


def version(name: str = "Llama-3-8B", architecture: Any = "Llama-3-8B", status: str = "verified",
            tag: str = "v1", min_gpu_mem_bytes: int = 2**30) -> ModelVersion:
    return ModelVersion.objects.create(
        name=name, version=tag, engine="vllm", architecture=architecture, weights_uri=f"hf://m/{name}/{tag}",
        sha256=(name.encode().hex() + tag.encode().hex() + "0" * 64)[:64], tokenizer="/models/tok",
        max_context=8192, min_gpu_mem_bytes=min_gpu_mem_bytes, warmup_tokens=8, status=status,
        registered_at=timezone.now(), registered_by="user:alice")


def body(v: ModelVersion, **over: Any) -> dict[str, Any]:
    return {"name": "chat2", "model_version": v.pk, "ttft_ms": 1500, "tpot_ms": 80, **over}


def post(client: Client, data: Any) -> Any:
    return client.post("/api/v1/deployments", json.dumps(data), content_type="application/json")


def patch(client: Client, name: str, data: Any) -> Any:
    return client.patch(f"/api/v1/deployments/{name}", json.dumps(data), content_type="application/json")


def stored() -> tuple[int, int]:
    return Deployment.objects.count(), AuditEntry.objects.count()


def test_an_operator_creates_a_deployment_whose_baseline_the_planner_chooses(operator: Person) -> None:
    enroll_fleet()
    v = version()
    resp = post(operator.api(), body(v, priority=5, min_replicas=0, max_replicas=3, idle_to_zero_s=600))
    assert resp.status_code == 201, resp.json()
    out = resp.json()
    assert out["name"] == "chat2" and out["model_version"]["id"] == v.pk and out["priority"] == 5
    assert out["replicas"] == {"min": 0, "max": 3} and out["idle_to_zero_s"] == 600.0
    assert out["created_by"] == operator.username and out["current_gear"] is None
    dep = Deployment.objects.get(name="chat2")
    baseline = Gear.from_dict(dep.baseline_gear)
    assert baseline.model == "Llama-3-8B" and baseline.plans and dep.baseline_by == f"user:{operator.username}"
    entry = AuditEntry.objects.get(event_type="gearbox.deployment_created")
    assert entry.actor == f"user:{operator.username}" and "the planner's best gear now" in entry.summary
    assert ticks.tick()["started"] == ["chat2#1"]  # the gearbox brings the chosen baseline up
    assert Gear.from_dict(Transition.objects.get(deployment=dep).to_gear) == baseline


@pytest.fixture(scope="module")
def big_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer of BIG_CONFIG's vocabulary (the shadow plan checks the version's tokenizer at PREPARE)."""
    return write_tokenizer(tmp_path_factory.mktemp("big-tokenizer"), vocab_size=32000, max_context=8192)


def test_a_model_outside_the_catalog_is_planned_from_its_registered_config(operator: Person, settings: Any,
                                                                          big_tokenizer: Path) -> None:
    settings.FLEXPIPE_MODEL_ROOTS = [big_tokenizer.parent]
    enroll_fleet()
    v = version("big-51b", BIG_CONFIG)
    ModelVersion.objects.filter(pk=v.pk).update(tokenizer=str(big_tokenizer))
    v.refresh_from_db()
    with pytest.raises(ValueError):
        model_spec("big-51b")  # the catalog does not know it
    resp = post(operator.api(), body(v, name="big"))
    assert resp.status_code == 201, resp.json()
    dep = Deployment.objects.get(name="big")
    spec = spec_for(dep)
    assert spec == from_hf_config(BIG_CONFIG, name="big-51b")
    assert spec.weight_bytes > 0.92 * 80 * 2**30  # more than one GPU holds ...
    baseline = Gear.from_dict(dep.baseline_gear)
    assert baseline.model == "big-51b"
    assert all(len(st.gpu_uuids) >= 2 for p in baseline.plans for st in p.stages)  # ... so the plan shards it
    agents = SimAgents()  # (the simulated engines size it from the model_spec its prepares carry)
    assert ticks.tick()["started"] == ["big#1"]
    done = drive(agents, "big")  # PREPARE books its memory from the config, then it serves
    assert done.phase == "done", (done.phase, done.error)
    assert Gear.from_dict(Deployment.objects.get(name="big").current_gear) == baseline
    # one GPU cannot hold it: a spec on one GPU is refused, planned with the same config
    one = {"plans": [{"stages": [{"gpus": ["b1/0"]}]}]}
    before = stored()
    resp = post(operator.api(), body(v, name="big-one", baseline_gear=one))
    assert resp.status_code == 400 and "baseline_gear.plans[0].stages" in resp.json(), resp.json()
    assert "do not fit" in resp.json()["baseline_gear.plans[0].stages"][0]
    assert stored() == before


def test_a_spec_baseline_names_gpus_by_node_and_index(operator: Person) -> None:
    enroll_fleet()
    v = version()
    spec = {"plans": [{"stages": [{"gpus": ["b1/2", "b1/3"], "tp": 2}]}]}
    resp = post(operator.api(), body(v, baseline_gear=spec, mode="advisory"))
    assert resp.status_code == 201, resp.json()
    dep = Deployment.objects.get(name="chat2")
    assert Gear.from_dict(dep.baseline_gear).plans[0].gpu_uuids == ("GPU-b1-2", "GPU-b1-3")
    assert dep.mode == "advisory"


@pytest.mark.parametrize("over, field, words", [
    ({"model_version": 10**9}, "model_version", "no model version"),
    ({"model_version": "one"}, "model_version", ""),
    ({"min_replicas": 4, "max_replicas": 2}, "min_replicas", "at most max_replicas (2)"),
    ({"min_replicas": 0, "idle_to_zero_s": -5}, "idle_to_zero_s", "> 0"),
    ({"idle_to_zero_s": 60}, "idle_to_zero_s", "needs min_replicas 0"),
    ({"ttft_ms": 0}, "ttft_ms", "> 0"),
    ({"tpot_ms": -1}, "tpot_ms", "> 0"),
    ({"ttft_ms": "fast"}, "ttft_ms", ""),
    ({"ttft_ms": 10**400}, "ttft_ms", ""),
    ({"priority": 5000}, "priority", ""),
    ({"name": "has/slash"}, "name", "letters, digits"),
    ({"colour": "red"}, "colour", "unknown field"),
    ({"baseline_gear": "fastest"}, "baseline_gear", '"auto"'),
    ({"baseline_gear": {"plans": [{"stages": [{"gpus": ["z9/0"]}]}]}}, "baseline_gear.plans[0].stages[0].gpus[0]",
     "no GPU 'z9/0'"),
    # TP across the NVLink domains of two nodes breaks invariant 4
    ({"baseline_gear": {"plans": [{"stages": [{"gpus": ["a1/7", "b1/0"]}]}]}}, "baseline_gear", "invariant 4"),
    ({"baseline_gear": {"plans": [{"stages": [{"gpus": ["b1/0"]}], "kv_reserve_tokens": 10**9}]}}, "baseline_gear",
     "invariant 4"),
])
def test_bad_deployment_input_is_a_400_naming_the_field_and_stores_nothing(
        operator: Person, over: dict[str, Any], field: str, words: str) -> None:
    enroll_fleet()
    v = version()
    before = stored()
    resp = post(operator.api(), body(v, **over))
    assert resp.status_code == 400, resp.json()
    assert field in resp.json(), resp.json()
    assert words in resp.json()[field][0]
    assert stored() == before


def test_a_version_that_may_not_be_loaded_is_refused(operator: Person) -> None:
    enroll_fleet()
    bad = version(status="quarantined")
    before = stored()
    resp = post(operator.api(), body(bad))
    assert resp.status_code == 400 and "quarantined" in resp.json()["model_version"][0]
    assert stored() == before


def test_a_version_whose_min_gpu_memory_no_gpu_has_gets_no_baseline_with_the_reason(operator: Person) -> None:
    enroll_fleet()  # H100s of 80 GiB
    v = version(min_gpu_mem_bytes=96 * 2**30)
    before = stored()
    auto = post(operator.api(), body(v))
    assert auto.status_code == 400, auto.json()
    assert "min_gpu_mem_bytes" in auto.json()["baseline_gear"][0], auto.json()
    spec = post(operator.api(), body(v, baseline_gear={"plans": [{"stages": [{"gpus": ["b1/0", "b1/1"]}]}]}))
    assert spec.status_code == 400
    assert "b1/0 (H100-SXM) has 80.0 GiB, below the registered min_gpu_mem_bytes of Llama-3-8B v1 (96.0 GiB)" \
        in spec.json()["baseline_gear"][0], spec.json()
    assert stored() == before


def test_creating_is_for_operators_and_a_name_is_taken_once(operator: Person, viewer: Person) -> None:
    enroll_fleet()
    v = version()
    assert post(viewer.api(), body(v)).status_code == 403
    assert post(Client(), body(v)).status_code == 401
    assert Deployment.objects.count() == 0
    assert post(operator.api(), body(v)).status_code == 201
    before = stored()
    again = post(operator.api(), body(v, ttft_ms=99))
    assert again.status_code == 409 and "name" in again.json()
    assert stored() == before


def test_patch_changes_the_slo_priority_replicas_and_idle_time_audited(operator: Person, viewer: Person) -> None:
    enroll_fleet()
    v = version()
    assert post(operator.api(), body(v)).status_code == 201
    resp = patch(operator.api(), "chat2", {"ttft_ms": 900, "priority": 7, "min_replicas": 0, "max_replicas": 2,
                                            "idle_to_zero_s": 120})
    assert resp.status_code == 200, resp.json()
    assert resp.json()["slo"]["ttft_ms"] == 900.0 and resp.json()["replicas"] == {"min": 0, "max": 2}
    dep = Deployment.objects.get(name="chat2")
    assert (dep.ttft_ms, dep.tpot_ms, dep.priority, dep.idle_to_zero_s) == (900.0, 80.0, 7, 120.0)
    entry = json.loads(AuditEntry.objects.get(event_type="gearbox.deployment_changed").body)
    assert entry["before"] == {"ttft_ms": 1500.0, "priority": 0, "min_replicas": 1, "max_replicas": 8,
                            "idle_to_zero_s": None}
    assert entry["after"]["priority"] == 7 and entry["actor"] == f"user:{operator.username}"
    # idle null again (never), then the same values: nothing new is audited
    assert patch(operator.api(), "chat2", {"idle_to_zero_s": None}).status_code == 200
    count = AuditEntry.objects.count()
    assert patch(operator.api(), "chat2", {"priority": 7}).status_code == 200
    assert AuditEntry.objects.count() == count
    assert patch(viewer.api(), "chat2", {"priority": 1}).status_code == 403
    assert patch(operator.api(), "nope", {"priority": 1}).status_code == 404


@pytest.mark.parametrize("change, field", [
    ({"min_replicas": 3, "max_replicas": 2}, "min_replicas"),
    ({"max_replicas": 0}, "max_replicas"),
    ({"idle_to_zero_s": 30}, "idle_to_zero_s"),  # min_replicas is 1
    ({"tpot_ms": 0}, "tpot_ms"),
    ({"model_version": 1}, "model_version"),
    ({"name": "other"}, "name"),
])
def test_a_bad_patch_is_a_400_naming_the_field_and_changes_nothing(operator: Person, change: dict[str, Any],
                                                                   field: str) -> None:
    enroll_fleet()
    v = version()
    assert post(operator.api(), body(v)).status_code == 201
    before = (Deployment.objects.values().get(name="chat2"), AuditEntry.objects.count())
    resp = patch(operator.api(), "chat2", change)
    assert resp.status_code == 400 and field in resp.json(), resp.json()
    assert (Deployment.objects.values().get(name="chat2"), AuditEntry.objects.count()) == before


def test_a_created_deployment_that_never_ran_is_deleted_at_once(operator: Person, admin: Person) -> None:
    enroll_fleet()
    v = version()
    assert post(operator.api(), body(v)).status_code == 201
    assert operator.api().delete("/api/v1/deployments/chat2").status_code == 403  # deleting is the admin's
    assert admin.api().delete("/api/v1/deployments/chat2").status_code == 204
    assert not Deployment.objects.filter(name="chat2").exists()
