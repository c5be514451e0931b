"""KV frames: exact round trips, corruption caught, and real TCP transfers between engines."""

from __future__ import annotations

import json
import socket
import struct

import pytest
import torch

from agents.engines.torch.engine import KVState
from agents.engines.torch.kvtransfer import (
    MAGIC,
    KVReceiver,
    KVTransferError,
    decode_kv_state,
    encode_kv_state,
    send_frames,
    send_kv_states,
)
from agents.engines.torch.sampling import SamplingParams
from tests.agents.engines.conftest import GREEDY, SEEDED, EnginePool, TinyModel, run_to_end

pytestmark = pytest.mark.timeout(60)

SHA = "5e" * 32


def make_state(num_cached: int = 5, seq_id: str = "seq-1") -> KVState:
    gen = torch.Generator().manual_seed(num_cached)
    shape = (4, num_cached, 2, 32)
    return KVState(
        seq_id=seq_id,
        model_sha256=SHA,
        token_ids=tuple(range(10, 16)),
        num_prompt_tokens=3,
        max_new_tokens=9,
        sampling=SamplingParams(temperature=0.8, top_p=0.95, seed=42),
        sampler_draws=3,
        num_cached_tokens=num_cached,
        keys=torch.randn(shape, generator=gen),
        values=torch.randn(shape, generator=gen),
    )


def assert_same(a: KVState, b: KVState) -> None:
    assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert {k: v for k, v in a.__dict__.items() if k not in ("keys", "values")} == {
        k: v for k, v in b.__dict__.items() if k not in ("keys", "values")
    }


def test_a_frame_round_trips_bit_exactly() -> None:
    state = make_state()
    frame = encode_kv_state(state)
    assert frame[:4] == MAGIC
    assert len(frame) > state.kv_bytes == 2 * 4 * 5 * 2 * 32 * 4
    assert_same(decode_kv_state(frame, expect_model_sha256=SHA), state)


def test_a_replay_only_state_is_a_few_hundred_bytes() -> None:
    state = make_state(num_cached=0)
    frame = encode_kv_state(state)
    assert len(frame) < 600
    assert_same(decode_kv_state(frame), state)


def _meta_span(frame: bytes) -> tuple[int, int]:
    meta_len = struct.unpack_from("<I", frame, 8)[0]
    return 20, 20 + meta_len


def test_a_flipped_kv_byte_is_caught_by_the_checksum() -> None:
    frame = bytearray(encode_kv_state(make_state()))
    frame[-7] ^= 0x01
    with pytest.raises(KVTransferError, match="frame.checksum_sha256: mismatch"):
        decode_kv_state(frame)


def test_a_changed_token_id_in_the_header_is_caught_by_the_checksum() -> None:
    frame = encode_kv_state(make_state())
    start, end = _meta_span(frame)
    meta = frame[start:end].replace(b'"token_ids":[10,', b'"token_ids":[11,')
    assert meta != frame[start:end] and len(meta) == end - start
    with pytest.raises(KVTransferError, match="frame.checksum_sha256: mismatch"):
        decode_kv_state(frame[:start] + meta + frame[end:])


@pytest.mark.parametrize(
    ("mangle", "match"),
    [
        (lambda f: b"XXXX" + f[4:], r"frame.magic: expected b'FPKV'"),
        (lambda f: f[:4] + struct.pack("<H", 9) + f[6:], "frame.version: this side speaks 1, the frame is 9"),
        (lambda f: f[:-10], "frame: .* bytes, its prefix announces"),
        (lambda f: f[:10], "shorter than the 20-byte prefix"),
    ],
)
def test_malformed_frames_are_refused_naming_the_field(mangle: object, match: str) -> None:
    frame = encode_kv_state(make_state())
    with pytest.raises(KVTransferError, match=match):
        decode_kv_state(mangle(frame))  # type: ignore[operator]


