"""Hostile input on every JSON endpoint: a clear 400 naming the field, never a 500, nothing stored.

Int64 bounds, finite floats, nesting depth and list caps are the readers' (agents.schema), so every
field of every wire message gets them; a hypothesis fuzz test throws mutated reports and gateway
bodies at the endpoints in a bounded number of examples.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.test import Client
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from console.fleet.models import Gpu, Node
from tests.builders import report_body
from tests.console.conftest import AgentHTTP
from tests.console.fleet.test_agent_api import stored_state

pytestmark = pytest.mark.django_db

DEEP = "[" * 100_000 + "]" * 100_000


def raw_post(client: Client, path: str, body: str, token: str) -> Any:
    return client.post(path, body, content_type="application/json", headers={"Authorization": f"Bearer {token}"})


def report_with(agent: AgentHTTP, mutate: Any, seq: int = 1) -> Any:
    body = report_body("a1", epoch=agent.epoch, seq=seq)
    mutate(body)
    return agent.post("/agent/v1/report", body)


@pytest.mark.parametrize("mutate,field", [
    (lambda b: b["gpus"][0].update(sm_util=10**400), "gpus[0].sm_util"),  # OverflowError in math.isfinite
    (lambda b: b["gpus"][0].update(temperature_c=-10**400), "gpus[0].temperature_c"),
    (lambda b: b["gpus"][0].update(xid_errors=2**63), "gpus[0].xid_errors"),
    (lambda b: b["gpus"][0].update(ecc_errors=2**31), "gpus[0].ecc_errors"),  # a 32-bit column
    (lambda b: b.update(seq=2**64), "seq"),
    (lambda b: b.update(engines=[{"plan_id": "p", "running": 10**30, "waiting": 0, "tokens_per_s": 1.0,
                                  "kv_usage": 0.1}]), "engines[0].running"),
    (lambda b: b.update(links=[{"peer": f"n{i}", "bw_gbps": 1.0} for i in range(10_000)]), "links"),
])
def test_a_number_or_list_out_of_bounds_is_a_400_naming_the_field(agent: AgentHTTP, mutate: Any, field: str) -> None:
    before = stored_state()
    resp = report_with(agent, mutate)
    assert resp.status_code == 400, resp.content
    assert field in resp.json()["errors"], resp.json()
    assert stored_state() == before


@pytest.mark.parametrize("text", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_not_json(agent: AgentHTTP, text: str) -> None:
    body = json.dumps(report_body("a1", epoch=agent.epoch)).replace('"sm_util": 0.5', f'"sm_util": {text}', 1)
    resp = raw_post(agent.client, "/agent/v1/report", body, agent.token)
    assert resp.status_code == 400 and "(body)" in resp.json()["errors"]


@pytest.mark.parametrize("path", ["/agent/v1/report", "/agent/v1/register", "/agent/v1/commands/1/ack"])
def test_deeply_nested_json_is_refused_on_the_agent_api(agent: AgentHTTP, path: str) -> None:
    resp = raw_post(agent.client, path, DEEP, agent.token)
    assert resp.status_code == 400 and "nest deeper" in resp.json()["errors"]["(body)"]
    # inside a valid document too: custom_spec is free-form
    body = json.dumps({"protocol": 1, "node_id": "a1", "x": json.loads("[" * 40 + "]" * 40)})
    resp = raw_post(agent.client, path, body, agent.token)
    assert resp.status_code == 400 and "nest deeper" in resp.json()["errors"]["(body)"]


@pytest.mark.parametrize("path", ["/agent/v1/report", "/v1/completions", "/api/v1/users"])
def test_a_body_over_the_size_limit_is_refused_not_a_server_error(agent: AgentHTTP, admin: Any, path: str,
                                                                  settings: Any) -> None:
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 64 * 1024  # Django's limit on every body (2.5 MB by default)
    token = agent.token if path.startswith("/agent/") else admin.token
    resp = raw_post(Client(), path, json.dumps({"model": "x", "prompt": "a" * 100_000}), token)
    assert resp.status_code in (400, 413), resp.status_code


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_deeply_nested_json_is_refused_by_the_gateway(viewer: Any, path: str) -> None:
    resp = viewer.api().post(path, DEEP, content_type="application/json")
    assert resp.status_code == 400 and "nest deeper" in resp.json()["error"]["message"]


def test_deeply_nested_json_is_refused_by_the_rest_api(admin: Any) -> None:
    resp = admin.api().post("/api/v1/users", DEEP, content_type="application/json")
    assert resp.status_code == 400 and "nest deeper" in resp.json()["detail"]


def test_a_number_where_the_schema_says_string_is_refused_not_coerced(operator: Any) -> None:
    # DRF's CharField turned 0 into "0": {"reason": 0} started a real emergency
    from tests.console.gearbox.harness import enroll_fleet, make_deployment

    enroll_fleet()
    make_deployment("chat")
    resp = operator.api().post("/api/v1/deployments/chat/emergency", {"reason": 0}, content_type="application/json")
    assert resp.status_code == 400 and resp.json() == {"reason": ["must be a string"]}
    from console.gearbox.models import Deployment

    assert Deployment.objects.get(name="chat").emergency_requested_at is None


# -- fuzzing ------------------------------------------------------------------------------------------

HOSTILE_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70), st.integers(-3, 3),
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([10**400, -(10**400), 2**63, 2**63 - 1]),
    st.text(max_size=20), st.sampled_from(["", "\x00", "a" * 300]),
)
JSON_VALUES = st.recursive(HOSTILE_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=12)
FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


def _replace(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    doc[path[0]] = _replace(doc[path[0]], path[1:], value)
    return doc


def mutated(base: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """`base` with one value (anywhere in it, the whole document included) replaced by a hostile one."""
    paths = _paths(base)
    return st.tuples(st.sampled_from(paths), JSON_VALUES).map(
        lambda pv: _replace(json.loads(json.dumps(base)), pv[0], pv[1]))


@FUZZ
@given(body=mutated({**report_body("a1"), "links": [{"peer": "b1", "bw_gbps": 12.5}],
                     "engines": [{"plan_id": "p-1", "running": 1, "waiting": 0, "tokens_per_s": 10.0,
                                  "kv_usage": 0.2, "ttft_p50_ms": 10.0}]}))
def test_no_mutated_report_makes_a_server_error(agent: AgentHTTP, body: dict[str, Any]) -> None:
    Node.objects.filter(node_id="a1").update(last_seq=0)  # each example is the first of its epoch
    if isinstance(body, dict) and "epoch" in body and body["epoch"] == 1:
        body["epoch"] = agent.epoch
    resp = agent.post("/agent/v1/report", body)
    assert resp.status_code in (200, 400, 403, 409), resp.content
    if resp.status_code != 200:
        assert resp.json()["errors"], resp.content
    assert Gpu.objects.filter(node__node_id="a1", present=True).count() == 4


@FUZZ
@given(body=st.one_of(
    mutated({"model": "nope", "prompt": "Hello", "max_tokens": 4, "temperature": 0.5, "top_p": 0.9,
             "stop": ["\n"], "seed": 1, "stream": False}),
    mutated({"model": "nope", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
             "stream": True, "stream_options": {"include_usage": True}, "max_completion_tokens": 3}),
))
def test_no_mutated_gateway_body_makes_a_server_error(viewer: Any, body: dict[str, Any]) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        resp = viewer.api().post(path, json.dumps(body), content_type="application/json")
        # no deployment is called "nope": a body that parses ends at 404, one that does not at 400
        assert resp.status_code in (400, 404), resp.content
        assert resp.json()["error"]["message"]
