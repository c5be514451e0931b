"""The registry's REST API: who may do what, every validation path, and the identity rules."""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from console.audit.chain import verify_chain
from console.audit.models import AuditEntry
from console.registry.models import ModelVersion
from tests.console.conftest import AgentHTTP
from tests.console.people import Person
from tests.console.registry.conftest import OTHER_SHA256, TinyWeights, model_body

pytestmark = pytest.mark.django_db

MODELS = "/api/v1/models"


def post(client: Client, path: str, body: Any) -> Any:
    return client.post(path, json.dumps(body), content_type="application/json")


def registered(admin: Person, **overrides: Any) -> dict[str, Any]:
    resp = post(admin.api(), MODELS, model_body(**overrides))
    assert resp.status_code == 201, resp.content
    return resp.json()


# -- who may call -----------------------------------------------------------------------------------


def test_listing_without_credentials_is_401(db: None) -> None:
    assert Client().get(MODELS).status_code == 401


def test_an_agent_token_is_refused_on_the_registry(agent: AgentHTTP) -> None:
    client = Client(headers={"Authorization": f"Bearer {agent.token}"})
    assert client.get(MODELS).status_code == 401
    assert post(client, MODELS, model_body()).status_code == 401
    assert not ModelVersion.objects.exists()


def test_an_outsider_may_not_even_list(outsider: Person) -> None:
    resp = outsider.api().get(MODELS)
    assert resp.status_code == 403 and "viewer role" in resp.json()["detail"]


@pytest.mark.parametrize("who", ["viewer", "operator", "admin"])
def test_every_role_may_list_and_read(request: pytest.FixtureRequest, admin: Person, who: str) -> None:
    version = registered(admin)
    person: Person = request.getfixturevalue(who)
    listing = person.api().get(MODELS)
    assert listing.status_code == 200 and [v["id"] for v in listing.json()["results"]] == [version["id"]]
    detail = person.api().get(f"{MODELS}/{version['id']}")
    assert detail.status_code == 200 and detail.json() == version


@pytest.mark.parametrize("who", ["outsider", "viewer", "operator"])
def test_only_an_admin_may_register(request: pytest.FixtureRequest, who: str) -> None:
    person: Person = request.getfixturevalue(who)
    resp = post(person.api(), MODELS, model_body())
    assert resp.status_code == 403
    assert not ModelVersion.objects.exists() and not AuditEntry.objects.exists()


@pytest.mark.parametrize("who", ["outsider", "viewer", "operator"])
def test_only_an_admin_may_retire(request: pytest.FixtureRequest, admin: Person, who: str) -> None:
    version = registered(admin)
    person: Person = request.getfixturevalue(who)
    assert post(person.api(), f"{MODELS}/{version['id']}/retire", {}).status_code == 403
    assert ModelVersion.objects.get().status == ModelVersion.AWAITING_AGENT


def test_retiring_without_credentials_is_401(admin: Person) -> None:
    version = registered(admin)
    assert post(Client(), f"{MODELS}/{version['id']}/retire", {}).status_code == 401


def test_a_browser_write_without_the_csrf_token_is_refused(admin: Person) -> None:
    resp = post(admin.browser(), MODELS, model_body())
    assert resp.status_code == 403 and "CSRF" in resp.json()["detail"]
    assert not ModelVersion.objects.exists()


def test_a_browser_write_with_the_csrf_token_is_accepted_and_audited_as_the_user(admin: Person) -> None:
    browser = admin.browser()
    browser.get("/")  # any page sets the CSRF cookie (the logout form), as in a real browser
    token = browser.cookies["csrftoken"].value
    resp = browser.post(MODELS, json.dumps(model_body()), content_type="application/json",
                        headers={"X-CSRFToken": token})
    assert resp.status_code == 201
    entry = AuditEntry.objects.get(event_type="registry.version_registered")
    assert entry.actor == "user:alice" and entry.user == admin.user


