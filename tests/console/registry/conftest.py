from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from agents.node.daemon import NodeAgent
    from agents.protocol import Ack
    from tests.console.conftest import AgentHTTP


@dataclass(frozen=True)
class TinyWeights:
    path: Path  # the weights file (model.safetensors)
    sha256: str  # its digest, as make_tiny_llama reports it

    @property
    def uri(self) -> str:
        return f"file://{self.path}"


@pytest.fixture(scope="session")
def tiny_weights(tmp_path_factory: pytest.TempPathFactory) -> TinyWeights:
    """The project's tiny Llama, made once per session (agents/engines/torch/weights.py)."""
    from agents.engines.torch.weights import WEIGHTS_FILE, make_tiny_llama

    out = tmp_path_factory.mktemp("tiny-llama")
    digest = make_tiny_llama(out)
    return TinyWeights(out / WEIGHTS_FILE, digest)


OTHER_SHA256 = hashlib.sha256(b"not the weights").hexdigest()
_TOKENIZER: list[str] = []  # the tiny model's tokenizer.json, set by model_roots below


@pytest.fixture(autouse=True)
def model_roots(settings: Any, tiny_weights: TinyWeights, tmp_path: Path) -> list[Path]:
    """The registry reads local files under these roots only: the tiny model's folder and the test's tmp."""
    settings.FLEXPIPE_MODEL_ROOTS = [tiny_weights.path.parent, tmp_path]
    _TOKENIZER[:] = [str(tiny_weights.path.parent / "tokenizer.json")]
    return list(settings.FLEXPIPE_MODEL_ROOTS)


def model_body(**overrides: Any) -> dict[str, Any]:
    """A valid registration body for remote weights (and the tiny model's tokenizer, which the console
    loads at registration); tests override what matters to them."""
    body: dict[str, Any] = {
        "name": "tiny-llama",
        "version": "v1",
        "engine": "torch",
        "architecture": "tiny-llama",
        "weights_uri": "hf://flexpipe/tiny-llama/model.safetensors",
        "sha256": hashlib.sha256(b"remote weights").hexdigest(),
        "tokenizer": _TOKENIZER[0],
        "max_context": 512,
        "min_gpu_mem_bytes": 2**30,
        "warmup_tokens": 16,
    }
    body.update(overrides)
    return body


@pytest.fixture
def models_root(tmp_path: Path) -> Path:
    """The model store of the node agent below."""
    return tmp_path / "models"


@pytest.fixture
def node_agent(models_root: Path) -> Iterator[NodeAgent]:
    """A real agent daemon of node a1, torch backend (no controller: the test carries its commands and acks)."""
    from agents.node.daemon import NodeAgent
    from agents.node.gpuspec import SpecProbe
    from agents.node.plans import ModelStore, TorchBackend
    from tests.agents.node.conftest import free_port

    addr = f"127.0.0.1:{free_port()}"
    agent = NodeAgent(controller="http://127.0.0.1:9", join_token="fpj_unused", probe=SpecProbe("2xA100-80G", "a1"),
                      backend=TorchBackend(ModelStore(models_root), addr, num_kv_blocks=64),
                      backend_name="torch", node_id="a1", data_addr=addr)
    yield agent
    agent.close()


def run_and_ack(agent: AgentHTTP, node_agent: NodeAgent, pulled: dict[str, Any], on_commit: Any) -> Ack:
    """The node agent runs a command pulled from the console and acks it through the agent endpoint,
    as its poll loop does; the ack's receivers run (on commit). Returns the agent's ack."""
    from agents.protocol import Command

    ack = node_agent.handle(Command(id=pulled["id"], kind=pulled["kind"], payload=pulled["payload"],
                                    deployment=pulled.get("deployment"), transition_seq=pulled.get("transition_seq"),
                                    step=pulled.get("step")))
    with on_commit(execute=True):
        resp = agent.post(f"/agent/v1/commands/{pulled['id']}/ack",
                          {"protocol": 1, "status": ack.status, "detail": ack.detail, "result": ack.result})
    assert resp.status_code == 200, resp.content
    return ack


def assert_quarantined_by_agent(version: Any, expected_sha256: str, observed_sha256: str) -> None:
    """The agent's digest differed from the registry's: the version is quarantined by it, and
    the audit entry records the move from awaiting_agent with both digests."""
    import json

    from console.audit.models import AuditEntry

    version.refresh_from_db()
    assert version.status == "quarantined" and version.quarantined_by == "agent:a1"
    assert version.observed_sha256 == observed_sha256
    entry = AuditEntry.objects.get(event_type="registry.version_quarantined")
    body = json.loads(entry.body)
    assert entry.actor == "agent:a1"
    assert body["before"]["status"] == "awaiting_agent" and body["after"]["status"] == "quarantined"
    assert body["data"]["expected_sha256"] == expected_sha256 and body["data"]["observed_sha256"] == observed_sha256
