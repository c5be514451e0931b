"""Parsing OpenAI request bodies: every bad field raises BadRequest naming it (`param`) and why.

Nothing is sent anywhere before a body parsed, so bad input changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from scheduler.router.request import DEFAULT_PRIORITY, PRIORITY_MAX, PRIORITY_MIN

MAX_TOKENS_DEFAULT = 16  # OpenAI's default for /v1/completions
MAX_DEADLINE_MS = 86_400_000  # a day: a longer "deadline" is no deadline


class BadRequest(ValueError):
    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(f"{param}: {message}" if param else message)
        self.param = param
        self.message = message


@dataclass(frozen=True)
class GenerateRequest:
    """What both endpoints ask of the data plane, in text form (the view tokenizes)."""

    model: str
    stream: bool
    max_tokens: int | None  # None: up to the model's context
    temperature: float
    top_p: float
    seed: int
    stop: tuple[str, ...]
    prompt_text: str | None = None  # /v1/completions with a string prompt
    prompt_ids: tuple[int, ...] | None = None  # /v1/completions with a token-id prompt
    messages: tuple[dict[str, str], ...] = ()  # /v1/chat/completions
    include_usage: bool = False  # stream_options.include_usage
    return_token_ids: bool = False  # vLLM's extension: the generated ids on each choice
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens even past end-of-text
    priority: int = DEFAULT_PRIORITY  # extension (as vLLM's): lower is served first; > 0 low priority
    deadline_ms: float | None = None  # extension: the first token is wanted within this many ms
    extra: dict[str, Any] = field(default_factory=dict)


def _num(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise BadRequest(key, f"must be a number, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise BadRequest(key, f"must be between {lo:g} and {hi:g}, got {v}")
    return float(v)


def _common(body: Any, *, default_max_tokens: int | None) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest(None, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("model", "is required: the name of a deployment (GET /v1/models lists them)")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream", "must be true or false")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(key, default_max_tokens)
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise BadRequest(key, f"must be an integer >= 1, got {max_tokens!r}")
    n = body.get("n", 1)
    if n not in (1, None):
        raise BadRequest("n", "only n=1 is supported")
    seed = body.get("seed", 0)
    if seed is None:
        seed = 0
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise BadRequest("seed", f"must be an integer in [0, 2^63), got {seed!r}")
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,) if stop else ()
    elif isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) and s for s in stop):
        stops = tuple(stop)
    else:
        raise BadRequest("stop", "must be a non-empty string or a list of up to 4 of them")
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or not stream):
        raise BadRequest("stream_options", "is an object, allowed only with stream: true")
    return {
        "model": model,
        "stream": stream,
        "max_tokens": max_tokens,
        "temperature": _num(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": _num(body, "top_p", 1.0, 0.0, 1.0) or 1.0,
        "seed": seed,
        "stop": stops,
        "include_usage": bool((opts or {}).get("include_usage", False)),
        "return_token_ids": _flag(body, "return_token_ids"),
        "ignore_eos": _flag(body, "ignore_eos"),
        "priority": _priority(body),
        "deadline_ms": _deadline_ms(body),
    }


def _priority(body: dict[str, Any]) -> int:
    v = body.get("priority", DEFAULT_PRIORITY)
    if v is None:
        return DEFAULT_PRIORITY
    if isinstance(v, bool) or not isinstance(v, int) or not PRIORITY_MIN <= v <= PRIORITY_MAX:
        raise BadRequest("priority", f"must be an integer in [{PRIORITY_MIN}, {PRIORITY_MAX}] (lower is served "
                                     f"first, {DEFAULT_PRIORITY} the default), got {v!r}")
    return v


def _deadline_ms(body: dict[str, Any]) -> float | None:
    v = body.get("deadline_ms")
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v <= MAX_DEADLINE_MS:
        raise BadRequest("deadline_ms", f"must be a number of milliseconds in (0, {MAX_DEADLINE_MS}], got {v!r}")
    return float(v)


def _flag(body: dict[str, Any], key: str) -> bool:
    v = body.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise BadRequest(key, "must be true or false")
    return v


def parse_completion(body: Any) -> GenerateRequest:
    common = _common(body, default_max_tokens=MAX_TOKENS_DEFAULT)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt", "must not be empty")
        return GenerateRequest(prompt_text=prompt, **common)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in prompt):
        return GenerateRequest(prompt_ids=tuple(prompt), **common)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise BadRequest("prompt", "batches of several prompts are not supported: send one per request")
    raise BadRequest("prompt", "is required: a string or a list of token ids")


def parse_chat(body: Any) -> GenerateRequest:
    common = _common(body, default_max_tokens=None)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages", "is required: a non-empty list of {role, content}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRequest(f"messages[{i}]", "must be an object with role and content")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise BadRequest(f"messages[{i}].role", f"must be system, user, assistant or tool, got {role!r}")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text ones
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise BadRequest(f"messages[{i}].content[{j}]", "only text parts are supported")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content", "must be a string or a list of text parts")
        out.append({"role": str(role), "content": content})
    return GenerateRequest(messages=tuple(out), **common)
