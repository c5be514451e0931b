"""The three ports a transition talks to the world through (store, agents, routing table), and
the callables the executor is given (clock, crash probe, model and weights resolvers)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from scheduler.modelspec import ModelSpec
from scheduler.plan import Gear
from scheduler.topology import Snapshot
from scheduler.transition.records import (
    CommandIntent,
    CommandResult,
    Guard,
    Route,
    RoutingState,
    TransitionEvent,
    TransitionRecord,
)


# --- ports ----------------------------------------------------------------------------------------
class TransitionStore(Protocol):
    """Where transitions live. Every write is conditional; nothing is visible before it is saved."""

    def active(self, deployment_id: str) -> TransitionRecord | None:
        """The deployment's transition in PREPARE, SWITCH, CLEANUP or ROLLBACK, if any (at most one)."""

    def load(self, deployment_id: str, seq: int) -> TransitionRecord | None: ...

    def last_seq(self, deployment_id: str) -> int:
        """The highest seq ever used for the deployment (0: none)."""

    def current_gear(self, deployment_id: str) -> Gear | None:
        """The deployment's stable gear: what a new transition starts from."""

    def create(self, record: TransitionRecord, events: Sequence[TransitionEvent]) -> bool:
        """Save a new transition. False (and nothing saved) when another one is active or `seq`
        is not above every seq used before: the claim that keeps one active per deployment."""

    def save(self, record: TransitionRecord, *, expected_version: int,
             events: Sequence[TransitionEvent]) -> TransitionRecord | None:
        """Save `record` as version expected_version + 1 if the stored one is still at
        `expected_version`; return what was saved, or None (someone else saved first). Saving
        phase DONE makes to_gear the deployment's current gear in the same write."""

    def request_abort(self, deployment_id: str, seq: int, reason: str) -> bool:
        """Ask an active transition to roll back (bumps its version); False if it is not active."""

    def reserve(self, guard: Guard, needs: Mapping[str, Mapping[str, int]]) -> list[str]:
        """Book GPU memory for the deployment's plans (plan_id -> gpu -> bytes). Idempotent.
        Returns conflicts (a GPU booked by another deployment), booking nothing then.
        Raises StaleGuard when the record moved past `guard.version`."""

    def unreserve(self, guard: Guard, plan_ids: Sequence[str]) -> None:
        """Drop these plans' bookings (safe when there are none). Raises StaleGuard likewise."""


class AgentPort(Protocol):
    """The agents: commands out, acks in, and the cluster as they last reported it."""

    def send(self, commands: Sequence[CommandIntent], guard: Guard) -> None:
        """Queue the commands; a key already queued is not queued again. Raises StaleGuard
        (queueing nothing) when the record moved past `guard.version`."""

    def results(self, keys: Sequence[str]) -> Mapping[str, CommandResult]:
        """The agents' answers so far (a key never sent is absent)."""

    def snapshot(self) -> Snapshot:
        """The cluster as the agents last reported it."""

    def data_addr(self, node_id: str) -> str:
        """Where that node's agent receives KV cache from its peers ('' if unknown)."""


class RoutingTable(Protocol):
    """Versioned routing per deployment. A commit names the version it builds on."""

    def current(self, deployment_id: str) -> RoutingState: ...

    def commit(self, deployment_id: str, expected_version: int, routes: Sequence[Route],
               guard: Guard) -> RoutingState | None:
        """Replace the routes and bump the version if it is still `expected_version` (None
        otherwise). Raises StaleGuard when the record moved past `guard.version`."""


Clock = Callable[[], float]
Probe = Callable[[str], None]
ModelResolver = Callable[[str], ModelSpec]
# What the new plans of a transition load (the registry's version of its model): a mapping with
# weights_sha256 (hex, or None: unknown, nothing to check) and, optionally, model_version (the
# version's id, label, tokenizer and warm-up tokens, for the agent's checks on the shadow plan) and
# slo ({ttft_ms, tpot_ms}: the deployment's, for an agent that simulates it).
WeightsResolver = Callable[["TransitionRecord"], "Mapping[str, object] | None"]


def _no_probe(point: str) -> None:
    return None


def _no_digest(record: TransitionRecord) -> Mapping[str, object] | None:
    return None