def test_updating_or_deleting_a_version_is_not_offered(admin: Person) -> None:
    version = registered(admin)
    url = f"{MODELS}/{version['id']}"
    client = admin.api()
    assert client.put(url, json.dumps(model_body()), content_type="application/json").status_code == 405
    assert client.patch(url, json.dumps({"tokenizer": "x"}), content_type="application/json").status_code == 405
    assert client.delete(url).status_code == 405
    assert ModelVersion.objects.get().tokenizer == model_body()["tokenizer"]


# -- registering --------------------------------------------------------------------------------------


def test_remote_weights_wait_for_an_agent_and_the_registration_is_audited(admin: Person) -> None:
    version = registered(admin)
    assert version["status"] == "awaiting_agent" and version["registered_by"] == "user:alice"
    assert version["verified_at"] is None and version["observed_sha256"] == ""
    entry = AuditEntry.objects.get()
    assert entry.event_type == "registry.version_registered" and entry.actor == "user:alice"
    body = json.loads(entry.body)
    assert body["data"]["sha256"] == model_body()["sha256"] and body["after"] == {"status": "awaiting_agent"}


def test_a_small_local_file_with_the_right_sha256_is_verified_at_once(admin: Person,
                                                                       tiny_weights: TinyWeights) -> None:
    version = registered(admin, weights_uri=tiny_weights.uri, sha256=tiny_weights.sha256)
    assert version["status"] == "verified"
    assert version["verified_by"] == "system:registry" and version["verified_at"] is not None
    assert version["weights_bytes"] == tiny_weights.path.stat().st_size
    types = list(AuditEntry.objects.values_list("event_type", flat=True))
    assert types == ["registry.version_registered", "registry.weights_verified"]


def test_an_absolute_path_is_a_local_file_too(admin: Person, tiny_weights: TinyWeights) -> None:
    version = registered(admin, weights_uri=str(tiny_weights.path), sha256=tiny_weights.sha256)
    assert version["status"] == "verified"


def test_it_quarantines_weights_with_a_wrong_sha256_and_audits_before_and_after(admin: Person,
                                                                                 tiny_weights: TinyWeights) -> None:
    resp = post(admin.api(), MODELS, model_body(weights_uri=tiny_weights.uri, sha256=OTHER_SHA256))
    assert resp.status_code == 201
    version = resp.json()
    assert version["status"] == "quarantined"
    assert version["observed_sha256"] == tiny_weights.sha256
    assert tiny_weights.sha256 in version["status_detail"] and OTHER_SHA256 in version["status_detail"]
    entry = AuditEntry.objects.get(event_type="registry.version_quarantined")
    body = json.loads(entry.body)
    assert entry.actor == "system:registry"
    assert body["before"] == {"status": "verifying", "observed_sha256": ""}
    assert body["after"] == {"status": "quarantined", "observed_sha256": tiny_weights.sha256}
    assert body["data"]["expected_sha256"] == OTHER_SHA256
    assert verify_chain().ok


def test_a_tokenizer_of_its_own_and_the_warmup_are_kept(admin: Person, tiny_weights: TinyWeights) -> None:
    folder = str(tiny_weights.path.parent)  # a model folder holding tokenizer.json is a tokenizer too
    version = registered(admin, tokenizer=folder, warmup_tokens=2048, max_context=512)
    stored = ModelVersion.objects.get(pk=version["id"])
    assert (stored.tokenizer, stored.warmup_tokens, stored.max_context) == (folder, 2048, 512)


def test_the_tokenizer_is_loaded_at_registration_and_refused_by_name_when_it_cannot_be(
        admin: Person, tmp_path: Path) -> None:
    broken = tmp_path / "tokenizer.json"
    broken.write_text('{"not": "a tokenizer"}')
    outside = Path(tempfile.mkdtemp(prefix="not-a-model-root-")) / "tokenizer.json"
    outside.write_text(broken.read_text())
    for tokenizer, words in ((str(broken), "does not load as a tokenizer"),
                             (str(outside), "is not under a model root"),
                             ("meta/llama3-8b", "must be the absolute path"),
                             (str(tmp_path / "missing.json"), "does not load")):
        resp = post(admin.api(), MODELS, model_body(tokenizer=tokenizer))
        assert resp.status_code == 400 and list(resp.json()) == ["tokenizer"], (tokenizer, resp.json())
        assert words in resp.json()["tokenizer"][0], (tokenizer, resp.json())
    assert not ModelVersion.objects.exists()


