"""The Llama math, the TP shard plan and the sampler, in this process (no workers)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from agents.engines.torch.kvcache import BlockAllocator, PagedKVCache
from agents.engines.torch.model import (
    ModelConfig,
    ModelConfigError,
    SeqChunk,
    StageModel,
    apply_rope,
    load_stage_weights,
    reference_logits,
    rms_norm,
    rope_cos_sin,
    rotate_half,
    tp_problems,
    tp_shard,
)
from agents.engines.torch.sampling import SamplingParams, draws_after, make_generator, sample
from tests.agents.engines.conftest import TinyModel

pytestmark = pytest.mark.timeout(60)


# --- config ---------------------------------------------------------------------------------------


def test_it_reads_the_tiny_models_config(tiny_model: TinyModel) -> None:
    cfg = tiny_model.cfg
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        64,
        4,
        4,
        2,
        32,
    )
    assert cfg.eos_token_ids == (2,)
    assert cfg.kv_bytes_per_token == 2 * 4 * 2 * 32 * 4


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"attention_bias": True}, "attention_bias"),
        ({"architectures": ["MistralForCausalLM"]}, "architectures"),
    ],
)
def test_it_rejects_configs_it_does_not_implement_naming_the_key(
    tiny_model: TinyModel, change: dict[str, object], field: str
) -> None:
    cfg = json.loads((tiny_model.path / "config.json").read_text())
    cfg.update(change)
    with pytest.raises(ModelConfigError, match=field):
        ModelConfig.from_dict(cfg)


def test_a_missing_key_is_named(tiny_model: TinyModel) -> None:
    cfg = json.loads((tiny_model.path / "config.json").read_text())
    del cfg["num_hidden_layers"]
    with pytest.raises(ModelConfigError, match="num_hidden_layers: missing"):
        ModelConfig.from_dict(cfg)


# --- primitives -----------------------------------------------------------------------------------


def test_rotate_half_pairs_the_first_half_with_the_second() -> None:
    # HF's convention (not the interleaved one): [a, b, c, d] -> [-c, -d, a, b].
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert rotate_half(x).tolist() == [-3.0, -4.0, 1.0, 2.0]


def test_rope_is_the_identity_at_position_zero_and_keeps_norms() -> None:
    x = torch.randn(3, 2, 32, generator=torch.Generator().manual_seed(0))
    cos, sin = rope_cos_sin(torch.tensor([0, 0, 0]), 32, 10000.0)
    assert torch.equal(apply_rope(x, cos, sin), x)
    cos, sin = rope_cos_sin(torch.tensor([5, 77, 300]), 32, 10000.0)
    assert torch.allclose(apply_rope(x, cos, sin).norm(dim=-1), x.norm(dim=-1), atol=1e-5)


def test_rope_scores_depend_only_on_the_relative_position() -> None:
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 1, 32, generator=gen), torch.randn(1, 1, 32, generator=gen)

    def score(m: int, n: int) -> float:
        cq, sq = rope_cos_sin(torch.tensor([m]), 32, 10000.0)
        ck, sk = rope_cos_sin(torch.tensor([n]), 32, 10000.0)
        return float((apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum())

    assert score(10, 3) == pytest.approx(score(107, 100), abs=1e-4)
    assert score(10, 3) != pytest.approx(score(10, 4), abs=1e-4)


def test_rope_frequencies_follow_theta_to_the_minus_2i_over_d() -> None:
    cos, sin = rope_cos_sin(torch.tensor([1]), 4, 100.0)
    # inv_freq = [1, 100^-0.5] = [1, 0.1], repeated for both halves.
    assert torch.allclose(sin[0], torch.tensor([math.sin(1.0), math.sin(0.1)] * 2))
    assert torch.allclose(cos[0], torch.tensor([math.cos(1.0), math.cos(0.1)] * 2))


def test_rms_norm_scales_by_the_root_mean_square() -> None:
    x = torch.tensor([[3.0, 4.0]])
    w = torch.tensor([1.0, 2.0])
    rms = math.sqrt((9 + 16) / 2 + 1e-5)
    assert torch.allclose(rms_norm(x, w, 1e-5), torch.tensor([[3 / rms, 8 / rms]]))


# --- the TP shard plan -----------------------------------------------------------------------------


def test_tp_that_does_not_divide_the_heads_is_rejected_with_the_reason(tiny_model: TinyModel) -> None:
    reasons = tp_problems(tiny_model.cfg, 3)
    assert any("num_attention_heads 4" in r for r in reasons)
    assert any("num_key_value_heads 2" in r for r in reasons)
    assert tp_problems(tiny_model.cfg, 8) == ["tp 8 does not divide num_attention_heads 4"]
    with pytest.raises(ValueError, match="tp: tp 3 does not divide"):
        tp_shard(tiny_model.cfg, 3, 0)


def test_tp_beyond_the_kv_heads_replicates_each_kv_head(tiny_model: TinyModel) -> None:
    cfg = tiny_model.cfg  # 4 query heads, 2 KV heads
    assert tp_problems(cfg, 4) == []
    shards = [tp_shard(cfg, 4, r) for r in range(4)]
    assert [(s.q_head_start, s.kv_head_start, s.num_kv_heads) for s in shards] == [
        (0, 0, 1),
        (1, 0, 1),
        (2, 1, 1),
        (3, 1, 1),
    ]
    tp2 = [tp_shard(cfg, 2, r) for r in range(2)]
    assert [(s.q_head_start, s.q_head_end, s.kv_head_start, s.kv_head_end) for s in tp2] == [
        (0, 2, 0, 1),
        (2, 4, 1, 2),
    ]
    assert [(s.inter_start, s.inter_end) for s in tp2] == [(0, 64), (64, 128)]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shards_put_together_are_the_whole_weights(tiny_model: TinyModel, tp: int) -> None:
    cfg, full = tiny_model.cfg, tiny_model.weights
    parts = [
        load_stage_weights(
            tiny_model.path,
            cfg,
            1,
            3,
            tp_shard(cfg, tp, r),
            with_embed=False,
            with_head=False,
            device=torch.device("cpu"),
        )
        for r in range(tp)
    ]
    layer = 2  # the second layer of the stage [1, 3)
    p = f"model.layers.{layer}."
    assert torch.equal(torch.cat([w.layers[1].wq for w in parts]), full[p + "self_attn.q_proj.weight"])
    assert torch.equal(torch.cat([w.layers[1].wo for w in parts], dim=1), full[p + "self_attn.o_proj.weight"])
    assert torch.equal(torch.cat([w.layers[1].w_up for w in parts]), full[p + "mlp.up_proj.weight"])
    assert torch.equal(
        torch.cat([w.layers[1].w_down for w in parts], dim=1), full[p + "mlp.down_proj.weight"]
    )
    kv = torch.cat([w.layers[1].wk for w in parts])
    if tp <= cfg.num_kv_heads:
        assert torch.equal(kv, full[p + "self_attn.k_proj.weight"])
    else:  # each KV head twice, on neighbouring ranks
        per_rank = kv.view(tp, cfg.head_dim, cfg.hidden_size)
        assert torch.equal(per_rank[0], per_rank[1]) and torch.equal(per_rank[2], per_rank[3])
        assert torch.equal(per_rank[::2].reshape(-1, cfg.hidden_size), full[p + "self_attn.k_proj.weight"])


# --- the stage forward over a paged cache, against the reference ----------------------------------


def test_the_paged_stage_forward_matches_the_reference_through_chunked_prefill_and_decode(
    tiny_model: TinyModel,
) -> None:
    cfg = tiny_model.cfg
    shard = tp_shard(cfg, 1, 0)
    weights = load_stage_weights(
        tiny_model.path,
        cfg,
        0,
        cfg.num_layers,
        shard,
        with_embed=True,
        with_head=True,
        device=torch.device("cpu"),
    )
    model = StageModel(cfg, weights)
    alloc = BlockAllocator(num_blocks=16, block_size=4)
    cache = PagedKVCache(cfg.num_layers, 16, 4, cfg.num_kv_heads, cfg.head_dim)
    alloc.ensure("other", 6)  # so the sequence's blocks are not 0, 1, 2...
    tokens = [7, 100, 23, 9, 301, 45, 12, 88, 5, 400, 41]
    ref = reference_logits(tiny_model.weights, cfg, tokens)
    start = 0
    for n in (3, 4, 1, 2, 1):  # chunks that straddle block boundaries, then decodes
        table = alloc.ensure("s", start + n)
        chunk = SeqChunk("s", start, n, table, True)
        hidden = model.forward(model.embed(torch.tensor(tokens[start : start + n])), [chunk], cache)
        got = model.logits(hidden)
        assert torch.allclose(got, ref[start : start + n], atol=1e-4), f"chunk at {start}"
        start += n


@pytest.mark.parametrize("tp_rank", [(1, 0), (4, 3)])
def test_batched_decodes_of_different_lengths_and_a_prefill_in_one_batch_match_the_reference(
    tiny_model: TinyModel, tp_rank: tuple[int, int]
) -> None:
    """The padded decode batch must mask each sequence's padding; with tp 4 (one KV head per
    rank, shared by one query head) only this rank's heads are computed, so compare the
    attention path through a whole model only at tp 1 and check the shapes at tp 4."""
    cfg = tiny_model.cfg
    tp, rank = tp_rank
    weights = load_stage_weights(
        tiny_model.path,
        cfg,
        0,
        cfg.num_layers,
        tp_shard(cfg, tp, rank),
        with_embed=True,
        with_head=True,
        device=torch.device("cpu"),
    )
    model = StageModel(cfg, weights)
    cache = PagedKVCache(cfg.num_layers, 32, 4, weights.shard.num_kv_heads, cfg.head_dim)
    alloc = BlockAllocator(num_blocks=32, block_size=4)
    seqs = {"a": [3, 4, 5], "b": [100, 200, 300, 400, 500, 6, 7, 8, 9], "c": [42] * 6}
    # prefill a and b (c waits)
    chunks = [SeqChunk(s, 0, len(seqs[s]), alloc.ensure(s, len(seqs[s])), True) for s in ("a", "b")]
    model.forward(model.embed(torch.tensor(seqs["a"] + seqs["b"])), chunks, cache)
    # one batch: a and b decode one token each (contexts 4 and 10), c prefills
    nxt = {"a": 77, "b": 88}
    chunks = [
        SeqChunk("a", 3, 1, alloc.ensure("a", 4), True),
        SeqChunk("c", 0, 6, alloc.ensure("c", 6), True),
        SeqChunk("b", 9, 1, alloc.ensure("b", 10), True),
    ]
    tokens = torch.tensor([nxt["a"], *seqs["c"], nxt["b"]])
    hidden = model.forward(model.embed(tokens), chunks, cache)
    assert hidden.shape == (8, cfg.hidden_size)
    if tp == 1:
        logits = model.logits(hidden)
        ref = {
            s: reference_logits(tiny_model.weights, cfg, seqs[s] + ([nxt[s]] if s in nxt else []))
            for s in seqs
        }
        assert torch.allclose(logits[0], ref["a"][-1], atol=1e-4)
        assert torch.allclose(logits[1:7], ref["c"], atol=1e-4)
        assert torch.allclose(logits[7], ref["b"][-1], atol=1e-4)


# --- sampling ---------------------------------------------------------------------------------------


def test_greedy_takes_the_lowest_id_on_a_tie_and_draws_nothing() -> None:
    logits = torch.tensor([0.0, 5.0, 1.0, 5.0])
    assert sample(logits, SamplingParams(), None) == 1
    assert draws_after(SamplingParams(), 10) == 0


def test_seeded_sampling_is_reproducible_and_depends_on_the_seed() -> None:
    logits = torch.randn(512, generator=torch.Generator().manual_seed(3))

    def run(seed: int) -> list[int]:
        params = SamplingParams(temperature=1.0, seed=seed)
        gen = make_generator(params, 0)
        return [sample(logits, params, gen) for _ in range(20)]

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_a_generator_advanced_by_draws_continues_the_same_stream() -> None:
    logits = torch.randn(512, generator=torch.Generator().manual_seed(4))
    params = SamplingParams(temperature=0.7, top_p=0.5, top_k=3, seed=11)
    gen = make_generator(params, 0)
    stream = [sample(logits, params, gen) for _ in range(12)]
    resumed = make_generator(params, 7)
    assert [sample(logits, params, resumed) for _ in range(5)] == stream[7:]


def test_top_k_one_and_a_tiny_top_p_are_greedy_but_still_draw() -> None:
    logits = torch.randn(512, generator=torch.Generator().manual_seed(5))
    best = int(logits.argmax())
    for params in (SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=1e-9)):
        gen = make_generator(params, 0)
        assert sample(logits, params, gen) == best
        assert torch.equal(gen.get_state(), make_generator(params, 1).get_state())


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -1.0}, "sampling.temperature"),
        ({"top_p": 0.0}, "sampling.top_p"),
        ({"top_k": -2}, "sampling.top_k"),
        ({"seed": -1}, "sampling.seed"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_sampling_params_round_trip_and_refuse_unknown_keys() -> None:
    params = SamplingParams(temperature=0.5, top_p=0.8, top_k=4, seed=3, ignore_eos=True)
    assert SamplingParams.from_dict(params.to_dict()) == params
    with pytest.raises(ValueError, match="unknown key"):
        SamplingParams.from_dict({"temprature": 1.0})


# --- device and backend selection ------------------------------------------------------------------


def test_the_backend_is_nccl_only_when_every_rank_of_the_group_has_a_gpu() -> None:
    from agents.engines.torch.comm import select_backend

    assert select_backend("cpu", 4) == "gloo"
    assert select_backend("cuda", 1, num_gpus=1) == "nccl"
    assert select_backend("cuda", 2, num_gpus=2) == "nccl"
    # NCCL refuses two ranks of one communicator on one GPU: fall back to gloo through host memory
    assert select_backend("cuda", 2, num_gpus=1) == "gloo"
    assert select_backend("cuda", 2, backend="gloo", num_gpus=8) == "gloo"
    with pytest.raises(ValueError, match="backend: nccl needs one GPU per rank; the group has 4 ranks and 2"):
        select_backend("cuda", 4, backend="nccl", num_gpus=2)
    with pytest.raises(ValueError, match="backend: nccl needs device 'cuda'"):
        select_backend("cpu", 1, backend="nccl")
    with pytest.raises(ValueError, match="backend: must be one of"):
        select_backend("cpu", 1, backend="mpi")
