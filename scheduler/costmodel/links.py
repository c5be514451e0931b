"""Links between GPUs (`Path`): point-to-point copy time, the TP all-reduce (alpha-beta ring, or a
measured collective curve) and the path between two GPUs or across a group of a snapshot."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.collectives import CollectiveCurve
from scheduler.costmodel.kernels import DEFAULT_EFFICIENCY, Efficiency
from scheduler.topology import Snapshot


# --- links -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Path:
    """The path data takes between two GPUs (or two groups, at its bottleneck)."""

    bytes_per_s: float  # per direction
    latency_s: float | None = None  # measured latency beyond the model's link_latency_s; None: none
    measured: bool = False  # True: a probe measured the bandwidth (no efficiency applied)
    curve: CollectiveCurve | None = None  # a measured send/recv sweep over this path: point-to-point copies use it

    def effective_bytes_per_s(self, eff: Efficiency) -> float:
        """What one point-to-point copy gets of the path: as measured, or the datasheet figure derated."""
        return self.bytes_per_s if self.measured else self.bytes_per_s * eff.p2p_link_efficiency

    def latency(self, eff: Efficiency) -> float:
        """One hop over the path: the link's latency (plus what a probe measured beyond it)."""
        return eff.link_latency_s if self.latency_s is None else eff.link_latency_s + self.latency_s

    def transfer_latency(self, eff: Efficiency) -> float:
        """Fixed time of a point-to-point copy: one kernel launch (send/recv is a kernel, with
        the same fixed cost as any other), the send/recv handshake, and one hop."""
        return eff.kernel_overhead_s + eff.p2p_latency_s + self.latency(eff)


def transfer_time_s(bytes_moved: float, path: Path, eff: Efficiency = DEFAULT_EFFICIENCY) -> float:
    """Point-to-point copy (send/recv): the measured curve where there is one, else one launch,
    one hop and the bytes over the path's bandwidth. inf when there is no path."""
    if path.curve is not None:
        return path.curve.time_s(bytes_moved)
    bw = path.effective_bytes_per_s(eff)
    if bw <= 0:
        return math.inf
    if math.isinf(bw):
        return 0.0
    return path.transfer_latency(eff) + bytes_moved / bw


REDUCE_HBM_TOUCHES = 3  # a reduce-scatter step reads two operands and writes the sum


def allreduce_time_s(ranks: int, bytes_moved: float, path: Path, eff: Efficiency = DEFAULT_EFFICIENCY,
                     hbm_bytes_per_s: float = 0.0, *, lanes: int = 1) -> float:
    """Ring all-reduce of `bytes_moved` over `ranks` GPUs whose slowest link is `path`.

    alpha-beta, term by term:
    * `allreduce_latency_s` once per call (launch, and the ring's synchronisation before its
      reduce-scatter and its all-gather phase);
    * 2(t-1) hops, each one transfer's latency over the path (`Path.latency`: `link_latency_s`,
      plus the probed latency on a measured network link): a chunk must cross every hop of
      the ring before the last rank has it, which is why an 8-GPU ring costs more than a
      2-GPU one before any byte counts, and a 16-rank ring across nodes ~30 network latencies;
    * each rank sends 2(t-1)/t of the bytes at `link_efficiency` of the path's bandwidth, even
      on a measured path: a probe times a one-way copy, while a ring sends and receives on
      every link at once and forwards each chunk only after reducing it;
    * `lanes` parallel paths share the bytes (ranks of one node spread their ring channels over
      that many network cards; 1 inside a node, where `path` is the whole NVLink/PCIe link);
    * the reduction streams its operands through HBM (read two, write one per element,
      (t-1)/t of the bytes); NCCL runs it in the same few SMs as the copies, so that time adds
      rather than overlaps. `hbm_bytes_per_s` 0 leaves it out.
    """
    if ranks <= 1:
        return 0.0
    bw = path.bytes_per_s * eff.link_efficiency * max(1, lanes)
    if bw <= 0:
        return math.inf
    share = (ranks - 1) / ranks * bytes_moved
    reduce_s = REDUCE_HBM_TOUCHES * share / (eff.mbu * hbm_bytes_per_s) if hbm_bytes_per_s > 0 else 0.0
    hops_s = 2.0 * (ranks - 1) * path.latency(eff)
    return eff.allreduce_latency_s + hops_s + 2.0 * share / bw + reduce_s


def gpu_path(snapshot: Snapshot, u: str, v: str) -> Path:
    """The path between two GPUs of a snapshot (nominal inside a node, measured across nodes)."""
    gu, gv = snapshot.gpu_by_uuid[u], snapshot.gpu_by_uuid[v]
    if gu.node_id == gv.node_id:
        # a measured copy sweep (an agent times GPU 0 -> 1) stands for pairs of one NVLink group
        curve = (snapshot.copy_curve(gu.node_id) if snapshot.collectives and gu.nvlink_group is not None
                 and gu.nvlink_group == gv.nvlink_group else None)
        return Path(bytes_per_s=snapshot.gpu_link_bytes_per_s(u, v), curve=curve)
    # across nodes: what Snapshot.gpu_link_bytes_per_s and gpu_link_latency_s give, with the
    # host links and the node link looked up once for both
    host = min(snapshot.spec(gu.model).host_link_bytes_per_s, snapshot.spec(gv.model).host_link_bytes_per_s)
    node_bw = snapshot.node_link_bytes_per_s(gu.node_id, gv.node_id)
    measured = node_bw <= host  # the node link is the bottleneck: use it as the probe measured it
    curve = snapshot.sendrecv_curve(gu.node_id, gv.node_id) if snapshot.collectives else None
    return Path(bytes_per_s=min(host, node_bw), latency_s=snapshot.node_link_latency_s(gu.node_id, gv.node_id),
                measured=measured, curve=curve)


def group_path(snapshot: Snapshot, uuids: Sequence[str]) -> Path:
    """The slowest path inside a TP group (ring neighbours)."""
    if len(uuids) <= 1:
        return Path(bytes_per_s=math.inf)
    gpus = snapshot.gpu_by_uuid
    first = gpus[uuids[0]]
    home = (first.node_id, first.nvlink_group, first.model)
    if all((g.node_id, g.nvlink_group, g.model) == home for g in map(gpus.__getitem__, uuids)):
        # one node, one NVLink group (or none), one model: every ring hop is the same path
        return gpu_path(snapshot, uuids[0], uuids[1])
    paths = [gpu_path(snapshot, uuids[i], uuids[(i + 1) % len(uuids)]) for i in range(len(uuids))]
    return min(paths, key=lambda p: p.bytes_per_s)
