"""Agent protocol v1: the wire messages between the controller and the GPU agents.

JSON over HTTP. Every request body carries `"protocol": 1`; the controller refuses other
versions with a 400 that names the field, so an old agent fails loudly instead of half working.

    POST /agent/v1/register            RegisterRequest  -> RegisterResponse
    POST /agent/v1/report              Report           -> {"accepted": seq}
    GET  /agent/v1/commands?after=ID&wait=S             -> {"commands": [Command, ...]}  (long poll)
    POST /agent/v1/commands/<ID>/ack   Ack              -> {"command": ID, "status": ...}

Authentication: `Authorization: Bearer <token>`. An agent enrolls once with the cluster's join
token (FLEXPIPE_ENROLL_TOKEN) and receives its own agent token in the RegisterResponse; from
then on it uses only that token, which is valid for its own node and only on these endpoints.

Ordering: `register` starts a new *epoch* for the node; each report carries (epoch, seq) with
seq strictly increasing inside an epoch. A report from an older epoch, or with a seq not above
the last accepted one, is stale and refused with 409 — a delayed packet from before an agent
restart can never overwrite newer state.

Control only: commands say *what* to move; KV bytes and tokens travel agent to agent
(`data_addr`), never through the controller (DESIGN.md, data flow).

This module is pure Python (no Django): the console validates incoming bodies with the
`parse_*` functions, the agents build bodies with `to_dict()`.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from agents.schema import ObjectReader, SchemaError, read_document

PROTOCOL_VERSION = 1

NODE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
ENGINE_BACKENDS = ("sim", "torch", "vllm")
ACK_STATUSES = ("ok", "failed", "running")

# Generous upper bounds that catch unit mistakes (bytes vs GiB) without limiting real hardware.
_MAX_MEM_BYTES = 4 * 1024**4  # 4 TiB per GPU
_MAX_GPUS_PER_NODE = 64


__all__ = [
    "PROTOCOL_VERSION",
    "SchemaError",
    "GpuInfo",
    "RegisterRequest",
    "RegisterResponse",
    "GpuReport",
    "LinkReport",
    "EngineReport",
    "Report",
    "Command",
    "Ack",
    "parse_register",
    "parse_report",
    "parse_ack",
    "parse_command",
    "parse_register_response",
]


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
    protocol: int = PROTOCOL_VERSION

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["gpus"] = [asdict(g) for g in self.gpus]
        d["backends"] = list(self.backends)
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
    peer: str  # the other node's id
    bw_gbps: float  # measured bandwidth to it, Gb/s


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


@dataclass(frozen=True)
class Report:
    node_id: str
    epoch: int
    seq: int  # strictly increasing inside one epoch
    gpus: tuple[GpuReport, ...]
    links: tuple[LinkReport, ...] = ()
    engines: tuple[EngineReport, ...] = ()
    protocol: int = PROTOCOL_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {
            "protocol": self.protocol,
            "node_id": self.node_id,
            "epoch": self.epoch,
            "seq": self.seq,
            "gpus": [asdict(g) for g in self.gpus],
            "links": [asdict(link) for link in self.links],
            "engines": [asdict(e) for e in self.engines],
        }


@dataclass(frozen=True)
class Command:
    """One thing the controller asks one agent to do (a step of a transition)."""

    id: int  # increasing per cluster; the agent pulls with after=<last id it saw>
    kind: str  # e.g. "prepare_plan", "freeze", "migrate_kv", "release_plan"
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


# -- parsing: every function raises SchemaError naming each bad key, or returns the message ----


def _check_protocol(r: ObjectReader) -> None:
    version = r.int("protocol")
    if version is not None and version != PROTOCOL_VERSION:
        r.fail("protocol", f"unsupported version {version}; this controller speaks {PROTOCOL_VERSION}")


def _node_id(r: ObjectReader, key: str = "node_id") -> str | None:
    value = r.str(key, max_len=64)
    if value is not None and not NODE_ID_RE.match(value):
        r.fail(key, "must be 1-64 characters of letters, digits, '.', '_' or '-', starting with a letter or digit")
        return None
    return value


def parse_register(body: Any) -> RegisterRequest:
    r, problems = read_document(body)
    _check_protocol(r)
    node_id = _node_id(r)
    hostname = r.str("hostname", max_len=255)
    agent_version = r.str("agent_version", max_len=64)
    rack = r.str("rack", None, max_len=64)
    data_addr = r.str("data_addr", None, max_len=255)
    backends: list[str] = []
    blist = r.list("backends", ["sim"], min_len=1, max_len=len(ENGINE_BACKENDS))
    if blist is not None:
        for path, item in blist.items():
            if item not in ENGINE_BACKENDS:
                problems.add(path, f"must be one of {', '.join(ENGINE_BACKENDS)}; got {item!r}")
            else:
                backends.append(item)
    gpus: list[GpuInfo] = []
    seen_uuids: dict[str, str] = {}
    seen_index: dict[int, str] = {}
    glist = r.list("gpus", min_len=1, max_len=_MAX_GPUS_PER_NODE)
    if glist is not None:
        for g in glist.objects():
            uuid = g.str("uuid", max_len=128)
            index = g.int("index", min=0, max=_MAX_GPUS_PER_NODE - 1)
            model = g.str("model", max_len=64)
            mem_total = g.int("mem_total_bytes", min=1, max=_MAX_MEM_BYTES)
            group = g.str("nvlink_group", None, max_len=64)
            custom = g.raw("custom_spec", None)
            if custom is not None and not isinstance(custom, dict):
                g.fail("custom_spec", "must be an object")
                custom = None
            g.done()
            if uuid is not None:
                if uuid in seen_uuids:
                    g.fail("uuid", f"duplicates {seen_uuids[uuid]}")
                seen_uuids.setdefault(uuid, g.child_path("uuid"))
            if index is not None:
                if index in seen_index:
                    g.fail("index", f"duplicates {seen_index[index]}")
                seen_index.setdefault(index, g.child_path("index"))
            if None not in (uuid, index, model, mem_total):
                gpus.append(GpuInfo(uuid, index, model, mem_total, group, custom))
    r.done()
    problems.raise_if_any("register request")
    assert node_id and hostname and agent_version  # noqa: S101 - guaranteed by raise_if_any
    return RegisterRequest(
        node_id=node_id,
        hostname=hostname,
        agent_version=agent_version,
        gpus=tuple(gpus),
        rack=rack,
        backends=tuple(backends),
        data_addr=data_addr,
    )


def parse_register_response(body: Any) -> RegisterResponse:
    r, problems = read_document(body)
    _check_protocol(r)
    resp = RegisterResponse(
        node_id=r.str("node_id"),
        epoch=r.int("epoch", min=1),
        report_interval_s=r.num("report_interval_s", min=0.0, exclusive_min=True),
        agent_token=r.str("agent_token", None),
    )
    r.done()
    problems.raise_if_any("register response")
    return resp


def parse_report(body: Any) -> Report:
    r, problems = read_document(body)
    _check_protocol(r)
    node_id = _node_id(r)
    epoch = r.int("epoch", min=1)
    seq = r.int("seq", min=1)
    gpus: list[GpuReport] = []
    seen: dict[str, str] = {}
    glist = r.list("gpus", min_len=1, max_len=_MAX_GPUS_PER_NODE)
    if glist is not None:
        for g in glist.objects():
            uuid = g.str("uuid", max_len=128)
            used = g.int("mem_used_bytes", min=0, max=_MAX_MEM_BYTES)
            total = g.int("mem_total_bytes", min=1, max=_MAX_MEM_BYTES)
            sm_util = g.num("sm_util", min=0.0, max=1.0)
            temp = g.num("temperature_c", min=-50.0, max=200.0)
            healthy = g.bool("healthy")
            allocatable = g.bool("allocatable", True)
            xid = g.int("xid_errors", 0, min=0)
            ecc = g.int("ecc_errors", 0, min=0)
            g.done()
            if used is not None and total is not None and used > total:
                g.fail("mem_used_bytes", f"must not exceed mem_total_bytes ({total}); got {used}")
                used = None
            if uuid is not None:
                if uuid in seen:
                    g.fail("uuid", f"duplicates {seen[uuid]}")
                seen.setdefault(uuid, g.child_path("uuid"))
            values = (uuid, used, total, sm_util, temp, healthy, allocatable, xid, ecc)
            if None not in values:
                gpus.append(GpuReport(uuid, used, total, sm_util, temp, healthy, allocatable, xid, ecc))
    links: list[LinkReport] = []
    llist = r.list("links", [], max_len=10_000)
    if llist is not None:
        for lk in llist.objects():
            peer = _node_id(lk, "peer")
            bw = lk.num("bw_gbps", min=0.0)
            lk.done()
            if peer is not None and bw is not None:
                if peer == node_id:
                    lk.fail("peer", "must be another node, not the reporting one")
                else:
                    links.append(LinkReport(peer, bw))
    engines: list[EngineReport] = []
    elist = r.list("engines", [], max_len=256)
    if elist is not None:
        for e in elist.objects():
            rep = EngineReport(
                plan_id=e.str("plan_id", max_len=128),
                running=e.int("running", min=0),
                waiting=e.int("waiting", min=0),
                tokens_per_s=e.num("tokens_per_s", min=0.0),
                kv_usage=e.num("kv_usage", min=0.0, max=1.0),
                ttft_p50_ms=e.num("ttft_p50_ms", None, min=0.0),
                ttft_p95_ms=e.num("ttft_p95_ms", None, min=0.0),
                tpot_p50_ms=e.num("tpot_p50_ms", None, min=0.0),
                tpot_p95_ms=e.num("tpot_p95_ms", None, min=0.0),
                finished=e.int("finished", 0, min=0),
                arrivals=e.int("arrivals", 0, min=0),
                prompt_tokens_mean=e.num("prompt_tokens_mean", None, min=0.0),
                output_tokens_mean=e.num("output_tokens_mean", None, min=0.0),
            )
            e.done()
            engines.append(rep)
    r.done()
    problems.raise_if_any("report")
    assert node_id is not None and epoch is not None and seq is not None  # noqa: S101
    return Report(node_id, epoch, seq, tuple(gpus), tuple(links), tuple(engines))


def parse_command(body: Any) -> Command:
    r, problems = read_document(body)
    payload = r.raw("payload", {})
    if not isinstance(payload, dict):
        r.fail("payload", "must be an object")
        payload = {}
    cmd = Command(
        id=r.int("id", min=1),
        kind=r.str("kind", max_len=64),
        payload=payload,
        deployment=r.str("deployment", None),
        transition_seq=r.int("transition_seq", None, min=1),
        step=r.str("step", None),
    )
    r.done()
    problems.raise_if_any("command")
    return cmd


def parse_ack(body: Any) -> Ack:
    r, problems = read_document(body)
    _check_protocol(r)
    status = r.str("status", choices=ACK_STATUSES)
    detail = r.str("detail", "", max_len=2000, allow_empty=True)
    result = r.raw("result", {})
    if not isinstance(result, dict):
        r.fail("result", "must be an object")
        result = {}
    r.done()
    problems.raise_if_any("ack")
    return Ack(status=status, detail=detail, result=result)
