"""Explicit rollout: registering a version changes nothing that serves; rolling it out is a transition with
the canary whose shadow plans check the version's tokenizer, and a failed check rolls back while the old
version keeps serving (console/gearbox/rollout.py, agents/shadow_check.py)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from agents.engines.torch.weights import write_tokenizer
from console.audit.models import AuditEntry
from console.fleet.models import AgentCommand
from console.gateway.views import _deployment as gateway_deployment
from console.gateway.views import _tokenizer_path
from console.gearbox.models import Deployment, Transition
from console.registry.actions import VersionSpec, do_register_model_version, do_retire_model_version
from console.registry.models import ModelVersion
from scheduler.plan import Gear
from tests.console.gearbox.ops import BASELINE, drive, running_deployment
from tests.console.people import Person

pytestmark = pytest.mark.django_db


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("llama-tokenizer"), vocab_size=512, max_context=8192)


@pytest.fixture
def root(settings: Any, tmp_path: Path, tokenizer_dir: Path) -> Path:
    """A model root holding a copy of the tokenizer (tests break their copy)."""
    shutil.copytree(tokenizer_dir, tmp_path / "llama")
    settings.FLEXPIPE_MODEL_ROOTS = [tmp_path]
    return tmp_path


def register(root: Path, version: str = "v1", status: str | None = None) -> ModelVersion:
    spec = VersionSpec(name="Llama-3-8B", version=version, engine="vllm", architecture="Llama-3-8B",
                       weights_uri=f"hf://meta/llama-3-8b-{version}/model.safetensors",
                       sha256=hashlib.sha256(version.encode()).hexdigest(), tokenizer=str(root / "llama"),
                       max_context=8192, min_gpu_mem_bytes=2**34, warmup_tokens=16)
    v = do_register_model_version(spec, actor="user:alice").version
    if status is not None:
        ModelVersion.objects.filter(pk=v.pk).update(status=status)
        v.refresh_from_db()
    return v


def post(client: Client, path: str, body: Any = None) -> Any:
    return client.post(path, json.dumps(body if body is not None else {}), content_type="application/json")


def test_registering_a_version_changes_nothing_that_serves(root: Path, operator: Person) -> None:
    world = running_deployment(moved=False)
    before = Deployment.objects.values("model_version", "current_gear", "routing_version").get(name="chat")
    tokenizer = _tokenizer_path(gateway_deployment("chat"))  # type: ignore[arg-type]
    register(root)
    assert Deployment.objects.values("model_version", "current_gear", "routing_version").get(name="chat") == before
    assert _tokenizer_path(gateway_deployment("chat")) == tokenizer  # type: ignore[arg-type]
    # the next gear change of chat loads what it served, not the version just registered
    resp = post(operator.api(), "/api/v1/deployments/chat/override",
                {"spec": {"plans": [{"stages": [{"gpus": ["b1/0", "b1/1"]}]}]}})
    assert resp.status_code == 201
    drive(world.agents)
    prepare = AgentCommand.objects.filter(kind="prepare_plan", transition_seq=2).first()
    assert prepare is not None and prepare.payload["weights_sha256"] is None and "model_version" not in prepare.payload


def test_a_rollout_is_a_canary_transition_beside_the_running_gear_and_then_serves(root: Path,
                                                                                  operator: Person) -> None:
    world = running_deployment(moved=False)
    v1 = register(root)
    resp = post(operator.api(), "/api/v1/deployments/chat/rollout", {"version": v1.pk})
    assert resp.status_code == 201, resp.json()
    t = resp.json()
    assert t["kind"] == "rollout" and t["from_gear"]["gear_id"] == BASELINE.gear_id
    target = Gear.from_dict(Transition.objects.get(seq=t["seq"]).to_gear)
    assert not set(target.gpu_uuids) & set(BASELINE.gpu_uuids)  # shadow plans beside the running gear
    assert AuditEntry.objects.get(event_type="gearbox.rollout_started").actor == "user:oscar"
    row = drive(world.agents)
    assert row.phase == "done" and "canary" in [s.step for s in row.steps.all()]
    prepares = AgentCommand.objects.filter(kind="prepare_plan", transition_seq=t["seq"])
    assert prepares and all(p.payload["weights_sha256"] == v1.sha256 and p.payload["model_version"]["id"] == v1.pk
                            for p in prepares)
    dep = Deployment.objects.get(name="chat")
    assert dep.model_version_id == v1.pk and Gear.from_dict(dep.current_gear) == target
    assert AuditEntry.objects.get(event_type="gearbox.version_rolled_out").transition_seq == t["seq"]
    assert _tokenizer_path(gateway_deployment("chat")) == str(root / "llama")  # type: ignore[arg-type]
    again = post(operator.api(), "/api/v1/deployments/chat/rollout", {"version": v1.pk})
    assert again.status_code == 200 and again.json()["state"] == "already_serving"
    retire = post(operator.api(), f"/api/v1/models/{v1.pk}/retire")
    assert retire.status_code == 403  # retiring is for admins; and even they may not retire a served version
    with pytest.raises(Exception) as exc:
        do_retire_model_version(v1, actor="user:alice")
    assert "in use by chat" in str(exc.value)


def test_a_rollout_whose_tokenizer_fails_on_the_shadow_plan_rolls_back_and_the_old_version_keeps_serving(
        root: Path, operator: Person) -> None:
    world = running_deployment(moved=False)
    v1 = register(root)
    assert post(operator.api(), "/api/v1/deployments/chat/rollout", {"version": v1.pk}).status_code == 201
    drive(world.agents)
    for node in ("a1", "b1"):
        world.reporter.report(node)
    serving = Deployment.objects.values("current_gear", "routing", "model_version").get(name="chat")
    shutil.copytree(root / "llama", root / "llama-v2")
    v2 = register(root, "v2")
    ModelVersion.objects.filter(pk=v2.pk).update(tokenizer=str(root / "llama-v2"))
    (root / "llama-v2" / "tokenizer.json").write_text('{"truncated":')  # broken after it was registered
    resp = post(operator.api(), "/api/v1/deployments/chat/rollout", {"version": v2.pk})
    assert resp.status_code == 201
    row = drive(world.agents)
    assert row.kind == "rollout" and row.phase == "rolled_back"
    assert "tokenizer" in row.error and "does not load" in row.error
    failed = [s for s in row.steps.all() if s.step == "prepare"]
    assert failed and failed[-1].state == "failed" and failed[-1].reason == "tokenizer"
    after = Deployment.objects.values("current_gear", "routing", "model_version").get(name="chat")
    assert after["model_version"] == v1.pk and after["current_gear"] == serving["current_gear"]
    assert [r["plan_id"] for r in after["routing"]] == [r["plan_id"] for r in serving["routing"]]
    assert _tokenizer_path(gateway_deployment("chat")) == str(root / "llama")  # type: ignore[arg-type]


def test_a_rollout_before_anything_runs_binds_the_version(root: Path, operator: Person) -> None:
    from tests.console.gearbox.harness import enroll_fleet, make_deployment

    enroll_fleet()
    make_deployment()
    v1 = register(root)
    resp = post(operator.api(), "/api/v1/deployments/chat/rollout", {"version": v1.pk})
    assert resp.status_code == 200 and resp.json()["state"] == "bound"
    assert resp.json()["deployment"]["model_version"]["version"] == "v1"
    assert Transition.objects.count() == 0


def test_rollout_refusals_name_the_field_and_change_nothing(root: Path, operator: Person, viewer: Person,
                                                           admin: Person) -> None:
    world = running_deployment(moved=False)
    v1 = register(root)
    other = ModelVersion.objects.create(name="Llama-3-70B", version="x", engine="vllm", architecture="Llama-3-70B",
                                        weights_uri="hf://m/70b/w", sha256="c" * 64, tokenizer=str(root / "llama"),
                                        max_context=8192, min_gpu_mem_bytes=1, warmup_tokens=1, status="verified",
                                        registered_at=v1.registered_at, registered_by="user:alice")
    bad = register(root, "v-bad", status="quarantined")
    api = operator.api()
    before = (Deployment.objects.values("model_version", "current_gear", "mode").get(name="chat"),
              Transition.objects.count())
    for body, code, field in (({}, 400, "version"), ({"version": "one"}, 400, "version"),
                              ({"version": v1.pk, "colour": 1}, 400, "colour"),
                              ({"version": 10**9}, 404, "version"), ({"version": other.pk}, 400, "version"),
                              ({"version": bad.pk}, 409, "version")):
        resp = post(api, "/api/v1/deployments/chat/rollout", body)
        assert resp.status_code == code and field in resp.json(), (body, resp.json())
    assert post(viewer.api(), "/api/v1/deployments/chat/rollout", {"version": v1.pk}).status_code == 403
    assert post(Client(), "/api/v1/deployments/chat/rollout", {"version": v1.pk}).status_code == 401
    assert post(api, "/api/v1/deployments/nope/rollout", {"version": v1.pk}).status_code == 404
    assert (Deployment.objects.values("model_version", "current_gear", "mode").get(name="chat"),
            Transition.objects.count()) == before
    assert post(api, "/api/v1/deployments/chat/rollout", {"version": v1.pk}).status_code == 201
    busy = post(api, "/api/v1/deployments/chat/rollout", {"version": v1.pk})
    assert busy.status_code == 409 and "in a transition" in busy.json()["deployment"][0]
    retire = post(admin.api(), f"/api/v1/models/{v1.pk}/retire")
    assert retire.status_code == 409 and "rolling it out" in retire.json()["status"][0]
    drive(world.agents)
    post(api, "/api/v1/deployments/chat/emergency", {"reason": "drill"})
    held = post(api, "/api/v1/deployments/chat/rollout", {"version": register(root, "v3").pk})
    assert held.status_code == 409 and "release it first" in held.json()["mode"][0]
