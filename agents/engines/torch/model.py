"""Llama math for the torch reference engine: the config, the TP shard plan, per-stage weights and
the forward pass of one pipeline stage over a paged KV cache.

Exactly HF-transformers' LlamaForCausalLM semantics, because the same model folder is served by
vLLM elsewhere in the project and must give identical greedy tokens:

- RMSNorm in float32: x * rsqrt(mean(x^2) + eps), then times the weight;
- RoPE with the rotate_half convention (the first half of head_dim pairs with the second half),
  inv_freq = 1 / theta^(2i/d), cos/sin of cat(freqs, freqs);
- GQA: query head h reads KV head h // (num_heads / num_kv_heads);
- attention scaled by head_dim^-0.5, softmax in float32;
- MLP down(silu(gate(x)) * up(x)); residual around both blocks; final norm; untied lm_head
  (tied when config.json says so).

Tensor parallelism (Megatron style): q/k/v and gate/up are split by output rows (heads,
intermediate columns), o_proj and down_proj by input columns; each rank's o_proj/down_proj
output is a partial sum and the stage all-reduces it. When tp exceeds num_kv_heads, each rank
holds one KV head, replicated on tp / num_kv_heads ranks (vLLM does the same).

`reference_logits` is a deliberately separate, textbook forward pass (whole sequence, no cache,
no sharding) that the tests hold the engine against.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F

from agents.engines.torch.sampling import SamplingParams, make_generator, sample
from agents.engines.torch.weights import WEIGHTS_FILE


class ModelConfigError(ValueError):
    """config.json describes a model the reference engine does not implement."""


@dataclass(frozen=True)
class ModelConfig:
    hidden_size: int
    num_layers: int  # config.json: num_hidden_layers
    num_heads: int  # num_attention_heads (query heads)
    num_kv_heads: int  # num_key_value_heads (GQA groups)
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_positions: int  # max_position_embeddings: longest sequence (prompt + generated)
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]  # generation stops at any of these unless ignore_eos

    @property
    def kv_bytes_per_token(self) -> int:
        """float32 K and V for every layer: what one cached token costs, unsharded."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4

    @classmethod
    def from_dict(cls, cfg: dict[str, object]) -> ModelConfig:
        def need(key: str, default: object = None) -> object:
            if key not in cfg:
                if default is None:
                    raise ModelConfigError(f"config.json: {key}: missing")
                return default
            return cfg[key]

        def pos_int(key: str, default: object = None) -> int:
            value = need(key, default)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelConfigError(f"config.json: {key}: must be a positive integer, got {value!r}")
            return value

        archs = need("architectures", ["LlamaForCausalLM"])
        if not isinstance(archs, list) or "LlamaForCausalLM" not in archs:
            raise ModelConfigError(
                f"config.json: architectures: only LlamaForCausalLM is implemented, got {archs!r}"
            )
        if need("hidden_act", "silu") != "silu":
            raise ModelConfigError(
                f"config.json: hidden_act: only silu is implemented, got {cfg['hidden_act']!r}"
            )
        for key in ("attention_bias", "mlp_bias"):
            if cfg.get(key, False):
                raise ModelConfigError(f"config.json: {key}: biases are not implemented")
        if cfg.get("rope_scaling") is not None:
            raise ModelConfigError("config.json: rope_scaling: not implemented (plain RoPE only)")
        hidden = pos_int("hidden_size")
        heads = pos_int("num_attention_heads")
        kv_heads = pos_int("num_key_value_heads", heads)
        head_dim = pos_int("head_dim", hidden // heads if hidden % heads == 0 else 0)
        if heads % kv_heads:
            raise ModelConfigError(
                f"config.json: num_key_value_heads: {kv_heads} does not divide num_attention_heads {heads}"
            )
        if head_dim % 2:
            raise ModelConfigError(f"config.json: head_dim: RoPE needs an even head_dim, got {head_dim}")
        eos = cfg.get("eos_token_id", ())
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        return cls(
            hidden_size=hidden,
            num_layers=pos_int("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=pos_int("intermediate_size"),
            vocab_size=pos_int("vocab_size"),
            max_positions=pos_int("max_position_embeddings", 2048),
            rms_norm_eps=float(need("rms_norm_eps", 1e-6)),  # type: ignore[arg-type]
            rope_theta=float(need("rope_theta", 10000.0)),  # type: ignore[arg-type]
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelConfigError(f"model_dir: {model_dir} has no config.json")
        return cls.from_dict(json.loads(path.read_text()))


# --- tensor-parallel shard plan ---------------------------------------------------------------


@dataclass(frozen=True)
class TPShard:
    """Which heads and MLP columns one TP rank of a stage holds."""

    tp: int
    rank: int
    q_head_start: int  # global query heads [q_head_start, q_head_end)
    q_head_end: int
    kv_head_start: int  # global KV heads [kv_head_start, kv_head_end); one head when replicated
    kv_head_end: int
    inter_start: int  # MLP intermediate columns [inter_start, inter_end)
    inter_end: int

    @property
    def num_q_heads(self) -> int:
        return self.q_head_end - self.q_head_start

    @property
    def num_kv_heads(self) -> int:
        return self.kv_head_end - self.kv_head_start


def tp_problems(cfg: ModelConfig, tp: int) -> list[str]:
    """Why `tp` cannot shard this model (empty when it can)."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        return [f"tp must be a positive integer, got {tp!r}"]
    reasons = []
    if cfg.num_heads % tp:
        reasons.append(f"tp {tp} does not divide num_attention_heads {cfg.num_heads}")
    # Fewer KV heads than ranks is fine when each KV head can be replicated on a whole number of
    # ranks; otherwise one rank would need a fraction of a head.
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        reasons.append(
            f"tp {tp} neither divides num_key_value_heads {cfg.num_kv_heads} nor is a multiple of it "
            "(KV heads can only be split whole or replicated evenly)"
        )
    if cfg.intermediate_size % tp:
        reasons.append(f"tp {tp} does not divide intermediate_size {cfg.intermediate_size}")
    return reasons


def tp_shard(cfg: ModelConfig, tp: int, rank: int) -> TPShard:
    reasons = tp_problems(cfg, tp)
    if reasons:
        raise ValueError("tp: " + "; ".join(reasons))
    if not 0 <= rank < tp:
        raise ValueError(f"rank: must be in [0, {tp}), got {rank}")
    q_per = cfg.num_heads // tp
    if tp <= cfg.num_kv_heads:
        kv_per = cfg.num_kv_heads // tp
        kv_start = rank * kv_per
    else:
        # Replicated: rank r's query heads all belong to KV head r * kv_heads // tp.
        kv_per = 1
        kv_start = rank * cfg.num_kv_heads // tp
    inter_per = cfg.intermediate_size // tp
    shard = TPShard(
        tp=tp,
        rank=rank,
        q_head_start=rank * q_per,
        q_head_end=(rank + 1) * q_per,
        kv_head_start=kv_start,
        kv_head_end=kv_start + kv_per,
        inter_start=rank * inter_per,
        inter_end=(rank + 1) * inter_per,
    )
    group = cfg.num_heads // cfg.num_kv_heads
    assert shard.q_head_start // group >= shard.kv_head_start
    assert (shard.q_head_end - 1) // group < shard.kv_head_end
    return shard


# --- weights ------------------------------------------------------------------------------------


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    post_norm: torch.Tensor  # [hidden]
    wq: torch.Tensor  # [q_heads_local * head_dim, hidden]
    wk: torch.Tensor  # [kv_heads_local * head_dim, hidden]
    wv: torch.Tensor  # [kv_heads_local * head_dim, hidden]
    wo: torch.Tensor  # [hidden, q_heads_local * head_dim]: row-parallel, output is a partial sum
    w_gate: torch.Tensor  # [inter_local, hidden]
    w_up: torch.Tensor  # [inter_local, hidden]
    w_down: torch.Tensor  # [hidden, inter_local]: row-parallel, output is a partial sum


@dataclass
class StageWeights:
    layer_start: int
    layer_end: int
    shard: TPShard
    layers: list[LayerWeights]
    embed: torch.Tensor | None  # [vocab, hidden] on the first stage only
    final_norm: torch.Tensor | None  # [hidden] on the last stage only
    lm_head: torch.Tensor | None  # [vocab, hidden] on the last stage, TP rank 0 only


def load_stage_weights(
    model_dir: str | Path,
    cfg: ModelConfig,
    layer_start: int,
    layer_end: int,
    shard: TPShard,
    *,
    with_embed: bool,
    with_head: bool,
    device: torch.device,
) -> StageWeights:
    """Read only this rank's slices from model.safetensors (a rank never holds the whole model)."""
    from safetensors import safe_open

    hd = cfg.head_dim
    with safe_open(str(Path(model_dir) / WEIGHTS_FILE), framework="pt", device="cpu") as fh:

        def rows(name: str, start: int, end: int) -> torch.Tensor:
            t: torch.Tensor = fh.get_slice(name)[start:end]
            return t.to(device).contiguous()

        def cols(name: str, start: int, end: int) -> torch.Tensor:
            t: torch.Tensor = fh.get_slice(name)[:, start:end]
            return t.to(device).contiguous()

        def whole(name: str) -> torch.Tensor:
            t: torch.Tensor = fh.get_tensor(name)
            return t.to(device).contiguous()

        layers = []
        for i in range(layer_start, layer_end):
            p = f"model.layers.{i}."
            layers.append(
                LayerWeights(
                    input_norm=whole(p + "input_layernorm.weight"),
                    post_norm=whole(p + "post_attention_layernorm.weight"),
                    wq=rows(p + "self_attn.q_proj.weight", shard.q_head_start * hd, shard.q_head_end * hd),
                    wk=rows(p + "self_attn.k_proj.weight", shard.kv_head_start * hd, shard.kv_head_end * hd),
                    wv=rows(p + "self_attn.v_proj.weight", shard.kv_head_start * hd, shard.kv_head_end * hd),
                    wo=cols(p + "self_attn.o_proj.weight", shard.q_head_start * hd, shard.q_head_end * hd),
                    w_gate=rows(p + "mlp.gate_proj.weight", shard.inter_start, shard.inter_end),
                    w_up=rows(p + "mlp.up_proj.weight", shard.inter_start, shard.inter_end),
                    w_down=cols(p + "mlp.down_proj.weight", shard.inter_start, shard.inter_end),
                )
            )
        embed = whole("model.embed_tokens.weight") if with_embed else None
        final_norm = whole("model.norm.weight") if with_head else None
        lm_head = None
        if with_head and shard.rank == 0:
            lm_head = whole("model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight")
    return StageWeights(layer_start, layer_end, shard, layers, embed, final_norm, lm_head)


def load_full_weights(model_dir: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(model_dir) / WEIGHTS_FILE))


# --- primitives ---------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # HF LlamaRMSNorm: the statistics in float32 whatever the activation dtype.
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, head_dim] for integer positions [T], computed as HF's LlamaRotaryEmbedding does."""
    device = positions.device
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim)
    )
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos/sin [T, head_dim] broadcast over heads."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