def test_a_frame_for_other_weights_or_beyond_the_size_limit_is_refused() -> None:
    frame = encode_kv_state(make_state())
    with pytest.raises(KVTransferError, match="frame.model_sha256"):
        decode_kv_state(frame, expect_model_sha256="00" * 32)
    with pytest.raises(KVTransferError, match="max_frame_bytes"):
        decode_kv_state(frame, max_frame_bytes=1000)


def test_states_cross_a_real_tcp_connection_and_the_bytes_are_counted() -> None:
    states = [make_state(5, "a"), make_state(0, "b"), make_state(17, "c")]
    with KVReceiver(expect_model_sha256=SHA) as receiver:
        sent = send_kv_states(receiver.address, states)
        got = [receiver.get(timeout_s=10) for _ in states]
        assert sent == sum(len(encode_kv_state(s)) for s in states) == receiver.bytes_received
        for state, received in zip(states, got, strict=True):
            assert_same(received.state, state)
            assert received.frame_bytes == len(encode_kv_state(state))


def test_the_receiver_refuses_a_corrupted_frame_and_keeps_serving() -> None:
    frame = bytearray(encode_kv_state(make_state()))
    frame[-1] ^= 0xFF
    with KVReceiver(expect_model_sha256=SHA) as receiver:
        with pytest.raises(
            KVTransferError, match="receiver refused the frame: frame.checksum_sha256: mismatch"
        ):
            send_frames(receiver.address, [[bytes(frame)]])
        assert receiver.errors and "checksum" in receiver.errors[0]
        with pytest.raises(KVTransferError, match="receiver refused the frame: frame.model_sha256"):
            send_kv_states(
                receiver.address, [KVState(**{**make_state().__dict__, "model_sha256": "ff" * 32})]
            )
        # a later, intact frame on a new connection still arrives
        send_kv_states(receiver.address, [make_state(3)])
        assert receiver.get(timeout_s=10).state.num_cached_tokens == 3


def test_garbage_on_the_socket_is_refused() -> None:
    with KVReceiver() as receiver, socket.create_connection(receiver.address, timeout=10) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        reply = sock.recv(2, socket.MSG_WAITALL)
        (n,) = struct.unpack("<I", sock.recv(4, socket.MSG_WAITALL))
        assert reply == b"ER" and b"frame.magic" in sock.recv(n, socket.MSG_WAITALL)


def test_one_engines_export_reaches_another_engines_import_over_tcp(
    engines: EnginePool, tiny_model: TinyModel
) -> None:
    """TP2 on one side, TP1 x PP2 on the other: the KV is re-sharded on import, tokens unchanged."""
    old, new = engines.get("tp2"), engines.get("pp2")
    old.add_request("g", [3, 1, 4, 1, 5], 10, GREEDY)
    old.add_request("s", [9, 2, 6], 10, SEEDED)
    out: dict[str, list[int]] = {}
    for _ in range(4):
        for o in old.step():
            out.setdefault(o.seq_id, []).append(o.token_id)
    with KVReceiver(expect_model_sha256=new.model_sha256) as receiver:
        sent = send_kv_states(receiver.address, [old.export_kv("g"), old.export_kv("s")])
        for _ in range(2):
            received = receiver.get(timeout_s=10)
            new.import_kv(received.state.seq_id, received.state)
            old.drop(received.state.seq_id)
    # the KV of 8 + 6 cached tokens, plus two headers
    assert sent > (8 + 6) * tiny_model.cfg.kv_bytes_per_token
    run_to_end(new, out)
    assert out["g"] == tiny_model.reference([3, 1, 4, 1, 5], 10, GREEDY)
    assert out["s"] == tiny_model.reference([9, 2, 6], 10, SEEDED)


def test_the_header_is_plain_json_naming_what_it_carries() -> None:
    frame = encode_kv_state(make_state())
    start, end = _meta_span(frame)
    meta = json.loads(frame[start:end])
    assert meta["seq_id"] == "seq-1" and meta["model_sha256"] == SHA
    assert meta["shape"] == [4, 5, 2, 32] and meta["dtype"] == "float32"
    assert len(meta["checksum_sha256"]) == 64
