from __future__ import annotations

import pytest

from scheduler.modelspec import CATALOG, from_hf_config, known_models, model_spec

KIB = 1024

# https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json (the keys we read)
LLAMA3_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


@pytest.mark.parametrize(
    ("name", "kib"),
    [("Llama-3-8B", 128), ("Llama-3-70B", 320), ("Phi-3-mini", 384), ("Llama-2-7B", 512), ("Qwen2-72B", 320)],
)
def test_kv_bytes_per_token_match_the_published_configs(name: str, kib: int) -> None:
    assert model_spec(name).kv_bytes_per_token == kib * KIB


def test_kv_bytes_use_kv_heads_not_hidden_size_under_gqa() -> None:
    m = model_spec("Llama-3-70B")
    no_gqa = 2 * m.num_layers * m.hidden_size * m.dtype_bytes  # seed 000's formula
    assert m.kv_bytes_per_token == no_gqa * m.num_kv_heads // m.num_heads


def test_parameter_counts_match_the_model_names() -> None:
    assert model_spec("Llama-3-8B").num_params == pytest.approx(8.03e9, rel=0.01)
    assert model_spec("Llama-3-70B").num_params == pytest.approx(70.6e9, rel=0.01)
    assert model_spec("Phi-3-mini").num_params == pytest.approx(3.82e9, rel=0.01)
    assert model_spec("Llama-2-7B").num_params == pytest.approx(6.74e9, rel=0.01)


def test_the_tiny_test_model_has_the_shape_the_weights_generator_makes() -> None:
    from agents.engines.torch.weights import TinyLlamaShape, hf_config

    made = from_hf_config(hf_config(TinyLlamaShape()), name="tiny-llama")
    tiny = model_spec("tiny-llama")
    assert (tiny.hidden_size, tiny.num_layers, tiny.num_heads, tiny.num_kv_heads, tiny.head_dim) == (64, 4, 4, 2, 32)
    assert (tiny.intermediate_size, tiny.vocab_size, tiny.dtype_bytes) == (128, 512, 4)
    assert made.num_params == tiny.num_params
    assert made.kv_bytes_per_token == tiny.kv_bytes_per_token


def test_a_hf_config_builds_the_same_spec_as_the_catalog() -> None:
    built = from_hf_config(LLAMA3_8B_CONFIG, name="Llama-3-8B")
    catalog = model_spec("Llama-3-8B")
    assert built.num_params == catalog.num_params
    assert built.kv_bytes_per_token == catalog.kv_bytes_per_token
    assert built.max_context_tokens == 8192


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_size": None}, "config.hidden_size: required"),
        ({"num_hidden_layers": "32"}, "config.num_hidden_layers: must be a positive integer"),
        ({"torch_dtype": "int3"}, "config.torch_dtype: unsupported"),
        ({"num_key_value_heads": 5}, "num_kv_heads: 5 must divide num_heads 32"),
        ({"tie_word_embeddings": "no"}, "config.tie_word_embeddings: must be true or false"),
    ],
)
def test_a_malformed_config_names_the_key(change: dict[str, object], message: str) -> None:
    config = {k: v for k, v in {**LLAMA3_8B_CONFIG, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        from_hf_config(config)


def test_an_unknown_model_is_an_error_that_lists_the_known_ones() -> None:
    with pytest.raises(ValueError) as err:
        model_spec("GPT-5")
    for name in known_models():
        assert name in str(err.value)


def test_stage_weights_add_up_to_the_whole_model() -> None:
    m = model_spec("Llama-3-70B")
    split = m.stage_weight_bytes(0, 30) + m.stage_weight_bytes(30, 55) + m.stage_weight_bytes(55, 80)
    assert split == m.weight_bytes


def test_it_rejects_a_stage_outside_the_model() -> None:
    with pytest.raises(ValueError, match="layer range"):
        model_spec("Llama-3-8B").stage_weight_bytes(10, 40)


def test_tp_must_shard_the_heads() -> None:
    m = model_spec("Llama-3-70B")  # 64 heads, 8 KV heads
    assert m.tp_error(8) is None
    assert m.tp_error(16) is None  # KV heads replicated two-fold
    assert "num_heads" in (m.tp_error(3) or "")
    assert m.valid_tps(8) == (1, 2, 4, 8)


def test_every_catalog_model_cites_its_config() -> None:
    for spec in CATALOG.values():
        assert spec.source, spec.name


def test_a_spec_goes_over_the_wire_and_back_unchanged_and_a_bad_one_names_the_key() -> None:
    from scheduler.modelspec import ModelSpec

    for spec in CATALOG.values():
        assert ModelSpec.from_dict(spec.to_dict()) == spec
    custom = from_hf_config({"hidden_size": 512, "num_attention_heads": 8, "num_hidden_layers": 6,
                             "intermediate_size": 1024, "vocab_size": 1000, "tie_word_embeddings": True}, name="c")
    assert ModelSpec.from_dict(custom.to_dict()) == custom
    short = {k: v for k, v in custom.to_dict().items() if k not in ("gated_mlp", "tie_word_embeddings", "qkv_bias",
                                                                     "source")}
    assert ModelSpec.from_dict(short) == ModelSpec(**{**short, "tie_word_embeddings": False})  # type: ignore[arg-type]
    for bad, key in (({"head_dim": 0}, "shape.head_dim"), ({"name": ""}, "shape.name"), ({"x": 1}, "shape.x"),
                     ({"num_heads": 6}, "shape.num_kv_heads"), ({"dtype_bytes": 2**40}, "shape.dtype_bytes")):
        with pytest.raises(ValueError, match=rf"^{key.replace('.', '[.]')}: "):
            ModelSpec.from_dict({**custom.to_dict(), **bad}, "shape")
    with pytest.raises(ValueError, match=r"^shape\.vocab_size: required"):
        ModelSpec.from_dict({k: v for k, v in custom.to_dict().items() if k != "vocab_size"}, "shape")
    with pytest.raises(ValueError, match="^shape: must be an object"):
        ModelSpec.from_dict([1], "shape")
