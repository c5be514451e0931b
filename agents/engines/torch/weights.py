"""The tiny Llama-style model the project ships with: made here, deterministically, never downloaded.

`python -m agents.engines.torch.weights OUT_DIR` writes a Hugging Face style model folder
(config.json, model.safetensors, tokenizer.json, tokenizer_config.json, generation_config.json)
and prints the SHA256 of the weights file, which is what the registry keys the model by.

The same folder loads in three engines with identical greedy token ids in float32: the torch
reference engine of this package, HF transformers and vLLM (../shared/STACK-NOTES.md). vLLM's CPU
attention rejects a head_dim below 32, hence head_dim 32 with hidden 64 (q_proj widens 64 -> 128).

Same seed and shape -> byte-identical files: the weights come from a seeded torch.Generator, the
tokenizer from a BPE trained on a fixed corpus written below.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

WEIGHTS_FILE = "model.safetensors"

# A fixed, small corpus: enough text for a byte-level BPE to learn a few hundred merges.
_CORPUS = """\
FlexPipe shifts gears when the cluster changes. A plan has stages; a stage has a layer range
and a tensor parallel group inside one atomic block. The gearbox weighs gain against the cost
of switching, with hysteresis, and never drops a request. Prefill is bound by compute, decode
by memory bandwidth. The KV cache moves between agents, never through the controller.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
Hello world! How are you today? I am fine, thank you. What is the capital of France? Paris.
0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 32 64 128 256 512 1024 2048 4096 8192
def main(): return 0  # code, too: { } [ ] ( ) < > = + - * / % & | ^ ~ ! ? : ; , .
"""


@dataclass(frozen=True)
class TinyLlamaShape:
    hidden_size: int = 64
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 128
    vocab_size: int = 512
    max_position_embeddings: int = 512
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0


def hf_config(shape: TinyLlamaShape) -> dict[str, object]:
    """The config.json of a Llama with this shape (transformers' LlamaConfig keys)."""
    cfg: dict[str, object] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "initializer_range": 0.02,
    }
    cfg.update(asdict(shape))
    return cfg


def _weights(shape: TinyLlamaShape, seed: int) -> dict[str, object]:
    import torch

    gen = torch.Generator().manual_seed(seed)

    def rand(*dims: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*dims, generator=gen, dtype=torch.float32) * std).contiguous()

    h, hd = shape.hidden_size, shape.head_dim
    q_out = shape.num_attention_heads * hd
    kv_out = shape.num_key_value_heads * hd
    # A larger std than usual init keeps logits far apart, so greedy decoding is not decided by
    # float rounding and the three engines agree token for token.
    std = 0.08
    tensors: dict[str, object] = {"model.embed_tokens.weight": rand(shape.vocab_size, h, std=0.5)}
    for i in range(shape.num_hidden_layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = torch.ones(h) + rand(h, std=0.05)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(h) + rand(h, std=0.05)
        tensors[p + "self_attn.q_proj.weight"] = rand(q_out, h, std=std)
        tensors[p + "self_attn.k_proj.weight"] = rand(kv_out, h, std=std)
        tensors[p + "self_attn.v_proj.weight"] = rand(kv_out, h, std=std)
        tensors[p + "self_attn.o_proj.weight"] = rand(h, q_out, std=std)
        tensors[p + "mlp.gate_proj.weight"] = rand(shape.intermediate_size, h, std=std)
        tensors[p + "mlp.up_proj.weight"] = rand(shape.intermediate_size, h, std=std)
        tensors[p + "mlp.down_proj.weight"] = rand(h, shape.intermediate_size, std=std)
    tensors["model.norm.weight"] = torch.ones(h) + rand(h, std=0.05)
    tensors["lm_head.weight"] = rand(shape.vocab_size, h, std=0.5)
    return tensors


def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2: pad/unk, bos, eos as in config.json
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    # Pad to exactly vocab_size so every logit index decodes to something.
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_tokens([f"<extra_{i}>" for i in range(missing)])
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"tokenizer has {tok.get_vocab_size()} tokens, the model {vocab_size}")
    return tok.to_str(pretty=True)


_CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


def make_tiny_llama(out_dir: str | Path, *, seed: int = 0, shape: TinyLlamaShape | None = None) -> str:
    """Write the model folder and return the SHA256 (hex) of its weights file."""
    from safetensors.torch import save_file

    shape = shape or TinyLlamaShape()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(shape), indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}, indent=2) + "\n"
    )
    save_file(_weights(shape, seed), str(out / WEIGHTS_FILE), metadata={"format": "pt"})  # type: ignore[arg-type]
    write_tokenizer(out, vocab_size=shape.vocab_size, max_context=shape.max_position_embeddings)
    return sha256_file(out / WEIGHTS_FILE)


def write_tokenizer(out_dir: str | Path, *, vocab_size: int, max_context: int) -> Path:
    """tokenizer.json (a byte-level BPE trained here on the fixed corpus, padded to `vocab_size`) and
    tokenizer_config.json (special tokens, chat template, `max_context` as model_max_length) in
    `out_dir`; returns the folder. Deterministic, never downloaded. The simulated fleet's demo
    tokenizes with one of these too (agents/sim/dataserver.py)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(_tokenizer_json(vocab_size))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "pad_token": "<unk>",
                "add_bos_token": False,
                "model_max_length": max_context,
                "chat_template": _CHAT_TEMPLATE,
            },
            indent=2,
        )
        + "\n"
    )
    return out


def sha256_file(path: str | Path, chunk_bytes: int = 1 << 20) -> str:
    """Stream a file through SHA256 (weights can be tens of GB: never read them whole)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk_bytes):
            digest.update(block)
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="folder to write the model into (created if missing)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=TinyLlamaShape.num_hidden_layers)
    parser.add_argument("--tokenizer-only", action="store_true",
                        help="write only the tokenizer (tokenizer.json, tokenizer_config.json): the simulated "
                             "fleet's demo tokenizes with it")
    parser.add_argument("--max-context", type=int, default=8192, help="with --tokenizer-only: model_max_length")
    args = parser.parse_args(argv)
    if args.layers < 1:
        parser.error("--layers: must be at least 1")
    if args.tokenizer_only:
        if args.max_context < 2:
            parser.error("--max-context: must be at least 2")
        out = write_tokenizer(args.out_dir, vocab_size=TinyLlamaShape.vocab_size, max_context=args.max_context)
        print(f"tokenizer: {out / 'tokenizer.json'}")
        return 0
    digest = make_tiny_llama(args.out_dir, seed=args.seed, shape=TinyLlamaShape(num_hidden_layers=args.layers))
    print(f"{digest}  {Path(args.out_dir) / WEIGHTS_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
