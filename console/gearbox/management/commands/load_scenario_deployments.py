"""manage.py load_scenario_deployments SCENARIO: create the scenario's deployments (idempotent).

Each `models[]` entry becomes a Deployment with its SLO, priority and baseline gear: the
baseline's `pp` stages of `tp` GPUs on the free GPUs of its nodes, in pipeline order, the way
the simulated fleet names them (agents.sim.cluster.SimCluster.gpu_uuid; the seed decides which
GPUs are free at t=0), deployments taking GPUs in file order, layers split evenly, and as much
KV reserve as fits under invariant 4. Running it again changes nothing, or only what the file
changed (SLO, priority, baseline); it never touches what runs. Nothing runs yet after it: the
gearbox's first tick brings each baseline up as a transition.
"""

from __future__ import annotations

import random
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from agents.schema import SchemaError
from agents.sim.cluster import SimCluster
from agents.sim.live import IDLE_MEM_BYTES, sim_snapshot
from agents.sim.scenario import Scenario, baseline_stage_nodes, load_scenario
from console.fleet.actions import Rejected
from console.gearbox.actions import do_sync_deployment
from scheduler.costmodel import max_kv_tokens
from scheduler.modelspec import model_spec
from scheduler.plan import Gear, Plan, Stage, validate_gear

KV_FILL = 0.95  # of the KV room that fits: leaves slack for the memory the agents report around it


def baseline_gears(scenario: Scenario) -> dict[str, Gear]:
    """deployment -> its baseline gear on the scenario's cluster at t=0."""
    cluster = SimCluster(scenario, random.Random(scenario.seed))
    snap = sim_snapshot(cluster, 0.0, {})
    taken: dict[str, set[int]] = {}
    out: dict[str, Gear] = {}
    for dep in scenario.models:
        base = dep.baseline
        free = {n: len([g for g in cluster.our_gpus(n) if g.index not in taken.get(n, set())]) for n in base.nodes}
        stage_nodes = baseline_stage_nodes(base, free)
        if stage_nodes is None:
            raise CommandError(f"{dep.deployment}: baseline tp={base.tp} pp={base.pp} does not fit on the free GPUs "
                               f"of {', '.join(base.nodes)} left by the deployments before it")
        model = model_spec(dep.model)
        per_stage = [model.num_layers // base.pp + (1 if i < model.num_layers % base.pp else 0) for i in range(base.pp)]
        stages, start = [], 0
        for node_id, n_layers in zip(stage_nodes, per_stage, strict=True):
            used = taken.setdefault(node_id, set())
            gpus = [g for g in cluster.our_gpus(node_id) if g.index not in used][: base.tp]
            used.update(g.index for g in gpus)
            stages.append(Stage(start, start + n_layers, tuple(g.uuid for g in gpus)))
            start += n_layers
        kv = int(KV_FILL * max_kv_tokens(stages, model, snap))
        if kv <= 0:
            raise CommandError(f"{dep.deployment}: the weights of {dep.model} do not fit its baseline's GPUs")
        gear = Gear(model.name, (Plan(model.name, "colocated", tuple(stages), kv_reserve_tokens=kv),), (1.0,))
        problems = validate_gear(gear, snap, model)
        if problems:
            raise CommandError(f"{dep.deployment}: baseline is not valid: {'; '.join(problems[:3])}")
        out[dep.deployment] = gear
    return out


class Command(BaseCommand):
    help = "Create (or update) the scenario's deployments with their baseline gears. Idempotent."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("scenario", help="scenario YAML (docs/scenarios.md)")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            scenario = load_scenario(options["scenario"])
        except SchemaError as exc:
            raise CommandError("; ".join(f"{k}: {v}" for k, v in exc.errors.items())) from None
        gears = baseline_gears(scenario)
        for dep in scenario.models:
            try:
                row, what = do_sync_deployment(name=dep.deployment, model_name=model_spec(dep.model).name,
                                               ttft_ms=dep.ttft_ms, tpot_ms=dep.tpot_ms, priority=dep.priority,
                                               baseline=gears[dep.deployment], actor="system:scenario")
            except Rejected as exc:
                raise CommandError(f"{dep.deployment}: {exc}") from None
            self.stdout.write(f"{row.name}: {what} (baseline {gears[dep.deployment].shape()}, "
                              f"idle GPU memory {IDLE_MEM_BYTES // 2**20} MiB assumed)")
