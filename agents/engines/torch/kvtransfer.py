"""Moving one sequence's KVState from agent to agent: a byte format and a small TCP link.

KV bytes go agent to agent, never through the controller: the controller tells the old agent
"send seq S to host:port" and the new agent "expect S"; the bytes take this path.

Frame (all integers little-endian):

    magic  b"FPKV"                      4 bytes
    version                             u16  (1)
    reserved                            u16  (0)
    meta_len                            u32  bytes of the JSON header that follows
    payload_len                         u64  bytes of K then V that follow the header
    meta   UTF-8 JSON: seq_id, model_sha256, token_ids, num_prompt_tokens, max_new_tokens,
           sampling, sampler_draws, num_cached_tokens, dtype ("float32"), shape
           [layers, tokens, kv_heads, head_dim], checksum_sha256; priority only when it is not 0
           (the default class), so a frame of the default class reads as it always did
    payload  K then V, C order, little-endian float32

checksum_sha256 = sha256(canonical JSON of the header without the checksum + payload): a
flipped token id is caught as surely as a flipped KV byte. The receiver answers every frame
with b"OK" or b"ER" + u32 length + a UTF-8 reason, so the sender knows the bytes arrived intact
before its agent drops the sequence.
"""

from __future__ import annotations

import hashlib
import json
import queue
import socket
import struct
import threading
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from agents.engines.torch.kvstate import KVState
from agents.engines.torch.sampling import SamplingParams

MAGIC = b"FPKV"
VERSION = 1
_PREFIX = struct.Struct("<4sHHIQ")
DEFAULT_MAX_FRAME_BYTES = 1 << 32  # refuse anything larger before allocating for it
_META_KEYS = {
    "seq_id",
    "model_sha256",
    "token_ids",
    "num_prompt_tokens",
    "max_new_tokens",
    "sampling",
    "sampler_draws",
    "num_cached_tokens",
    "dtype",
    "shape",
    "checksum_sha256",
}
_OPTIONAL_META_KEYS = {"priority"}


class KVTransferError(ValueError):
    """A frame that is malformed, corrupted, for other weights, or refused by the receiver."""


def _canonical(meta: dict[str, object]) -> bytes:
    return json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()


def _checksum(meta: dict[str, object], payload_parts: Iterable[bytes | memoryview]) -> str:
    digest = hashlib.sha256(_canonical({k: v for k, v in meta.items() if k != "checksum_sha256"}))
    for part in payload_parts:
        digest.update(part)
    return digest.hexdigest()


def _array(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.detach().to("cpu", torch.float32).numpy(), dtype="<f4")


def frame_parts(state: KVState) -> list[bytes | memoryview]:
    """The frame as a few buffers (K and V are not copied: sockets take them as they are)."""
    keys, values = _array(state.keys), _array(state.values)
    if keys.shape != values.shape:
        raise KVTransferError(
            f"state.values: shape {list(values.shape)} differs from keys {list(keys.shape)}"
        )
    # Flat byte views: memoryview.cast refuses shapes with a zero (a replay-only state).
    payload: list[bytes | memoryview] = [
        memoryview(keys.reshape(-1).view(np.uint8).data),
        memoryview(values.reshape(-1).view(np.uint8).data),
    ]
    meta: dict[str, object] = {
        "seq_id": state.seq_id,
        "model_sha256": state.model_sha256,
        "token_ids": [int(t) for t in state.token_ids],
        "num_prompt_tokens": state.num_prompt_tokens,
        "max_new_tokens": state.max_new_tokens,
        "sampling": state.sampling.to_dict(),
        "sampler_draws": state.sampler_draws,
        "num_cached_tokens": state.num_cached_tokens,
        "dtype": "float32",
        "shape": list(keys.shape),
    }
    if state.priority:
        meta["priority"] = state.priority
    meta["checksum_sha256"] = _checksum(meta, payload)
    meta_bytes = _canonical(meta)
    payload_len = keys.nbytes + values.nbytes
    return [_PREFIX.pack(MAGIC, VERSION, 0, len(meta_bytes), payload_len), meta_bytes, *payload]


def encode_kv_state(state: KVState) -> bytes:
    return b"".join(bytes(p) if isinstance(p, memoryview) else p for p in frame_parts(state))


