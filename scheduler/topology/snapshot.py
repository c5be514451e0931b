"""The cluster as the agents last reported it: nodes, GPUs, links, and their plain-JSON shape.

`NodeState`, `GpuState`, `LinkState` and `Snapshot` are the facts every decision reads; the
snapshot's lookups (specs, link bandwidths and latencies, measured collective curves), its
validation and its JSON reading and writing (`_Reader` names the path of every bad key) live
here. Atomic blocks are in `blocks`, their history over time in `history`.

A `Snapshot` is built by the console (from agents' reports) and by the simulator (from a
scenario); both go through the same plain-JSON shape (`Snapshot.from_dict` / `to_dict`):

    {
      "now_s": 1200.0,                      # when the snapshot was taken (injected clock)
      "nodes": [{"id": "a1", "rack": "A", "schedulable": true, "last_seen_s": 1195.0,
                 "engine": {"backend": "torch", ...}}],     # capabilities.EngineCaps; optional
      "gpus": [{
          "uuid": "GPU-a1-0", "node_id": "a1", "index": 0,
          "model": "H100-SXM",              # catalog name, or the name of a custom spec below
          "mem_total_bytes": 80000000000, "mem_used_bytes": 1200000000,
          "sm_util": 0.0, "temperature_c": 41.0,
          "healthy": true, "schedulable": true,
          "nvlink_group": "0",              # GPUs of one node with the same group share an
                                            # NVLink/NVSwitch domain; null = PCIe only
          "xid_errors": 0, "ecc_errors": 0, "failed_checks": 0,
          "last_seen_s": 1195.0}],
      "links": [{"a": "a1", "b": "b1", "bw_gbps": 200.0, "latency_us": 8.0}],   # measured
      "network": {"intra_rack_gbps": 400.0, "inter_rack_gbps": 100.0},        # defaults
      "custom_specs": [{"name": "X1", "bf16_flops": ..., ...}],                # hardware.GpuSpec
      "collectives": [{"op": "all_reduce", "scope": "intra", "node": "a1", "ranks": 8,
                       "points": [[2048, 4.1e-05], ...], ...}]                 # collectives.CollectiveCurve
    }

Optional keys and their defaults: node `rack` (its own id), `schedulable` (true),
`last_seen_s` (now_s), `engine` (null: not reported, unrestricted); GPU `sm_util` (0), `temperature_c` (0), `healthy` and `schedulable`
(true), `nvlink_group` (null), the three error counters (0), `last_seen_s` (its node's);
`links`, `custom_specs`, `collectives` ([]); `network` ({} = no default path between nodes); link
`latency_us` (null: the cost model's own latency). Unknown keys are an error; every error
names the path of the offending key (`gpus[3].mem_used_bytes: ...`).

Link bandwidths between nodes are in gigabits per second (`*_gbps`, as measured by the
agents' probes and as scenarios state them); everything inside the scheduler uses bytes per
second (`*_bytes_per_s`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from types import MappingProxyType

from scheduler.capabilities import EngineCaps
from scheduler.collectives import CollectiveCurve, index
from scheduler.hardware import CATALOG as GPU_CATALOG
from scheduler.hardware import GpuSpec, gpu_spec

GBPS_TO_BYTES_PER_S = 1e9 / 8  # 1 Gb/s in bytes per second


# --- snapshot types ------------------------------------------------------------------------
@dataclass(frozen=True)
class NodeState:
    """One host with GPUs and one agent."""

    id: str  # unique node id
    rack: str  # rack (or any locality group); links inside a rack default to intra_rack_gbps
    schedulable: bool = True  # false: cordoned by an operator or the platform
    last_seen_s: float = 0.0  # when its agent last reported (snapshot clock)
    engine: EngineCaps | None = None  # what its engine can run (capabilities.py); None: not reported, unrestricted


@dataclass(frozen=True)
class GpuState:
    """One accelerator as its node's agent last reported it."""

    uuid: str  # stable id (NVML UUID or the simulator's)
    node_id: str  # the node it sits in
    index: int  # its index inside the node
    model: str  # hardware catalog name, or the name of a custom spec in the snapshot
    mem_total_bytes: int  # device memory capacity
    mem_used_bytes: int  # in use by anyone (other tenants and our own plans)
    sm_util: float = 0.0  # compute utilisation 0..1
    temperature_c: float = 0.0  # degrees Celsius
    healthy: bool = True  # false after the agent's health checks failed (XID, ECC, probe)
    schedulable: bool = True  # false: reserved by another tenant or cordoned
    nvlink_group: str | None = None  # same group on one node = one NVLink/NVSwitch domain
    xid_errors: int = 0  # XID events since the agent started
    ecc_errors: int = 0  # uncorrectable ECC errors
    failed_checks: int = 0  # consecutive failed health checks
    last_seen_s: float = 0.0  # when this GPU was last reported
    # the part of its time a plan placed here gets: 1 / (deployments time-slicing it), set by the
    # control loop's view of a GPU other deployments hold (scheduler.pool.sharing); the cost model
    # stretches a stage's time by its inverse (costmodel.profiles). Never reported, not serialised
    compute_share: float = 1.0

    @property
    def mem_free_bytes(self) -> int:
        return max(0, self.mem_total_bytes - self.mem_used_bytes)


