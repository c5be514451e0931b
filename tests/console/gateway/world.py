"""A deployment of the tiny torch model behind the gateway: rows in the database, PlanHosts on data servers.

The gateway finds everything the way production does: the Deployment's routing table (plan,
weight, frozen, nodes), the leader Node's data_addr, the model's tokenizer folder (here through
FLEXPIPE_GATEWAY_TOKENIZERS, which the tests set to the tiny model's folder).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.utils import timezone

from agents.dataplane import DataServer, PlanHost
from console.fleet.models import Node
from console.gearbox.models import Deployment

MODEL = "tiny-llama"


def route(host: PlanHost, node_id: str, *, weight: float = 1.0, frozen: bool = False) -> dict[str, Any]:
    return {"plan_id": host.plan_id, "plan": host.plan, "weight": weight, "frozen": frozen, "nodes": [node_id]}


def make_node(node_id: str, data_addr: str) -> Node:
    return Node.objects.create(node_id=node_id, hostname=node_id, agent_version="test", data_addr=data_addr,
                               token_hash=f"h-{node_id}", registered_at=timezone.now(), backends=["torch"])


def make_deployment(name: str, routes: list[dict[str, Any]], *, version: int = 1) -> Deployment:
    now = timezone.now()
    return Deployment.objects.create(name=name, model_name=MODEL, ttft_ms=500.0, tpot_ms=50.0,
                                     baseline_gear={"model": MODEL, "plans": [], "weights": []},
                                     routing_version=version, routing=routes, created_at=now, updated_at=now)


def set_routes(name: str, routes: list[dict[str, Any]]) -> None:
    """A routing commit: new table, version bumped (what a transition's SWITCH does)."""
    dep = Deployment.objects.get(name=name)
    Deployment.objects.filter(pk=dep.pk).update(routing=routes, routing_version=dep.routing_version + 1)


class Hosts:
    """Two nodes, each a DataServer; plans started on them on demand and stopped at the end."""

    def __init__(self, model_dir: Path, sha: str) -> None:
        self.model_dir, self.sha = model_dir, sha
        self.servers = {"a1": DataServer().start(), "b1": DataServer().start()}
        self.hosts: list[PlanHost] = []

    def addr(self, node_id: str) -> str:
        return self.servers[node_id].address

    def run(self, node_id: str, plan: dict[str, Any], **kw: Any) -> PlanHost:
        host = PlanHost(deployment="tiny", plan=plan, model_dir=str(self.model_dir), layout=None,
                        weights_sha256=self.sha, **kw)
        host.start()
        self.servers[node_id].add(host)
        self.hosts.append(host)
        return host

    def close(self) -> None:
        for h in self.hosts:
            h.stop()
        for s in self.servers.values():
            s.close()
