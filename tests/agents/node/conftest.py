"""Builders for the node agent tests: GPUs from a spec, prepare payloads as the controller makes them."""

from __future__ import annotations

import itertools
import socket
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from agents.node.daemon import NodeAgent
from agents.node.gpuspec import SpecProbe, gpu_uuid
from agents.node.plans import ModelStore, TorchBackend
from agents.protocol import Command
from scheduler.plan import Plan, Stage
from tests.agents.engines.conftest import tiny_model  # noqa: F401 - the fixture, for tests here
from tests.agents.engines.vllm.conftest import skip_vllm_tests_without_venv

MODEL = "tiny-llama"
_ids = itertools.count(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gpus(node_id: str, n: int = 2) -> list[str]:
    return [gpu_uuid("static", node_id, i) for i in range(n)]


def tiny_plan(stages: Sequence[Sequence[str]], kv_tokens: int = 2048) -> Plan:
    """A colocated plan of the tiny model (4 layers) over `stages` (GPU uuids per stage)."""
    bounds = [4 * i // len(stages) for i in range(len(stages) + 1)]
    return Plan(MODEL, "colocated", tuple(Stage(bounds[i], bounds[i + 1], tuple(g)) for i, g in enumerate(stages)),
                kv_reserve_tokens=kv_tokens)


def prepare_payload(plan: Plan, node_id: str, *, deployment: str = "tiny", reserve_bytes: int = 2 * 2**30,
                    weights_sha256: str | None = None, node_of: dict[str, str] | None = None) -> dict[str, Any]:
    """prepare_plan's payload for `node_id` (scheduler.transition: _prepare_payload's shape)."""
    node_of = node_of or {}
    mine = {u for st in plan.stages for u in st.gpu_uuids if node_of.get(u, node_id) == node_id}
    first = plan.stages[0].gpu_uuids[0]
    stages = [{"pipeline": "main", "index": i, "layers": [st.layer_start, st.layer_end], "tp": st.tp,
               "gpus": list(st.gpu_uuids), "ranks": [r for r, u in enumerate(st.gpu_uuids) if u in mine]}
              for i, st in enumerate(plan.stages)]
    return {"plan_id": plan.plan_id, "deployment": deployment, "plan": plan.to_dict(), "model": MODEL,
            "weights_sha256": weights_sha256, "role": "leader" if node_of.get(first, node_id) == node_id else "member",
            "stages": [s for s in stages if s["ranks"]], "reserve_bytes": {u: reserve_bytes for u in sorted(mine)},
            "peers": {}}


def command(kind: str, payload: dict[str, Any], *, cid: int | None = None, deployment: str = "tiny") -> Command:
    return Command(id=cid if cid is not None else next(_ids), kind=kind, payload=payload, deployment=deployment,
                   transition_seq=1, step="prepare")


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture
def make_agent(models_dir: Path, tmp_path: Path) -> Iterator[Any]:
    """NodeAgent(node_id, spec, backend=True) with a torch backend on a free data port; closed after.
    Each node keeps its agent token in tmp_path, so a second agent of a node is that node restarted."""
    made: list[NodeAgent] = []

    def make(node_id: str = "n1", spec: str = "2xA100-80G", *, controller: str = "http://127.0.0.1:9",
             token: str = "fpj_unused", backend: bool = True, kv_blocks: int = 256, **kwargs: Any) -> NodeAgent:
        addr = f"127.0.0.1:{free_port()}"
        kwargs.setdefault("token_file", tmp_path / "agent-tokens" / f"{node_id}.token")
        agent = NodeAgent(controller=controller, join_token=token, probe=SpecProbe(spec, node_id),
                          backend=TorchBackend(ModelStore(models_dir), addr, num_kv_blocks=kv_blocks) if backend else None,
                          backend_name="torch", node_id=node_id, data_addr=addr, **kwargs)
        made.append(agent)
        return agent

    yield make
    for agent in made:
        agent.close()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_vllm_tests_without_venv(items)
