"""Why the data plane refuses something; each maps to one HTTP status and one ack reason (its `code`).

Each is a `scheduler.refusal.Refused`: `code` is the word of the answer's and the ack's `reason`
(agents/protocol/), `reason` the words.
"""

from __future__ import annotations

from scheduler.refusal import Refused as _Refused


class DataPlaneError(_Refused):
    """Base class: `code` is the word agents/protocol/ uses in a failed ack."""

    code = "failed"


class Saturated(DataPlaneError):
    """The plan's waiting queue is full: try again after `retry_after_s` (HTTP 429)."""

    code = "saturated"

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Frozen(DataPlaneError):
    """The plan admits nothing new: a switch froze it, or it is released or stopped (HTTP 409)."""

    code = "frozen"


class UnknownPlan(DataPlaneError):
    """No plan of that deployment and id runs on this node (HTTP 409)."""

    code = "unknown_plan"


class StaleLease(DataPlaneError):
    """A hand-over whose lease is not newer than the one this node had for the sequence."""

    code = "stale_lease"


class Refused(DataPlaneError):
    """The target would not take a sequence: wrong plan or weights, no room, bad state."""

    code = "target_refused"


class NotHere(DataPlaneError):
    """The sequence is not (yet) on this node: a reader retries briefly after a hand-over (HTTP 404)."""

    code = "not_here"
