"""One exception for "no": something asked of an agent, a simulated agent or a data plane was
refused, and nothing was changed.

`code` is the machine-readable word the refusal travels as - in an agent's failed ack it is the
ack's `reason` (agents.protocol.FAILURE_REASONS: out_of_memory from scheduler.booking,
unsupported from scheduler.capabilities, preempted, conflict, failed, ...), in a data-plane
answer the answer's `reason`. `reason` is the human words (the ack's detail); `field` names the
input at fault when it is the input's fault (None when it is the node's or the fleet's state);
`gpus` are the GPUs the refusal is about (a preemption, an overbooked GPU); `detail` holds any
other fields the answer carries (e.g. `weights_sha256`, the digest a node found instead of the
registry's).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


class Refused(Exception):  # noqa: N818 - a refusal is an answer, not an error of the caller's code
    """A refusal (module docstring). Subclasses may fix their `code` as a class attribute."""

    code: str = "failed"

    def __init__(self, reason: str, code: str | None = None, *, field: str | None = None,
                 gpus: Iterable[str] = (), detail: Mapping[str, object] | None = None) -> None:
        super().__init__(reason)
        self.reason = reason  # the words
        if code is not None:
            self.code = code  # the word machines act on
        self.field = field  # the input at fault, if any
        self.gpus = list(gpus)  # the GPUs it is about
        self.detail: dict[str, object] = dict(detail or {})  # further fields of the answer


__all__ = ["Refused"]
