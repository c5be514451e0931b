"""Agent protocol v1's messages as dataclasses; `to_dict()` is the body an agent sends
(agents.protocol: the package docstring says what each means, agents.protocol.parse reads them)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from agents.protocol.rules import PROTOCOL_VERSION


@dataclass(frozen=True)
class GpuInfo:
    """What an agent says about one GPU when it registers (static facts)."""

    uuid: str  # the GPU's UUID as NVML reports it ("GPU-..."), unique in the cluster
    index: int  # its index on the node (CUDA device order)
    model: str  # a name of scheduler.hardware's catalog, or of `custom_spec`
    mem_total_bytes: int  # HBM size
    nvlink_group: str | None = None  # GPUs of a node with the same group share one NVLink/NVSwitch domain
    custom_spec: dict[str, Any] | None = None  # for a GPU outside the catalog: its datasheet figures


@dataclass(frozen=True)
class RegisterRequest:
    node_id: str  # stable node name, e.g. the hostname of a GPU node or a scenario node id
    hostname: str
    agent_version: str
    gpus: tuple[GpuInfo, ...]
    rack: str | None = None  # racks set the default link bandwidth between nodes
    backends: tuple[str, ...] = ("sim",)  # engine backends this agent can run
    data_addr: str | None = None  # host:port where this agent receives KV cache from its peers
    # The plans this agent runs right now, as leader or member (after a restart: none). The
    # controller drops from its gears the plans it placed on this node that are not listed
    # (console.fleet.actions.do_register_node). None: not said - nothing is reconciled.
    plans: tuple[str, ...] | None = None
    # What each backend's engine can run (scheduler.capabilities.EngineCaps.to_dict(), schema
    # version CAPS_VERSION), by backend name; every key is one of `backends`. None: not said
    # (an older agent) - the planner then restricts nothing on this node.
    capabilities: dict[str, dict[str, Any]] | None = None
    protocol: int = PROTOCOL_VERSION

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["gpus"] = [asdict(g) for g in self.gpus]
        d["backends"] = list(self.backends)
        if self.plans is None:
            del d["plans"]
        else:
            d["plans"] = list(self.plans)
        if self.capabilities is None:
            del d["capabilities"]
        return d


@dataclass(frozen=True)
class RegisterResponse:
    node_id: str
    epoch: int  # reports must carry it; a new registration starts a new epoch
    report_interval_s: float  # how often the controller wants a report when nothing changes
    agent_token: str | None = None  # only on enrollment: the agent's own token, shown once
    protocol: int = PROTOCOL_VERSION

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class GpuReport:
    """The changing state of one GPU."""

    uuid: str
    mem_used_bytes: int
    mem_total_bytes: int
    sm_util: float  # 0..1, fraction of time a kernel ran (NVML utilization.gpu / 100)
    temperature_c: float
    healthy: bool  # False after an XID that needs a reset, uncorrectable ECC, or a failed check
    allocatable: bool = True  # False while the node's owner gives this GPU to another tenant
    xid_errors: int = 0  # XID events since the agent started
    ecc_errors: int = 0  # uncorrectable (double-bit) ECC errors, volatile count


@dataclass(frozen=True)
class LinkReport:
    """What a node measured to a peer (agents/node/links.py: a timed bulk transfer over the data
    server path KV takes)."""

    peer: str  # the other node's id
    bw_gbps: float  # measured bandwidth to it, Gb/s
    latency_us: float | None = None  # one-way latency, microseconds (half a small round trip); None: not measured
    measured_at: float | None = None  # when, seconds since the epoch (the agent's clock); None: now
    method: str = ""  # how it was measured, e.g. "dataplane-bulk"; "" for a figure that was not measured


@dataclass(frozen=True)
class CollectiveReport:
    """A collective the agent timed over a sweep of message sizes (scheduler.collectives)."""

    op: str  # all_reduce | send_recv
    scope: str  # intra: this node's GPUs | inter: this node and `peer`
    ranks: int  # processes (GPUs) taking part
    points: tuple[tuple[int, float], ...]  # (message bytes, seconds), increasing bytes
    peer: str | None = None  # inter: the other node
    backend: str = ""  # nccl | gloo
    measured_at: float | None = None  # seconds since the epoch; None: now
    method: str = ""  # e.g. "torch.distributed"


@dataclass(frozen=True)
class EngineReport:
    """Serving metrics of one plan's engine on this node (empty until plans run)."""

    plan_id: str
    running: int  # sequences being decoded
    waiting: int  # sequences queued for admission
    tokens_per_s: float  # generated tokens per second over the report interval
    kv_usage: float  # 0..1 of this plan's KV cache in use
    ttft_p50_ms: float | None = None
    ttft_p95_ms: float | None = None
    tpot_p50_ms: float | None = None
    tpot_p95_ms: float | None = None
    finished: int = 0  # requests finished during the report interval
    arrivals: int = 0  # requests admitted during the report interval
    prompt_tokens_mean: float | None = None
    output_tokens_mean: float | None = None
    # of `finished`, the requests that missed their deployment's SLO (TTFT or TPOT): what the global
    # correction's violation rate counts (scheduler/control/correction.py). v1.2, no version bump:
    # an older agent does not send it (0)
    slo_violations: int = 0


@dataclass(frozen=True)
class Report:
    node_id: str
    epoch: int
    seq: int  # strictly increasing inside one epoch
    gpus: tuple[GpuReport, ...]
    links: tuple[LinkReport, ...] = ()
    engines: tuple[EngineReport, ...] = ()
    collectives: tuple[CollectiveReport, ...] = ()
    protocol: int = PROTOCOL_VERSION
    # False: a delta report - `gpus` lists only the GPUs whose state changed since the agent's last
    # accepted report (maybe none); the others are as that report said. Added to v1 without a
    # version bump (v1.1): a body without "full" is a full report, as before.
    full: bool = True
    # The plans this agent runs right now, as leader or member - what `RegisterRequest.plans` says,
    # kept true while the agent runs: a plan whose engine died and could not be restarted, or whose
    # GPUs failed under it, is not listed. A delta report carries it as a full one does. The
    # controller drops from its gears the plans it placed here that are not listed (v1.3, no version
    # bump). None: not said (an older agent) - nothing is assumed lost, the last list said stands.
    plans: tuple[str, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "protocol": self.protocol,
            "node_id": self.node_id,
            "epoch": self.epoch,
            "seq": self.seq,
            "gpus": [asdict(g) for g in self.gpus],
            "links": [{k: v for k, v in asdict(link).items() if v not in (None, "")} for link in self.links],
            "engines": [asdict(e) for e in self.engines],
        }
        if self.collectives:
            d["collectives"] = [{**asdict(c), "points": [list(p) for p in c.points]} for c in self.collectives]
        if not self.full:
            d["full"] = False
        if self.plans is not None:
            d["plans"] = list(self.plans)
        return d


@dataclass(frozen=True)
class Command:
    """One thing the controller asks one agent to do (a step of a transition, or a node command)."""

    id: int  # increasing per cluster; the agent pulls with after=<last id it saw>
    kind: str  # one of COMMAND_KINDS (package docstring: the transition commands and the node commands)
    payload: dict[str, Any] = field(default_factory=dict)
    deployment: str | None = None
    transition_seq: int | None = None
    step: str | None = None  # the transition step this command belongs to (idempotency key with seq)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Ack:
    status: str  # ok | failed | running (a progress report for a long step)
    detail: str = ""
    result: dict[str, Any] = field(default_factory=dict)
    protocol: int = PROTOCOL_VERSION

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
