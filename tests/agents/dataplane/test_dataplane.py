"""PlanHosts on DataServers: streams that survive a hand-over, and every way the data plane says no."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from agents.dataplane import Frozen, NotHere, PlanHost, StaleLease
from agents.dataplane.client import send_state, stream_tokens
from agents.engines.torch.sampling import SamplingParams
from scheduler.buckets import LengthBuckets
from tests.agents.dataplane.conftest import PLAN_PP2, PLAN_TP1, PLAN_TP2, Node, TinyModel, new_seq_id

GREEDY = SamplingParams(ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True)
PROMPT = [5, 17, 42, 99, 3, 250, 7, 11]


class Followed:
    """What a client saw reading one sequence across hand-overs."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.ends: list[dict[str, Any]] = []  # every end event, in order (moved ..., then the last)
        self.stall_s: list[float] = []  # last token before a move -> first token after it


def follow(addr: str, body: dict[str, Any], on_token: Callable[[int], None] | None = None) -> Followed:
    """Read a generate stream like the gateway does: on "moved", go on at the target from the
    tokens already received (retrying briefly while the target does not have it yet)."""
    seen = Followed()
    events = stream_tokens(addr, generate=body)
    last_token_s = time.monotonic()
    moved_at: float | None = None
    while True:
        end = None
        for ev in events:
            if "token" in ev:
                assert ev["i"] == len(seen.tokens), f"index {ev['i']} after {len(seen.tokens)} tokens"
                now = time.monotonic()
                if moved_at is not None:
                    seen.stall_s.append(now - last_token_s)
                    moved_at = None
                last_token_s = now
                seen.tokens.append(ev["token"])
                if on_token is not None:
                    on_token(len(seen.tokens))
            else:
                end = ev
        assert end is not None, "a stream ended without an end event"
        seen.ends.append(end)
        if "moved" not in end:
            return seen
        moved_at = time.monotonic()
        target = end["moved"]
        for _ in range(100):
            try:
                events = stream_tokens(target["target_addr"], seq_id=body["seq_id"], from_index=len(seen.tokens))
                first = next(events)
            except NotHere:
                time.sleep(0.01)
                continue
            events = _chain(first, events)
            break
        else:
            raise AssertionError(f"{body['seq_id']} never showed up at {target['target_addr']}")


def _chain(first: dict[str, Any], rest: Any) -> Any:
    yield first
    yield from rest


def gen_body(plan_host: PlanHost, seq_id: str, max_tokens: int, sampling: SamplingParams = GREEDY,
             prompt: list[int] | None = None) -> dict[str, Any]:
    return {"deployment": plan_host.deployment, "plan_id": plan_host.plan_id, "seq_id": seq_id,
            "prompt_ids": prompt or PROMPT, "max_tokens": max_tokens, "sampling": sampling.to_dict()}


def move_when(host: PlanHost, sid: str, n: int,
              fn: Callable[[], Any]) -> tuple[Callable[[int], None], dict[str, Any]]:
    """An on_token callback that runs `fn` in a thread once the client has read `n` tokens; its
    result lands in box.

    So that the move lands mid-stream however loaded the machine is, `host`'s engine holds its
    step once `sid` has `n` tokens until the move thread runs, and then steps at most every 10 ms
    until the move returned (a tiny model would otherwise finish 64 tokens before the thread starts).
    """
    box: dict[str, Any] = {}
    started, done = threading.Event(), threading.Event()
    assert host.engine is not None
    engine, step = host.engine, host.engine.step

    def paced_step() -> Any:
        stream = host.stream(sid)
        if stream is not None and stream.generated >= n and not done.is_set():
            started.wait(30)
            time.sleep(0.01)
        return step()

    engine.step = paced_step  # type: ignore[method-assign]

    def run() -> None:
        started.set()
        try:
            box["result"] = fn()
        finally:
            done.set()

    def on_token(count: int) -> None:
        if count == n:
            t = threading.Thread(target=run)
            t.start()
            box["thread"] = t

    return on_token, box


