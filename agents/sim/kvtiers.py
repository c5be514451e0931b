"""Tiered KV in the simulator: prompt blocks a plan's GPU prefix cache evicts go to its node's host
memory, from there to the node's SSD, and a later request - the next turn of a conversation,
whose prompt starts with the last turn's - copies them back instead of recomputing them.

    GPU (PrefixCache, agents/sim/queues.py)  --evict-->  host (per node, LRU)  --evict-->  SSD (per node,
    LRU)  --evict-->  dropped

* Offload: the blocks a plan's GPU cache evicts (least recently used first) become the host
  tier's newest; the host tier's oldest go to the SSD tier; the SSD tier's oldest are dropped.
  The copies off the GPU are asynchronous (a copy engine; vLLM's KV connectors and LMCache store
  this way), so an offload costs no round time; the GPU-to-host direction of PCIe is not the one a
  restore uses (full duplex).
* Restore: at admission, after the GPU cache's hit, the request's next blocks found in the tiers
  (host, or SSD), as one run from the first missing block, are copied back and skip their
  prefill. The copy is synchronous: the round that starts the request's prefill waits for it (as a
  connector that loads before the forward pass), at each tier's bandwidth:
    host -> GPU over each GPU's own PCIe link, in parallel (the GPU catalog's
      `host_link_bytes_per_s`, per direction): the pipe's KV bytes / (GPUs x that link);
    SSD -> host -> GPU: the node's NVMe read, one drive shared by every plan of the node (a
      restore waits for the drive to be free), then the PCIe copy as above.
  A tier is only read when a block from it costs less than recomputing one on that plan (the
  plan's marginal prefill of one block, from the cost model): an SSD block restores slower than an
  H100 group recomputes it, faster than an L40S group does.
  A restored block stays in the host tier (a copy, touched: the newest); one read from the SSD
  moves to the host tier, which it went through. Demotions to the SSD are background writes and
  are not charged (reads and writes sharing the drive are not modelled).
* Conversations: a request whose prompt blocks (a trace's hash ids) start with an earlier one's
  is that conversation's next turn; in the Mooncake trace 1,782 of 3,993 requests begin with an
  earlier request's first block. Scenario workloads without block ids never hit any tier.
* Keys: (model, block hash). KV is a function of the weights: the same prompt under other weights
  has other keys and values in every layer, so a block is never reused across models. Seed 004
  §3.3 claims 73% "KV overlap" reused across models (Qwen2-72B then Llama-3-8B on one document);
  that is not physical - the two models' KV do not even have the same shape - and we do not do it.
  Plans of the same model on one node share its tiers (a different TP split reads another slice
  of the same bytes).
* A plan's node is its first stage's (a plan over several nodes keeps its tiers there).

Sizes per node: `host_kv_gib`, `ssd_kv_gib` on a scenario's node, else `KvTierOptions`' defaults.
Off unless `SimOptions.kv_tiers` is set: without it nothing here runs and the simulator is as it was.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agents.sim.queues import PrefixCache
    from agents.sim.request import Request

GIB = 1 << 30

# Host memory for KV per node: a quarter of a DGX H100's 2 TB of system memory (NVIDIA DGX H100
# datasheet: "System memory 2TB"); the rest is the OS, the weight cache and the engines.
DEFAULT_HOST_KV_GIB = 512.0
# SSD for KV per node: one of a DGX H100's eight 3.84 TB U.2 NVMe data drives (DGX H100 datasheet:
# "Internal storage: 8x 3.84 TB NVMe U.2"), less its file system's share.
DEFAULT_SSD_KV_GIB = 3400.0
# One datacenter PCIe Gen4 x4 NVMe drive's sequential read: Kioxia CM6 datasheet 6.9 GB/s, Micron
# 7450 PRO product brief 6.8 GB/s. A restore reads whole 512-token blocks (MiBs): sequential.
DEFAULT_SSD_READ_BYTES_PER_S = 6.9e9


@dataclass(frozen=True)
class KvTierOptions:
    """The tiers' defaults for nodes that do not set their own (module docstring)."""

    host_kv_gib: float = DEFAULT_HOST_KV_GIB  # host memory for KV per node
    ssd_kv_gib: float = DEFAULT_SSD_KV_GIB  # SSD for KV per node
    ssd_read_bytes_per_s: float = DEFAULT_SSD_READ_BYTES_PER_S  # the node's NVMe read bandwidth

    def __post_init__(self) -> None:
        for name in ("host_kv_gib", "ssd_kv_gib"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.ssd_read_bytes_per_s <= 0:
            raise ValueError(f"ssd_read_bytes_per_s: must be > 0, got {self.ssd_read_bytes_per_s}")


class TierLRU:
    """One tier of one node: (model, block hash) -> the block's bytes, least recently used first."""

    __slots__ = ("_lru", "capacity_bytes", "used_bytes")

    def __init__(self, capacity_bytes: float) -> None:
        self._lru: OrderedDict[tuple[str, int], int] = OrderedDict()
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: tuple[str, int]) -> bool:
        return key in self._lru

    def put(self, key: tuple[str, int], nbytes: int) -> list[tuple[tuple[str, int], int]]:
        """`key` is now the newest; returns what fell off the old end to make room."""
        lru = self._lru
        if key in lru:
            lru.move_to_end(key)
            return []
        if nbytes > self.capacity_bytes:
            return [(key, nbytes)]  # (a tier too small for one block keeps nothing)
        lru[key] = nbytes
        self.used_bytes += nbytes
        out: list[tuple[tuple[str, int], int]] = []
        while self.used_bytes > self.capacity_bytes:
            old, b = lru.popitem(last=False)
            self.used_bytes -= b
            out.append((old, b))
        return out

    def touch(self, key: tuple[str, int]) -> None:
        self._lru.move_to_end(key)

    def pop(self, key: tuple[str, int]) -> None:
        b = self._lru.pop(key, None)
        if b is not None:
            self.used_bytes -= b


