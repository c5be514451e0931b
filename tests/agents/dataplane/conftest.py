"""Fixtures for the data plane: the tiny torch model, plans in two layouts, live data servers.

Two nodes on this machine, each a DataServer on its own port: node A runs the plan in TP1, node
B the same model in PP2 (the layout a switch re-shards the KV into). Hosts are shared per module
(worker processes are what costs); tests that freeze, release or break a host build their own.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from agents.dataplane import DataServer, PlanHost
from scheduler.plan import Plan, Stage
from tests.agents.engines.conftest import TinyModel, pid_alive, tiny_model  # noqa: F401 - the fixture
from tests.agents.engines.vllm.conftest import skip_vllm_tests_without_venv

_ids = itertools.count()


def tiny_plan(*stages: tuple[int, int, int], tag: str) -> dict[str, Any]:
    """A plan of the 4-layer tiny model; each stage (start, end, tp) on made-up GPU uuids."""
    return Plan(
        model="tiny-llama",
        mode="colocated",
        stages=tuple(Stage(a, b, tuple(f"GPU-{tag}-{a}-{r}" for r in range(tp))) for a, b, tp in stages),
    ).to_dict()


PLAN_TP1 = tiny_plan((0, 4, 1), tag="a")
PLAN_PP2 = tiny_plan((0, 2, 1), (2, 4, 1), tag="b")
PLAN_TP2 = tiny_plan((0, 4, 2), tag="c")


def new_seq_id(prefix: str = "s") -> str:
    return f"{prefix}-{next(_ids)}"


class Node:
    """A DataServer and the PlanHosts started on it; closes them all."""

    def __init__(self) -> None:
        self.server = DataServer().start()
        self.hosts: list[PlanHost] = []

    @property
    def addr(self) -> str:
        return self.server.address

    def run(self, model: TinyModel, plan: dict[str, Any], **kw: Any) -> PlanHost:
        host = PlanHost(deployment="tiny", plan=plan, model_dir=str(model.path), layout=None,
                        weights_sha256=model.sha256, **kw)
        host.start()
        self.server.add(host)
        self.hosts.append(host)
        return host

    def close(self) -> list[int]:
        pids = [pid for h in self.hosts if h.engine is not None for pid in h.engine.pids]
        for h in self.hosts:
            h.stop()
        self.server.close()
        return pids


@pytest.fixture
def make_node() -> Iterator[Callable[[], Node]]:
    nodes: list[Node] = []

    def make() -> Node:
        nodes.append(Node())
        return nodes[-1]

    yield make
    pids = [pid for n in nodes for pid in n.close()]
    leaked = [p for p in pids if pid_alive(p)]
    assert not leaked, f"worker processes left running: {leaked}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_vllm_tests_without_venv(items)