def test_local_weights_outside_the_model_roots_are_refused_naming_weights_uri_and_never_read(
        admin: Person, tmp_path: Path) -> None:
    secret = Path(tempfile.mkdtemp(prefix="not-a-model-root-")) / "shadow"
    secret.write_bytes(b"root:$6$not-for-you")
    link = tmp_path / "model.safetensors"
    link.symlink_to(secret)  # a link under a root that points out of it is outside too
    for uri in ("file:///etc/shadow", "/etc/shadow", f"file://{secret}", str(link),
                f"file://{tmp_path}/../{secret.parent.name}/shadow"):
        resp = post(admin.api(), MODELS, model_body(weights_uri=uri, sha256=OTHER_SHA256))
        assert resp.status_code == 400 and list(resp.json()) == ["weights_uri"], (uri, resp.json())
        assert "is not under a model root (FLEXPIPE_MODEL_ROOTS: " in resp.json()["weights_uri"][0]
        assert "size" not in resp.content.decode() and hashlib.sha256(secret.read_bytes()).hexdigest() \
            not in resp.content.decode()
    assert not ModelVersion.objects.exists()


def test_a_hugging_face_config_is_an_architecture(admin: Person) -> None:
    config = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 32, "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 512,
              "torch_dtype": "float32", "model_type": "llama"}
    version = registered(admin, architecture=config)
    assert version["architecture"] == config


def test_a_context_longer_than_the_architecture_allows_is_refused_naming_max_context(admin: Person) -> None:
    config = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 128,
              "vocab_size": 512, "max_position_embeddings": 512}
    resp = post(admin.api(), MODELS, model_body(architecture=config, max_context=1024))
    assert resp.status_code == 400 and list(resp.json()) == ["max_context"]
    assert "limit of 512 tokens" in resp.json()["max_context"][0]
    assert not ModelVersion.objects.exists()


# -- identity -----------------------------------------------------------------------------------------


def test_the_same_name_with_other_weights_is_another_version(admin: Person) -> None:
    first = registered(admin)
    second = registered(admin, version="v2", sha256=OTHER_SHA256)
    assert first["id"] != second["id"]
    assert ModelVersion.objects.filter(name="tiny-llama").count() == 2


def test_re_registering_a_name_and_version_with_another_sha256_is_refused_naming_sha256(admin: Person) -> None:
    registered(admin)
    before = AuditEntry.objects.count()
    resp = post(admin.api(), MODELS, model_body(sha256=OTHER_SHA256))
    assert resp.status_code == 409
    assert list(resp.json()) == ["sha256"] and "another entity" in resp.json()["sha256"][0]
    assert ModelVersion.objects.get().sha256 == model_body()["sha256"]
    assert AuditEntry.objects.count() == before


def test_re_registering_the_identical_version_returns_it_unchanged(admin: Person) -> None:
    first = registered(admin)
    before = AuditEntry.objects.count()
    again = post(admin.api(), MODELS, model_body())
    assert again.status_code == 200 and again.json() == first
    assert ModelVersion.objects.count() == 1 and AuditEntry.objects.count() == before


def test_re_registering_a_version_with_other_fields_is_refused_naming_them(admin: Person) -> None:
    registered(admin)
    resp = post(admin.api(), MODELS, model_body(tokenizer=str(Path(model_body()["tokenizer"]).parent),
                                                 warmup_tokens=1))
    assert resp.status_code == 409 and sorted(resp.json()) == ["tokenizer", "warmup_tokens"]
    assert ModelVersion.objects.get().warmup_tokens == 16


def test_the_same_weights_under_a_second_version_label_are_refused(admin: Person) -> None:
    registered(admin)
    resp = post(admin.api(), MODELS, model_body(version="v1-again"))
    assert resp.status_code == 409 and "already registered as tiny-llama v1" in resp.json()["sha256"][0]
    assert ModelVersion.objects.count() == 1


def test_other_names_may_share_weights(admin: Person) -> None:
    registered(admin)
    registered(admin, name="tiny-llama-chat")
    assert ModelVersion.objects.count() == 2


