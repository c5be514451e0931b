"""A deployment created in the console comes up on the live simulated fleet of `make run` and serves.

The fleet's scenario lists one deployment the console does not have; an operator creates another
through POST /api/v1/deployments, for a registry version whose architecture - a ~51 B Llama-shaped
config.json - the built-in catalog does not know. The simulated agents over real HTTP (LiveFleet,
with a real Celery worker advancing the transition) take its PREPARE from the model_spec and slo
it carries, book its memory as the console sized it, and serve its requests; the console sees
the plan's engine report.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agents.engines.torch.weights import write_tokenizer
from agents.sim.live import LiveFleet
from console.fleet.models import Node
from console.gearbox.models import Deployment, Transition
from console.registry.models import ModelVersion
from console.registry.specs import spec_for
from scheduler.booking import plan_memory
from scheduler.modelspec import model_spec
from scheduler.plan import Gear
from tests.agents.sim.worlds import one_deployment
from tests.console.gearbox.test_deployment_api import BIG_CONFIG, body, post, version
from tests.console.people import make_person
from tests.demo_fleet import run_until

JOIN = "fpj_live-new-deployment"
NODES = [{"id": "a1", "gpu": "H100-SXM", "gpus": 8, "nvlink": True, "rack": "A"}]
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


@pytest.fixture
def fleet(live_server: Any, settings: Any, worker: None, tmp_path: Path) -> Iterator[LiveFleet]:
    settings.FLEXPIPE_ENROLL_TOKEN = JOIN
    settings.FLEXPIPE_MODEL_ROOTS = [tmp_path]
    # the scenario serves "d", which the console never heard of; nothing arrives for it
    f = LiveFleet(one_deployment(rate_rps=0, nodes=NODES), live_server.url, JOIN, report_interval_s=1.0,
                  long_poll_s=2.0, token_dir=tmp_path / "tokens")
    yield f
    f.close()


def test_a_deployment_created_in_the_console_of_a_model_outside_the_catalog_comes_up_and_serves(
        fleet: LiveFleet, tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        model_spec("big-51b")  # the catalog does not know it
    v = version("big-51b", BIG_CONFIG)
    tokenizer = write_tokenizer(tmp_path / "big-tokenizer", vocab_size=32000, max_context=8192)
    ModelVersion.objects.filter(pk=v.pk).update(tokenizer=str(tokenizer))
    run_until(fleet, lambda: Node.objects.filter(node_id="a1", last_seq__gt=0).exists(), 30, "a1 reports")
    resp = post(make_person("oscar", "operator").api(), body(v, name="big"))
    assert resp.status_code == 201, resp.json()
    baseline = Gear.from_dict(Deployment.objects.get(name="big").baseline_gear)

    def up() -> bool:  # (the create queued the tick that starts it; the worker runs it)
        t = Transition.objects.filter(deployment__name="big", seq=1).first()
        if t is None:
            return False
        assert t.phase not in ("rollback", "rolled_back"), (t.phase, t.error)
        return t.phase == "done"

    run_until(fleet, up, 90, "big#1 done")
    assert Gear.from_dict(Deployment.objects.get(name="big").current_gear) == baseline
    spec = spec_for(Deployment.objects.get(name="big"))
    assert fleet.sim.deployments["big"].model == spec  # the shape its prepares carried
    (plan,) = baseline.plans
    booked = fleet.sim.booked_bytes()
    assert all(booked[u] >= b for u, b in plan_memory(plan, spec).items())  # held as the console sized it

    ids = [fleet.sim.submit("big", 300, 20) for _ in range(8)]

    def served() -> bool:
        reports = [e for n in Node.objects.all() for e in n.engines if e.get("plan_id") == plan.plan_id]
        return not any(i in fleet.sim.in_system for i in ids) and any(r["finished"] > 0 for r in reports)

    run_until(fleet, served, 60, "big's requests served and its plan's report in the console")
    ended = {e.seq_id: e.kind for e in fleet.log.of("seq_finished", "seq_failed")}
    assert all(ended.get(str(i)) == "seq_finished" for i in ids), ended