@pytest.mark.parametrize(("action", "target_plan", "sampling"), [
    ("migrate", PLAN_PP2, GREEDY),
    ("replay", PLAN_PP2, GREEDY),
    ("migrate", PLAN_TP2, SEEDED),
    ("replay", PLAN_TP2, SEEDED),
])
def test_a_stream_handed_over_mid_way_gives_the_tokens_of_a_run_without_a_switch(
        tiny_model: TinyModel, make_node: Callable[[], Node], action: str, target_plan: dict[str, Any],
        sampling: SamplingParams) -> None:
    a, b = make_node(), make_node()
    src, dst = a.run(tiny_model, PLAN_TP1), b.run(tiny_model, target_plan)
    sid, n = new_seq_id(action), 64
    expected = tiny_model.reference(PROMPT, n, sampling)
    move = {"seq_id": sid, "action": action, "target_plan": dst.plan_id, "target_node": "b",
            "target_addr": b.addr}
    on_token, box = move_when(src, sid, 5, lambda: src.move([move], routing_version=2))

    seen = follow(a.addr, gen_body(src, sid, n, sampling), on_token)

    box["thread"].join(30)
    result = box["result"]
    assert result["plan_id"] == src.plan_id and "reason" not in result, result
    (moved,) = result["moved"]
    assert moved["ok"] and moved["action"] == action
    assert seen.ends[0] == {"moved": {"target_addr": b.addr, "target_plan": dst.plan_id, "routing_version": 2}}
    assert seen.ends[-1] == {"done": True, "finish_reason": "length"}
    assert seen.tokens == expected
    if action == "migrate":
        assert moved["kv_bytes"] > 0 and moved["replay_tokens"] == 0
    else:
        assert moved["kv_bytes"] == 0 and moved["replay_tokens"] == moved["context_tokens"]
    print(f"\n{action} TP1 -> {dst.layout.describe()}: client stall {1000 * seen.stall_s[0]:.1f} ms, "
          f"hand-over {1000 * moved['stall_s']:.1f} ms, {moved['kv_bytes']} KV bytes")
    # the source no longer runs it; the target finished it
    assert src.engine is not None and sid not in src.engine.sequence_ids()
    assert dst.report().finished == 1


def test_a_full_waiting_queue_answers_429_with_retry_after(
        tiny_model: TinyModel, make_node: Callable[[], Node]) -> None:
    a = make_node()
    host = a.run(tiny_model, PLAN_TP1, max_waiting=1)
    assert host.engine is not None
    host.engine.max_tokens_per_step = 1  # a 480-token prompt now takes 480 steps to prefill: it waits
    long_prompt = [(7 * i) % 500 + 3 for i in range(480)]
    host.admit(new_seq_id(), long_prompt, 1, GREEDY)

    resp = httpx.post(f"http://{a.addr}/data/v1/generate", json=gen_body(host, new_seq_id(), 4))

    assert resp.status_code == 429
    assert int(resp.headers["Retry-After"]) >= 1
    assert resp.json()["reason"] == "saturated"


def test_a_frozen_plan_answers_409_and_admits_again_when_thawed(
        tiny_model: TinyModel, make_node: Callable[[], Node]) -> None:
    a = make_node()
    host = a.run(tiny_model, PLAN_TP1)
    running = host.admit("in-flight", PROMPT, 400, GREEDY)

    ack = host.freeze(routing_version=3)
    resp = httpx.post(f"http://{a.addr}/data/v1/generate", json=gen_body(host, new_seq_id(), 4))

    assert resp.status_code == 409 and resp.json()["reason"] == "frozen"
    assert ack["plan_id"] == host.plan_id and ack["decode_step_s"] >= 0
    seqs = {s["seq_id"]: s for s in ack["sequences"]}
    assert list(seqs) == ["in-flight"] and seqs["in-flight"]["max_tokens"] == 400
    assert seqs["in-flight"]["context_tokens"] == len(PROMPT) + seqs["in-flight"]["generated_tokens"]
    with pytest.raises(Frozen):
        host.admit(new_seq_id(), PROMPT, 4, GREEDY)
    host.thaw()
    seen = follow(a.addr, gen_body(host, new_seq_id(), 4))
    assert seen.ends == [{"done": True, "finish_reason": "length"}] and len(seen.tokens) == 4
    assert running.end is None or running.end.get("done")


def test_an_unknown_plan_answers_409_and_bad_input_400_naming_the_field(
        tiny_model: TinyModel, make_node: Callable[[], Node]) -> None:
    a = make_node()
    host = a.run(tiny_model, PLAN_TP1)
    url = f"http://{a.addr}/data/v1/generate"

    unknown = httpx.post(url, json={**gen_body(host, new_seq_id(), 4), "plan_id": "p-nope"})
    bad_ids = httpx.post(url, json={**gen_body(host, new_seq_id(), 4), "prompt_ids": [1, "x"]})
    too_big = httpx.post(url, json={**gen_body(host, new_seq_id(), 4), "prompt_ids": [1, 100_000]})
    bad_temp = httpx.post(url, json={**gen_body(host, new_seq_id(), 4), "sampling": {"temperature": -1}})
    bad_priority = httpx.post(url, json={**gen_body(host, new_seq_id(), 4), "priority": "soon"})

    assert unknown.status_code == 409 and unknown.json()["reason"] == "unknown_plan"
    assert bad_ids.status_code == 400 and bad_ids.json()["param"] == "prompt_ids"
    assert too_big.status_code == 400 and too_big.json()["param"] == "prompt_ids[1]"
    assert bad_temp.status_code == 400 and bad_temp.json()["param"] == "sampling.temperature"
    assert bad_priority.status_code == 400 and bad_priority.json()["param"] == "priority"
    assert httpx.get(f"http://{a.addr}/data/v1/sequences/none/stream").status_code == 404


