"""Builders for scheduler tests: small clusters, plans and workloads, no database."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from scheduler.costmodel import Slo, Workload
from scheduler.hardware import CATALOG
from scheduler.modelspec import ModelSpec, model_spec
from scheduler.plan import Gear, Plan, Stage
from scheduler.topology import GpuState, LinkState, NodeState, Snapshot

NOW_S = 1000.0


@dataclass(frozen=True)
class NodeSpec:
    id: str
    gpu: str = "H100-SXM"
    gpus: int = 8
    nvlink: bool = True
    rack: str = "A"
    used_bytes: int = 0  # taken by other tenants on every GPU
    down: tuple[int, ...] = ()  # GPU indexes reported unhealthy


def make_fleet(
    nodes: Sequence[NodeSpec],
    *,
    now_s: float = NOW_S,
    intra_rack_gbps: float = 400.0,
    inter_rack_gbps: float = 100.0,
    links: Iterable[LinkState] = (),
) -> Snapshot:
    node_states = []
    gpus = []
    for n in nodes:
        node_states.append(NodeState(id=n.id, rack=n.rack, schedulable=True, last_seen_s=now_s))
        spec = CATALOG[n.gpu]
        for i in range(n.gpus):
            gpus.append(
                GpuState(
                    uuid=f"{n.id}-g{i}",
                    node_id=n.id,
                    index=i,
                    model=n.gpu,
                    mem_total_bytes=spec.mem_bytes,
                    mem_used_bytes=min(spec.mem_bytes, n.used_bytes),
                    healthy=i not in n.down,
                    nvlink_group="0" if n.nvlink else None,
                    last_seen_s=now_s,
                )
            )
    snap = Snapshot(
        now_s=now_s,
        nodes=tuple(node_states),
        gpus=tuple(gpus),
        links=tuple(links),
        intra_rack_gbps=intra_rack_gbps,
        inter_rack_gbps=inter_rack_gbps,
    )
    snap.validate()
    return snap


def with_gpus(snapshot: Snapshot, **changes_by_uuid: dict[str, object]) -> Snapshot:
    """A copy with some GPUs changed: with_gpus(s, **{"a1-g0": {"healthy": False}})."""
    gpus = tuple(replace(g, **changes_by_uuid[g.uuid]) if g.uuid in changes_by_uuid else g for g in snapshot.gpus)  # type: ignore[arg-type]
    return replace(snapshot, gpus=gpus)


def tp_plan(model: ModelSpec | str, uuids: Sequence[str], kv_tokens: int = 8192) -> Plan:
    m = model_spec(model) if isinstance(model, str) else model
    return Plan(m.name, "colocated", (Stage(0, m.num_layers, tuple(uuids)),), kv_reserve_tokens=kv_tokens)


def one_plan_gear(plan: Plan) -> Gear:
    return Gear(plan.model, (plan,), (1.0,))


def chat_workload(rate_rps: float = 2.0) -> Workload:
    return Workload(rate_rps=rate_rps, prompt_tokens_mean=512, output_tokens_mean=200,
                    prompt_tokens_cv=0.8, output_tokens_cv=0.6)


CHAT_SLO = Slo(ttft_ms=2000, tpot_ms=100)
