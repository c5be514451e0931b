"""Tokenizing prompts and detokenizing streams, per model (each model has its own tokenizer).

The tokenizer comes from the model folder (`tokenizer.json`, and `tokenizer_config.json` for the
chat template and the end-of-text token). Where the folder is: the registry's newest version of
the deployment's model (`ModelVersion.tokenizer`: a folder or a tokenizer.json path), or
settings.FLEXPIPE_GATEWAY_TOKENIZERS {model name: path} which wins.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

_FALLBACK_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
DEFAULT_MAX_CONTEXT = 2048  # when the tokenizer does not say
_jinja = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)


@dataclass(frozen=True)
class ModelTokenizer:
    tokenizer: Tokenizer
    chat_template: str
    special: dict[str, str]  # bos_token, eos_token as the template sees them
    max_context: int  # tokens: prompt + output (tokenizer_config's model_max_length)
    longest_token_chars: int = 1  # the longest entry of the vocabulary (added tokens included)

    def encode(self, text: str) -> list[int]:
        # encode_batch lets go of the GIL while the Rust tokenizer works (encode() holds it: measured,
        # a thread spinning beside a 2.4 MB encode got 2 turns in 1.5 s); run it off the event loop
        # (console.gateway.cpu) and the loop keeps serving meanwhile.
        ids: list[int] = self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
        return ids

    def max_prompt_chars(self) -> int:
        """A text longer than this cannot fit the context, so it is refused before tokenizing.

        Each token covers at most `longest_token_chars` characters of the text (a byte-level BPE token
        is at most that many bytes, and a character is at least one byte), so more than
        max_context x longest_token_chars characters need more than max_context tokens. Doubled, for
        normalizers that fold a few characters into one.
        """
        return 2 * self.max_context * max(1, self.longest_token_chars)

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        template = _jinja.from_string(self.chat_template)
        return template.render(messages=messages, add_generation_prompt=True, **self.special)


_cache: dict[str, ModelTokenizer] = {}
_lock = threading.Lock()


def load(path: str) -> ModelTokenizer:
    """The tokenizer at `path` (a model folder or a tokenizer.json), cached per process."""
    with _lock:
        cached = _cache.get(path)
    if cached is not None:
        return cached
    p = Path(path)
    folder = p if p.is_dir() else p.parent
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file():
        raise FileNotFoundError(f"tokenizer: no tokenizer.json at {path}")
    tok = Tokenizer.from_file(str(file))
    config: dict[str, Any] = {}
    cfg_file = folder / "tokenizer_config.json"
    if cfg_file.is_file():
        config = json.loads(cfg_file.read_text())
    special = {k: v for k in ("bos_token", "eos_token") if isinstance(v := config.get(k), str)}
    template = config.get("chat_template")
    limit = config.get("model_max_length")
    max_context = limit if isinstance(limit, int) and 0 < limit < 10**8 else DEFAULT_MAX_CONTEXT
    longest = max((len(t) for t in tok.get_vocab(with_added_tokens=True)), default=1)
    out = ModelTokenizer(tok, template if isinstance(template, str) and template else _FALLBACK_TEMPLATE, special,
                         max_context, longest)
    with _lock:
        _cache[path] = out
    return out


class Detokenizer:
    """Turns a stream of token ids into text pieces, holding back incomplete UTF-8.

    Byte-level BPE splits multi-byte characters over tokens; decoding a token alone gives U+FFFD
    for the part it holds. Invariant: the concatenation of every piece returned equals the decoding
    of all ids so far, minus a held-back tail that ends in an incomplete character. Decodes only a
    short window (from `prefix`), not the whole output, per token.
    """

    def __init__(self, tok: ModelTokenizer) -> None:
        self.tok = tok
        self.ids: list[int] = []
        self.prefix = 0  # window start: ids before it are final text
        self.read = 0  # ids up to here have been emitted as text

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self.tok.decode(self.ids[self.prefix:self.read])
        after = self.tok.decode(self.ids[self.prefix:])
        if after.endswith("\ufffd"):
            return ""  # an incomplete character: wait for the next token
        piece = after[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        return piece

    def flush(self) -> str:
        """Whatever is still held back (the stream ended inside a character)."""
        before = self.tok.decode(self.ids[self.prefix:self.read])
        after = self.tok.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return after[len(before):]


class StopMatcher:
    """Cuts the text at the first stop string; holds back a tail that could start one."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.pending = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        if not self.stops:
            return piece
        text = self.pending + piece
        hits = [i for s in self.stops if (i := text.find(s)) >= 0]
        if hits:
            self.stopped = True
            self.pending = ""
            return text[:min(hits)]
        keep = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        self.pending = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep] if keep else text

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
