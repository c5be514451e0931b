"""A deployment with a history, for the operator API, pages and metrics: built the way it happens.

`running_deployment()` enrolls two H100 nodes (a1, b1), creates "chat" (Llama-3-8B, baseline TP2
on a1), lets the gearbox's first tick bring the baseline up, then has an operator move it to TP2
on b1 (a manual transition) - each transition driven to its end by the simulated agents acting
through the database (harness.SimAgents). Afterwards the deployment runs a gear that is not its
baseline, with two transitions and two decisions behind it.

`engine_report(...)` is what an agent's report says about a plan's engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from django.utils import timezone

from agents.protocol import EngineReport, GpuReport, Report
from console.fleet.actions import do_ingest_report
from console.fleet.models import Node
from console.gearbox import ticks
from console.gearbox.actions import do_request_gear, do_set_mode
from console.gearbox.executor import build_executor
from console.gearbox.models import Decision, Deployment, Transition
from scheduler.plan import Gear
from tests.console.gearbox.harness import FleetReporter, SimAgents, enroll_fleet, gear, make_deployment

GIB = 2**30
BASELINE = gear("a1", [0, 1])
MOVED = gear("b1", [4, 5])


def drive(agents: SimAgents, name: str = "chat", *, max_s: float = 120.0) -> Transition:
    """Advance the deployment's transition until it ended (the agents answer as they go)."""
    ex = build_executor()
    deadline = time.monotonic() + max_s
    while time.monotonic() < deadline:
        out = ex.advance(name)
        agents.run()
        if out.record is None or not out.record.active:
            break
        time.sleep(0.01)
    row = Transition.objects.filter(deployment__name=name).order_by("-seq").first()
    assert row is not None and not row.active, f"still {row.phase if row else None}/{row.step if row else None}"
    return row


@dataclass
class World:
    reporter: FleetReporter
    agents: SimAgents

    def report_engines(self, node_id: str, *reports: EngineReport, gpus: int = 8) -> None:
        """One report of `node_id`, as its agent sends it: its GPUs and its engines' metrics."""
        node = Node.objects.get(node_id=node_id)
        rep = self.reporter
        rep.seq[node_id] = rep.seq.get(node_id, 0) + 1
        total = 80 * GIB
        gpu_reports = tuple(GpuReport(f"GPU-{node_id}-{i}", 600 * 2**20, total, 0.1, 40.0, True,
                                      f"GPU-{node_id}-{i}" not in rep.gone) for i in range(gpus))
        do_ingest_report(node, Report(node_id, node.epoch, rep.seq[node_id], gpu_reports, engines=reports),
                         now=timezone.now())


def running_deployment(*, moved: bool = True, inflight: int = 0) -> World:
    """The module docstring's "chat": baseline up, then (moved=True) moved to b1 by an operator -
    with `inflight` long requests running on the baseline when it moves (they are handed over)."""
    reporter = enroll_fleet()
    make_deployment("chat", baseline=BASELINE)
    agents = SimAgents()
    out = ticks.tick()
    assert out["started"] == ["chat#1"], out
    drive(agents)
    for _ in range(inflight):
        agents.fleet.submit("chat", 3000, 3000)
    if inflight:
        agents.run(0.2)
    if moved:
        decision, started = do_request_gear("chat", MOVED, actor="system:test", reason="make room on a1")
        assert started is not None, decision.reasons
        drive(agents)
    return World(reporter, agents)


def advised(world: World) -> Decision:
    """Advisory mode, then another tenant takes a GPU of the running gear: the gearbox advises a move."""
    do_set_mode("chat", "advisory", actor="system:test")
    current = Gear.from_dict(Deployment.objects.get(name="chat").current_gear)
    world.reporter.gone = {current.gpu_uuids[1]}
    node = current.gpu_uuids[1].split("-")[1]
    world.reporter.report(node)
    ticks.tick(trigger="topology")
    return Decision.objects.get(deployment__name="chat", approval=Decision.PENDING)


def engine_report(plan_id: str, *, tokens_per_s: float = 900.0, ttft_p95_ms: float = 180.0,
                  tpot_p95_ms: float = 22.0, running: int = 12, waiting: int = 1) -> EngineReport:
    return EngineReport(plan_id=plan_id, running=running, waiting=waiting, tokens_per_s=tokens_per_s, kv_usage=0.31,
                        ttft_p50_ms=ttft_p95_ms / 2, ttft_p95_ms=ttft_p95_ms, tpot_p50_ms=tpot_p95_ms * 0.7,
                        tpot_p95_ms=tpot_p95_ms, finished=40, arrivals=42, prompt_tokens_mean=410.0,
                        output_tokens_mean=180.0)
