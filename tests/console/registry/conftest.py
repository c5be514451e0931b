from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest


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


def model_body(**overrides: Any) -> dict[str, Any]:
    """A valid registration body for remote weights; tests override what matters to them."""
    body: dict[str, Any] = {
        "name": "tiny-llama",
        "version": "v1",
        "engine": "torch",
        "architecture": "tiny-llama",
        "weights_uri": "hf://flexpipe/tiny-llama/model.safetensors",
        "sha256": hashlib.sha256(b"remote weights").hexdigest(),
        "tokenizer": "hf://flexpipe/tiny-llama/tokenizer.json",
        "max_context": 512,
        "min_gpu_mem_bytes": 2**30,
        "warmup_tokens": 16,
    }
    body.update(overrides)
    return body