def gated_mlp(x: torch.Tensor, lw: LayerWeights) -> torch.Tensor:
    """This rank's partial sum of the MLP output (complete when tp == 1)."""
    return (F.silu(x @ lw.w_gate.T) * (x @ lw.w_up.T)) @ lw.w_down.T


# --- the stage forward pass over a paged KV cache ------------------------------------------------


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's share of a batch: `num_tokens` new tokens starting at position `start`."""

    seq_id: str
    start: int  # position of the first new token == tokens already cached
    num_tokens: int
    block_table: tuple[int, ...]  # physical KV blocks holding positions [0, start + num_tokens)
    sample: bool  # the chunk ends at the last known token: produce the next one


class PagedKV(Protocol):
    """What the stage forward needs from a paged KV cache (see kvcache.PagedKVCache)."""

    block_size: int

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def gather_slots(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def gather(
        self, layer: int, block_table: torch.Tensor, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


AllReduce = Callable[[torch.Tensor], torch.Tensor]


def _no_reduce(t: torch.Tensor) -> torch.Tensor:
    return t


class StageModel:
    """One TP rank of one pipeline stage: its layers' shards, and the embedding / head when at an end.

    Invariants kept by `forward`:
    - the KV of position p of a sequence lives at slot block_table[p // B] * B + p % B of every
      layer of this stage (B = block size), for exactly this rank's KV heads;
    - a chunk's new tokens are written before attention reads the context, so a query at
      position p sees keys 0..p (causal), whether they came from this chunk or earlier ones;
    - the hidden state leaving a stage is complete (all-reduced), so any rank of the next stage
      can take it from any rank of this one.
    """

    def __init__(self, cfg: ModelConfig, weights: StageWeights, all_reduce: AllReduce | None = None) -> None:
        self.cfg = cfg
        self.w = weights
        self.all_reduce = all_reduce or _no_reduce
        shard = weights.shard
        group = cfg.num_heads // cfg.num_kv_heads
        # local query head j reads local KV head kv_of_q[j]
        q_heads = torch.arange(shard.q_head_start, shard.q_head_end)
        device = weights.layers[0].wq.device if weights.layers else torch.device("cpu")
        self.kv_of_q = (q_heads // group - shard.kv_head_start).to(device)
        # _attend_decodes relies on it: local query head j belongs to local KV head j // per_kv
        per_kv = shard.num_q_heads // shard.num_kv_heads
        assert torch.equal(self.kv_of_q.cpu(), torch.arange(shard.num_q_heads) // per_kv)
        self.device = device

    @property
    def is_first(self) -> bool:
        return self.w.embed is not None

    @property
    def is_last(self) -> bool:
        return self.w.final_norm is not None

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        assert self.w.embed is not None
        return self.w.embed[token_ids]

    def forward(self, hidden: torch.Tensor, chunks: Sequence[SeqChunk], cache: PagedKV) -> torch.Tensor:
        """Run this stage's layers over hidden [T, hidden] (chunks concatenated in order)."""
        cfg, dev = self.cfg, hidden.device
        positions = torch.cat([torch.arange(c.start, c.start + c.num_tokens, device=dev) for c in chunks])
        tables = [torch.tensor(c.block_table, dtype=torch.long, device=dev) for c in chunks]
        bs = cache.block_size
        per_seq = torch.split(positions, [c.num_tokens for c in chunks])
        slots = torch.cat(
            [table[pos // bs] * bs + pos % bs for table, pos in zip(tables, per_seq, strict=True)]
        )
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
        n_tok = hidden.shape[0]
        hd = cfg.head_dim
        offsets = [0]
        for c in chunks:
            offsets.append(offsets[-1] + c.num_tokens)
        # Single-token chunks (decodes) attend in one padded batch; longer chunks one by one.
        decodes = [i for i, c in enumerate(chunks) if c.num_tokens == 1]
        batched = len(decodes) > 1
        others = [i for i, c in enumerate(chunks) if c.num_tokens > 1 or not batched]
        batch = self._decode_batch([chunks[i] for i in decodes], bs, dev) if batched else None
        rows = torch.tensor([offsets[i] for i in decodes], dtype=torch.long, device=dev)
        for local, lw in enumerate(self.w.layers):
            h = rms_norm(hidden, lw.input_norm, cfg.rms_norm_eps)
            q = apply_rope((h @ lw.wq.T).view(n_tok, -1, hd), cos, sin)
            k = apply_rope((h @ lw.wk.T).view(n_tok, -1, hd), cos, sin)
            v = (h @ lw.wv.T).view(n_tok, -1, hd)
            cache.write(local, slots, k, v)
            attn = torch.empty_like(q)
            for i in others:
                c = chunks[i]
                k_ctx, v_ctx = cache.gather(local, tables[i], c.start + c.num_tokens)
                attn[offsets[i] : offsets[i + 1]] = self._attend(
                    q[offsets[i] : offsets[i + 1]], k_ctx, v_ctx, c.start
                )
            if batch is not None:
                attn[rows] = self._attend_decodes(q[rows], cache, local, *batch)
            hidden = hidden + self.all_reduce(attn.reshape(n_tok, -1) @ lw.wo.T)
            h = rms_norm(hidden, lw.post_norm, cfg.rms_norm_eps)
            hidden = hidden + self.all_reduce(gated_mlp(h, lw))
        return hidden

    def _decode_batch(
        self, chunks: Sequence[SeqChunk], block_size: int, dev: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots [B, max_ctx] of every decode's context (padded with slot 0) and a validity mask."""
        ctx = torch.tensor([c.start + 1 for c in chunks], device=dev)
        width = max(len(c.block_table) for c in chunks)
        tables = torch.tensor(
            [list(c.block_table) + [0] * (width - len(c.block_table)) for c in chunks], device=dev
        )
        pos = torch.arange(int(ctx.max()), device=dev)
        slots = tables[:, pos // block_size] * block_size + pos % block_size
        return slots, pos[None, :] < ctx[:, None]

    def _attend_decodes(
        self, q: torch.Tensor, cache: PagedKV, layer: int, slots: torch.Tensor, valid: torch.Tensor
    ) -> torch.Tensor:
        """q [B, Hq, D], one query per sequence at its last position -> [B, Hq, D].

        GQA without copying KV: the local query heads of one KV head are neighbours, so q is
        viewed as [B, Hkv, heads per KV head, D] and each KV head serves its group as a short
        query sequence (one query per head, all at the same position: no causal mask needed).
        """
        b, hq, d = q.shape
        k, v = cache.gather_slots(layer, slots)  # [B, max_ctx, Hkv, D]; padding masked below
        hkv = k.shape[2]
        out = F.scaled_dot_product_attention(
            q.view(b, hkv, hq // hkv, d),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=valid[:, None, None, :],
            scale=self.cfg.head_dim**-0.5,
        )
        return out.reshape(b, hq, d)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
        """q [t, Hq, D] at positions start..start+t-1 against k/v [ctx, Hkv, D] -> [t, Hq, D]."""
        k = k[:, self.kv_of_q].transpose(0, 1)  # GQA: expand KV heads to the query heads
        v = v[:, self.kv_of_q].transpose(0, 1)
        qh = q.transpose(0, 1)
        t, ctx = q.shape[0], k.shape[1]
        mask = None
        if t > 1:
            q_pos = torch.arange(start, start + t, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=self.cfg.head_dim**-0.5)
        return out.transpose(0, 1)

    def logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """Final norm and lm_head over the rows to sample from (last stage, TP rank 0)."""
        assert self.w.final_norm is not None and self.w.lm_head is not None
        return rms_norm(hidden_rows, self.w.final_norm, self.cfg.rms_norm_eps) @ self.w.lm_head.T


# --- the reference: one process, no shards, no cache -------------------------------------------


def reference_logits(
    weights: dict[str, torch.Tensor], cfg: ModelConfig, token_ids: Sequence[int]
) -> torch.Tensor:
    """Logits [T, vocab] of a whole sequence, recomputed from scratch: the yardstick for the engine."""
    x = weights["model.embed_tokens.weight"][torch.tensor(list(token_ids), dtype=torch.long)]
    n = x.shape[0]
    hd, heads, kv_heads = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    cos, sin = rope_cos_sin(torch.arange(n), hd, cfg.rope_theta)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        h = rms_norm(x, weights[p + "input_layernorm.weight"], cfg.rms_norm_eps)
        q = apply_rope((h @ weights[p + "self_attn.q_proj.weight"].T).view(n, heads, hd), cos, sin)
        k = apply_rope((h @ weights[p + "self_attn.k_proj.weight"].T).view(n, kv_heads, hd), cos, sin)
        v = (h @ weights[p + "self_attn.v_proj.weight"].T).view(n, kv_heads, hd)
        k = k.repeat_interleave(heads // kv_heads, dim=1)  # HF repeat_kv
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * hd**-0.5
        scores = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1, dtype=torch.float32)
        attn = torch.einsum("hqk,khd->qhd", scores, v).reshape(n, heads * hd)
        x = x + attn @ weights[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, weights[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        gate = F.silu(h @ weights[p + "mlp.gate_proj.weight"].T)
        x = x + (gate * (h @ weights[p + "mlp.up_proj.weight"].T)) @ weights[p + "mlp.down_proj.weight"].T
    head = weights["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
    return rms_norm(x, weights["model.norm.weight"], cfg.rms_norm_eps) @ head.T


def reference_generate(
    weights: dict[str, torch.Tensor],
    cfg: ModelConfig,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    sampling: SamplingParams | None = None,
) -> list[int]:
    """Generate with `reference_logits` (full recompute per token) and the engine's sampler."""
    params = sampling or SamplingParams()
    gen = None if params.greedy else make_generator(params, 0)
    ids = list(prompt_ids)
    out: list[int] = []
    for _ in range(max_new_tokens):
        token = sample(reference_logits(weights, cfg, ids)[-1], params, gen)
        out.append(token)
        ids.append(token)
        if token in cfg.eos_token_ids and not params.ignore_eos:
            break
    return out
