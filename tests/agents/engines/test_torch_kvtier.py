"""The engine's host KV tier on real workers: offload and restore token-exact, the next turn of a
conversation reusing the last turn's KV, and a full tier that recomputes rather than loses."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from agents.engines.torch.engine import EngineStats, TorchEngine
from agents.engines.torch.kvtier import HostKVTier
from agents.engines.torch.layout import Layout
from tests.agents.engines.conftest import DEVICE, GREEDY, NUM_LAYERS, SEEDED, TinyModel, run_to_end

pytestmark = pytest.mark.timeout(120)

PROMPT = [5, 17, 99, 300, 42, 7, 8]


@pytest.fixture(scope="module")
def tiered(tiny_model: TinyModel) -> Iterator[TorchEngine]:
    engine = TorchEngine(tiny_model.path, Layout.pipeline(NUM_LAYERS, pp=2), device=DEVICE, timeout_s=60,
                         host_kv_bytes=1 << 30)
    yield engine
    engine.shutdown()


@pytest.fixture
def engine(tiered: TorchEngine) -> Iterator[TorchEngine]:
    tiered.stats = EngineStats()
    yield tiered
    for seq_id in tiered.sequence_ids():
        tiered.drop(seq_id)
    assert tiered.host_tier is not None
    tiered.host_tier = HostKVTier(tiered.host_tier.capacity_bytes)


def _steps(engine: TorchEngine, n: int, out: dict[str, list[int]]) -> None:
    for _ in range(n):
        for o in engine.step():
            out.setdefault(o.seq_id, []).append(o.token_id)


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_sequence_offloaded_mid_decode_and_restored_gives_the_tokens_of_a_run_without_it(
        engine: TorchEngine, tiny_model: TinyModel, sampling: object) -> None:
    out: dict[str, list[int]] = {}
    engine.add_request("s", PROMPT, 16, sampling)  # type: ignore[arg-type]
    _steps(engine, 5, out)
    free_before = engine.num_free_blocks()
    moved = engine.offload("s")
    assert moved > 0 and "s" not in engine.sequence_ids() and "s" in engine.host_tier  # type: ignore[operator]
    assert all(engine.num_free_blocks()[g] > free_before[g] for g in free_before), "its GPU blocks are free"
    assert engine.restore("s") == moved, "the KV came back, not recomputed"
    run_to_end(engine, out)
    assert out["s"] == tiny_model.reference(PROMPT, 16, sampling)  # type: ignore[arg-type]
    assert engine.stats.prefix_hit_tokens == 0


def test_the_next_turn_of_a_conversation_reuses_the_last_turn_s_kv_and_matches_a_full_prefill(
        engine: TorchEngine, tiny_model: TinyModel) -> None:
    first = run_to_end_new(engine, "turn-1", PROMPT, 6)
    assert "turn-1" in engine.host_tier, "a finished sequence's KV stays in host memory"  # type: ignore[operator]
    second_prompt = PROMPT + first + [11, 12, 13]
    prefilled = engine.stats.tokens_prefilled
    second = run_to_end_new(engine, "turn-2", second_prompt, 8)
    assert second == tiny_model.reference(second_prompt, 8, GREEDY)
    # the cached tokens: the first turn's prompt and all its generated tokens but the last (not fed yet)
    reused = len(PROMPT) + len(first) - 1
    assert engine.stats.prefix_hit_tokens == reused
    assert engine.stats.tokens_prefilled - prefilled == len(second_prompt) - reused
    assert "turn-1" not in engine.host_tier, "the donor's KV went to the new sequence"  # type: ignore[operator]


def test_a_prompt_that_does_not_start_with_a_held_sequence_is_prefilled_whole(
        engine: TorchEngine, tiny_model: TinyModel) -> None:
    run_to_end_new(engine, "a", PROMPT, 4)
    other = [9, 10, 11, 12]
    assert run_to_end_new(engine, "b", other, 5) == tiny_model.reference(other, 5, GREEDY)
    assert engine.stats.prefix_hit_tokens == 0 and "a" in engine.host_tier  # type: ignore[operator]


def test_a_tier_too_small_keeps_the_tokens_and_a_restore_recomputes_them_exactly(
        engine: TorchEngine, tiny_model: TinyModel) -> None:
    engine.host_tier = HostKVTier(1)  # no KV fits: every offload is kept replay-only
    out: dict[str, list[int]] = {}
    engine.add_request("s", PROMPT, 12, GREEDY)
    _steps(engine, 4, out)
    engine.offload("s")
    assert engine.host_tier.used_bytes == 0 and engine.host_tier.evictions == 1
    assert engine.restore("s") == 0, "nothing to copy back: recomputed"
    run_to_end(engine, out)
    assert out["s"] == tiny_model.reference(PROMPT, 12, GREEDY)


def test_offload_without_a_host_tier_is_refused_naming_the_setting(tiny_model: TinyModel) -> None:
    with TorchEngine(tiny_model.path, Layout.pipeline(NUM_LAYERS), device=DEVICE, timeout_s=60) as plain:
        plain.add_request("s", PROMPT, 4, GREEDY)
        plain.step()
        with pytest.raises(ValueError, match="host_kv_bytes"):
            plain.offload("s")
        assert "s" in plain.sequence_ids(), "a refused offload changes nothing"
        with pytest.raises(KeyError, match="seq_id"):
            plain.restore("s")


def run_to_end_new(engine: TorchEngine, seq_id: str, prompt: list[int], n: int) -> list[int]:
    engine.add_request(seq_id, prompt, n, GREEDY)
    return run_to_end(engine).get(seq_id, [])
