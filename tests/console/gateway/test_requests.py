"""What the gateway refuses before anything reaches a plan: auth, bad input, unknown models, no route."""

from __future__ import annotations

import time
from typing import Any

import pytest
from django.test import Client

from console.gearbox.models import Deployment
from tests.agents.dataplane.conftest import PLAN_TP1
from tests.console.gateway.world import make_deployment, make_node
from tests.console.people import Person

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _tokenizer(settings: Any, tiny_model: Any) -> None:
    settings.FLEXPIPE_GATEWAY_TOKENIZERS = {"tiny-llama": str(tiny_model.path)}
    settings.FLEXPIPE_GATEWAY_FROZEN_WAIT_S = 0.3


@pytest.fixture
def deployment() -> Deployment:
    make_node("a1", "127.0.0.1:9")  # nothing listens there: the plan's leader is unreachable
    route = {"plan_id": "p-x", "plan": PLAN_TP1, "weight": 1.0, "frozen": False, "nodes": ["a1"]}
    return make_deployment("tiny", [route])


def post(person: Person | None, path: str, body: Any, token: str | None = None) -> Any:
    headers = {"Authorization": f"Bearer {token or (person.token if person else '')}"} if (person or token) else {}
    return Client(headers=headers).post(path, body, content_type="application/json")


def test_a_request_without_a_valid_api_token_gets_401_in_openai_shape(viewer: Person, outsider: Person) -> None:
    none = post(None, "/v1/completions", {"model": "tiny", "prompt": "hi"})
    wrong = post(None, "/v1/completions", {"model": "tiny", "prompt": "hi"}, token="fpu_nope")
    agentish = post(None, "/v1/chat/completions", {"model": "tiny", "messages": []}, token="fpa_x")
    no_role = post(outsider, "/v1/completions", {"model": "tiny", "prompt": "hi"})
    models = Client().get("/v1/models")

    for resp in (none, wrong, agentish, no_role, models):
        assert resp.status_code == 401
        err = resp.json()["error"]
        assert err["type"] == "authentication_error" and err["message"]
    assert none.json()["error"]["code"] == "missing_api_key"
    assert no_role.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "hi"}, "model"),
    ("/v1/completions", {"model": "tiny"}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": ""}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 100_000}, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": 3}, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "top_p": "x"}, "top_p"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "n": 2}, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stop": [1]}, "stop"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stream": "yes"}, "stream"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stream_options": {"include_usage": True}},
     "stream_options"),
    ("/v1/completions", {"model": "tiny", "prompt": [5, 100_000]}, "prompt"),
    ("/v1/completions", {"model": "nope", "prompt": "hi"}, "model"),
    ("/v1/chat/completions", {"model": "tiny"}, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]},
     "messages[0].role"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": 5}]},
     "messages[0].content"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "seed": -1},
     "seed"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "priority": 5000}, "priority"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "priority": "high"}, "priority"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "priority": 1.5}, "priority"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "priority": True},
     "priority"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "deadline_ms": 0}, "deadline_ms"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "deadline_ms": "soon"}, "deadline_ms"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "deadline_ms": -5},
     "deadline_ms"),
])
def test_bad_input_gets_400_naming_the_param_and_changes_nothing(
        viewer: Person, deployment: Deployment, path: str, body: dict[str, Any], param: str) -> None:
    before = Deployment.objects.values("routing_version", "load_window").get(name="tiny")

    resp = post(viewer, path, body)

    assert resp.status_code == (404 if body.get("model") == "nope" else 400), resp.content
    err = resp.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert param.split("[")[0] in err["message"]
    assert Deployment.objects.values("routing_version", "load_window").get(name="tiny") == before


def test_a_body_that_is_not_json_gets_400(viewer: Person, deployment: Deployment) -> None:
    resp = Client(headers={"Authorization": f"Bearer {viewer.token}"}).post(
        "/v1/completions", b"{nope", content_type="application/json")
    assert resp.status_code == 400 and "JSON" in resp.json()["error"]["message"]


def test_models_lists_the_deployments(viewer: Person, deployment: Deployment) -> None:
    resp = Client(headers={"Authorization": f"Bearer {viewer.token}"}).get("/v1/models")
    assert resp.status_code == 200
    assert [(m["id"], m["root"], m["object"]) for m in resp.json()["data"]] == [("tiny", "tiny-llama", "model")]


def test_the_registered_max_context_binds_prompt_plus_max_tokens(viewer: Person, deployment: Deployment,
                                                                  tiny_model: Any) -> None:
    from django.utils import timezone

    from console.registry.models import ModelVersion

    v = ModelVersion.objects.create(name="tiny-llama", version="short", engine="torch", architecture="tiny-llama",
                                    weights_uri="hf://t/w", sha256="d" * 64, tokenizer=str(tiny_model.path),
                                    max_context=64, min_gpu_mem_bytes=1, warmup_tokens=1, status="verified",
                                    registered_at=timezone.now(), registered_by="user:alice")
    Deployment.objects.filter(pk=deployment.pk).update(model_version=v)
    before = Deployment.objects.values("routing_version", "load_window").get(name="tiny")
    resp = post(viewer, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 100})
    assert resp.status_code == 400, resp.content  # the tokenizer's own context (512) would take it
    err = resp.json()["error"]
    assert err["param"] == "max_tokens" and "registered max_context of tiny-llama short (64 tokens)" in err["message"]
    assert Deployment.objects.values("routing_version", "load_window").get(name="tiny") == before
    # within the registered context it is admitted (and then finds no routable plan)
    assert post(viewer, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 8}).status_code == 429


def test_no_routable_plan_gets_429_with_retry_after(viewer: Person, deployment: Deployment) -> None:
    resp = post(viewer, "/v1/completions", {"model": "tiny", "prompt": "hi"})
    assert resp.status_code == 429 and int(resp["Retry-After"]) >= 1
    assert resp.json()["error"]["type"] == "rate_limit_error"


def test_a_route_frozen_for_good_waits_then_gets_429(viewer: Person, deployment: Deployment) -> None:
    Deployment.objects.filter(name="tiny").update(routing=[{**deployment.routing[0], "frozen": True}])
    t0 = time.monotonic()
    resp = post(viewer, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
    assert resp.status_code == 429 and "switch is in progress" in resp.json()["error"]["message"]
    assert time.monotonic() - t0 >= 0.3  # it waited for a new table first
