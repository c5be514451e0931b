"""Greedy and seeded sampling that a replay or a migration reproduces token for token.

The sampler state of a sequence is two numbers: its seed and how many random draws it has made.
Every sampled token with temperature > 0 makes exactly one draw from the sequence's own CPU
torch.Generator (greedy makes none), so the state after n generated tokens is "seeded, then n
draws" — it needs no bytes of generator state to move, and a replay that only knows the tokens
so far rebuilds it. Sampling always runs on the CPU, in float64, so a CUDA engine and a CPU
engine draw the same stream.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax, lowest id on ties)
    top_p: float = 1.0  # nucleus: keep the smallest set of most likely tokens with mass >= top_p
    top_k: int = 0  # keep the k most likely tokens; 0 = all
    seed: int = 0  # seeds the sequence's own generator (ignored when greedy)
    ignore_eos: bool = False  # keep generating past an end-of-sequence token

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, int | float) or not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"sampling.temperature: must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_p, int | float) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling.top_p: must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"sampling.top_k: must be an integer >= 0, got {self.top_k!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**63:
            raise ValueError(f"sampling.seed: must be an integer in [0, 2^63), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> SamplingParams:
        unknown = set(data) - {"temperature", "top_p", "top_k", "seed", "ignore_eos"}
        if unknown:
            raise ValueError(f"sampling: unknown key(s) {sorted(unknown)}")
        return cls(**data)  # type: ignore[arg-type]


def draws_after(params: SamplingParams, num_generated: int) -> int:
    """Random draws a sequence has made after generating `num_generated` tokens."""
    return 0 if params.greedy else num_generated


def make_generator(params: SamplingParams, draws: int) -> torch.Generator:
    """The sequence's generator, seeded and advanced past `draws` draws."""
    gen = torch.Generator(device="cpu").manual_seed(params.seed)
    for _ in range(draws):
        # One scalar draw at a time: exactly what `sample` consumes per token.
        torch.rand((), generator=gen, dtype=torch.float64)
    return gen


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """Pick one token id from logits [vocab].

    Invariant: with temperature > 0 this draws exactly one uniform from `gen`, whatever top_p and
    top_k cut (even to a single token), so the draw count equals the number of sampled tokens.
    """
    logits = logits.detach().to("cpu", torch.float64)
    if params.greedy:
        return int(torch.argmax(logits).item())
    if gen is None:
        raise ValueError("gen: a seeded generator is needed when temperature > 0")
    u = float(torch.rand((), generator=gen, dtype=torch.float64).item())
    probs = torch.softmax(logits / params.temperature, dim=-1)
    # Stable sort: equal probabilities keep id order, so the pick is a pure function of the logits.
    sorted_probs, order = torch.sort(probs, descending=True, stable=True)
    keep = sorted_probs.numel()
    if params.top_k:
        keep = min(keep, params.top_k)
    if params.top_p < 1.0:
        # The smallest prefix whose mass reaches top_p (at least one token).
        mass_before = torch.cumsum(sorted_probs, 0) - sorted_probs
        keep = min(keep, max(1, int((mass_before < params.top_p).sum().item())))
    kept = sorted_probs[:keep]
    cdf = torch.cumsum(kept, 0)
    idx = int(torch.searchsorted(cdf, u * float(cdf[-1].item()), right=True).item())
    return int(order[min(idx, keep - 1)].item())
