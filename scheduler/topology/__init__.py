"""The cluster as the agents last reported it, its atomic blocks, and how blocks change over time.

Modules: `snapshot` (NodeState, GpuState, LinkState, Snapshot: the facts, their lookups,
validation and plain-JSON shape), `blocks` (BlockPolicy, AtomicBlock, Partition: which GPUs
form a tensor-parallel domain, and why the rest are left out) and `history` (FragmentHistory:
each block's size over time and its stability score). Every public name is re-exported here,
so `from scheduler.topology import ...` is the one import callers need.
"""

from __future__ import annotations

from scheduler.topology.blocks import (
    DEFAULT_POLICY,
    AtomicBlock,
    BlockPolicy,
    LinkKind,
    Partition,
    atomic_blocks,
    block_of,
    exclusion_reason,
    partition,
)
from scheduler.topology.history import FragmentHistory, Trajectory
from scheduler.topology.snapshot import GBPS_TO_BYTES_PER_S, GpuState, LinkState, NodeState, Snapshot

__all__ = ["DEFAULT_POLICY", "GBPS_TO_BYTES_PER_S", "AtomicBlock", "BlockPolicy", "FragmentHistory", "GpuState",
           "LinkKind", "LinkState", "NodeState", "Partition", "Snapshot", "Trajectory", "atomic_blocks", "block_of",
           "exclusion_reason", "partition"]
