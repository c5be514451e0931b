"""The torch engine's batching (agents/engines/torch/batching.py): priority classes and length
buckets - first the choice of chunks on a bare block allocator, then on real worker processes.

Steps are counted, never timed: a short prompt's "time to first token" here is the engine steps
from its arrival to its first token."""

from __future__ import annotations

import dataclasses
import multiprocessing
from collections.abc import Iterator

import pytest

from agents.engines.torch.batching import Batcher, Seq
from agents.engines.torch.engine import TorchEngine
from agents.engines.torch.kvcache import BlockAllocator
from agents.engines.torch.kvtransfer import decode_kv_state, encode_kv_state
from agents.engines.torch.layout import Layout
from scheduler.buckets import LengthBuckets
from tests.agents.engines.conftest import DEVICE, GREEDY, SEEDED, EnginePool, TinyModel, pid_alive, run_to_end

pytestmark = pytest.mark.timeout(120)

BUCKETS = LengthBuckets(edges=(16, 64))  # the tiny model holds 512 positions: < 16, 16-64, >= 64 tokens
LONG = [(7 * i) % 500 + 3 for i in range(200)]  # bucket 2
SHORTS = [[10 + k, 20, 30, 40, 50, 60] for k in range(4)]  # bucket 0
STEP_TOKENS = 32  # the long prompt's prefill takes 7 steps at this budget


# --- the choice of chunks, without workers ----------------------------------------------------------


def _seq(alloc: BlockAllocator, seq_id: str, prompt: int, arrival: int, priority: int = 0,
         generated: int = 1, computed: int | None = None) -> Seq:
    """A sequence holding the blocks of its first `computed` tokens (all but the last: decoding)."""
    n = prompt + generated
    seq = Seq(seq_id, list(range(1, n + 1)), prompt, 64, GREEDY, 0, arrival, "main",
              num_computed=n - 1 if computed is None else computed, priority=priority)
    if seq.num_computed:
        alloc.ensure(seq_id, seq.num_computed)
    return seq


def _full_of_decodes(alloc: BlockAllocator) -> list[Seq]:
    """Four decodes, each with a full last block, filling the cache: every one needs a new block."""
    seqs = [_seq(alloc, "a", 8, 0, priority=1), _seq(alloc, "b-long", 72, 1, priority=1),
            _seq(alloc, "c", 8, 2, priority=1), _seq(alloc, "d-urgent", 8, 3, priority=0)]
    assert alloc.num_free_blocks == 0
    return seqs


def test_a_decode_preempts_the_least_urgent_class_then_its_longest_bucket_then_the_latest() -> None:
    alloc = BlockAllocator(24, 4)
    seqs = _full_of_decodes(alloc)
    batch = Batcher("main", BUCKETS).schedule("main", seqs, alloc, 256)
    assert [s.seq_id for s in batch.preempted] == ["b-long"]  # class 1, bucket 2, though "c" came later
    assert sorted(s.seq_id for s, _, _ in batch.chunks) == ["a", "c", "d-urgent"]
    alloc = BlockAllocator(24, 4)
    seqs = _full_of_decodes(alloc)
    batch = Batcher("main").schedule("main", seqs, alloc, 256)
    assert batch.preempted[0].seq_id == "c"  # no buckets: the latest of class 1, never "d-urgent"
    assert all(s.seq_id != "d-urgent" for s in batch.preempted)
    assert all(s.num_computed == 0 and not alloc.has(s.seq_id) for s in batch.preempted)


def _full_with_a_waiting(alloc: BlockAllocator, waiting_priority: int, waiting_prompt: int = 4) -> list[Seq]:
    """Three decodes of classes 2, 1, 0 (none needs a new block) fill the cache; one prompt waits."""
    seqs = [_seq(alloc, f"run{p}", 7, 2 - p, priority=p) for p in (2, 1, 0)]
    assert alloc.num_free_blocks == 0
    return [*seqs, _seq(alloc, "new", waiting_prompt, 9, priority=waiting_priority, generated=0, computed=0)]


def test_a_waiting_prefill_preempts_only_a_less_urgent_class_and_only_when_that_makes_it_fit() -> None:
    alloc = BlockAllocator(6, 4)
    batch = Batcher("main").schedule("main", _full_with_a_waiting(alloc, 1), alloc, 256)
    assert [s.seq_id for s in batch.preempted] == ["run2"]
    assert [(s.seq_id, n) for s, n, _ in batch.chunks] == [("run0", 1), ("run1", 1), ("new", 4)]
    for same_or_less_urgent in (2, 3):  # an equal class waits; so does a less urgent one
        alloc = BlockAllocator(6, 4)
        batch = Batcher("main").schedule("main", _full_with_a_waiting(alloc, same_or_less_urgent), alloc, 256)
        assert batch.preempted == [] and len(batch.chunks) == 3
    alloc = BlockAllocator(6, 4)  # 5 blocks needed, "run1" and "run2" free 4: nobody is preempted for nothing
    batch = Batcher("main").schedule("main", _full_with_a_waiting(alloc, 0, waiting_prompt=20), alloc, 256)
    assert batch.preempted == [] and [s.seq_id for s, _, _ in batch.chunks] == ["run0", "run1", "run2"]


