"""The engine on real worker processes: sharded layouts against the unsharded reference,
continuous batching, chunked prefill, the KV cache running out, bad input, dying workers."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from agents.engines.torch.engine import EngineError, KVCacheFullError, KVState, TorchEngine
from agents.engines.torch.layout import Layout
from agents.engines.torch.sampling import SamplingParams
from tests.agents.engines.conftest import (
    DEVICE,
    GREEDY,
    LAYOUTS,
    SEEDED,
    SEEDED_TOPK,
    EnginePool,
    TinyModel,
    pid_alive,
    run_to_end,
)

pytestmark = pytest.mark.timeout(120)

PROMPTS = {
    "greedy": ([5, 17, 99, 300, 42], GREEDY),
    "seeded": ([9, 10, 11], SEEDED),
    "topk": ([400, 3, 77, 78, 79, 80, 81, 82, 83], SEEDED_TOPK),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_generates_the_reference_tokens_while_sequences_join_and_leave(
    engines: EnginePool, tiny_model: TinyModel, name: str
) -> None:
    engine = engines.get(name)
    lengths = {"greedy": 12, "seeded": 7, "topk": 10}
    out: dict[str, list[int]] = {}
    # "greedy" runs alone for 3 steps, then "seeded" joins, then "topk": each later one is
    # prefilled in the same iteration as the others decode.
    engine.add_request("greedy", PROMPTS["greedy"][0], lengths["greedy"], PROMPTS["greedy"][1])
    for step in range(6):
        if step == 3:
            engine.add_request("seeded", PROMPTS["seeded"][0], lengths["seeded"], PROMPTS["seeded"][1])
        if step == 5:
            engine.add_request("topk", PROMPTS["topk"][0], lengths["topk"], PROMPTS["topk"][1])
        emitted = engine.step()
        for o in emitted:
            out.setdefault(o.seq_id, []).append(o.token_id)
        if step in (3, 5) and not engine.disaggregated:
            assert len(emitted) == (2 if step == 3 else 3), "prefill and decode share the iteration"
    run_to_end(engine, out)
    for seq_id, (prompt, params) in PROMPTS.items():
        assert out[seq_id] == tiny_model.reference(prompt, lengths[seq_id], params), seq_id
    assert engine.sequence_ids() == []
    assert all(free == 256 for free in engine.num_free_blocks().values()), (
        "finished sequences free their blocks"
    )
    if DEVICE == "cpu":
        assert set(engine.backends.values()) == {"gloo"}


def test_a_disaggregated_engine_prefills_in_one_group_and_decodes_in_the_other(
    engines: EnginePool, tiny_model: TinyModel
) -> None:
    engine = engines.get("disagg")
    before = engine.stats.handoffs, engine.stats.handoff_bytes
    engine.add_request("a", [1, 2, 3, 4, 5, 6], 5, GREEDY)
    first = engine.step()
    assert [(o.seq_id, o.finished) for o in first] == [("a", False)]  # the prefill's token
    assert engine._seqs["a"].group == "decode"
    assert engine.stats.handoffs == before[0] + 1
    # 6 cached tokens x 4 layers x 2 KV heads x 32 x 4 bytes, K and V
    assert engine.stats.handoff_bytes - before[1] == 2 * 4 * 6 * 2 * 32 * 4
    out = run_to_end(engine, {"a": [first[0].token_id]})
    assert out["a"] == tiny_model.reference([1, 2, 3, 4, 5, 6], 5, GREEDY)


def test_chunked_prefill_splits_a_long_prompt_across_steps_and_keeps_the_tokens(
    engines: EnginePool, tiny_model: TinyModel
) -> None:
    engine = engines.get("tp2")
    engine.max_tokens_per_step = 3
    prompt = [30 + i for i in range(11)]
    engine.add_request("short", [7, 8], 9, SEEDED)
    engine.add_request("long", prompt, 6, GREEDY)
    out: dict[str, list[int]] = {}
    steps_to_first = None
    for step in range(1, 100):
        for o in engine.step():
            out.setdefault(o.seq_id, []).append(o.token_id)
        if steps_to_first is None and "long" in out:
            steps_to_first = step
        if not engine.has_unfinished():
            break
    # "short" takes 2 of the first step's 3 tokens, then decodes 1 per step: "long" gets 1, 2, 2...
    assert steps_to_first is not None and steps_to_first >= 5
    assert out["long"] == tiny_model.reference(prompt, 6, GREEDY)
    assert out["short"] == tiny_model.reference([7, 8], 9, SEEDED)


def test_sharded_exports_agree_and_an_import_anywhere_exports_the_same_bytes(engines: EnginePool) -> None:
    states: dict[str, KVState] = {}
    for name in ("tp1", "tp2", "tp4", "pp2", "mixed"):
        engine = engines.get(name)
        engine.add_request("x", [11, 12, 13, 14, 15, 16, 17], 8, SEEDED)
        for _ in range(3):
            engine.step()
        states[name] = engine.export_kv("x")
        engine.drop("x")
    ref = states["tp1"]
    assert ref.keys.shape == (4, 9, 2, 32) and ref.num_cached_tokens == 9 == len(ref.token_ids) - 1
    for name, state in states.items():
        assert state.token_ids == ref.token_ids, name
        assert torch.allclose(state.keys, ref.keys, atol=1e-5) and torch.allclose(
            state.values, ref.values, atol=1e-5
        )
    # Re-sharding is lossless: whatever layout imports it gives back the very same bytes.
    for name in ("tp4", "tp2pp2", "disagg"):
        engine = engines.get(name)
        engine.import_kv("y", states["tp2"])
        back = engine.export_kv("y")
        engine.drop("y")
        assert torch.equal(back.keys, states["tp2"].keys) and torch.equal(
            back.values, states["tp2"].values
        ), name


def test_a_replay_only_export_carries_tokens_and_sampler_but_no_kv(engines: EnginePool) -> None:
    engine = engines.get("tp1")
    engine.add_request("r", [4, 5, 6], 10, SEEDED)
    engine.step()
    engine.step()
    state = engine.export_kv("r", include_kv=False)
    assert state.num_cached_tokens == 0 and state.kv_bytes == 0
    assert len(state.generated_ids) == 2 and state.sampler_draws == 2
    assert state.prompt_ids == (4, 5, 6)


# --- capacity ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_model_dir(tiny_model: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """The tiny model with a second end-of-sequence id: the 3rd token the reference generates."""
    stop_token = tiny_model.reference([5, 17, 99, 300, 42], 3, GREEDY)[2]
    path = tmp_path_factory.mktemp("tiny-llama-eos")
    for f in tiny_model.path.iterdir():
        shutil.copy(f, path / f.name)
    cfg = json.loads((path / "config.json").read_text())
    cfg["eos_token_id"] = [2, stop_token]
    (path / "config.json").write_text(json.dumps(cfg))
    return path, stop_token


@pytest.fixture(scope="module")
def small_engine(small_model_dir: tuple[Path, int]) -> Iterator[TorchEngine]:
    """4 blocks of 4 tokens: 16 tokens of KV in all."""
    engine = TorchEngine(small_model_dir[0], Layout.pipeline(4), device=DEVICE, num_kv_blocks=4, block_size=4)
    yield engine
    engine.shutdown()
    assert not any(pid_alive(p) for p in engine.pids)


def test_generation_stops_at_an_end_of_sequence_token_unless_told_to_ignore_it(
    small_engine: TorchEngine, small_model_dir: tuple[Path, int]
) -> None:
    prompt = [5, 17, 99, 300, 42]
    small_engine.add_request("stops", prompt, 8, SamplingParams())
    emitted = []
    while small_engine.has_unfinished():
        emitted += small_engine.step()
    assert len(emitted) == 3 and emitted[-1].token_id == small_model_dir[1] and emitted[-1].finished
    small_engine.add_request("goes-on", prompt, 8, GREEDY)
    assert len(run_to_end(small_engine)["goes-on"]) == 8


def test_when_the_cache_runs_out_the_latest_sequence_is_preempted_and_recomputed_exactly(
    small_engine: TorchEngine, tiny_model: TinyModel
) -> None:
    # Three sequences of 4 + 8 = 12 tokens (3 blocks each) in 4 blocks: they cannot all stay.
    prompts = {"p0": [1, 2, 3, 4], "p1": [50, 60, 70, 80], "p2": [9, 9, 9, 9]}
    params = {"p0": GREEDY, "p1": SEEDED, "p2": SEEDED_TOPK}
    before = small_engine.stats.preemptions
    for seq_id, prompt in prompts.items():
        small_engine.add_request(seq_id, prompt, 8, params[seq_id])
    out = run_to_end(small_engine)
    assert small_engine.stats.preemptions > before
    for seq_id, prompt in prompts.items():
        assert out[seq_id] == tiny_model.reference(prompt, 8, params[seq_id]), seq_id
    assert small_engine.num_free_blocks() == {"main": 4}


def test_a_request_that_could_never_fit_is_refused_up_front(small_engine: TorchEngine) -> None:
    with pytest.raises(ValueError, match=r"max_new_tokens: a sequence of 20 tokens needs 5 KV blocks.*has 4"):
        small_engine.add_request("huge", [1] * 10, 10)
    assert small_engine.sequence_ids() == []


def test_an_import_into_a_full_cache_fails_and_changes_nothing(
    small_engine: TorchEngine, engines: EnginePool
) -> None:
    small_engine.add_request("hog", [3] * 8, 4, GREEDY)
    small_engine.step()  # 8 cached tokens: 2 of the 4 blocks
    assert small_engine.num_free_blocks() == {"main": 2}
    donor = engines.get("tp1")  # the same weights file, so the same sha256
    donor.add_request("big", [4] * 9, 4, GREEDY)
    donor.step()
    state = donor.export_kv("big")  # 9 cached + the next token: 3 blocks
    with pytest.raises(KVCacheFullError, match="'big' needs 3 more block"):
        small_engine.import_kv("big", state)
    assert small_engine.sequence_ids() == ["hog"] and small_engine.num_free_blocks() == {"main": 2}
    small_engine.drop("hog")


# --- bad input ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"seq_id": ""}, "seq_id: must be a non-empty string"),
        ({"prompt_ids": []}, "prompt_ids: must hold at least one token"),
        ({"prompt_ids": [1, 512]}, r"prompt_ids\[1\]: must be a token id in \[0, 512\), got 512"),
        ({"prompt_ids": [1, -1]}, r"prompt_ids\[1\]"),
        ({"max_new_tokens": 0}, "max_new_tokens: must be a positive integer"),
        ({"max_new_tokens": 600}, "max_new_tokens: .* exceeds max_position_embeddings 512"),
        ({"sampling": {"temperature": -1}}, "sampling.temperature"),
        ({"sampling": "greedy"}, "sampling: must be SamplingParams"),
    ],
)
def test_bad_requests_are_refused_naming_the_field(
    engines: EnginePool, kwargs: dict[str, object], match: str
) -> None:
    engine = engines.get("tp1")
    args: dict[str, object] = {"seq_id": "bad", "prompt_ids": [1, 2], "max_new_tokens": 4, "sampling": None}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        engine.add_request(**args)  # type: ignore[arg-type]
    assert engine.sequence_ids() == []


def test_a_duplicate_or_unknown_sequence_is_named(engines: EnginePool) -> None:
    engine = engines.get("tp1")
    engine.add_request("dup", [1, 2], 3)
    with pytest.raises(ValueError, match="seq_id: 'dup' is already in this engine"):
        engine.add_request("dup", [1, 2], 3)
    with pytest.raises(KeyError, match="seq_id: 'ghost' is not in this engine"):
        engine.export_kv("ghost")
    assert engine.drop("dup") and not engine.drop("dup")
    with pytest.raises(ValueError, match="generated_ids: 3 tokens already reach max_new_tokens 3"):
        engine.replay("done", [1], [2, 3, 4], 3)


def test_a_state_from_other_weights_or_of_the_wrong_shape_is_refused(engines: EnginePool) -> None:
    engine = engines.get("tp1")
    engine.add_request("s", [1, 2, 3], 5, SEEDED)
    engine.step()
    state = engine.export_kv("s")
    engine.drop("s")
    bad = [
        (KVState(**{**state.__dict__, "model_sha256": "0" * 64}), "state.model_sha256"),
        (
            KVState(**{**state.__dict__, "keys": state.keys[:, :2]}),
            r"state.keys: expected float32 \[4, 3, 2, 32\]",
        ),
        (KVState(**{**state.__dict__, "num_cached_tokens": 4}), "state.num_cached_tokens: 4 not in"),
        (KVState(**{**state.__dict__, "sampler_draws": 0}), "state.sampler_draws: 0 draws do not match 1"),
        (KVState(**{**state.__dict__, "max_new_tokens": 1}), "state.max_new_tokens: .* finished"),
    ]
    for broken, match in bad:
        with pytest.raises(ValueError, match=match):
            engine.import_kv("s2", broken)
    assert engine.sequence_ids() == [] and engine.num_free_blocks() == {"main": 256}


def test_a_wrong_weights_hash_or_device_is_refused_before_any_process_starts(tiny_model: TinyModel) -> None:
    with pytest.raises(ValueError, match="expected_sha256: the weights in .* hash to"):
        TorchEngine(tiny_model.path, Layout.pipeline(4), expected_sha256="ab" * 32)
    with pytest.raises(ValueError, match="device: must be 'cpu' or 'cuda'"):
        TorchEngine(tiny_model.path, Layout.pipeline(4), device="tpu")
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="gpus: only meaningful with device 'cuda'"):
            TorchEngine(tiny_model.path, Layout.pipeline(4), gpus=[0])
    else:
        with pytest.raises(ValueError, match=r"gpus\[0\]: must be a visible GPU index"):
            TorchEngine(tiny_model.path, Layout.pipeline(4), device="cuda", gpus=[99])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device: 'cuda' requested but"):
            TorchEngine(tiny_model.path, Layout.pipeline(4), device="cuda")


# --- lifetime ----------------------------------------------------------------------------------------


def test_a_dead_worker_fails_the_step_and_takes_its_whole_group_down(tiny_model: TinyModel) -> None:
    engine = TorchEngine(tiny_model.path, Layout.pipeline(4, pp=2), device=DEVICE, timeout_s=30)
    pids = engine.pids
    engine.add_request("a", [1, 2, 3], 10)
    engine.step()
    os.kill(pids[1], signal.SIGKILL)  # our own worker, by its id
    for _ in range(500):
        if not pid_alive(pids[1]):
            break
        time.sleep(0.01)
    with pytest.raises(EngineError, match=r"rank 1 \(flexpipe-main-s1t0\) (died|exited|unreachable)"):
        engine.step()
    assert not any(pid_alive(p) for p in pids)
    with pytest.raises(EngineError, match="shut down"):
        engine.add_request("b", [1], 1)
    engine.shutdown()  # idempotent


def test_shutdown_stops_every_worker(tiny_model: TinyModel) -> None:
    with TorchEngine(tiny_model.path, Layout.disaggregated(4, prefill_pp=2), device=DEVICE) as engine:
        pids = engine.pids
        assert len(pids) == 3 and all(pid_alive(p) for p in pids)
        engine.add_request("a", [1, 2, 3], 4)
        engine.step()
    assert not any(pid_alive(p) for p in pids)
    with pytest.raises(EngineError, match="shut down"):
        engine.step()
