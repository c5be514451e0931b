"""What `architecture` accepts: a catalog name or a Hugging Face config, checked in one function."""

from __future__ import annotations

import importlib.util

import pytest

from console.registry.architecture import HF_REQUIRED_KEYS, MAX_CONFIG_BYTES, validate_architecture

HAS_CATALOG = importlib.util.find_spec("scheduler.modelspec") is not None
TINY = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 512,
        "torch_dtype": "float32", "model_type": "llama"}


def test_a_catalog_name_is_kept_as_the_name() -> None:
    assert validate_architecture("tiny-llama").value == "tiny-llama"


def test_a_config_is_kept_whole_with_its_context_limit() -> None:
    arch = validate_architecture(TINY)
    assert arch.value == TINY and arch.max_context_tokens == 512


def test_a_config_without_a_stated_limit_binds_no_context() -> None:
    config = {k: v for k, v in TINY.items() if k != "max_position_embeddings"}
    assert validate_architecture(config).max_context_tokens is None


@pytest.mark.parametrize("key", HF_REQUIRED_KEYS)
def test_each_key_the_cost_model_needs_is_required(key: str) -> None:
    config = {k: v for k, v in TINY.items() if k != key}
    with pytest.raises(ValueError, match=key):
        validate_architecture(config)


@pytest.mark.parametrize("value,words", [
    ("", "empty name"), ("   ", "empty name"), ("x" * 129, "at most 128"), (3, "got int"), (None, "got NoneType"),
    ([TINY], "got list"), ({**TINY, "note": "a\x00b"}, "NUL"), ({**TINY, "hidden_size": True}, "hidden_size"),
    ({**TINY, "pad": "x" * MAX_CONFIG_BYTES}, "larger than"),
])
def test_what_is_not_an_architecture_says_why(value: object, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        validate_architecture(value)


@pytest.mark.skipif(not HAS_CATALOG, reason="scheduler/modelspec.py (the catalog) is not in this build yet")
def test_once_the_catalog_exists_an_unknown_name_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match="known: .*tiny-llama"):
        validate_architecture("no-such-model")
    assert validate_architecture("Llama-3-8B").max_context_tokens == 8192
