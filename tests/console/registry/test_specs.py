"""The spec the console plans a model with (console/registry/specs.py): the catalog, else the registry
version's own architecture; and the version's placement requirements."""

from __future__ import annotations

from typing import Any

import pytest
from django.utils import timezone

from console.registry.models import ModelVersion
from console.registry.specs import planner_options, requirements_for, spec_for
from scheduler.modelspec import from_hf_config, model_spec

pytestmark = pytest.mark.django_db

CONFIG = {"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 16,
          "num_key_value_heads": 4, "intermediate_size": 5632, "vocab_size": 32000, "max_position_embeddings": 4096,
          "torch_dtype": "float16"}


def version(name: str, architecture: Any, tag: str = "v1", **kw: Any) -> ModelVersion:
    fields: dict[str, Any] = {"engine": "torch", "weights_uri": f"hf://m/{name}/{tag}", "tokenizer": "/t",
                              "max_context": 4096, "min_gpu_mem_bytes": 1, "warmup_tokens": 1, "status": "verified",
                              "registered_at": timezone.now(), "registered_by": "user:alice", **kw}
    return ModelVersion.objects.create(name=name, version=tag, architecture=architecture,
                                       sha256=(name + tag).encode().hex().ljust(64, "0")[:64], **fields)


def test_a_catalog_name_is_the_catalog_entry_without_the_registry() -> None:
    assert spec_for("Llama-3-8B") is model_spec("Llama-3-8B")


def test_a_config_version_is_planned_from_its_config_under_its_own_name() -> None:
    v = version("small-2b", CONFIG)
    spec = spec_for(v)
    assert spec == from_hf_config(CONFIG, name="small-2b")
    assert spec.num_kv_heads == 4 and spec.dtype_bytes == 2
    assert spec_for("small-2b") == spec  # a bare name: its newest version


def test_a_version_naming_a_catalog_architecture_gets_that_shape_under_its_own_name() -> None:
    v = version("chat-llama", "Llama-3-8B")
    spec = spec_for(v)
    assert spec.name == "chat-llama" and spec.weight_bytes == model_spec("Llama-3-8B").weight_bytes


def test_a_name_nobody_registered_is_a_value_error_naming_it() -> None:
    with pytest.raises(ValueError, match="unknown model 'ghost'"):
        spec_for("ghost")


def test_the_requirements_are_the_versions_min_memory_and_engine() -> None:
    v = version("small-2b", CONFIG, min_gpu_mem_bytes=24 * 2**30, engine="vllm")
    req = requirements_for(v)
    assert (req.min_gpu_mem_bytes, req.engine, req.source) == (24 * 2**30, "vllm", "small-2b v1")
    options = planner_options(v)
    assert options is not None and options.requires == req
