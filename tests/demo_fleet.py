"""The demo scenario's live fleet against a live console, for the end-to-end tests.

The console's deployments come from `manage.py load_scenario_deployments`, the simulated agents
talk to it over real HTTP; a test drives the fleet pass by pass with `run_until`, standing in
for beat by asking a real worker for the transition sweep every two seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from django.core.management import call_command

from agents.sim.live import LiveFleet
from agents.sim.scenario import load_scenario
from console.celery import app
from console.gearbox.models import Transition

DEMO = Path(__file__).resolve().parents[1] / "scenarios" / "demo.yaml"


def demo_fleet(controller: str, join_token: str) -> LiveFleet:
    """The demo's deployments in the console, and its fleet ready to enroll (close it after)."""
    call_command("load_scenario_deployments", str(DEMO))
    return LiveFleet(load_scenario(DEMO), controller, join_token, report_interval_s=1.0, long_poll_s=2.0)


def run_until(fleet: LiveFleet, cond: Callable[[], bool], max_s: float, what: str) -> None:
    deadline = time.monotonic() + max_s
    last_sweep = 0.0
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {max_s} s; transitions: {story()}"
        fleet.step()
        if time.monotonic() - last_sweep > 2.0:  # what beat's sweep does
            app.send_task("transitions.sweep", queue=app.conf.task_default_queue)
            last_sweep = time.monotonic()
        time.sleep(0.05)


def story() -> str:
    """Every transition so far, for a failure message."""
    return "; ".join(f"{t.deployment.name}#{t.seq} {t.kind} {t.phase}/{t.step} "
                     f"({t.decision.trigger if t.decision else '-'}) {t.error[:60]}"
                     for t in Transition.objects.select_related("deployment", "decision").order_by("id"))
