"""--backend vllm: what the daemon asks vLLM for, and how a server that cannot start is answered.
(tests/agents/engines/vllm launches real vLLM servers; here none is started.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agents.dataplane.client import stream_tokens
from agents.engines.vllm import build_command
from agents.node.daemon import NodeAgent
from agents.node.gpuspec import SpecProbe
from agents.node.plans import ModelStore, VllmBackend
from tests.agents.node.conftest import command, free_port, gpus, prepare_payload, tiny_plan


def test_a_plan_becomes_a_cpu_vllm_server_on_its_own_port(models_dir: Path) -> None:
    backend = VllmBackend(ModelStore(models_dir), port_base=8300)
    plan = tiny_plan([gpus("n1", 1)])
    folder, _ = backend.models.resolve("tiny-llama", None)
    first = backend.spec(plan.to_dict(), plan.plan_id, "tiny-llama", folder)
    second = backend.spec(plan.to_dict(), plan.plan_id, "tiny-llama", folder)
    assert (first.port, second.port) == (8300, 8301)
    argv = build_command(first, "/usr/bin/python3")
    assert argv[argv.index("--model") + 1] == str(folder) and argv[argv.index("--dtype") + 1] == "float32"
    assert "--enforce-eager" in argv and first.gpu_ids == () and first.max_model_len == 512
    assert dict(first.env)["VLLM_CPU_KVCACHE_SPACE"] == "1"
    # the registry's max_context for the version caps the server's context when it is the lower
    assert backend.spec(plan.to_dict(), plan.plan_id, "tiny-llama", folder, 300).max_model_len == 300
    assert backend.spec(plan.to_dict(), plan.plan_id, "tiny-llama", folder, 4096).max_model_len == 512


def test_on_gpus_the_plan_s_parallelism_and_devices_go_to_vllm(models_dir: Path) -> None:
    backend = VllmBackend(ModelStore(models_dir), cpu=False)
    a, b, c, d = gpus("n1", 4)
    plan = tiny_plan([[a, b], [c, d]])
    folder, _ = backend.models.resolve("tiny-llama", None)
    spec = backend.spec(plan.to_dict(), plan.plan_id, "tiny-llama", folder)
    assert (spec.tensor_parallel_size, spec.pipeline_parallel_size) == (2, 2)
    assert spec.gpu_ids == (a, b, c, d) and spec.dtype == "auto"


def test_a_vllm_that_cannot_start_fails_the_prepare_and_books_nothing(models_dir: Path, tmp_path: Path) -> None:
    backend = VllmBackend(ModelStore(models_dir), python=str(tmp_path / "no-python"), log_dir=str(tmp_path))
    agent = NodeAgent(controller="http://127.0.0.1:9", join_token="fpj_x", probe=SpecProbe("1xA100-80G", "n1"),
                      backend=backend, backend_name="vllm", node_id="n1")
    try:
        plan = tiny_plan([gpus("n1", 1)])
        ack: Any = agent.handle(command("prepare_plan", prepare_payload(plan, "n1")))
        assert ack.status == "failed" and ack.result["reason"] == "failed"
        assert "no-python" in ack.detail and "does not exist" in ack.detail
        assert agent.booked() == {} and not agent.plans
    finally:
        agent.close()


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_a_prepared_vllm_plan_is_served_by_the_node_s_data_server(models_dir: Path, tmp_path: Path) -> None:
    addr = f"127.0.0.1:{free_port()}"
    backend = VllmBackend(ModelStore(models_dir), addr, port_base=free_port(), log_dir=str(tmp_path))
    agent = NodeAgent(controller="http://127.0.0.1:9", join_token="fpj_x", probe=SpecProbe("1xA100-80G", "n1"),
                      backend=backend, backend_name="vllm", node_id="n1", data_addr=addr)
    try:
        plan = tiny_plan([gpus("n1", 1)])
        prepared: Any = agent.handle(command("prepare_plan", prepare_payload(plan, "n1")))
        assert prepared.status == "ok", prepared.detail

        events = list(stream_tokens(addr, generate={"deployment": "tiny", "plan_id": plan.plan_id, "seq_id": "s1",
                                                    "prompt_ids": [5, 17, 42], "max_tokens": 6,
                                                    "sampling": {"ignore_eos": True}}))
        base = {"plan_id": plan.plan_id, "deployment": "tiny"}
        frozen: Any = agent.handle(command("freeze_plan", {**base, "routing_version": 2}))
        released: Any = agent.handle(command("release_plan", {**base, "drain_timeout_s": 0}))

        assert [e["i"] for e in events if "token" in e] == list(range(6))
        assert events[-1] == {"done": True, "finish_reason": "length"}
        assert frozen.status == "ok" and frozen.result["sequences"] == []
        assert released.status == "ok" and released.result["failed"] == []
    finally:
        agent.close()