class NodeTiers:
    """One node's host and SSD tiers, its NVMe drive's queue, and what went through them."""

    def __init__(self, node: str, host_bytes: float, ssd_bytes: float, ssd_read_bytes_per_s: float) -> None:
        self.node = node
        self.host = TierLRU(host_bytes)
        self.ssd = TierLRU(ssd_bytes)
        self.ssd_read_bytes_per_s = ssd_read_bytes_per_s
        self.ssd_free_s = 0.0  # the drive is reading for earlier restores until then
        # accounting
        self.offloaded_blocks = 0  # blocks the GPU caches evicted into the host tier
        self.demoted_blocks = 0  # host -> SSD
        self.dropped_blocks = 0  # fell off the SSD tier: gone
        self.restored_host_tokens = 0  # prompt tokens restored from the host tier
        self.restored_ssd_tokens = 0  # ... from the SSD tier
        self.restore_s = 0.0  # round time spent waiting for restores

    def offload(self, model: str, hashes: Iterable[int], block_bytes: int) -> None:
        """Blocks a GPU cache evicted, oldest first: the host tier's newest (module docstring)."""
        for h in hashes:
            key = (model, h)
            self.ssd.pop(key)  # (an older copy on the SSD: the host one is now the newest)
            self.offloaded_blocks += 1
            self._to_host(key, block_bytes)

    def _to_host(self, key: tuple[str, int], block_bytes: int) -> None:
        for old, b in self.host.put(key, block_bytes):
            self.demoted_blocks += 1
            dropped = self.ssd.put(old, b)
            self.dropped_blocks += len(dropped)