def test_with_buckets_a_shorter_bucket_is_prefilled_first_within_its_class_even_unsplit() -> None:
    # 15 and 17 tokens: buckets 0 and 1, a spread under the split ratio - no caps, only the order
    def step(buckets: LengthBuckets | None) -> list[str]:
        alloc = BlockAllocator(64, 4)
        seqs = [_seq(alloc, "medium", 17, 0, generated=0, computed=0),
                _seq(alloc, "short", 15, 1, generated=0, computed=0),
                _seq(alloc, "urgent-medium", 17, 2, priority=-1, generated=0, computed=0)]
        return [s.seq_id for s, _, _ in Batcher("main", buckets).schedule("main", seqs, alloc, 40).chunks]

    assert step(BUCKETS) == ["urgent-medium", "short", "medium"]  # the class first, then the bucket
    assert step(None) == ["urgent-medium", "medium", "short"]  # one queue: arrival order


# --- on worker processes ----------------------------------------------------------------------------


def _engine(tiny_model: TinyModel, **kw: object) -> Iterator[TorchEngine]:
    engine = TorchEngine(tiny_model.path, Layout.pipeline(4), device=DEVICE, timeout_s=60, **kw)  # type: ignore[arg-type]
    yield engine
    engine.shutdown()
    assert not any(pid_alive(p) for p in engine.pids)


@pytest.fixture(scope="module")
def bucketed_engine(tiny_model: TinyModel) -> Iterator[TorchEngine]:
    yield from _engine(tiny_model, max_tokens_per_step=STEP_TOKENS, length_buckets=BUCKETS)


@pytest.fixture(scope="module")
def tight_engine(tiny_model: TinyModel) -> Iterator[TorchEngine]:
    """5 blocks of 4 tokens: one sequence of 8 + 12 tokens fills it."""
    yield from _engine(tiny_model, num_kv_blocks=5, block_size=4)


def _tidy(engine: TorchEngine) -> Iterator[TorchEngine]:
    yield engine
    for seq_id in engine.sequence_ids():  # what a failed test left behind
        engine.drop(seq_id)


@pytest.fixture
def bucketed(bucketed_engine: TorchEngine) -> Iterator[TorchEngine]:
    yield from _tidy(bucketed_engine)


@pytest.fixture
def tight(tight_engine: TorchEngine) -> Iterator[TorchEngine]:
    yield from _tidy(tight_engine)


def first_token_steps(engine: TorchEngine) -> tuple[dict[str, int], dict[str, list[int]]]:
    """The long prompt, then four short ones, all queued before the first step: per sequence, the
    step that gave its first token, and its tokens."""
    engine.add_request("long", LONG, 4, GREEDY)
    for k, prompt in enumerate(SHORTS):
        engine.add_request(f"short{k}", prompt, 4, GREEDY)
    first: dict[str, int] = {}
    out: dict[str, list[int]] = {}
    for step in range(1, 100):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            first.setdefault(o.seq_id, step)
            out.setdefault(o.seq_id, []).append(o.token_id)
    return first, out


def test_short_prompts_behind_a_long_one_get_their_first_token_sooner_and_the_same_tokens_with_buckets(
    bucketed: TorchEngine, engines: EnginePool, tiny_model: TinyModel
) -> None:
    fcfs = engines.get("tp1")
    fcfs.max_tokens_per_step = STEP_TOKENS
    first_fcfs, out_fcfs = first_token_steps(fcfs)
    first_split, out_split = first_token_steps(bucketed)
    shorts = [f"short{k}" for k in range(len(SHORTS))]
    # one queue: every short prompt waits for the long prefill (7 steps); with buckets the shorter
    # bucket is prefilled first, in the very first step (all queued: the long one is not begun yet)
    assert min(first_fcfs[s] for s in shorts) == 7
    assert max(first_split[s] for s in shorts) == 1
    assert first_split["long"] <= first_fcfs["long"] + 1  # the long one pays one step, not more
    assert out_split == out_fcfs  # greedy: the split changes when tokens come, never which
    assert out_split["long"] == tiny_model.reference(LONG, 4, GREEDY)
    assert out_split["short0"] == tiny_model.reference(SHORTS[0], 4, GREEDY)


LOW_PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


