"""Model architecture math for decoder-only transformers (Llama family and kin).

Everything here follows from the config: parameter counts, weight bytes per layer, FLOPs per
token, and the KV-cache size per token. With grouped-query attention the KV cache holds
`num_kv_heads` heads, not `num_heads`:

    kv_bytes_per_token = 2 (K and V) x layers x kv_heads x head_dim x dtype_bytes

Seed 000's "2 x layers x hidden x dtype" is the special case kv_heads x head_dim == hidden.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from scheduler._lazy import cached_field_hash, lazy, state_without_hash

_DTYPE_BYTES: Mapping[str, int] = {
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "float32": 4,
    "float": 4,
    "float8_e4m3fn": 1,
    "fp8": 1,
}


# ModelSpec.from_dict: the integer fields (all required), everything to_dict writes, and a bound on
# a size that catches a unit mistake without limiting any real model (the largest are ~1e6 wide)
_SPEC_SIZES = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
               "vocab_size", "dtype_bytes", "max_context_tokens")
_SPEC_REQUIRED = ("name", *_SPEC_SIZES)
_SPEC_KEYS = frozenset((*_SPEC_REQUIRED, "gated_mlp", "tie_word_embeddings", "qkv_bias", "source"))
_MAX_SIZE = 2**31 - 1


@dataclass(frozen=True)
class ModelSpec:
    """The shape of one model; derived sizes are properties."""

    __hash__ = cached_field_hash  # fields hashed once (memo keys)
    __getstate__ = state_without_hash

    name: str  # catalog key or the name given to from_hf_config
    hidden_size: int  # model width
    num_layers: int  # transformer blocks
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA); == num_heads without GQA
    head_dim: int  # per-head width (usually hidden_size // num_heads)
    intermediate_size: int  # MLP inner width
    vocab_size: int  # embedding rows
    dtype_bytes: int  # bytes per weight and per KV element
    gated_mlp: bool = True  # SwiGLU: gate and up projections (3 matrices), else 2
    tie_word_embeddings: bool = False  # LM head shares the embedding matrix
    qkv_bias: bool = False  # bias on the Q, K, V projections (Qwen2)
    max_context_tokens: int = 4096  # max_position_embeddings
    source: str = ""  # where the config comes from

    def __post_init__(self) -> None:
        for field in (
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "dtype_bytes",
            "max_context_tokens",
        ):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{field}: must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads: {self.num_kv_heads} must divide num_heads {self.num_heads}"
            )

    # --- widths -------------------------------------------------------------------------
    @lazy
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @lazy
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    # --- parameters and bytes -----------------------------------------------------------
    @lazy
    def attn_params_per_layer(self) -> int:
        qkv = self.hidden_size * (self.q_dim + 2 * self.kv_dim)
        bias = (self.q_dim + 2 * self.kv_dim) if self.qkv_bias else 0
        return qkv + bias + self.q_dim * self.hidden_size

    @lazy
    def mlp_params_per_layer(self) -> int:
        return (3 if self.gated_mlp else 2) * self.hidden_size * self.intermediate_size

    @lazy
    def params_per_layer(self) -> int:
        # two RMSNorm weight vectors per block
        return self.attn_params_per_layer + self.mlp_params_per_layer + 2 * self.hidden_size

    @lazy
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @lazy
    def lm_head_params(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @lazy
    def num_params(self) -> int:
        return (
            self.num_layers * self.params_per_layer
            + self.embedding_params
            + self.lm_head_params
            + self.hidden_size  # final norm
        )

    @lazy
    def weight_bytes_per_layer(self) -> int:
        return self.params_per_layer * self.dtype_bytes

    @lazy
    def embedding_bytes(self) -> int:
        return self.embedding_params * self.dtype_bytes

    @lazy
    def lm_head_bytes(self) -> int:
        """Bytes of the output projection; with tied embeddings it is the embedding itself."""
        return self.vocab_size * self.hidden_size * self.dtype_bytes

    @lazy
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    def stage_weight_bytes(self, layer_start: int, layer_end: int) -> int:
        """Weights a pipeline stage holds: its layers, plus the embedding on the first stage and
        the LM head and final norm on the last (a tied head is held by both ends)."""
        if not 0 <= layer_start < layer_end <= self.num_layers:
            raise ValueError(
                f"layer range: [{layer_start}, {layer_end}) is not inside [0, {self.num_layers})"
            )
        total = (layer_end - layer_start) * self.weight_bytes_per_layer
        if layer_start == 0:
            total += self.embedding_bytes
        if layer_end == self.num_layers:
            total += self.lm_head_bytes + self.hidden_size * self.dtype_bytes
        return total

    # --- KV cache -----------------------------------------------------------------------
    @lazy
    def kv_bytes_per_token_per_layer(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @lazy
    def kv_bytes_per_token(self) -> int:
        """2 x layers x kv_heads x head_dim x dtype_bytes (GQA-aware)."""
        return self.num_layers * self.kv_bytes_per_token_per_layer

    def kv_shards(self, tp: int) -> int:
        """Over how many ranks one layer's KV is split: by KV head, replicated beyond num_kv_heads."""
        return min(tp, self.num_kv_heads)

    def tp_error(self, tp: int) -> str | None:
        """Why `tp` cannot shard this model's attention, or None when it can."""
        if tp < 1:
            return f"tp {tp} must be >= 1"
        if self.num_heads % tp:
            return f"tp {tp} must divide num_heads {self.num_heads}"
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            return f"tp {tp} and num_kv_heads {self.num_kv_heads}: one must divide the other"
        return None

    def valid_tps(self, max_tp: int) -> tuple[int, ...]:
        return tuple(t for t in range(1, max_tp + 1) if self.tp_error(t) is None)

    # --- FLOPs and activations ------------------------------------------------------------
    @lazy
    def linear_flops_per_token(self) -> int:
        """2 FLOPs per weight per token for every matrix a token passes (layers and LM head)."""
        layer = 2 * (self.attn_params_per_layer + self.mlp_params_per_layer)
        return self.num_layers * layer + 2 * self.vocab_size * self.hidden_size

    def attention_flops(self, query_tokens: int, context_tokens: int) -> int:
        """QK^T and AV over all layers for `query_tokens` that each attend `context_tokens`."""
        return 4 * self.num_layers * self.q_dim * query_tokens * context_tokens

    @lazy
    def activation_bytes_per_token(self) -> int:
        """Hidden state of one token: what a PP hand-off or a TP all-reduce moves."""
        return self.hidden_size * self.dtype_bytes

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "dtype_bytes": self.dtype_bytes,
            "gated_mlp": self.gated_mlp,
            "tie_word_embeddings": self.tie_word_embeddings,
            "qkv_bias": self.qkv_bias,
            "max_context_tokens": self.max_context_tokens,
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, d: object, path: str = "model_spec") -> ModelSpec:
        """The inverse of to_dict: every key of it, the three flags and `source` optional (their
        defaults), no other key. Raises ValueError naming the offending key ("model_spec.num_layers")."""
        if not isinstance(d, Mapping):
            raise ValueError(f"{path}: must be an object, got {type(d).__name__}")
        unknown = sorted(str(k) for k in d if k not in _SPEC_KEYS)
        if unknown:
            raise ValueError(f"{path}.{unknown[0]}: unknown key")
        missing = [k for k in _SPEC_REQUIRED if k not in d]
        if missing:
            raise ValueError(f"{path}.{missing[0]}: required")
        name = d["name"]
        if not isinstance(name, str) or not name.strip() or len(name) > 200:
            raise ValueError(f"{path}.name: must be a non-empty string of at most 200 characters")
        source = d.get("source", "")
        if not isinstance(source, str) or len(source) > 2000:
            raise ValueError(f"{path}.source: must be a string of at most 2000 characters")
        flags: dict[str, bool] = {}
        for key in ("gated_mlp", "tie_word_embeddings", "qkv_bias"):
            value = d.get(key, getattr(cls, key))
            if not isinstance(value, bool):
                raise ValueError(f"{path}.{key}: must be true or false, got {value!r}")
            flags[key] = value
        sizes: dict[str, int] = {}
        for key in _SPEC_SIZES:
            value = d[key]
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= _MAX_SIZE:
                raise ValueError(f"{path}.{key}: must be an integer in [1, {_MAX_SIZE}], got {value!r}")
            sizes[key] = value
        try:
            return cls(name=name, source=source, **sizes, **flags)  # type: ignore[arg-type]
        except ValueError as exc:  # (num_kv_heads must divide num_heads: __post_init__ names the field)
            raise ValueError(f"{path}.{exc}") from None


