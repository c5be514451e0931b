"""The demo end to end: scenario deployments, simulated agents over real HTTP, a real Celery worker.

`manage.py load_scenario_deployments` creates the demo's deployments; the simulated fleet
enrolls, reports, long-polls its commands and acks them over HTTP against a live server; a
Celery worker runs the ticks (at once on each topology event) and the transitions (on each
ack). Nothing is called by hand: the first transitions bring the baselines up, then the
scenario's preemption at t=45 s takes four H100s and the gearbox moves the gear in response.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from agents.sim.live import LiveFleet
from console.gearbox.models import Deployment, Transition
from scheduler.invariants import check
from scheduler.plan import Gear
from tests.console.gearbox.harness import django_log
from tests.demo_fleet import demo_fleet, run_until, story

JOIN = "fpj_end-to-end"
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


@pytest.fixture
def fleet(live_server: Any, settings: Any, worker: None) -> Iterator[LiveFleet]:
    settings.FLEXPIPE_ENROLL_TOKEN = JOIN
    f = demo_fleet(live_server.url, JOIN)
    yield f
    f.close()


def gpus_of(raw: object) -> set[str]:
    return set(Gear.from_dict(raw).gpu_uuids) if raw else set()


def test_the_demo_brings_its_baselines_up_and_shifts_gear_after_the_preemption(fleet: LiveFleet) -> None:
    deps = list(Deployment.objects.order_by("name"))
    assert [d.name for d in deps] == ["chat-8b", "summarize-70b"] and all(d.current_gear is None for d in deps)
    run_until(fleet, lambda: all(d.current_gear for d in Deployment.objects.all()), 90, "baselines up")
    for d in Deployment.objects.all():
        assert d.current_gear == d.baseline_gear
        first = Transition.objects.get(deployment=d, seq=1)
        assert first.phase == "done" and first.decision is not None
    # requests are admitted to, and served on, the commanded plans
    run_until(fleet, lambda: bool(fleet.log.of("seq_finished")), 60, "requests served")
    before = {d.name: gpus_of(d.current_gear) for d in Deployment.objects.all()}

    # jump to just past the preemption at t=45 s: another tenant takes four H100s of h100-a
    fleet.t0 -= max(0.0, 45.5 - fleet.sim_time_s())
    fleet.step()
    taken = {g.uuid for g in fleet.cluster.nodes["h100-a"].gpus if not g.ours}
    assert len(taken) == 4
    hit = [name for name, gpus in before.items() if gpus & taken]
    assert hit, "the preemption hits a running plan"
    # (its agent's report no longer lists the stopped plan: the console may drop it before it moves -
    # a gear is up again only once a new one is)
    run_until(fleet, lambda: all((g := gpus_of(Deployment.objects.get(name=n).current_gear)) and not g & taken
                                 for n in hit), 120, "a new gear off the preempted GPUs")
    for name in hit:
        moved = Transition.objects.filter(deployment__name=name, seq__gt=1, phase="done").first()
        assert moved is not None and moved.decision is not None and moved.decision.trigger == "topology", story()
    # invariants: engines (1, 2) from the fleet's log, transitions (3) from the audit chain and commands
    violations = check(fleet.log, complete=False)
    assert not violations, violations[:5]
    for name in ("chat-8b", "summarize-70b"):
        assert not [v for v in check(django_log(name), complete=False) if v.invariant == 3]