def _fill_with_low(engine: TorchEngine, out: dict[str, list[int]]) -> None:
    engine.add_request("low", LOW_PROMPT, 12, SEEDED, priority=1)
    for _ in range(20):
        if not engine.num_free_blocks()["main"]:
            return
        for o in engine.step():
            out.setdefault(o.seq_id, []).append(o.token_id)
    raise AssertionError("the low sequence never filled the cache")


def test_an_urgent_request_preempts_a_less_urgent_one_which_still_finishes_with_its_own_tokens_once(
    tight: TorchEngine, tiny_model: TinyModel
) -> None:
    out: dict[str, list[int]] = {}
    _fill_with_low(tight, out)
    before = tight.stats.preemptions
    tight.add_request("urgent", [9, 8, 7, 6], 4, GREEDY, priority=0)
    emitted = tight.step()
    assert [o.seq_id for o in emitted] == ["urgent"]  # at once: "low" gave up its KV
    assert tight.stats.preemptions == before + 1
    out.setdefault("urgent", []).append(emitted[0].token_id)
    finished: list[str] = []
    while tight.has_unfinished():
        for o in tight.step():
            out.setdefault(o.seq_id, []).append(o.token_id)
            if o.finished:
                finished.append(o.seq_id)
    assert finished == ["urgent", "low"]  # each exactly once, the urgent one first
    assert out["low"] == tiny_model.reference(LOW_PROMPT, 12, SEEDED)  # recomputed, not lost or repeated
    assert out["urgent"] == tiny_model.reference([9, 8, 7, 6], 4, GREEDY)
    assert tight.num_free_blocks() == {"main": 5}


def test_a_request_of_the_same_class_waits_for_room_instead_of_preempting(tight: TorchEngine) -> None:
    out: dict[str, list[int]] = {}
    _fill_with_low(tight, out)
    before = tight.stats.preemptions
    tight.add_request("peer", [9, 8, 7, 6], 4, GREEDY, priority=1)
    run_to_end(tight, out)
    assert tight.stats.preemptions == before and len(out["low"]) == 12 and len(out["peer"]) == 4


def test_a_decode_that_preempts_itself_is_recomputed_and_keeps_its_tokens(
    tight: TorchEngine, tiny_model: TinyModel
) -> None:
    # Two sequences of 4 + 12 tokens in 5 blocks: the later one, needing a block while the other
    # is already in the step, gives up its own KV. It used to be fed at position 0 in that very
    # step, sampling a token after its first prompt token.
    prompts = {"first": [1, 2, 3, 4], "second": [50, 60, 70, 80]}
    before = tight.stats.preemptions
    for seq_id, prompt in prompts.items():
        tight.add_request(seq_id, prompt, 12, GREEDY)
    out = run_to_end(tight)
    assert tight.stats.preemptions > before
    for seq_id, prompt in prompts.items():
        assert out[seq_id] == tiny_model.reference(prompt, 12, GREEDY), seq_id


def test_a_state_carries_its_priority_through_export_import_and_the_wire(engines: EnginePool) -> None:
    engine = engines.get("tp1")
    engine.add_request("p", [5, 6, 7], 4, GREEDY, priority=-3)
    engine.step()
    state = engine.export_kv("p")
    assert state.priority == -3 and decode_kv_state(encode_kv_state(state)).priority == -3
    default = dataclasses.replace(state, priority=0)
    assert b'"priority"' not in encode_kv_state(default)  # the default class: the frame as before
    engine.drop("p")
    engine.import_kv("p", state)
    assert engine.export_kv("p").priority == -3


# --- bad input ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("priority", [True, 1.5, "0", 1001, -1001])
def test_a_bad_priority_is_refused_naming_the_field(engines: EnginePool, priority: object) -> None:
    engine = engines.get("tp1")
    with pytest.raises(ValueError, match=r"priority: must be an integer in \[-1000, 1000\]"):
        engine.add_request("bad", [1, 2], 4, priority=priority)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"priority: must be an integer"):
        engine.replay("bad", [1, 2], [3], 4, priority=priority)  # type: ignore[arg-type]
    assert engine.sequence_ids() == []
    engine.add_request("ok", [1, 2], 4)
    engine.step()
    state = dataclasses.replace(engine.export_kv("ok"), priority=priority)
    engine.drop("ok")
    with pytest.raises(ValueError, match=r"state.priority: must be an integer"):
        engine.import_kv("ok", state)
    assert engine.sequence_ids() == []


def test_bad_length_buckets_are_refused_before_any_process_starts(tiny_model: TinyModel) -> None:
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="length_buckets: must be a LengthBuckets or None, got tuple"):
        TorchEngine(tiny_model.path, Layout.pipeline(4), device=DEVICE, length_buckets=(16, 64))  # type: ignore[arg-type]
    assert set(multiprocessing.active_children()) <= before

