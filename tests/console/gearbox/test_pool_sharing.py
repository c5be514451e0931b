"""The console's tick on one pool (scheduler/pool/sharing.py): two deployments whose baselines
ask for the same GPUs share them by memory fraction, booked under 92% together; with
FLEXPIPE_MAX_MODELS_PER_GPU=1 the second is kept off them."""

from __future__ import annotations

from typing import Any

import pytest

from console.fleet.models import Gpu
from console.gearbox import ticks
from console.gearbox.models import Deployment, GpuReservation
from scheduler.plan import Gear
from tests.console.gearbox.harness import SimAgents, enroll_fleet, gear, make_deployment
from tests.console.gearbox.test_gearbox_actions import drive

pytestmark = pytest.mark.django_db

SMALL = gear("a1", [0, 1], kv=20_000)  # an 8B at TP2 with a small KV reserve: two fit on one pair of GPUs
# the other's plan differs (a plan's id is its content's hash: an agent refuses a second copy of one plan)
OTHER = gear("a1", [0, 1], kv=16_000)


def test_two_deployments_share_their_gpus_within_092_through_the_tick() -> None:
    enroll_fleet()
    make_deployment("chat", baseline=SMALL)
    make_deployment("other", baseline=OTHER)
    agents = SimAgents()
    out = ticks.tick()
    assert sorted(out["started"]) == ["chat#1", "other#1"], out  # type: ignore[arg-type]
    for name in ("chat", "other"):
        row = drive(agents, name)
        assert row.phase == "done", row.error
        assert Gear.from_dict(Deployment.objects.get(name=name).current_gear).gpu_uuids == SMALL.gpu_uuids
    for u in SMALL.gpu_uuids:
        rows = GpuReservation.objects.filter(gpu_uuid=u)
        assert {r.deployment.name for r in rows} == {"chat", "other"}
        assert sum(r.mem_bytes for r in rows) <= 0.92 * Gpu.objects.get(uuid=u).mem_total_bytes


def test_with_one_model_per_gpu_the_second_deployment_is_kept_off_them(settings: Any) -> None:
    settings.FLEXPIPE_MAX_MODELS_PER_GPU = 1
    enroll_fleet()
    make_deployment("chat", baseline=SMALL)
    make_deployment("other", baseline=OTHER)
    SimAgents()
    ticks.tick()
    other = Deployment.objects.get(name="other")
    started = other.transitions.order_by("-seq").first()
    assert started is None or not set(Gear.from_dict(started.to_gear).gpu_uuids) & set(SMALL.gpu_uuids)
