"""KVState: one sequence, layout-independent - what another engine needs to continue it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agents.engines.torch.batching import check_priority
from agents.engines.torch.model import ModelConfig
from agents.engines.torch.sampling import SamplingParams, draws_after

__all__ = ["KVState"]


@dataclass(frozen=True)
class KVState:
    """One sequence, layout-independent: everything another engine needs to continue it.

    keys/values hold the unsharded K/V of every layer for token_ids[:num_cached_tokens]
    ([num_layers, num_cached_tokens, num_kv_heads, head_dim], float32, CPU). At a safe boundary
    the last token is sampled but not yet fed, so num_cached_tokens == len(token_ids) - 1 for a
    decoding sequence; fewer for one still in prefill, 0 for a replay-only export.
    """

    seq_id: str
    model_sha256: str  # the weights the KV was computed with; import refuses any other
    token_ids: tuple[int, ...]  # prompt + generated so far
    num_prompt_tokens: int
    max_new_tokens: int  # the cap on generated tokens, counted from the original prompt
    sampling: SamplingParams
    sampler_draws: int  # random draws made so far (the whole sampler state besides the seed)
    num_cached_tokens: int
    keys: torch.Tensor
    values: torch.Tensor
    priority: int = 0  # the request's class, lower is more urgent (0: the default class)

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def generated_ids(self) -> tuple[int, ...]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def kv_bytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def check(self, cfg: ModelConfig, model_sha256: str) -> None:
        """Refuse a state that an engine of `cfg` and these weights cannot continue (ValueError
        naming the field)."""
        if self.model_sha256 != model_sha256:
            raise ValueError(
                f"state.model_sha256: KV computed with weights {self.model_sha256[:12]}..., "
                f"this engine runs {model_sha256[:12]}..."
            )
        n_tokens = len(self.token_ids)
        if not 1 <= self.num_prompt_tokens <= n_tokens:
            raise ValueError(f"state.num_prompt_tokens: {self.num_prompt_tokens} not in [1, {n_tokens}]")
        if not 0 <= self.num_cached_tokens < n_tokens:
            raise ValueError(
                f"state.num_cached_tokens: {self.num_cached_tokens} not in [0, {n_tokens}) "
                "(the last token is never cached at a safe boundary)"
            )
        expected = (cfg.num_layers, self.num_cached_tokens, cfg.num_kv_heads, cfg.head_dim)
        for name in ("keys", "values"):
            t = getattr(self, name)
            if tuple(t.shape) != expected or t.dtype != torch.float32:
                raise ValueError(
                    f"state.{name}: expected float32 {list(expected)}, got {t.dtype} {list(t.shape)}"
                )
        check_priority(self.priority, "state.priority")
        generated = n_tokens - self.num_prompt_tokens
        if generated >= self.max_new_tokens:
            raise ValueError(
                f"state.max_new_tokens: the sequence already generated {generated}: it is finished"
            )
        if self.sampler_draws != draws_after(self.sampling, generated):
            raise ValueError(
                f"state.sampler_draws: {self.sampler_draws} draws do not match {generated} generated tokens "
                f"with {'greedy' if self.sampling.greedy else 'seeded'} sampling"
            )