def test_a_lease_not_newer_than_the_one_held_is_refused_and_the_sequence_stays(
        tiny_model: TinyModel, make_node: Callable[[], Node]) -> None:
    a, b = make_node(), make_node()
    src, dst = a.run(tiny_model, PLAN_TP1), b.run(tiny_model, PLAN_PP2)
    move = {"seq_id": "twice", "action": "migrate", "target_plan": dst.plan_id, "target_node": "b",
            "target_addr": b.addr}
    src.admit("twice", PROMPT, 300, GREEDY)
    first = src.move([move], routing_version=5)
    assert first["moved"][0]["ok"], first
    # the same sequence id comes back to A and is moved again under the same version: B had 5
    stream = src.admit("twice", PROMPT, 40, GREEDY)
    again = src.move([move], routing_version=5)

    (r,) = again["moved"]
    assert not r["ok"] and r["reason"] == "stale_lease" and again["reason"] == "stale_lease"
    # the refused hand-over rolled back: A goes on decoding it and finishes it, tokens intact
    assert list(e for e in stream.events(0) if "token" not in e) == [{"done": True, "finish_reason": "length"}]
    assert stream.tokens == tiny_model.reference(PROMPT, 40, GREEDY)
    # the KV frame path refuses it the same way
    state_src = make_node().run(tiny_model, PLAN_TP1)
    state_src.admit("twice", PROMPT, 300, GREEDY)
    assert state_src.engine is not None
    state = state_src._call(lambda: state_src.engine.export_kv("twice"))  # type: ignore[union-attr]
    with pytest.raises(StaleLease):
        send_state(b.addr, state, deployment="tiny", plan_id=dst.plan_id, routing_version=4,
                   resume_from=len(state.generated_ids))


def test_release_hands_unfinished_sequences_to_the_fallback_by_replay(
        tiny_model: TinyModel, make_node: Callable[[], Node]) -> None:
    a, b = make_node(), make_node()
    src, dst = a.run(tiny_model, PLAN_TP1), b.run(tiny_model, PLAN_TP2)
    sid, n = new_seq_id("rel"), 64
    fallback = {"target_plan": dst.plan_id, "target_node": "b", "target_addr": b.addr, "routing_version": 7}
    on_token, box = move_when(src, sid, 3, lambda: src.release(drain_timeout_s=0.0, fallback=fallback))

    seen = follow(a.addr, gen_body(src, sid, n), on_token)

    box["thread"].join(30)
    assert box["result"]["handed_over"] == [sid] and box["result"]["failed"] == []
    assert seen.ends[0]["moved"]["routing_version"] == 7
    assert seen.tokens == tiny_model.reference(PROMPT, n, GREEDY)
    assert src.state == "stopped"
    assert src.release(0.0, None)["noop"] is True


def test_release_without_a_fallback_ends_unfinished_sequences_with_an_explicit_error(
        tiny_model: TinyModel, make_node: Callable[[], Node]) -> None:
    a = make_node()
    host = a.run(tiny_model, PLAN_TP1)
    stream = host.admit("left", PROMPT, 400, GREEDY)
    finished = host.admit("short", PROMPT, 2, GREEDY)
    list(finished.events(0))

    result = host.release(drain_timeout_s=0.0, fallback=None)

    assert result["failed"] == ["left"] and result["handed_over"] == []
    assert "released" in (stream.end or {}).get("error", "")
    assert finished.end == {"done": True, "finish_reason": "length"}


def test_report_counts_the_interval(tiny_model: TinyModel, make_node: Callable[[], Node]) -> None:
    a = make_node()
    host = a.run(tiny_model, PLAN_TP1)
    host.report()  # starts a fresh interval
    for _ in range(3):
        follow(a.addr, gen_body(host, new_seq_id(), 6))

    rep = host.report()

    assert (rep.arrivals, rep.finished, rep.running, rep.waiting) == (3, 3, 0, 0)
    assert rep.prompt_tokens_mean == len(PROMPT) and rep.output_tokens_mean == 6
    assert rep.tokens_per_s > 0 and rep.ttft_p50_ms is not None and rep.tpot_p95_ms is not None
    assert host.report().finished == 0