class TierView:
    """What one pipe sees of its node's tiers: its model's keys, its link speeds, its recompute
    price per block (module docstring)."""

    def __init__(self, tiers: NodeTiers, model: str, block_tokens: int, block_bytes: int,
                 pipe_kv_bytes_per_token: float, pcie_bytes_per_s: float, recompute_s_per_block: float) -> None:
        self.tiers = tiers
        self.model = model
        self.block_tokens = block_tokens
        self.block_bytes = block_bytes  # one block's KV as stored (every layer, once)
        # host -> GPU: the pipe's KV of one block (replicated heads included) over all its links
        self.pcie_s_per_block = block_tokens * pipe_kv_bytes_per_token / pcie_bytes_per_s
        self.ssd_s_per_block = block_bytes / tiers.ssd_read_bytes_per_s
        self.recompute_s_per_block = recompute_s_per_block
        self.use_host = self.pcie_s_per_block < recompute_s_per_block
        self.use_ssd = self.pcie_s_per_block + self.ssd_s_per_block < recompute_s_per_block

    @property
    def host_s_per_token(self) -> float:
        """Restoring one token from the host tier (what the router prices a host hit at)."""
        return self.pcie_s_per_block / self.block_tokens

    def offload(self, hashes: Sequence[int]) -> None:
        self.tiers.offload(self.model, hashes, self.block_bytes)

    def restore(self, blocks: Sequence[int], start: int, usable: int, t: float) -> tuple[int, float]:
        """Blocks `start`.. of a prompt (the GPU cache held the ones before) found in the tiers, as
        one run, at most `usable`: (how many are restored, the seconds the restore takes from t)."""
        tiers, model = self.tiers, self.model
        host, ssd = tiers.host, tiers.ssd
        n_host = n_ssd = 0
        i = start
        while i < usable:
            key = (model, blocks[i])
            if self.use_host and key in host:
                n_host += 1
            elif self.use_ssd and key in ssd:
                n_ssd += 1
            else:
                break
            i += 1
        if i == start:
            return 0, 0.0
        for k in range(i - 1, start - 1, -1):  # touched tail first: the head is the newest
            key = (model, blocks[k])
            if key in host:
                host.touch(key)
            else:
                ssd.pop(key)
                tiers._to_host(key, self.block_bytes)
        seconds = (n_host + n_ssd) * self.pcie_s_per_block
        if n_ssd:
            begin = max(t, tiers.ssd_free_s)
            tiers.ssd_free_s = begin + n_ssd * self.ssd_s_per_block
            seconds += tiers.ssd_free_s - t
        bt = self.block_tokens
        tiers.restored_host_tokens += n_host * bt
        tiers.restored_ssd_tokens += n_ssd * bt
        tiers.restore_s += seconds
        return i - start, seconds


class KvTiers:
    """Every node's tiers in one simulation (module docstring), made when a pipe first asks."""

    def __init__(self, options: KvTierOptions, sizes: dict[str, tuple[float | None, float | None]]) -> None:
        self.options = options
        self._sizes = sizes  # node -> (host GiB, SSD GiB) where the scenario sets them
        self.nodes: dict[str, NodeTiers] = {}

    def node(self, node: str) -> NodeTiers:
        got = self.nodes.get(node)
        if got is None:
            host, ssd = self._sizes.get(node, (None, None))
            o = self.options
            got = self.nodes[node] = NodeTiers(node, (o.host_kv_gib if host is None else host) * GIB,
                                               (o.ssd_kv_gib if ssd is None else ssd) * GIB, o.ssd_read_bytes_per_s)
        return got

    def host_bytes(self, node: str) -> float:
        return self.node(node).host.capacity_bytes

    def totals(self) -> dict[str, float]:
        """What went through every node's tiers (bench output)."""
        keys = ("offloaded_blocks", "demoted_blocks", "dropped_blocks", "restored_host_tokens",
                "restored_ssd_tokens", "restore_s")
        return {k: sum(getattr(n, k) for n in self.nodes.values()) for k in keys}


def admit_prefix(cache: PrefixCache, tiers: TierView | None, req: Request, t: float) -> float:
    """A request admitted to a pipe with a prefix cache: the blocks its GPU cache holds, then the
    ones the tiers restore, skip their prefill (never the last prompt token: its logits are
    computed). Returns the seconds the restore adds to this round (0 without tiers or a hit)."""
    hit = cache.match(req.blocks, req.prompt)
    req.blocks_in = hit  # (blocks already on the GPU: the pass does not insert them again)
    extra_s = 0.0
    if tiers is not None:
        usable = min(len(req.blocks), req.prompt // cache.block_tokens)
        more, extra_s = tiers.restore(req.blocks, hit, usable, t)
        hit += more  # (restored blocks join the GPU cache when the pass inserts its blocks)
    if hit:
        req.done = min(hit * cache.block_tokens, req.need - 1)
        cache.hit_tokens += req.done
    return extra_s


__all__ = ["DEFAULT_HOST_KV_GIB", "DEFAULT_SSD_KV_GIB", "DEFAULT_SSD_READ_BYTES_PER_S", "GIB", "KvTierOptions", "KvTiers",
           "NodeTiers", "TierLRU", "TierView", "admit_prefix"]