def _parse_prefix(prefix: bytes, max_frame_bytes: int) -> tuple[int, int]:
    if len(prefix) < _PREFIX.size:
        raise KVTransferError(f"frame: {len(prefix)} bytes is shorter than the {_PREFIX.size}-byte prefix")
    magic, version, _, meta_len, payload_len = _PREFIX.unpack(prefix[: _PREFIX.size])
    if magic != MAGIC:
        raise KVTransferError(f"frame.magic: expected {MAGIC!r}, got {magic!r} (not a FlexPipe KV frame)")
    if version != VERSION:
        raise KVTransferError(f"frame.version: this side speaks {VERSION}, the frame is {version}")
    if _PREFIX.size + meta_len + payload_len > max_frame_bytes:
        raise KVTransferError(
            f"frame: {meta_len + payload_len} bytes exceeds the limit of {max_frame_bytes} (max_frame_bytes)"
        )
    return meta_len, payload_len


def _decode(
    meta_bytes: bytes | bytearray, payload: bytes | bytearray | memoryview, expect_model_sha256: str | None
) -> KVState:
    try:
        meta = json.loads(bytes(meta_bytes))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise KVTransferError(f"frame.meta: not valid JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise KVTransferError("frame.meta: must be a JSON object")
    missing, unknown = _META_KEYS - set(meta), set(meta) - _META_KEYS - _OPTIONAL_META_KEYS
    if missing or unknown:
        raise KVTransferError(f"frame.meta: missing {sorted(missing)}, unknown {sorted(unknown)}")
    if _checksum(meta, [memoryview(payload)]) != meta["checksum_sha256"]:
        raise KVTransferError("frame.checksum_sha256: mismatch, the frame was corrupted on the way")
    if expect_model_sha256 is not None and meta["model_sha256"] != expect_model_sha256:
        raise KVTransferError(
            f"frame.model_sha256: KV of weights {str(meta['model_sha256'])[:12]}..., "
            f"this side runs {expect_model_sha256[:12]}..."
        )
    if meta["dtype"] != "float32":
        raise KVTransferError(f"frame.dtype: only float32 is supported, got {meta['dtype']!r}")
    shape = meta["shape"]
    if not (
        isinstance(shape, list) and len(shape) == 4 and all(isinstance(d, int) and d >= 0 for d in shape)
    ):
        raise KVTransferError(f"frame.shape: must be 4 non-negative integers, got {shape!r}")
    per = int(np.prod(shape)) * 4
    if len(payload) != 2 * per:
        raise KVTransferError(f"frame.payload: {len(payload)} bytes, the shape {shape} needs {2 * per}")
    data = np.frombuffer(payload, dtype="<f4")
    keys = torch.from_numpy(data[: per // 4].reshape(shape).astype(np.float32))
    values = torch.from_numpy(data[per // 4 :].reshape(shape).astype(np.float32))
    try:
        sampling = SamplingParams.from_dict(meta["sampling"])
    except (TypeError, ValueError) as exc:
        raise KVTransferError(f"frame.sampling: {exc}") from None
    return KVState(
        seq_id=str(meta["seq_id"]),
        model_sha256=str(meta["model_sha256"]),
        token_ids=tuple(int(t) for t in meta["token_ids"]),
        num_prompt_tokens=int(meta["num_prompt_tokens"]),
        max_new_tokens=int(meta["max_new_tokens"]),
        sampling=sampling,
        sampler_draws=int(meta["sampler_draws"]),
        num_cached_tokens=int(meta["num_cached_tokens"]),
        keys=keys,
        values=values,
        priority=int(meta.get("priority", 0)),
    )


def decode_kv_state(
    frame: bytes | bytearray | memoryview,
    *,
    expect_model_sha256: str | None = None,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> KVState:
    """Parse and verify one frame; KVTransferError says which field is wrong."""
    view = memoryview(frame)
    meta_len, payload_len = _parse_prefix(bytes(view[: _PREFIX.size]), max_frame_bytes)
    total = _PREFIX.size + meta_len + payload_len
    if len(view) != total:
        raise KVTransferError(f"frame: {len(view)} bytes, its prefix announces {total}")
    meta = view[_PREFIX.size : _PREFIX.size + meta_len]
    return _decode(bytes(meta), view[_PREFIX.size + meta_len :], expect_model_sha256)


# --- TCP ----------------------------------------------------------------------------------------


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"peer closed after {got} of {n} bytes")
        got += k
    return buf


@dataclass(frozen=True)
class Received:
    state: KVState
    frame_bytes: int  # bytes this frame took on the wire
    peer: str


class KVReceiver:
    """Accepts KV frames over TCP and queues the decoded states for the engine's thread.

    The engine is not thread-safe, so the receiver never imports: it verifies each frame,
    acknowledges it, and queues it; the agent's engine loop takes states with `get()` and
    imports them between two steps.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        expect_model_sha256: str | None = None,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    ) -> None:
        self.expect_model_sha256 = expect_model_sha256
        self.max_frame_bytes = max_frame_bytes
        self.bytes_received = 0
        self.errors: list[str] = []
        self._queue: queue.Queue[Received] = queue.Queue()
        self._lock = threading.Lock()
        self._server = socket.create_server((host, port))
        self._server.settimeout(0.2)
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []
        accept = threading.Thread(target=self._accept_loop, name="kv-receiver", daemon=True)
        accept.start()
        self._threads.append(accept)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.getsockname()[:2]
        return host, port

    def get(self, timeout_s: float = 30.0) -> Received:
        try:
            return self._queue.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"no KV frame arrived within {timeout_s:g} s") from None

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, peer = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            t = threading.Thread(target=self._serve, args=(conn, f"{peer[0]}:{peer[1]}"), daemon=True)
            t.start()
            with self._lock:
                self._threads = [x for x in self._threads if x.is_alive()] + [t]

    def _serve(self, conn: socket.socket, peer: str) -> None:
        with conn:
            conn.settimeout(60.0)
            while not self._closed.is_set():
                try:
                    prefix = conn.recv(_PREFIX.size, socket.MSG_WAITALL)
                except OSError:
                    return
                if not prefix:
                    return  # the sender is done
                try:
                    meta_len, payload_len = _parse_prefix(prefix, self.max_frame_bytes)
                    meta = _recv_exact(conn, meta_len)
                    payload = _recv_exact(conn, payload_len)
                    state = _decode(meta, payload, self.expect_model_sha256)
                except KVTransferError as exc:
                    self._refuse(conn, str(exc))
                    return  # the stream is no longer in step: close it
                except (ConnectionError, OSError) as exc:
                    with self._lock:
                        self.errors.append(f"{peer}: {exc}")
                    return
                size = _PREFIX.size + meta_len + payload_len
                with self._lock:
                    self.bytes_received += size
                self._queue.put(Received(state, size, peer))
                conn.sendall(b"OK")

    def _refuse(self, conn: socket.socket, reason: str) -> None:
        with self._lock:
            self.errors.append(reason)
        data = reason.encode()
        try:
            conn.sendall(b"ER" + struct.pack("<I", len(data)) + data)
        except OSError:
            pass

    def close(self) -> None:
        self._closed.set()
        self._server.close()
        for t in self._threads:
            t.join(5.0)

    def __enter__(self) -> KVReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def send_frames(
    address: tuple[str, int], frames: Iterable[list[bytes | memoryview]], *, timeout_s: float = 60.0
) -> int:
    """Send frames over one connection, each acknowledged before the next; return bytes sent."""
    sent = 0
    with socket.create_connection(address, timeout=timeout_s) as sock:
        for parts in frames:
            for part in parts:
                sock.sendall(part)
                sent += len(part) if isinstance(part, bytes) else part.nbytes
            reply = sock.recv(2, socket.MSG_WAITALL)
            if reply == b"ER":
                (n,) = struct.unpack("<I", sock.recv(4, socket.MSG_WAITALL))
                raise KVTransferError(
                    f"receiver refused the frame: {sock.recv(n, socket.MSG_WAITALL).decode()}"
                )
            if reply != b"OK":
                raise KVTransferError(f"receiver answered {reply!r} instead of an acknowledgement")
    return sent


def send_kv_states(address: tuple[str, int], states: Iterable[KVState], *, timeout_s: float = 60.0) -> int:
    """Send states to a KVReceiver; returns the bytes moved. Raises KVTransferError when refused."""
    return send_frames(address, (frame_parts(s) for s in states), timeout_s=timeout_s)
