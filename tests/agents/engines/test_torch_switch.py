"""The property of issue 7: a gear switch at token k changes no token.

Generating N tokens with a switch at token k (and back at a later token) — TP2 -> TP1xPP2,
PP2 -> TP2, colocated -> disaggregated, and back — yields exactly the token ids of the same
generation without a switch, through the migrate path (KV moved over a real TCP socket and
re-sharded) and the replay path (re-prefill), with greedy and with seeded sampling.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agents.engines.torch.engine import KVCacheFullError, TorchEngine
from agents.engines.torch.layout import Layout
from agents.engines.torch.sampling import SamplingParams
from agents.engines.torch.switch import InProcessLink, SwitchResult, TcpLink, switch_sequences
from tests.agents.engines.conftest import (
    DEVICE,
    GREEDY,
    SEEDED,
    SEEDED_TOPK,
    EnginePool,
    TinyModel,
    run_to_end,
)

pytestmark = pytest.mark.timeout(120)

N = 14
# (seq_id, prompt, sampling, the step at which it joins): staggered, so at a switch the three
# sequences stand at different token counts.
REQUESTS = [
    ("greedy", [5, 17, 99, 300, 42], GREEDY, 0),
    ("seeded", [9, 10, 11], SEEDED, 2),
    ("topk", [400, 3, 77, 78, 79, 80, 81], SEEDED_TOPK, 3),
]

ROUND_TRIPS = {
    "TP2 -> TP1xPP2 -> TP2": ("tp2", "pp2"),
    "TP1xPP2 -> TP2 -> TP1xPP2": ("pp2", "tp2"),
    "colocated -> disaggregated -> colocated": ("tp2", "disagg"),
    "disaggregated -> colocated -> disaggregated": ("disagg", "pp2"),
    "TP1 -> TP2xPP2 -> TP1": ("tp1", "tp2pp2"),
    "TP4 -> uneven PP2 -> TP4": ("tp4", "mixed"),
}


def generate(
    engines: Sequence[TorchEngine],
    switch_at: Sequence[int],
    path: str,
    requests: Sequence[tuple[str, list[int], SamplingParams, int]] = REQUESTS,
    n: int = N,
) -> tuple[dict[str, list[int]], list[SwitchResult]]:
    """Run `requests` starting on engines[0]; once switch_at[i] steps have run, move every live
    sequence from engines[i] to engines[i + 1] (a sequence that joined at step 0 has then
    generated switch_at[i] tokens). Returns the tokens per sequence and the switch results."""
    out: dict[str, list[int]] = {}
    results = []
    current = 0
    for step in range(1000):
        for seq_id, prompt, params, join in requests:
            if join == step:
                engines[current].add_request(seq_id, prompt, n, params)
        if current < len(switch_at) and step == switch_at[current]:
            link = (
                TcpLink(expect_model_sha256=engines[current].model_sha256)
                if path == "migrate"
                else InProcessLink()
            )
            try:
                result = switch_sequences(engines[current], engines[current + 1], path=path, link=link)  # type: ignore[arg-type]
            finally:
                if isinstance(link, TcpLink):
                    link.close()
            results.append(result)
            for o in result.outputs:
                out.setdefault(o.seq_id, []).append(o.token_id)
            current += 1
        for o in engines[current].step():
            out.setdefault(o.seq_id, []).append(o.token_id)
        if step > max(r[3] for r in requests) and not engines[current].has_unfinished():
            return out, results
    raise AssertionError("generation did not finish")


@pytest.mark.parametrize("path", ["migrate", "replay"])
@pytest.mark.parametrize("trip", list(ROUND_TRIPS))
def test_a_switch_there_and_back_changes_no_token(
    engines: EnginePool, tiny_model: TinyModel, trip: str, path: str
) -> None:
    first, second = (engines.get(name) for name in ROUND_TRIPS[trip])
    baseline, _ = generate([first], [], path)
    switched, results = generate([first, second, first], [5, 10], path)
    assert switched == baseline
    for seq_id, prompt, params, _ in REQUESTS:
        assert baseline[seq_id] == tiny_model.reference(prompt, N, params), seq_id
    # Both switches moved all three sequences, at different token counts.
    assert [sorted(r.records) for r in results] == [["greedy", "seeded", "topk"]] * 2
    for result in results:
        for record in result.records.values():
            assert record.stall_s > 0
            if path == "migrate":
                assert record.tokens_recomputed == 0
                assert record.bytes_moved > record.kv_bytes > 0
            else:
                assert record.kv_bytes == 0 and record.tokens_recomputed > 0
                assert record.bytes_moved < 1000


def test_migrated_bytes_are_the_kv_of_the_cached_tokens_plus_a_header(
    engines: EnginePool, tiny_model: TinyModel
) -> None:
    _, results = generate([engines.get("tp2"), engines.get("pp2")], [5], "migrate")
    records = results[0].records
    # After 5 steps "greedy" (joined at step 0) has 5 generated tokens, the last not yet fed:
    # its prompt + 4 tokens are cached. "seeded" joined at step 2 (3 tokens), "topk" at 3 (2).
    per_token = tiny_model.cfg.kv_bytes_per_token
    assert records["greedy"].kv_bytes == (5 + 5 - 1) * per_token
    assert records["seeded"].kv_bytes == (3 + 3 - 1) * per_token
    assert records["topk"].kv_bytes == (7 + 2 - 1) * per_token
    for r in records.values():
        assert 0 < r.bytes_moved - r.kv_bytes < 1000
    run_to_end(engines.get("pp2"))


@pytest.mark.parametrize("path", ["migrate", "replay"])
@pytest.mark.parametrize("target", ["tp2", "disagg"])
def test_a_sequence_caught_in_chunked_prefill_moves_too(
    engines: EnginePool, tiny_model: TinyModel, path: str, target: str
) -> None:
    old, new = engines.get("pp2"), engines.get(target)
    old.max_tokens_per_step = 2
    prompt = [20, 21, 22, 23, 24, 25, 26, 27, 28]
    old.add_request("slow", prompt, 6, SEEDED)
    old.step()
    old.step()
    state = old.export_kv("slow")
    assert state.num_cached_tokens == 4 and state.generated_ids == ()
    result = switch_sequences(old, new, path=path)  # type: ignore[arg-type]
    out = {"slow": [o.token_id for o in result.outputs]}
    run_to_end(new, out)
    assert out["slow"] == tiny_model.reference(prompt, 6, SEEDED)


@pytest.mark.parametrize("k", [1, N - 1])
def test_a_switch_right_after_prefill_or_before_the_last_token_changes_nothing(
    engines: EnginePool, tiny_model: TinyModel, k: int
) -> None:
    requests = [("only", [7, 7, 8], SEEDED, 0)]
    out, results = generate([engines.get("tp2"), engines.get("disagg")], [k], "migrate", requests)
    assert out["only"] == tiny_model.reference([7, 7, 8], N, SEEDED)
    assert len(results[0].outputs) == 1 and results[0].outputs[0].finished == (k == N - 1)


def test_a_failed_import_leaves_the_sequences_on_the_old_engine(
    engines: EnginePool, tiny_model: TinyModel
) -> None:
    """The rollback: the new engine has no room, the old one keeps every sequence and goes on."""
    old = engines.get("tp2")
    tiny = TorchEngine(tiny_model.path, Layout.pipeline(4), device=DEVICE, num_kv_blocks=2, block_size=4)
    try:
        old.add_request("a", [1, 2, 3, 4, 5, 6, 7], 8, SEEDED)
        out: dict[str, list[int]] = {}
        for _ in range(3):
            for o in old.step():
                out.setdefault(o.seq_id, []).append(o.token_id)
        with pytest.raises(KVCacheFullError):
            switch_sequences(old, tiny, path="migrate")
        assert old.sequence_ids() == ["a"] and tiny.sequence_ids() == []
        assert tiny.num_free_blocks() == {"main": 2}
        run_to_end(old, out)
        assert out["a"] == tiny_model.reference([1, 2, 3, 4, 5, 6, 7], 8, SEEDED)
    finally:
        tiny.shutdown()


LAYOUT_PAIRS = [("tp2", "pp2"), ("pp2", "tp2"), ("tp2", "disagg"), ("disagg", "pp2"), ("tp1", "tp4")]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompt=st.lists(st.integers(0, 511), min_size=1, max_size=12),
    n=st.integers(2, 10),
    data=st.data(),
    pair=st.sampled_from(LAYOUT_PAIRS),
    path=st.sampled_from(["migrate", "replay"]),
    temperature=st.sampled_from([0.0, 0.7, 1.5]),
    seed=st.integers(0, 2**31),
)
def test_any_prompt_switched_at_any_token_matches_the_unswitched_run(
    engines: EnginePool,
    tiny_model: TinyModel,
    prompt: list[int],
    n: int,
    data: st.DataObject,
    pair: tuple[str, str],
    path: str,
    temperature: float,
    seed: int,
) -> None:
    k = data.draw(st.integers(1, n - 1), label="switch after token")
    params = SamplingParams(temperature=temperature, top_p=0.9, seed=seed, ignore_eos=True)
    old, new = (engines.get(name) for name in pair)
    requests = [("h", prompt, params, 0)]
    baseline, _ = generate([old], [], path, requests, n)
    switched, _ = generate([old, new], [k], path, requests, n)
    assert switched == baseline
    engines.tidy()


def test_a_paused_sequence_waits_while_the_others_decode_then_moves_or_resumes(
    engines: EnginePool, tiny_model: TinyModel
) -> None:
    """The cross-agent protocol: export + pause, send, then drop (moved) or resume (rolled back)."""
    old, new = engines.get("tp2"), engines.get("pp2")
    prompts = {"moves": [1, 2, 3], "stays": [4, 5, 6, 7], "rolls-back": [8, 9]}
    for seq_id, prompt in prompts.items():
        old.add_request(seq_id, prompt, 9, SEEDED)
    out: dict[str, list[int]] = {}
    for _ in range(3):
        for o in old.step():
            out.setdefault(o.seq_id, []).append(o.token_id)
    states = {s: old.export_kv(s) for s in ("moves", "rolls-back")}
    for seq_id in states:
        old.pause(seq_id)
    for _ in range(2):  # the transfer takes a while; "stays" keeps decoding, the paused do not
        emitted = old.step()
        assert [o.seq_id for o in emitted] == ["stays"]
        out["stays"].append(emitted[0].token_id)
    link = TcpLink(expect_model_sha256=new.model_sha256)
    try:
        moved, _ = link.move(states["moves"])
    finally:
        link.close()
    new.import_kv("moves", moved)
    old.drop("moves")
    old.resume("rolls-back")  # say its target refused it: it simply goes on here
    run_to_end(old, out)
    run_to_end(new, out)
    for seq_id, prompt in prompts.items():
        assert out[seq_id] == tiny_model.reference(prompt, 9, SEEDED), seq_id


def test_a_replay_only_state_imported_elsewhere_is_re_prefilled(
    engines: EnginePool, tiny_model: TinyModel
) -> None:
    """Over the wire the replay path is the same frame without KV: import_kv re-prefills it."""
    old, new = engines.get("tp1"), engines.get("disagg")
    old.add_request("r", [6, 5, 4, 3], 8, SEEDED_TOPK)
    out = run_to_end_after(old, 4)
    state = InProcessLink().move(old.export_kv("r", include_kv=False))[0]
    new.import_kv("r", state)
    old.drop("r")
    run_to_end(new, out)
    assert out["r"] == tiny_model.reference([6, 5, 4, 3], 8, SEEDED_TOPK)


def run_to_end_after(engine: TorchEngine, steps: int) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for _ in range(steps):
        for o in engine.step():
            out.setdefault(o.seq_id, []).append(o.token_id)
    return out
