"""Scale to zero on the live simulated fleet: the simulated agents over real HTTP against a live
console, a real Celery worker running the ticks and transitions, real Redis for the tick marks.

An operator lets the deployment scale to zero after 2 s; its load window (the engine reports the
ticks sample) shows no arrivals, so a tick drains and releases its plan over the agent protocol. A
request then waits in the deployment's queue - held, not refused - while the gateway's signal
(`do_request_wake`, what console/gateway/views.py calls for a held request) makes the worker's tick
bring the baseline back up; the request is served.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.core.management import call_command

from agents.sim.live import LiveFleet
from agents.sim.scenario import load_scenario
from console.audit.models import AuditEntry
from console.celery import app
from console.gearbox.lifecycle import do_change_deployment
from console.gearbox.models import Deployment, Transition
from console.gearbox.zero import do_request_wake
from tests.demo_fleet import run_until

JOIN = "fpj_live-zero"
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]
SCENARIO = {
    "name": "zero", "seed": 3, "duration_s": 3600,
    "nodes": [{"id": "a1", "gpu": "H100-SXM", "gpus": 8, "nvlink": True, "rack": "A"}],
    "network": {"intra_rack_gbps": 400, "inter_rack_gbps": 100},
    "models": [{"deployment": "d", "model": "Llama-3-8B", "slo": {"ttft_ms": 2000, "tpot_ms": 100},
                "baseline": {"tp": 1, "nodes": ["a1"]}}],
    "workload": [{"deployment": "d", "arrival": "poisson", "rate_rps": 0,
                  "prompt_tokens": {"dist": "fixed", "value": 300}, "output_tokens": {"dist": "fixed", "value": 20}}],
    "events": [],
}


@pytest.fixture
def fleet(live_server: Any, settings: Any, worker: None, tmp_path: Path) -> Iterator[LiveFleet]:
    settings.FLEXPIPE_ENROLL_TOKEN = JOIN
    path = tmp_path / "zero.yaml"
    path.write_text(yaml.safe_dump(SCENARIO))
    call_command("load_scenario_deployments", str(path))
    f = LiveFleet(load_scenario(path), live_server.url, JOIN, report_interval_s=1.0, long_poll_s=2.0,
                  token_dir=tmp_path / "tokens")
    yield f
    f.close()


def ticking(cond: Any) -> Any:
    """`cond`, asking the worker for a periodic tick about once a second meanwhile (what beat does)."""
    last = [0.0]

    def check() -> bool:
        if time.monotonic() - last[0] > 1.0:
            app.send_task("gearbox.tick", kwargs={"trigger": "periodic"}, queue=app.conf.task_default_queue)
            last[0] = time.monotonic()
        return bool(cond())
    return check


def test_a_deployment_scales_to_zero_and_its_next_request_is_held_and_served(fleet: LiveFleet) -> None:
    run_until(fleet, lambda: Deployment.objects.filter(name="d", current_gear__isnull=False).exists(), 90,
              "the baseline up")
    do_change_deployment("d", {"min_replicas": 0, "idle_to_zero_s": 2.0}, actor="system:test")
    run_until(fleet, ticking(lambda: Deployment.objects.filter(name="d", zero_since__isnull=False).exists()), 90,
              "d scaled to zero")
    assert Deployment.objects.get(name="d").routing == []
    run_until(fleet, lambda: not fleet.sim.plans("d"), 60, "its plan drained and released by the agent")
    assert AuditEntry.objects.filter(event_type="gearbox.scaled_to_zero", deployment="d").count() == 1

    rid = fleet.sim.submit("d", 300, 20)  # no plan: it waits in the deployment's queue, held
    fleet.step()
    assert rid in fleet.sim.in_system and len(fleet.sim.deployments["d"].pending) == 1
    assert do_request_wake("d")  # the gateway's signal: a request is held (it asks for a tick)
    run_until(fleet, lambda: rid not in fleet.sim.in_system, 120, "the held request served after the wake-up")
    ended = {e.seq_id: e.kind for e in fleet.log.of("seq_finished", "seq_failed")}
    assert ended.get(str(rid)) == "seq_finished", ended
    assert AuditEntry.objects.filter(event_type="gearbox.waking_from_zero", deployment="d").count() == 1
    # the wake-up was a transition from no gear to the baseline (it may have gone back to zero since:
    # 2 s is a short idle time)
    run_until(fleet, lambda: Transition.objects.filter(deployment__name="d", seq=2, phase="done").exists(), 60,
              "the wake-up transition done")
    woke = Transition.objects.get(deployment__name="d", seq=2)
    assert woke.from_gear is None and woke.to_gear == woke.deployment.baseline_gear
