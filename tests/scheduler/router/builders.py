"""A mixed pool for router tests: Qwen2-72B as TP4 plans on an H100 (NVLink), an A100 (NVLink)
and an L40S (PCIe) node - seed 003's heterogeneous cluster - built without a database."""

from __future__ import annotations

import random
from dataclasses import replace

from scheduler.costmodel import max_kv_tokens
from scheduler.modelspec import model_spec
from scheduler.plan import Plan, Stage
from scheduler.router import PlanFacts, PlanLoad, Pool, Router, RouterConfig, RouteRequest, plan_facts
from scheduler.topology import Snapshot
from tests.scheduler.builders import NodeSpec, make_fleet

MODEL = model_spec("Qwen2-72B")
NODES = (("h100", "H100-SXM", True), ("a100", "A100-80G", True), ("l40s", "L40S", False))


def mixed_snapshot(*, used_bytes: dict[str, int] | None = None) -> Snapshot:
    used = used_bytes or {}
    return make_fleet([NodeSpec(n, gpu=g, gpus=8, nvlink=nv, used_bytes=used.get(n, 0)) for n, g, nv in NODES])


def tp4(node: str, snap: Snapshot, *, k: int = 0, kv_tokens: int | None = None) -> Plan:
    stages = (Stage(0, MODEL.num_layers, tuple(f"{node}-g{i}" for i in range(4 * k, 4 * k + 4))),)
    kv = kv_tokens if kv_tokens is not None else max_kv_tokens(stages, MODEL, snap)
    return Plan(MODEL.name, "colocated", stages, kv_reserve_tokens=kv)


def facts(node: str, snap: Snapshot | None = None, **kw: object) -> PlanFacts:
    s = snap or mixed_snapshot()
    kv = kw.pop("kv_tokens", None)
    return plan_facts(tp4(node, s, kv_tokens=kv), MODEL, s, **kw)  # type: ignore[arg-type]


def mixed_pool(nodes: tuple[str, ...] = ("h100", "a100", "l40s"), **kw: object) -> Pool:
    snap = mixed_snapshot()
    return Pool([facts(n, snap, **kw) for n in nodes], model=MODEL.name)


def copies(f: PlanFacts, n: int) -> list[PlanFacts]:
    """n plans like `f`, each with an id of its own."""
    return [replace(f, plan_id=f"{f.plan_id}-{i}") for i in range(n)]


def router(seed: int = 0, **cfg: object) -> Router:
    return Router(RouterConfig(**cfg), rng=random.Random(seed))  # type: ignore[arg-type]


def req(prompt: int = 1000, max_tokens: int = 100, **kw: object) -> RouteRequest:
    return RouteRequest(prompt, max_tokens, **kw)  # type: ignore[arg-type]


def idle(pool: Pool) -> Pool:
    pool.set_loads([PlanLoad() for _ in range(pool.n)])
    return pool


def gpu_of(pool: Pool, slot: int) -> str:
    return pool.facts[slot].gpu_model
