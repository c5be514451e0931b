"""What `architecture` may be: a name of the scheduler's model catalog, or a Hugging Face config.

Kept in this one function so the registry follows scheduler/modelspec.py: when that module is
present its catalog (`known_models()`) and parser (`from_hf_config()`) decide; until then a
non-empty name, or a config with the five keys the cost model needs, is accepted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

HF_REQUIRED_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
MAX_NAME_LEN = 128
MAX_CONFIG_BYTES = 64 * 1024


@dataclass(frozen=True)
class Architecture:
    value: str | dict[str, Any]  # what is stored: the catalog name or the config object
    max_context_tokens: int | None  # the longest context the architecture allows, when known


def _modelspec() -> Any | None:
    try:
        from scheduler import modelspec
    except ImportError:
        return None
    return modelspec


def _has_nul(value: Any) -> bool:
    # PostgreSQL's jsonb refuses \u0000: refuse it here with a 400 instead of failing with a 500.
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_nul(v) for v in value)
    return False


def _positive_int(config: dict[str, Any], key: str) -> int:
    value = config.get(key)
    if value is None:
        raise ValueError(f"the config lacks {key!r} (needed: {', '.join(HF_REQUIRED_KEYS)})")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"config.{key} must be a positive integer; got {value!r}")
    return value


def validate_architecture(value: Any) -> Architecture:
    """Check an architecture; ValueError with the reason when it is not usable."""
    spec_module = _modelspec()
    if isinstance(value, str):
        name = value.strip()
        if not name:
            raise ValueError("must be a model catalog name or a Hugging Face config object; got an empty name")
        if len(name) > MAX_NAME_LEN or "\x00" in name:
            raise ValueError(f"a catalog name is at most {MAX_NAME_LEN} printable characters")
        if spec_module is None:
            return Architecture(name, None)
        try:
            spec = spec_module.model_spec(name)
        except ValueError:
            raise ValueError(f"unknown catalog name {name!r}; known: {', '.join(spec_module.known_models())}, "
                             "or give the model's config.json as an object") from None
        return Architecture(spec.name, spec.max_context_tokens)
    if isinstance(value, dict):
        if _has_nul(value):
            raise ValueError("the config must not contain NUL characters")
        if len(json.dumps(value, default=str)) > MAX_CONFIG_BYTES:
            raise ValueError(f"the config is larger than {MAX_CONFIG_BYTES // 1024} KiB")
        if spec_module is not None:
            try:
                spec = spec_module.from_hf_config(value)
            except ValueError as exc:
                raise ValueError(str(exc)) from None
            # modelspec assumes 4096 when the key is absent; only a stated limit binds max_context.
            stated = "max_position_embeddings" in value
            return Architecture(value, spec.max_context_tokens if stated else None)
        for key in HF_REQUIRED_KEYS:
            _positive_int(value, key)
        limit = value.get("max_position_embeddings")
        ok_limit = isinstance(limit, int) and not isinstance(limit, bool) and limit > 0
        return Architecture(value, limit if ok_limit else None)
    raise ValueError(f"must be a catalog name (string) or a Hugging Face config (object); got {type(value).__name__}")