@pytest.mark.parametrize(("slo_ms", "missed"), [((1e-6, 1e9), 3), ((1e9, 1e-6), 3), ((1e9, 1e9), 0), (None, 0)])
def test_report_counts_the_finished_sequences_that_missed_the_deployment_s_slo(
        tiny_model: TinyModel, make_node: Callable[[], Node], slo_ms: tuple[float, float] | None, missed: int) -> None:
    # a nanosecond objective every real sequence misses, a 10^6 s one none does: what the global
    # correction reads (EngineReport.slo_violations) is counted per sequence, TTFT or TPOT
    a = make_node()
    host = a.run(tiny_model, PLAN_TP1, slo_ms=slo_ms)
    host.report()
    for _ in range(3):
        follow(a.addr, gen_body(host, new_seq_id(), 6))
    rep = host.report()
    assert (rep.finished, rep.slo_violations) == (3, missed)


def test_a_host_refuses_an_slo_that_is_not_two_positive_objectives(tiny_model: TinyModel) -> None:
    with pytest.raises(ValueError, match="slo_ms: must be"):
        PlanHost(deployment="tiny", plan=PLAN_TP1, model_dir=str(tiny_model.path), layout=None,
                 weights_sha256=tiny_model.sha256, slo_ms=(100.0, 0.0))


def test_a_reader_that_goes_away_cancels_its_sequence(tiny_model: TinyModel, make_node: Callable[[], Node]) -> None:
    a = make_node()
    host = a.run(tiny_model, PLAN_TP1)
    sid = new_seq_id("gone")
    with httpx.Client() as client, client.stream("POST", f"http://{a.addr}/data/v1/generate",
                                                 json=gen_body(host, sid, 400)) as resp:
        lines = resp.iter_lines()
        assert "token" in next(lines) and "token" in next(lines)
    # the next token the server writes finds the connection closed
    stream = host.stream(sid)
    assert stream is not None
    ends = [e for e in stream.events(0, idle_timeout_s=30) if "token" not in e]

    assert ends == [{"error": "cancelled: the client went away"}]
    assert host.engine is not None and sid not in host.engine.sequence_ids()


def test_a_hinted_batch_scale_sets_the_torch_engine_s_tokens_per_step_and_none_restores_its_own(
        tiny_model: TinyModel, make_node: Callable[[], Node]) -> None:
    node = make_node()
    host = node.run(tiny_model, PLAN_TP1)
    assert host.engine is not None
    own = host.engine.max_tokens_per_step
    host.set_batch_scale(0.5)  # apply_hints (agents/node/node_commands.py)
    assert host.engine.max_tokens_per_step == own // 2
    host.set_batch_scale(2.0)  # a newer hint scales the engine's own threshold, not the last hinted one
    assert host.engine.max_tokens_per_step == own * 2
    seen = follow(node.addr, gen_body(host, new_seq_id(), 4))  # it serves at the hinted threshold
    assert seen.ends == [{"done": True, "finish_reason": "length"}] and len(seen.tokens) == 4
    host.set_batch_scale(None)  # the hint lapsed
    assert host.engine.max_tokens_per_step == own


def test_a_torch_host_hands_the_request_s_priority_and_its_length_buckets_to_the_engine(
        tiny_model: TinyModel, make_node: Callable[[], Node]) -> None:
    buckets = LengthBuckets(edges=(16, 64))
    host = make_node().run(tiny_model, PLAN_TP1, length_buckets=buckets)
    engine = host.engine
    assert engine is not None and engine.batcher.length_buckets == buckets
    asked: list[object] = []
    add = engine.add_request

    def spy(*args: Any, **kwargs: Any) -> None:
        asked.append(kwargs.get("priority"))
        add(*args, **kwargs)

    engine.add_request = spy  # type: ignore[method-assign]
    stream = host.admit(new_seq_id(), PROMPT, 4, GREEDY, priority=3)
    ends = [e for e in stream.events(0, idle_timeout_s=30) if "token" not in e]
    assert asked == [3] and ends == [{"done": True, "finish_reason": "length"}]
    with pytest.raises(ValueError, match="priority: must be an integer"):
        host.admit(new_seq_id(), PROMPT, 4, GREEDY, priority=5000)
