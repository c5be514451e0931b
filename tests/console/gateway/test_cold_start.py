"""A deployment scaled to zero at the gateway, in-process: its request is held (demand signalled, a tick
asked for) and, when no gear comes up within FLEXPIPE_GATEWAY_COLD_START_WAIT_S, refused with a 503 that
names why. (Held and served through a live daphne: test_live.py.)"""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from console.gateway import metrics
from console.gearbox.models import Deployment
from tests.console.gateway.world import make_deployment
from tests.console.people import Person

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _tokenizer(settings: Any, tiny_model: Any) -> None:
    settings.FLEXPIPE_GATEWAY_TOKENIZERS = {"tiny-llama": str(tiny_model.path)}
    settings.FLEXPIPE_GATEWAY_COLD_START_WAIT_S = 0.3


def ask(person: Person) -> Any:
    return Client(headers={"Authorization": f"Bearer {person.token}"}).post(
        "/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 4}, content_type="application/json")


def test_a_deployment_at_zero_holds_the_request_signals_demand_then_answers_503_naming_the_wait(
        viewer: Person) -> None:
    make_deployment("tiny", [])
    Deployment.objects.filter(name="tiny").update(zero_since=timezone.now())
    colds = metrics.COLD_STARTS.labels("tiny")._value.get()
    resp = ask(viewer)
    assert resp.status_code == 503
    err = resp.json()["error"]
    assert err["code"] == "cold_start_timeout" and "scaled to zero" in err["message"]
    assert "FLEXPIPE_GATEWAY_COLD_START_WAIT_S" in err["message"] and int(resp["Retry-After"]) >= 1
    assert Deployment.objects.get(name="tiny").wake_requested_at is not None  # the tick can see the demand
    assert metrics.COLD_STARTS.labels("tiny")._value.get() == colds + 1
    assert metrics.COLD_START_HELD.labels("tiny")._value.get() == 0  # none held any more
    assert ask(viewer).status_code == 503 and metrics.COLD_STARTS.labels("tiny")._value.get() == colds + 1


def test_a_deployment_with_no_route_that_is_not_at_zero_is_refused_at_once_as_before(viewer: Person) -> None:
    make_deployment("tiny", [])
    resp = ask(viewer)
    assert resp.status_code == 429 and resp.json()["error"]["code"] == "no_route"
    assert Deployment.objects.get(name="tiny").wake_requested_at is None
