"""Fleet events other apps subscribe to (the gearbox reacts to acks and topology changes)."""

from __future__ import annotations

from django.dispatch import Signal

# sent on commit after an agent acknowledged a command; kwargs: command
command_acked = Signal()
# sent on commit when GPUs were lost or returned (health, allocatable, node heartbeat); kwargs: node_ids
topology_changed = Signal()
