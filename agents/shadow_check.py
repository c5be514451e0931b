"""The checks a shadow plan passes before it is ready: the version it loads can be tokenized and warms up.

prepare_plan may name the registry version a plan loads (`model_version`: id, version, tokenizer,
warmup_tokens; agents/protocol/). Before an agent acks the prepare ok it loads that tokenizer -
the one the gateway tokenizes this version's requests with - encodes a warm-up prompt, and checks
that every id lies inside the model's vocabulary (an id past the embedding table is what crashes an
engine at its first forward pass: a tokenizer of another model). Then it generates `warmup_tokens`.
A problem fails the prepare (reason "tokenizer"), so the transition rolls back and the plans that
served keep serving. Both simulated agents (agents/sim: the live fleet's and the in-memory one) run
it; the node daemon (agents/node) does not yet - the tokenizer path the registry holds is the
console's, which a GPU node need not have.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

WARMUP_PROMPT = "FlexPipe warm-up: the quick brown fox jumps over the lazy dog. 0123456789"


def tokenizer_problem(model_version: object, vocab_size: int | None) -> str | None:
    """Why the shadow plan of this version cannot serve, or None (module docstring)."""
    if not isinstance(model_version, Mapping):
        return None
    label = f"{model_version.get('version', '?')}"
    where = str(model_version.get("tokenizer") or "")
    path = Path(where)
    file = path / "tokenizer.json" if path.is_dir() else path
    try:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(file))
        ids = tok.encode(WARMUP_PROMPT, add_special_tokens=False).ids
    except Exception as exc:  # noqa: BLE001 - the tokenizers library raises plain Exception for bad files
        return f"tokenizer: version {label}'s tokenizer at {where} does not load ({exc.__class__.__name__}: {exc})"[:500]
    if not ids:
        return f"tokenizer: version {label}'s tokenizer encodes the warm-up prompt to no tokens"
    if vocab_size is not None and max(ids) >= vocab_size:
        return (f"tokenizer: version {label}'s tokenizer gives id {max(ids)}, outside the model's vocabulary of "
                f"{vocab_size}: the warm-up would fail (a tokenizer of another model?)")
    return None


__all__ = ["WARMUP_PROMPT", "tokenizer_problem"]
