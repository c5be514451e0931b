"""The scenario's baselines in the simulator: each deployment's baseline plan placed on the GPUs
that are ours now, and every deployment started on its own before the scenario runs. A mixin of
FleetSim (agents/sim/fleet.py): its methods run on the simulator's state."""

# mypy: disable-error-code="misc"
# (its methods take `self: FleetSim`, as agents/sim/churn.py explains)

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from agents.sim.scenario import baseline_stage_nodes
from scheduler.costmodel import max_kv_tokens
from scheduler.plan import Plan, Stage

if TYPE_CHECKING:
    from agents.sim.engine import PlanEngine
    from agents.sim.fleet import FleetSim


class Baselines:
    """The scenario's baselines of FleetSim (module docstring)."""

    def baseline_plan(self: FleetSim, deployment: str, taken: Mapping[str, set[int]] | None = None) -> Plan:
        """The deployment's baseline plan on the GPUs that are ours now: its stages fill the
        listed nodes in order on their first free GPUs (as agents/sim/live.py places it), layers
        split evenly, KV reserve = all that fits under 92% of each GPU."""
        dep = self._dep(deployment)
        base = dep.spec.baseline
        if not base.nodes:
            raise ValueError(f"deployment: {deployment!r} has no scenario baseline (it came with a PREPARE)")
        taken = taken or {}
        free = {n: [g.index for g in self.cluster.our_gpus(n) if g.index not in taken.get(n, set())]
                for n in base.nodes}
        stage_nodes = baseline_stage_nodes(base, {n: len(v) for n, v in free.items()})
        path = f"models[{dep.index}].baseline"
        if stage_nodes is None:
            raise ValueError(f"{path}: {base.pp} stage(s) of tp={base.tp} do not fit on the free GPUs of"
                             f" {', '.join(base.nodes)} now")
        model = dep.model
        per_stage = [model.num_layers // base.pp + (1 if i < model.num_layers % base.pp else 0)
                     for i in range(base.pp)]
        used_here: dict[str, int] = {}
        stages: list[Stage] = []
        start = 0
        for node_id, n_layers in zip(stage_nodes, per_stage, strict=True):
            k = used_here.get(node_id, 0)
            idx = free[node_id][k:k + base.tp]
            used_here[node_id] = k + base.tp
            stages.append(Stage(start, start + n_layers, tuple(self.cluster.gpu_uuid(node_id, i) for i in idx)))
            start += n_layers
        kv = max_kv_tokens(stages, model, self.snapshot())
        if kv < model.max_context_tokens // 4:
            raise ValueError(f"{path}: tp={base.tp} x pp={base.pp} of {model.name} leaves {kv} tokens of KV cache"
                             f" on {', '.join(base.nodes)} (weights barely fit); raise tp or pp")
        return Plan(model.name, "colocated", tuple(stages), kv_reserve_tokens=kv)

    def start_baselines(self: FleetSim) -> dict[str, PlanEngine]:
        """Every deployment's baseline plan, warm and serving now (what runs before the scenario
        starts). Deployments are placed in file order, each on GPUs the earlier ones left."""
        taken: dict[str, set[int]] = {}
        out: dict[str, PlanEngine] = {}
        for name, dep in self.deployments.items():
            plan = self.baseline_plan(name, taken)
            dep.baseline = plan
            for u in plan.gpu_uuids:
                node, index = self._gpu_home[u]
                taken.setdefault(node, set()).add(index)
            out[name] = self.launch(name, plan, source="warm", accepting=True)
        return out


__all__ = ["Baselines"]