# -- validation: 400 naming the field, nothing written -----------------------------------------------

BAD_FIELDS = [
    ("name", "", "blank"),
    ("name", "has space", "letters, digits"),
    ("name", "x" * 129, "128"),
    ("version", "", "blank"),
    ("version", "v/1", "letters, digits"),
    ("engine", "tensorrt", "not a valid choice"),
    ("architecture", "", "empty name"),
    ("architecture", 7, "got int"),
    ("architecture", ["llama"], "got list"),
    ("architecture", {"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 512},
     "num_hidden_layers"),
    ("architecture", {"hidden_size": 64, "num_hidden_layers": 0, "num_attention_heads": 4,
                      "intermediate_size": 128, "vocab_size": 512}, "num_hidden_layers"),
    ("architecture", {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                      "intermediate_size": 128, "vocab_size": 512, "note": "nul\x00"}, "NUL"),
    ("weights_uri", "", "blank"),
    ("weights_uri", "ftp://host/w.bin", "file:///absolute/path"),
    ("weights_uri", "relative/model.safetensors", "file:///absolute/path"),
    ("weights_uri", "file://otherhost/w.bin", "console's host"),
    ("weights_uri", "s3://bucket-only", "path after the bucket"),
    ("weights_uri", "https:///no-host", "needs a host"),
    ("weights_uri", "hf://org/repo with space", "whitespace"),
    ("sha256", "ABCDEF" + "0" * 58, "lowercase"),
    ("sha256", "0" * 63, "64 lowercase"),
    ("sha256", "g" * 64, "64 lowercase"),
    ("tokenizer", "", "blank"),
    ("max_context", 0, "greater than or equal to 1"),
    ("max_context", "many", "valid integer"),
    ("min_gpu_mem_bytes", 0, "greater than or equal to 1"),
    ("min_gpu_mem_bytes", 5 * 1024**4, "less than or equal to"),
    ("warmup_tokens", -1, "greater than or equal to 0"),
]


@pytest.mark.parametrize("field,value,words", BAD_FIELDS, ids=[f"{f}={v!r:.30}" for f, v, _ in BAD_FIELDS])
def test_a_bad_field_is_refused_by_name_and_nothing_is_written(admin: Person, field: str, value: Any,
                                                               words: str) -> None:
    resp = post(admin.api(), MODELS, model_body(**{field: value}))
    assert resp.status_code == 400, resp.content
    errors = resp.json()
    assert list(errors) == [field], errors
    assert words in " ".join(errors[field]), errors
    assert not ModelVersion.objects.exists() and not AuditEntry.objects.exists()


@pytest.mark.parametrize("field", ["name", "version", "engine", "architecture", "weights_uri", "sha256",
                                   "tokenizer", "max_context", "min_gpu_mem_bytes", "warmup_tokens"])
def test_a_missing_field_is_named(admin: Person, field: str) -> None:
    body = model_body()
    del body[field]
    resp = post(admin.api(), MODELS, body)
    assert resp.status_code == 400 and list(resp.json()) == [field] and "required" in resp.json()[field][0]
    assert not ModelVersion.objects.exists()


def test_an_unknown_key_is_named_rather_than_ignored(admin: Person) -> None:
    resp = post(admin.api(), MODELS, model_body(sha_256="typo", status="verified"))
    assert resp.status_code == 400 and sorted(resp.json()) == ["sha_256", "status"]
    assert not ModelVersion.objects.exists()


def test_a_body_that_is_not_json_is_refused(admin: Person) -> None:
    resp = admin.api().post(MODELS, "name=x", content_type="application/x-www-form-urlencoded")
    assert resp.status_code == 415
    resp = admin.api().post(MODELS, "{not json", content_type="application/json")
    assert resp.status_code == 400 and "JSON parse error" in resp.json()["detail"]
    resp = post(admin.api(), MODELS, ["a", "list"])
    assert resp.status_code == 400 and "non_field_errors" in resp.json()
    assert not ModelVersion.objects.exists()


def test_a_local_file_that_does_not_exist_is_refused_naming_weights_uri(admin: Person, tmp_path: Path) -> None:
    resp = post(admin.api(), MODELS, model_body(weights_uri=f"file://{tmp_path}/missing.safetensors"))
    assert resp.status_code == 400 and "no such file" in resp.json()["weights_uri"][0]
    assert not ModelVersion.objects.exists() and not AuditEntry.objects.exists()


def test_a_directory_is_not_a_weights_file(admin: Person, tmp_path: Path) -> None:
    resp = post(admin.api(), MODELS, model_body(weights_uri=f"file://{tmp_path}"))
    assert resp.status_code == 400 and "not a regular file" in resp.json()["weights_uri"][0]


def test_several_bad_fields_are_all_named_at_once(admin: Person) -> None:
    resp = post(admin.api(), MODELS, model_body(engine="onnx", sha256="nope", max_context=-5))
    assert resp.status_code == 400 and sorted(resp.json()) == ["engine", "max_context", "sha256"]


# -- retiring -------------------------------------------------------------------------------------------


def test_an_admin_retires_a_version_once_and_it_is_audited(admin: Person) -> None:
    version = registered(admin)
    resp = post(admin.api(), f"{MODELS}/{version['id']}/retire", {"reason": "superseded by v2"})
    assert resp.status_code == 200
    assert resp.json()["status"] == "retired" and resp.json()["retired_by"] == "user:alice"
    entry = AuditEntry.objects.get(event_type="registry.version_retired")
    body = json.loads(entry.body)
    assert body["before"] == {"status": "awaiting_agent"} and body["after"] == {"status": "retired"}
    assert body["data"]["reason"] == "superseded by v2"
    again = post(admin.api(), f"{MODELS}/{version['id']}/retire", {})
    assert again.status_code == 200 and again.json()["retired_at"] == resp.json()["retired_at"]
    assert AuditEntry.objects.filter(event_type="registry.version_retired").count() == 1


def test_retire_refuses_a_bad_reason_and_unknown_keys(admin: Person) -> None:
    version = registered(admin)
    url = f"{MODELS}/{version['id']}/retire"
    assert list(post(admin.api(), url, {"reason": "x" * 301}).json()) == ["reason"]
    assert list(post(admin.api(), url, {"because": "x"}).json()) == ["because"]
    assert ModelVersion.objects.get().status == "awaiting_agent"


def test_an_unknown_version_is_404(admin: Person) -> None:
    assert admin.api().get(f"{MODELS}/999").status_code == 404
    assert post(admin.api(), f"{MODELS}/999/retire", {}).status_code == 404
    assert admin.api().get(f"{MODELS}/99999999999999999999999").status_code == 404


# -- listing ------------------------------------------------------------------------------------------


def test_the_list_filters_by_status_name_engine_and_sha256(admin: Person, tiny_weights: TinyWeights) -> None:
    remote = registered(admin)
    local = registered(admin, name="local", weights_uri=tiny_weights.uri, sha256=tiny_weights.sha256, engine="vllm")
    client = admin.api()

    def ids(**params: str) -> list[int]:
        resp = client.get(MODELS, params)
        assert resp.status_code == 200, resp.content
        return [v["id"] for v in resp.json()["results"]]

    assert ids(status="verified") == [local["id"]]
    assert ids(status="awaiting_agent") == [remote["id"]]
    assert ids(name="local") == [local["id"]]
    assert ids(engine="torch") == [remote["id"]]
    assert ids(sha256=tiny_weights.sha256) == [local["id"]]
    assert sorted(ids()) == sorted([remote["id"], local["id"]])


@pytest.mark.parametrize("params,field", [
    ({"status": "broken"}, "status"), ({"engine": "onnx"}, "engine"), ({"limit": "0"}, "limit"),
    ({"limit": "many"}, "limit"), ({"offset": "-1"}, "offset"), ({"name": "a\x00b"}, "name"),
])
def test_a_bad_list_filter_is_named(viewer: Person, params: dict[str, str], field: str) -> None:
    resp = viewer.api().get(MODELS, params)
    assert resp.status_code == 400 and list(resp.json()) == [field]
