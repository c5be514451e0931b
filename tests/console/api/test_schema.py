"""OpenAPI 3 at /api/schema/, Swagger UI at /api/docs/ with local assets, and schemathesis over it all:
every check (no server error, status codes, content types and bodies as documented, valid data
accepted and invalid data refused), with the exceptions schemathesis.toml names and explains."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from django.test import Client
from hypothesis import HealthCheck, settings

from tests.console.people import Person

pytestmark = pytest.mark.django_db

OPERATIONS = {
    ("/api/v1/models", "get"), ("/api/v1/models", "post"), ("/api/v1/models/{id}", "get"),
    ("/api/v1/models/{id}/retire", "post"), ("/api/v1/models/{id}/check", "post"), ("/api/v1/audit", "get"), ("/api/v1/audit/{seq}", "get"),
    ("/api/v1/audit/verify", "get"), ("/api/v1/nodes", "get"), ("/api/v1/nodes/{node_id}", "get"),
    ("/api/v1/gpus", "get"), ("/api/v1/gpus/{uuid}", "get"), ("/api/v1/me", "get"), ("/api/v1/alerts", "get"),
    ("/api/v1/nodes/{node_id}/agent-token", "post"),
    ("/api/v1/deployments", "get"), ("/api/v1/deployments", "post"), ("/api/v1/deployments/{name}", "get"),
    ("/api/v1/deployments/{name}", "patch"),
    ("/api/v1/deployments/{name}/pin", "post"), ("/api/v1/deployments/{name}/unpin", "post"),
    ("/api/v1/deployments/{name}/mode", "post"), ("/api/v1/deployments/{name}/emergency", "post"),
    ("/api/v1/deployments/{name}", "delete"), ("/api/v1/deployments/{name}/release", "post"),
    ("/api/v1/deployments/{name}/candidates", "get"), ("/api/v1/deployments/{name}/override", "post"),
    ("/api/v1/deployments/{name}/baseline", "post"), ("/api/v1/deployments/{name}/rollout", "post"),
    ("/api/v1/deployments/{name}/latency-critical", "post"),
    ("/api/v1/gears", "get"), ("/api/v1/gears/{gear_id}", "get"), ("/api/v1/plans", "get"),
    ("/api/v1/plans/{plan_id}", "get"), ("/api/v1/transitions", "get"), ("/api/v1/transitions/{id}", "get"),
    ("/api/v1/decisions", "get"), ("/api/v1/decisions/{id}", "get"), ("/api/v1/decisions/{id}/approve", "post"),
    ("/api/v1/jobs", "get"), ("/api/v1/jobs", "post"), ("/api/v1/jobs/{name}", "get"), ("/api/v1/jobs/{name}", "delete"),
    ("/api/v1/jobs/{name}/checkpointed", "post"), ("/api/v1/jobs/{name}/runner-token", "post"),
    ("/api/v1/users", "get"), ("/api/v1/users", "post"), ("/api/v1/users/{username}", "get"),
    ("/api/v1/users/{username}/role", "post"), ("/api/v1/users/{username}/active", "post"),
    ("/api/v1/users/{username}/tokens", "post"), ("/api/v1/users/{username}/revoke-token", "post"),
}


def test_the_schema_is_openapi_3_and_lists_every_operation(db: None) -> None:
    resp = Client().get("/api/schema/", {"format": "json"})
    assert resp.status_code == 200
    schema = resp.json()
    assert schema["openapi"].startswith("3.")
    found = {(path, method) for path, ops in schema["paths"].items() for method in ops}
    assert found == OPERATIONS
    assert schema["components"]["securitySchemes"]["apiToken"] == {
        "type": "http", "scheme": "bearer", "bearerFormat": "fpu_…",
        "description": "A user's API token (manage.py create_api_token USER). Agent tokens are refused here."}
    register = schema["components"]["schemas"]["RegisterRequest"]
    assert {"sha256", "weights_uri", "architecture", "tokenizer", "warmup_tokens"} <= set(register["required"])


def test_swagger_ui_loads_every_asset_from_this_server(db: None) -> None:
    client = Client()
    page = client.get("/api/docs/")
    assert page.status_code == 200
    html = page.content.decode()
    assets = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert assets and not [a for a in assets if a.startswith(("http:", "https:", "//"))], assets
    assert any("swagger-ui-bundle.js" in a for a in assets)
    for asset in assets:
        assert client.get(asset).status_code == 200, asset
    assert "/api/schema/" in html


# Loaded at collection: the schema view is public and touches no database. Requests then run in-process
# through the WSGI app, inside each test's transaction, authenticated as the admin.
openapi = schemathesis.openapi.from_wsgi("/api/schema/?format=json", get_wsgi_application())


@pytest.fixture
def in_test_transaction() -> Iterator[None]:
    """Keep the test's database connection across WSGI requests, as Django's own test client does:
    the handler's close_old_connections would otherwise close it (autocommit is off inside a test)."""
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        yield
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)


@pytest.fixture
def a_gearbox() -> None:
    """Something for the gearbox's endpoints to show and refuse: the demo's chat deployment (the schema's
    example name, so generated verbs reach it), its baseline on the way up, and the decision that started it."""
    from console.gearbox import ticks
    from tests.console.gearbox.harness import enroll_fleet, make_deployment

    enroll_fleet()
    make_deployment("chat-8b")
    assert ticks.tick()["started"] == ["chat-8b#1"]


@openapi.parametrize()
@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.filter_too_much])
def test_every_generated_request_is_answered_as_the_schema_says(case: Any, admin: Person, a_gearbox: None,
                                                                in_test_transaction: None) -> None:
    case.call_and_validate(headers={"Authorization": f"Bearer {admin.token}"})


def test_every_operation_documents_its_refusals_with_a_body(db: None) -> None:
    schema = Client().get("/api/schema/", {"format": "json"}).json()
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            for code in ("401", "403") + (("404",) if "{" in path else ()):
                assert "application/json" in op["responses"].get(code, {}).get("content", {}), (method, path, code)
    assert schema["components"]["schemas"]["EmergencyRequest"]["additionalProperties"] is False