def from_hf_config(config: Mapping[str, object], name: str = "custom") -> ModelSpec:
    """A ModelSpec from a Hugging Face `config.json` dict (Llama, Mistral, Qwen2, Phi-3 keys).

    Raises ValueError naming the offending key.
    """
    if not isinstance(config, Mapping):
        raise ValueError(f"config: must be an object, got {type(config).__name__}")

    def integer(key: str, default: int | None = None) -> int:
        value = config.get(key, default)
        if value is None:
            raise ValueError(f"config.{key}: required")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"config.{key}: must be a positive integer, got {value!r}")
        return value

    hidden = integer("hidden_size")
    heads = integer("num_attention_heads")
    kv_heads = integer("num_key_value_heads", heads)
    head_dim_default = hidden // heads if hidden % heads == 0 else None
    head_dim = integer("head_dim", head_dim_default)
    dtype_name = config.get("torch_dtype", config.get("dtype", "bfloat16"))
    if not isinstance(dtype_name, str) or dtype_name not in _DTYPE_BYTES:
        raise ValueError(
            f"config.torch_dtype: unsupported {dtype_name!r}; known: {', '.join(_DTYPE_BYTES)}"
        )
    act = config.get("hidden_act", "silu")
    if not isinstance(act, str):
        raise ValueError(f"config.hidden_act: must be a string, got {act!r}")
    tie = config.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise ValueError(f"config.tie_word_embeddings: must be true or false, got {tie!r}")
    model_type = config.get("model_type", "llama")
    bias = config.get("attention_bias", model_type == "qwen2")
    if not isinstance(bias, bool):
        raise ValueError(f"config.attention_bias: must be true or false, got {bias!r}")
    try:
        return ModelSpec(
            name=name,
            hidden_size=hidden,
            num_layers=integer("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=integer("intermediate_size"),
            vocab_size=integer("vocab_size"),
            dtype_bytes=_DTYPE_BYTES[dtype_name],
            gated_mlp=act in ("silu", "swiglu", "gelu_pytorch_tanh") or model_type in ("llama", "qwen2"),
            tie_word_embeddings=tie,
            qkv_bias=bias,
            max_context_tokens=integer("max_position_embeddings", 4096),
            source=str(config.get("_name_or_path", "")),
        )
    except ValueError as exc:
        raise ValueError(f"config: {exc}") from None


_CATALOG: tuple[ModelSpec, ...] = (
    # https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json
    ModelSpec(
        name="Llama-3-8B",
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
        dtype_bytes=2,
        max_context_tokens=8192,
        source="https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json",
    ),
    # https://huggingface.co/meta-llama/Meta-Llama-3-70B/blob/main/config.json
    ModelSpec(
        name="Llama-3-70B",
        hidden_size=8192,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=28672,
        vocab_size=128256,
        dtype_bytes=2,
        max_context_tokens=8192,
        source="https://huggingface.co/meta-llama/Meta-Llama-3-70B/blob/main/config.json",
    ),
    # https://huggingface.co/Qwen/Qwen2-72B/blob/main/config.json (Q/K/V carry a bias)
    ModelSpec(
        name="Qwen2-72B",
        hidden_size=8192,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=29568,
        vocab_size=152064,
        dtype_bytes=2,
        qkv_bias=True,
        max_context_tokens=131072,
        source="https://huggingface.co/Qwen/Qwen2-72B/blob/main/config.json",
    ),
    # https://huggingface.co/microsoft/Phi-3-mini-4k-instruct/blob/main/config.json
    ModelSpec(
        name="Phi-3-mini",
        hidden_size=3072,
        num_layers=32,
        num_heads=32,
        num_kv_heads=32,
        head_dim=96,
        intermediate_size=8192,
        vocab_size=32064,
        dtype_bytes=2,
        max_context_tokens=4096,
        source="https://huggingface.co/microsoft/Phi-3-mini-4k-instruct/blob/main/config.json",
    ),
    # https://huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json (float16)
    ModelSpec(
        name="Llama-2-7B",
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=32,
        head_dim=128,
        intermediate_size=11008,
        vocab_size=32000,
        dtype_bytes=2,
        max_context_tokens=4096,
        source="https://huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json",
    ),
    # The project's own test model, made by agents/engines/torch/weights.py (TinyLlamaShape):
    # head_dim 32 is wider than hidden/heads = 16 on purpose (vLLM's CPU attention needs >= 32).
    ModelSpec(
        name="tiny-llama",
        hidden_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=128,
        vocab_size=512,
        dtype_bytes=4,
        max_context_tokens=512,
        source="agents/engines/torch/weights.py",
    ),
)

CATALOG: Mapping[str, ModelSpec] = {m.name: m for m in _CATALOG}


def known_models() -> tuple[str, ...]:
    return tuple(CATALOG)


def model_spec(name: str) -> ModelSpec:
    """The catalog entry `name`; ValueError listing the known names otherwise."""
    if name in CATALOG:
        return CATALOG[name]
    for key, spec in CATALOG.items():
        if key.lower() == name.strip().lower():
            return spec
    raise ValueError(f"unknown model {name!r}; known: {', '.join(CATALOG)}")
