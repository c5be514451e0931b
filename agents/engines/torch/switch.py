"""A gear switch of live sequences from one engine (layout) to another, measured.

    result = switch_sequences(old, new, ["r1", "r2"], path="migrate", link=TcpLink(new))

Called between two steps of `old`, i.e. at the end of a decode iteration — the safe boundary.
For each sequence, in order:

- migrate: export its KV (unsharded), move the bytes over `link`, import into `new` (which
  re-shards them to its own TP/PP layout), then drop it from `old`;
- replay: move only the tokens and the sampler state, and let `new` re-prefill
  prompt + generated tokens.

The sequence is dropped from `old` only after `new` holds it, so a failed import leaves it where
it was (the switch can roll back), and it is never stepped by both (invariant 2 of DESIGN.md:
neither engine steps while this runs). Then `new` is stepped until every switched sequence has
produced its next token; that token's arrival minus the end of `old`'s last step is the
sequence's stall.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from agents.engines.torch.engine import KVState, StepOutput, TorchEngine
from agents.engines.torch.kvtransfer import KVReceiver, decode_kv_state, encode_kv_state, send_kv_states

Path = Literal["migrate", "replay"]
PATHS: tuple[str, ...] = ("migrate", "replay")


class KVLink(Protocol):
    """Carries a state from the old engine's agent to the new one's; returns it and the bytes moved."""

    def move(self, state: KVState) -> tuple[KVState, int]: ...


class InProcessLink:
    """Serialises and parses the frame without a socket: the bytes a real link would move."""

    def move(self, state: KVState) -> tuple[KVState, int]:
        frame = encode_kv_state(state)
        return decode_kv_state(frame, expect_model_sha256=state.model_sha256), len(frame)


class TcpLink:
    """A real TCP hop through a KVReceiver (on the new engine's side) on this machine."""

    def __init__(self, expect_model_sha256: str | None = None) -> None:
        self.receiver = KVReceiver(expect_model_sha256=expect_model_sha256)

    def move(self, state: KVState) -> tuple[KVState, int]:
        sent = send_kv_states(self.receiver.address, [state])
        return self.receiver.get().state, sent

    def close(self) -> None:
        self.receiver.close()


@dataclass(frozen=True)
class SwitchRecord:
    seq_id: str
    path: str
    bytes_moved: int  # frame bytes on the link: KV + header (migrate), header only (replay)
    kv_bytes: int  # the K/V payload alone
    tokens_recomputed: int  # tokens the new engine prefilled again (replay), 0 for migrate
    stall_s: float  # last token on old -> first token on new


@dataclass
class SwitchResult:
    records: dict[str, SwitchRecord]
    outputs: list[StepOutput] = field(default_factory=list)  # all that `new` emitted meanwhile, in order


def switch_sequences(
    old: TorchEngine,
    new: TorchEngine,
    seq_ids: Sequence[str] | None = None,
    *,
    path: Path,
    link: KVLink | None = None,
    max_steps: int = 10_000,
) -> SwitchResult:
    if path not in PATHS:
        raise ValueError(f"path: must be one of {list(PATHS)}, got {path!r}")
    if old.model_sha256 != new.model_sha256:
        raise ValueError("new: runs other weights than old; a switch keeps the model")
    ids = list(old.sequence_ids() if seq_ids is None else seq_ids)
    link = link or InProcessLink()
    t_last = old.last_step_end_s
    moved: dict[str, tuple[int, int, int]] = {}
    for seq_id in ids:
        state = old.export_kv(seq_id, include_kv=path == "migrate")
        received, nbytes = link.move(state)
        if path == "migrate":
            new.import_kv(seq_id, received)
            recomputed = len(received.token_ids) - 1 - received.num_cached_tokens
        else:
            new.replay(
                seq_id,
                received.prompt_ids,
                received.generated_ids,
                received.max_new_tokens,
                received.sampling,
                received.priority,
            )
            recomputed = len(received.token_ids) - 1
        old.drop(seq_id)  # only now: `new` holds it
        moved[seq_id] = (nbytes, state.kv_bytes, recomputed)
    result = SwitchResult(records={})
    waiting = set(ids)
    steps = 0
    while waiting:
        if steps == max_steps:
            raise RuntimeError(
                f"max_steps: {sorted(waiting)} produced no token on the new engine in {max_steps} steps"
            )
        outs = new.step()
        steps += 1
        now = time.perf_counter()
        result.outputs.extend(outs)
        for out in outs:
            if out.seq_id in waiting:
                waiting.discard(out.seq_id)
                nbytes, kv_bytes, recomputed = moved[out.seq_id]
                result.records[out.seq_id] = SwitchRecord(
                    out.seq_id, path, nbytes, kv_bytes, recomputed, now - t_last
                )
    return result


__all__ = [
    "PATHS",
    "InProcessLink",
    "KVLink",
    "KVReceiver",
    "SwitchRecord",
    "SwitchResult",
    "TcpLink",
    "switch_sequences",
]
