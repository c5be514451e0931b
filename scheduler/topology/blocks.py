"""Atomic blocks: which GPUs of a snapshot may hold one tensor-parallel group together.

Atomic blocks: GPUs of one node that share an NVLink group form one block; a node's PCIe-only
GPUs form one block when their host link is fast enough for tensor parallelism, else each is
a block of its own. Only healthy, schedulable GPUs of schedulable nodes with a fresh
heartbeat and fewer than `max_failed_checks` failed checks are in a block. Block ids derive
from the node and the domain (`a1/nvl0`, `a1/pcie`, `a1/gpu3`), so they are stable across
snapshots and `FragmentHistory` can follow a block as it shrinks and grows.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from operator import attrgetter
from types import MappingProxyType
from typing import Literal

from scheduler._lazy import check_plain_dataclass, make_frozen
from scheduler.topology.snapshot import GpuState, NodeState, Snapshot

LinkKind = Literal["nvlink", "pcie", "single"]


# --- atomic blocks -----------------------------------------------------------------------
@dataclass(frozen=True)
class BlockPolicy:
    """Which GPUs may enter a block, and when PCIe peers are good enough for TP."""

    heartbeat_timeout_s: float = 60.0  # a GPU or node not heard from for longer is out
    max_failed_checks: int = 3  # this many consecutive failed checks puts a GPU out
    min_pcie_tp_bytes_per_s: float = 20e9  # PCIe peers of one node form one block at or above this


DEFAULT_POLICY = BlockPolicy()


@dataclass(frozen=True)
class AtomicBlock:
    """GPUs good enough for tensor parallelism among themselves (one NVLink domain, or PCIe peers)."""

    id: str  # stable across snapshots: node id + domain ("a1/nvl0", "a1/pcie", "a1/gpu3")
    node_id: str  # the node it lies in
    rack: str  # that node's rack
    gpu_model: str  # every GPU of a block is the same model
    gpu_uuids: tuple[str, ...]  # its GPUs, by index
    mem_total_bytes: tuple[int, ...]  # capacity per GPU, same order
    mem_free_bytes: tuple[int, ...]  # total - used per GPU, same order
    link_kind: LinkKind  # what connects its GPUs
    tp_link_bytes_per_s: float  # slowest GPU-to-GPU path inside it, per direction (0 if single)

    @property
    def size(self) -> int:
        return len(self.gpu_uuids)


check_plain_dataclass(AtomicBlock, field_names=("id", "node_id", "rack", "gpu_model", "gpu_uuids", "mem_total_bytes",
                                                "mem_free_bytes", "link_kind", "tp_link_bytes_per_s"))


@dataclass(frozen=True)
class Partition:
    """The blocks of a snapshot, and why each left-out GPU is out."""

    blocks: tuple[AtomicBlock, ...]  # sorted by id
    excluded: Mapping[str, str]  # uuid -> reason


def exclusion_reason(gpu: GpuState, node: NodeState | None, now_s: float, policy: BlockPolicy) -> str | None:
    """Why this GPU may not be planned on, or None when it may."""
    if node is None:
        return f"node {gpu.node_id!r} unknown"
    if not node.schedulable:
        return f"node {node.id} is not schedulable"
    if now_s - node.last_seen_s > policy.heartbeat_timeout_s:
        return f"node {node.id} heartbeat is {now_s - node.last_seen_s:.0f} s old"
    if now_s - gpu.last_seen_s > policy.heartbeat_timeout_s:
        return f"heartbeat is {now_s - gpu.last_seen_s:.0f} s old"
    if not gpu.healthy:
        return "unhealthy"
    if gpu.failed_checks >= policy.max_failed_checks:
        return f"{gpu.failed_checks} failed checks in a row"
    if not gpu.schedulable:
        return "not schedulable"
    return None


def partition(snapshot: Snapshot, policy: BlockPolicy = DEFAULT_POLICY) -> Partition:
    """Split the usable GPUs of a snapshot into atomic blocks (see the module docstring).

    Cost: one pass over the GPUs plus a sort per block. A snapshot never changes, so the
    result is kept on it per policy: every deployment decided on one snapshot shares it.
    """
    memo: dict[BlockPolicy, Partition] = snapshot.__dict__.setdefault("_partitions", {})
    hit = memo.get(policy)
    if hit is None:
        hit = memo[policy] = _partition(snapshot, policy)
    return hit


def _partition(snapshot: Snapshot, policy: BlockPolicy) -> Partition:
    excluded: dict[str, str] = {}
    domains: dict[tuple[str, str], list[GpuState]] = {}
    pcie: dict[tuple[str, str], list[GpuState]] = {}
    nodes = snapshot.node_by_id
    now_s = snapshot.now_s
    timeout = policy.heartbeat_timeout_s
    max_failed = policy.max_failed_checks
    # per GPU model named in the snapshot (`_specs` holds those: no second walk of the GPUs)
    has_nvlink = {m: spec.intra_link_bytes_per_s > 0 for m, spec in snapshot._specs.items()}
    # nodes whose GPUs may be used at all (known, schedulable, heard from in time)
    node_ok = {n.id for n in snapshot.nodes if n.schedulable and now_s - n.last_seen_s <= timeout}
    for gpu in snapshot.gpus:
        # the common case (all fine) is decided without building a reason
        if (
            gpu.node_id not in node_ok or not gpu.healthy or not gpu.schedulable
            or gpu.failed_checks >= max_failed or now_s - gpu.last_seen_s > timeout
        ):
            reason = exclusion_reason(gpu, nodes.get(gpu.node_id), now_s, policy)
            if reason is not None:
                excluded[gpu.uuid] = reason
                continue
        if gpu.nvlink_group is not None and has_nvlink[gpu.model]:
            key = (gpu.node_id, gpu.nvlink_group)
            group = domains.get(key)
            if group is None:
                domains[key] = [gpu]
            else:
                group.append(gpu)
        else:
            key = (gpu.node_id, gpu.model)
            group = pcie.get(key)
            if group is None:
                pcie[key] = [gpu]
            else:
                group.append(gpu)

    blocks: list[AtomicBlock] = []
    for (node_id, group_name), members in domains.items():
        spec = snapshot.spec(members[0].model)
        kind: LinkKind = "nvlink" if len(members) > 1 else "single"
        bw = spec.intra_link_bytes_per_s if len(members) > 1 else 0.0
        blocks.append(_block(f"{node_id}/nvl{group_name}", nodes[node_id], members, kind, bw))
    pcie_models_per_node: dict[str, int] = {}
    for node_id, _model in pcie:
        pcie_models_per_node[node_id] = pcie_models_per_node.get(node_id, 0) + 1
    for (node_id, model), members in pcie.items():
        spec = snapshot.spec(model)
        suffix = "" if pcie_models_per_node[node_id] == 1 else f"-{model}"
        if len(members) > 1 and spec.host_link_bytes_per_s >= policy.min_pcie_tp_bytes_per_s:
            blocks.append(
                _block(f"{node_id}/pcie{suffix}", nodes[node_id], members, "pcie", spec.host_link_bytes_per_s)
            )
        else:
            for g in sorted(members, key=_BY_INDEX):
                blocks.append(_block(f"{node_id}/gpu{g.index}", nodes[node_id], [g], "single", 0.0))
    blocks.sort(key=_block_id)
    return Partition(blocks=tuple(blocks), excluded=MappingProxyType(excluded))


def _block_id(block: AtomicBlock) -> str:
    return block.id


def _block(block_id: str, node: NodeState, members: list[GpuState], kind: LinkKind, bw: float) -> AtomicBlock:
    if len(members) > 1:
        members.sort(key=_BY_INDEX)
    totals = tuple([g.mem_total_bytes for g in members])
    return make_frozen(AtomicBlock, {
        "id": block_id,
        "node_id": node.id,
        "rack": node.rack,
        "gpu_model": members[0].model,
        "gpu_uuids": tuple([g.uuid for g in members]),
        "mem_total_bytes": totals,
        "mem_free_bytes": tuple([g.mem_total_bytes - g.mem_used_bytes if g.mem_used_bytes < g.mem_total_bytes else 0
                                 for g in members]),
        "link_kind": kind,
        "tp_link_bytes_per_s": bw,
    })


_BY_INDEX = attrgetter("index")


def atomic_blocks(snapshot: Snapshot, policy: BlockPolicy = DEFAULT_POLICY) -> list[AtomicBlock]:
    """The atomic blocks of a snapshot, sorted by id (see `partition` for the left-out GPUs)."""
    return list(partition(snapshot, policy).blocks)


def block_of(blocks: Iterable[AtomicBlock]) -> dict[str, str]:
    """uuid -> block id, for the GPUs in `blocks`."""
    return {u: b.id for b in blocks for u in b.gpu_uuids}