@dataclass(frozen=True)
class LinkState:
    """A measured node-to-node path (both directions)."""

    a: str  # node id
    b: str  # node id
    bw_gbps: float  # measured bandwidth, gigabits per second
    latency_us: float | None = None  # measured one-way latency, microseconds; None = unknown


@dataclass(frozen=True)
class Snapshot:
    """The cluster at `now_s`. Build with `from_dict`, or directly (then call `validate`)."""

    now_s: float  # when it was taken (injected clock, seconds)
    nodes: tuple[NodeState, ...]  # every known node
    gpus: tuple[GpuState, ...]  # every known GPU
    links: tuple[LinkState, ...] = ()  # measured node-to-node links (override the defaults)
    intra_rack_gbps: float = 0.0  # default node-to-node bandwidth inside a rack; 0 = no path
    inter_rack_gbps: float = 0.0  # default across racks; 0 = no path
    custom_specs: tuple[GpuSpec, ...] = ()  # specs of GPUs not in the hardware catalog
    collectives: tuple[CollectiveCurve, ...] = ()  # measured collective curves (collectives.py)

    # --- lookups (cached; a snapshot never changes) ---
    @cached_property
    def gpu_by_uuid(self) -> Mapping[str, GpuState]:
        return MappingProxyType({g.uuid: g for g in self.gpus})

    @cached_property
    def node_by_id(self) -> Mapping[str, NodeState]:
        return MappingProxyType({n.id: n for n in self.nodes})

    @cached_property
    def _specs(self) -> Mapping[str, GpuSpec]:
        custom = {s.name: s for s in self.custom_specs}
        return MappingProxyType({m: gpu_spec(m, custom) for m in {g.model for g in self.gpus}})

    @cached_property
    def _link_index(self) -> Mapping[tuple[str, str], LinkState]:
        index: dict[tuple[str, str], LinkState] = {}
        for link in self.links:
            index[(link.a, link.b)] = link
            index[(link.b, link.a)] = link
        return MappingProxyType(index)

    @cached_property
    def _curves(self) -> Mapping[tuple[str, str, str, str, int], CollectiveCurve]:
        return MappingProxyType(index(self.collectives))

    def allreduce_curve(self, node_id: str, ranks: int) -> CollectiveCurve | None:
        """A measured all-reduce over `ranks` GPUs of one node, if its agent reported one."""
        if not self.collectives:
            return None
        return self._curves.get(("all_reduce", "intra", node_id, "", ranks))

    def copy_curve(self, node_id: str) -> CollectiveCurve | None:
        """A measured device-to-device copy sweep between two GPUs of one node, if any."""
        if not self.collectives:
            return None
        return self._curves.get(("send_recv", "intra", node_id, "", 2))

    def sendrecv_curve(self, a: str, b: str) -> CollectiveCurve | None:
        """A measured send/recv between two nodes (either end's report), if any."""
        if not self.collectives or a == b:
            return None
        lo, hi = sorted((a, b))
        return self._curves.get(("send_recv", "inter", lo, hi, 2))

    def spec(self, gpu_model: str) -> GpuSpec:
        """The spec of a GPU model named in this snapshot (custom specs first)."""
        try:
            return self._specs[gpu_model]
        except KeyError:
            return gpu_spec(gpu_model, {s.name: s for s in self.custom_specs})

    def spec_of(self, uuid: str) -> GpuSpec:
        return self.spec(self.gpu_by_uuid[uuid].model)

    def node_link_bytes_per_s(self, a: str, b: str) -> float:
        """Bandwidth between two nodes: measured if known, else the rack defaults; inf for a==b."""
        if a == b:
            return math.inf
        link = self._link_index.get((a, b))
        if link is not None:
            return link.bw_gbps * GBPS_TO_BYTES_PER_S
        na, nb = self.node_by_id.get(a), self.node_by_id.get(b)
        if na is None or nb is None:
            return 0.0
        gbps = self.intra_rack_gbps if na.rack == nb.rack else self.inter_rack_gbps
        return gbps * GBPS_TO_BYTES_PER_S

    def node_link_latency_s(self, a: str, b: str) -> float | None:
        link = self._link_index.get((a, b))
        if link is None or link.latency_us is None:
            return None
        return link.latency_us * 1e-6

    def gpu_link_bytes_per_s(self, u: str, v: str) -> float:
        """Bandwidth one GPU can send to another, per direction.

        Same NVLink group: the slower of the two NVLink figures. Same node otherwise: the
        host link (PCIe). Different nodes: the node link, capped by both host links.
        """
        gu, gv = self.gpu_by_uuid[u], self.gpu_by_uuid[v]
        su, sv = self.spec(gu.model), self.spec(gv.model)
        host = min(su.host_link_bytes_per_s, sv.host_link_bytes_per_s)
        if gu.node_id == gv.node_id:
            if gu.nvlink_group is not None and gu.nvlink_group == gv.nvlink_group:
                nvl = min(su.intra_link_bytes_per_s, sv.intra_link_bytes_per_s)
                if nvl > 0:
                    return nvl
            return host
        return min(host, self.node_link_bytes_per_s(gu.node_id, gv.node_id))

    def gpu_link_latency_s(self, u: str, v: str) -> float | None:
        gu, gv = self.gpu_by_uuid[u], self.gpu_by_uuid[v]
        if gu.node_id == gv.node_id:
            return None
        return self.node_link_latency_s(gu.node_id, gv.node_id)

    # --- validation and JSON ---
    def validate(self) -> None:
        """Raise ValueError naming the first inconsistent field (path-style)."""
        custom_names = set()
        for i, spec in enumerate(self.custom_specs):
            if spec.name in GPU_CATALOG:
                raise ValueError(f"custom_specs[{i}].name: {spec.name!r} shadows a catalog entry")
            if spec.name in custom_names:
                raise ValueError(f"custom_specs[{i}].name: duplicate {spec.name!r}")
            custom_names.add(spec.name)
        node_ids: set[str] = set()
        for i, node in enumerate(self.nodes):
            if not node.id:
                raise ValueError(f"nodes[{i}].id: must be a non-empty string")
            if node.id in node_ids:
                raise ValueError(f"nodes[{i}].id: duplicate {node.id!r}")
            node_ids.add(node.id)
        uuids: set[str] = set()
        slots: set[tuple[str, int]] = set()
        group_model: dict[tuple[str, str], str] = {}
        custom = {s.name: s for s in self.custom_specs}
        for i, gpu in enumerate(self.gpus):
            p = f"gpus[{i}]"
            if not gpu.uuid:
                raise ValueError(f"{p}.uuid: must be a non-empty string")
            if gpu.uuid in uuids:
                raise ValueError(f"{p}.uuid: duplicate {gpu.uuid!r}")
            uuids.add(gpu.uuid)
            if gpu.node_id not in node_ids:
                raise ValueError(f"{p}.node_id: unknown node {gpu.node_id!r}")
            if gpu.index < 0:
                raise ValueError(f"{p}.index: must be >= 0, got {gpu.index}")
            if (gpu.node_id, gpu.index) in slots:
                raise ValueError(f"{p}.index: node {gpu.node_id!r} already has a GPU {gpu.index}")
            slots.add((gpu.node_id, gpu.index))
            try:
                gpu_spec(gpu.model, custom)
            except ValueError as exc:
                raise ValueError(f"{p}.model: {exc}") from None
            if gpu.mem_total_bytes <= 0:
                raise ValueError(f"{p}.mem_total_bytes: must be > 0, got {gpu.mem_total_bytes}")
            if not 0 <= gpu.mem_used_bytes <= gpu.mem_total_bytes:
                raise ValueError(
                    f"{p}.mem_used_bytes: must be within [0, mem_total_bytes={gpu.mem_total_bytes}],"
                    f" got {gpu.mem_used_bytes}"
                )
            if not 0.0 <= gpu.sm_util <= 1.0:
                raise ValueError(f"{p}.sm_util: must be within [0, 1], got {gpu.sm_util}")
            if not 0.0 < gpu.compute_share <= 1.0:
                raise ValueError(f"{p}.compute_share: must be within (0, 1], got {gpu.compute_share}")
            for counter in ("xid_errors", "ecc_errors", "failed_checks"):
                if getattr(gpu, counter) < 0:
                    raise ValueError(f"{p}.{counter}: must be >= 0")
            if gpu.nvlink_group is not None:
                key = (gpu.node_id, gpu.nvlink_group)
                if group_model.setdefault(key, gpu.model) != gpu.model:
                    raise ValueError(
                        f"{p}.nvlink_group: group {gpu.nvlink_group!r} of node {gpu.node_id!r}"
                        f" mixes {group_model[key]!r} and {gpu.model!r}"
                    )
        for i, link in enumerate(self.links):
            for end in ("a", "b"):
                if getattr(link, end) not in node_ids:
                    raise ValueError(f"links[{i}].{end}: unknown node {getattr(link, end)!r}")
            if link.a == link.b:
                raise ValueError(f"links[{i}].b: a link needs two different nodes")
            if link.bw_gbps < 0:
                raise ValueError(f"links[{i}].bw_gbps: must be >= 0, got {link.bw_gbps}")
            if link.latency_us is not None and link.latency_us < 0:
                raise ValueError(f"links[{i}].latency_us: must be >= 0, got {link.latency_us}")
        for name in ("intra_rack_gbps", "inter_rack_gbps"):
            if getattr(self, name) < 0:
                raise ValueError(f"network.{name}: must be >= 0")
        for i, curve in enumerate(self.collectives):
            for end in ("node", "peer"):
                who = getattr(curve, end)
                if who is not None and who not in node_ids:
                    raise ValueError(f"collectives[{i}].{end}: unknown node {who!r}")

    def to_dict(self) -> dict[str, object]:
        return {
            "now_s": self.now_s,
            "nodes": [
                {"id": n.id, "rack": n.rack, "schedulable": n.schedulable, "last_seen_s": n.last_seen_s,
                 **({"engine": n.engine.to_dict()} if n.engine is not None else {})}
                for n in self.nodes
            ],
            "gpus": [
                {
                    "uuid": g.uuid,
                    "node_id": g.node_id,
                    "index": g.index,
                    "model": g.model,
                    "mem_total_bytes": g.mem_total_bytes,
                    "mem_used_bytes": g.mem_used_bytes,
                    "sm_util": g.sm_util,
                    "temperature_c": g.temperature_c,
                    "healthy": g.healthy,
                    "schedulable": g.schedulable,
                    "nvlink_group": g.nvlink_group,
                    "xid_errors": g.xid_errors,
                    "ecc_errors": g.ecc_errors,
                    "failed_checks": g.failed_checks,
                    "last_seen_s": g.last_seen_s,
                }
                for g in self.gpus
            ],
            "links": [
                {"a": link.a, "b": link.b, "bw_gbps": link.bw_gbps, "latency_us": link.latency_us}
                for link in self.links
            ],
            "network": {"intra_rack_gbps": self.intra_rack_gbps, "inter_rack_gbps": self.inter_rack_gbps},
            "custom_specs": [s.to_dict() for s in self.custom_specs],
            **({"collectives": [c.to_dict() for c in self.collectives]} if self.collectives else {}),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> Snapshot:
        """Parse and validate the JSON shape in the module docstring."""
        r = _Reader(d, "snapshot", required=("now_s", "nodes", "gpus"),
                    optional=("links", "network", "custom_specs", "collectives"))
        now_s = r.number("now_s")
        nodes = []
        for i, item in enumerate(r.items("nodes")):
            n = _Reader(item, f"nodes[{i}]", required=("id",),
                        optional=("rack", "schedulable", "last_seen_s", "engine"))
            node_id = n.string("id")
            engine = n.raw("engine")
            nodes.append(
                NodeState(
                    id=node_id,
                    rack=n.string("rack", node_id),
                    schedulable=n.boolean("schedulable", True),
                    last_seen_s=n.number("last_seen_s", now_s),
                    engine=None if engine is None else EngineCaps.from_dict(engine, f"nodes[{i}].engine"),
                )
            )
        node_seen = {n.id: n.last_seen_s for n in nodes}
        gpus = []
        for i, item in enumerate(r.items("gpus")):
            g = _Reader(
                item,
                f"gpus[{i}]",
                required=("uuid", "node_id", "index", "model", "mem_total_bytes", "mem_used_bytes"),
                optional=(
                    "sm_util", "temperature_c", "healthy", "schedulable", "nvlink_group",
                    "xid_errors", "ecc_errors", "failed_checks", "last_seen_s",
                ),
            )
            node_id = g.string("node_id")
            gpus.append(
                GpuState(
                    uuid=g.string("uuid"),
                    node_id=node_id,
                    index=g.integer("index"),
                    model=g.string("model"),
                    mem_total_bytes=g.integer("mem_total_bytes"),
                    mem_used_bytes=g.integer("mem_used_bytes"),
                    sm_util=g.number("sm_util", 0.0),
                    temperature_c=g.number("temperature_c", 0.0),
                    healthy=g.boolean("healthy", True),
                    schedulable=g.boolean("schedulable", True),
                    nvlink_group=g.optional_string("nvlink_group"),
                    xid_errors=g.integer("xid_errors", 0),
                    ecc_errors=g.integer("ecc_errors", 0),
                    failed_checks=g.integer("failed_checks", 0),
                    last_seen_s=g.number("last_seen_s", node_seen.get(node_id, now_s)),
                )
            )
        links = []
        for i, item in enumerate(r.items("links", [])):
            lr = _Reader(item, f"links[{i}]", required=("a", "b", "bw_gbps"), optional=("latency_us",))
            latency = lr.raw("latency_us")
            links.append(
                LinkState(
                    a=lr.string("a"),
                    b=lr.string("b"),
                    bw_gbps=lr.number("bw_gbps"),
                    latency_us=None if latency is None else lr.number("latency_us"),
                )
            )
        intra = inter = 0.0
        if r.raw("network") is not None:
            net = _Reader(r.raw("network"), "network", required=(), optional=("intra_rack_gbps", "inter_rack_gbps"))
            intra = net.number("intra_rack_gbps", 0.0)
            inter = net.number("inter_rack_gbps", 0.0)
        specs = []
        for i, item in enumerate(r.items("custom_specs", [])):
            if not isinstance(item, Mapping):
                raise ValueError(f"custom_specs[{i}]: must be an object")
            specs.append(GpuSpec.from_dict(item, f"custom_specs[{i}]"))
        curves = tuple(CollectiveCurve.from_dict(c, f"collectives[{i}]")
                       for i, c in enumerate(r.items("collectives", [])))
        snap = cls(
            now_s=now_s,
            nodes=tuple(nodes),
            gpus=tuple(gpus),
            links=tuple(links),
            intra_rack_gbps=intra,
            inter_rack_gbps=inter,
            custom_specs=tuple(specs),
            collectives=curves,
        )
        snap.validate()
        return snap


class _Reader:
    """Typed access to one JSON object with path-naming errors."""

    def __init__(self, d: object, path: str, required: Sequence[str], optional: Sequence[str]) -> None:
        if not isinstance(d, Mapping):
            raise ValueError(f"{path}: must be an object, got {type(d).__name__}")
        unknown = sorted(set(d) - set(required) - set(optional))
        if unknown:
            raise ValueError(f"{path}.{unknown[0]}: unknown key")
        for key in required:
            if key not in d:
                raise ValueError(f"{path}.{key}: required")
        self.d: Mapping[str, object] = d
        self.path = path

    def raw(self, key: str) -> object:
        return self.d.get(key)

    def _get(self, key: str, default: object) -> object:
        value = self.d.get(key, default)
        if value is None and default is None:
            raise ValueError(f"{self.path}.{key}: required")
        return value

    def number(self, key: str, default: float | None = None) -> float:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ValueError(f"{self.path}.{key}: must be a finite number, got {value!r}")
        return float(value)

    def integer(self, key: str, default: int | None = None) -> int:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{self.path}.{key}: must be an integer, got {value!r}")
        return value

    def string(self, key: str, default: str | None = None) -> str:
        value = self._get(key, default)
        if not isinstance(value, str) or not value:
            raise ValueError(f"{self.path}.{key}: must be a non-empty string, got {value!r}")
        return value

    def optional_string(self, key: str) -> str | None:
        value = self.d.get(key)
        if value is None:
            return None
        if not isinstance(value, str):
            raise ValueError(f"{self.path}.{key}: must be a string or null, got {value!r}")
        return value

    def boolean(self, key: str, default: bool) -> bool:
        value = self.d.get(key, default)
        if not isinstance(value, bool):
            raise ValueError(f"{self.path}.{key}: must be true or false, got {value!r}")
        return value

    def items(self, key: str, default: list[object] | None = None) -> list[object]:
        value = self.d.get(key, default)
        if not isinstance(value, list):
            raise ValueError(f"{self.path}.{key}: must be a list, got {type(value).__name__}")
        return value
