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
It keeps it (agents.client: --token-file): the join token enrolls only a node id nobody holds, so
an enrolled node registers again with its own token, or one an operator issued for it
(DESIGN.md invariant 8; 403 naming `node_id` otherwise). Another node's GPUs or commands are
refused too (403 naming `gpus[i].uuid` or `id`). Every integer fits 64 bits, every number is
finite, bodies nest at most agents.schema.MAX_DEPTH deep.

Ordering: `register` starts a new *epoch* for the node; each report carries (epoch, seq) with
seq strictly increasing inside an epoch. A report from an older epoch, or with a seq not above
the last accepted one, is stale and refused with 409 — a delayed packet from before an agent
restart can never overwrite newer state.

Delta reports (v1.1, added without a version bump): a report with `"full": false` lists only the
GPUs whose state changed since the agent's last *accepted* report (a report that failed does not
count: the next one says everything since the last that was accepted); the controller keeps the
others as they were. `engines`, `links` and `collectives` mean what they mean in a full report.
An agent sends a full report after each registration, after any failed report, and every
agents.client.FULL_REPORT_EVERY reports, so nothing a delta missed lasts. An agent whose controller
refuses `full` (400 naming it: an older console) goes back to full reports.

What runs (v1.3, added without a version bump): a registration and every report, delta ones too,
may list the plans the agent runs (`plans`, as leader or member). A plan that dies under a running
agent - its engine failed for good, its GPUs failed - is not listed in the next report; the
controller takes the plans it placed on this node that are not listed out of their gears and
routing, as for an agent that came back without them (console.fleet.actions). A plan whose
`prepare_plan` is still open, or was acked after the previous accepted report, is not judged on
this report (the agent may have built it before that prepare). A body without `plans` (an older
agent) says nothing: no plan is assumed lost, and what the last list said stands.

Control only: commands say *what* to move; KV bytes and tokens travel agent to agent
(`data_addr`), never through the controller (DESIGN.md, data flow).

This module is pure Python (no Django): the console validates incoming bodies with the
`parse_*` functions, the agents build bodies with `to_dict()`.

Transition commands (v1)
------------------------

A gear transition (scheduler/transition/) drives the agents with six command kinds. They are
engine-neutral: the simulated agents (agents/sim) and the real daemon (vLLM or the torch
engine) implement the same meaning. Every command carries `deployment`, `transition_seq` and
`step` on the envelope; its `key` on the controller side is (deployment, seq, step, attempt,
node, plan), so the same step re-run after a crash re-sends the *same* command (same id), and a
retry is a new command. An agent must treat each one as idempotent: doing it twice is doing it
once, and the undo commands are safe for something that never happened. Every payload names
`plan_id` (the plan's content id, scheduler.plan.Plan.plan_id) and `deployment` (whose plan it
is: an agent never touches another deployment's plan with the same content). `check_payload`
validates a payload and `check_result` an ok-ack's result, each naming every bad field.

A plan's **leader** is the node of its first stage's first GPU: it runs the plan's entry
(admission, the sequence table); the other nodes are **members** holding later stages.

`prepare_plan` - to every node of a new plan (the shadow plan; no request reaches it yet)
    payload: plan (Plan.to_dict()), model (name), weights_sha256 (hex or null: the registry's
    digest of the weights to load), role (leader | member), stages (this node's part:
    [{pipeline: main|prefill|decode, index, layers: [start, end), tp, gpus: [the stage's GPU
    uuids, rank order], ranks: [the ranks on this node]}]), reserve_bytes ({gpu uuid: bytes to
    reserve: weight shard + KV reserve}), peers ({node id: data_addr} of the plan's other nodes,
    for its communication groups: a torch leader asks each peer's data server to start the
    stage workers that peer's own `stages` place on it - agents/dataplane/stages.py).
    The agent reserves the memory, loads the weights (from its host-memory weight cache when
    they are there: agents/node/weightcache.py), builds the communication groups, warms up,
    then acks ok with {plan_id, reserved_bytes, load_s, weights_sha256 (the digest the node
    computed for the weights before loading them, when it hashed them), weights_source
    (host_cache | disk: where this node read them from), weights_bytes}. Before it is served the
    leader generates model_version's warmup_tokens (below; 1 without a model_version, 0: none).
    Weights whose digest is not the registry's: ack failed with weights_sha256,
    the digest observed (the console quarantines that model version).
    Already prepared: ack ok at once. GPUs not ours: ack failed, reason "preempted".
    Optional model_version ({id, version, tokenizer, warmup_tokens}: the registry version the
    plan loads): an agent that can read that tokenizer checks the shadow plan with it before it
    acks - it loads, and a warm-up prompt encodes to ids inside the model's vocabulary; otherwise
    ack failed, reason "tokenizer" (the transition rolls back; what served keeps serving). The
    simulated agents do (agents/shadow_check.py); the node daemon does not yet (its engines warm
    up from their own model folder, and the console loads the tokenizer at registration).
    Optional model_spec (the model's shape as scheduler.modelspec.ModelSpec.to_dict() writes it:
    name - the payload's model -, hidden_size, num_layers, num_heads, num_kv_heads, head_dim,
    intermediate_size, vocab_size, dtype_bytes, max_context_tokens, and optionally gated_mlp,
    tie_word_embeddings, qkv_bias, source: the spec the controller sized reserve_bytes with) and
    optional slo ({ttft_ms, tpot_ms} > 0: the deployment's objectives). Added to v1 without a
    version bump: a payload without them means what it meant before. The console sends both
    (console/gearbox/executor.py). A simulated agent runs a deployment its scenario does not
    serve - one created in the console - from them, and refuses its prepare naming `model_spec`
    or `slo` when one is missing; it books memory by the same 92% rule either way. The node
    daemon validates them and runs what its engine reads from the model's own folder.
`abort_plan` - undo a prepare (rollback); safe if it never ran (ack ok, noop: true)
    payload: reason, drain_timeout_s (sequences still there may finish for this long; then
    each ends with an explicit error). Ack: {plan_id, failed: [seq ids ended with an error]}.
`freeze_plan` - to a plan's leader: stop admitting (at the end of the current decode
    iteration), and say what is in flight
    payload: routing_version (the table version that froze it).
    Ack: {plan_id, decode_step_s (the plan's decode iteration now, measured), sequences:
    [{seq_id, context_tokens (prompt + generated: what its KV holds), generated_tokens,
    max_tokens, state: running | waiting (idle: queued, not decoding), kv_lost (its KV is gone
    with a lost GPU: it can only be replayed)}]}. Unknown plan: ack ok with no sequences.
`thaw_plan` - undo a freeze (rollback): admit again. Safe if never frozen.
`move_sequences` - to a leaving plan's leader: hand its sequences over
    payload: routing_version (the lease version the receivers must see as newer), boundary
    ("decode_end"), moves (in order: active sequences longest first, then idle ones):
    [{seq_id, action: migrate | replay | finish, target_plan, target_node, target_addr (the
    target agent's data address), bw_cap_bytes_per_s (cap for this KV transfer; 0: none),
    lazy (idle: move after the active ones), est_stall_s (the controller's estimate)}].
    migrate: at the end of its decode iteration pause the sequence, send its KV to the target
    (at most the cap), and hand it over with lease (target_plan, routing_version); replay: hand
    over its tokens and let the target re-prefill; finish: keep it here until it ends. A
    sequence no longer here is reported as "gone". The target accepts a sequence only with a
    lease newer than the one it had. Ack: {plan_id, moved: [{seq_id, action, ok, outcome?
    ("gone"), context_tokens, kv_bytes, replay_tokens, stall_s (how long it stood still),
    error?, reason?}]}; any hand-over that failed makes the ack failed (reason "preempted" when
    the target lost its GPUs, "target_refused", "stale_lease").
`release_plan` - to every node of a leaving plan, after the routing table dropped it
    payload: drain_timeout_s (sequences left to finish get this long), fallback (optional:
    {target_plan, target_node, target_addr, routing_version} - a sequence that cannot finish
    here, because the drain ran out or the plan lost its GPUs, is handed over there by replay
    with that lease version; without a fallback, or when the target refuses, it ends with an
    explicit error). Free the GPUs; ack {plan_id, freed_bytes, failed, handed_over}. Unknown
    plan: ack ok, noop: true.

A failed ack's result carries `reason` (preempted | failed | conflict | target_refused |
stale_lease | timeout | out_of_memory | unsupported) and, for preemptions, `gpus`: the controller retries SWITCH steps that
fail (twice), rolls back PREPARE ones.

Node commands (v1)
------------------

Commands about what a node holds, outside any transition: no deployment, no transition seq, no
plan. They are not scheduler.transition.CommandKind (the scheduler never sends them); their kinds
are `NodeCommandKind`. `COMMAND_KINDS` lists both families; `check_payload` and `check_result`
validate both.

`verify_weights` - the registry asks a node to hash its copy of a model version's weights before
    any deployment loads them (console/registry/actions.py do_request_weights_check; the key is
    per (version, node), so asking again re-sends the same command)
    payload: model_version_id, name (the model: the node's folder of that name in its model
    store), version, weights_uri, sha256 (the registry's digest, 64 lowercase hex), engine (vllm |
    torch), tokenizer. The node hashes the weights it holds for `name` (it downloads and writes
    nothing) and acks ok with {sha256: the digest it computed}, whether or not it is the
    registry's: the console verifies the version on a match and quarantines it on a mismatch. No
    weights for that model on this node, or a node that holds no models (a simulated one): ack
    failed with a detail naming the model and where it looked (the registry records
    registry.weights_check_failed; the version's status stays).
`probe_links` - measure the links to these peers now, and keep probing them every
    FLEXPIPE_LINK_PROBE_S (agents/node/links.py: timed uploads to each peer's data server, the
    path KV takes). Sent when a node registers - to it, naming every other node, and to each of
    those, naming it - and whenever an operator asks (manage.py probe_links).
    payload: peers ({node id: data address}), bulk_bytes (optional: the size of one timed upload).
    Ack ok with {links: [{peer, bw_gbps, latency_us, measured_at, method}]} (what it could
    measure); the same figures go out with every report from then on (`Report.links`).

`apply_hints` - the global correction's hints to the plans this node leads
    (scheduler/control/correction.py: the rules, the three time scales). Added to v1 without a
    version bump: an older agent answers it failed, naming `kind`.
    payload: deployment, hints_version (an integer >= 1, strictly increasing per deployment: the
    node ignores a version not newer than the last it applied), ttl_s (> 0, at most 3600: past
    it the engine returns to its own defaults, so a controller that stops sending leaves the
    engines' local loops at their defaults), plans (1 to 1024, each plan_id once): [{plan_id,
    direction (speed_up | slow_down | hold), weight_multiplier (0 < m <= 10: the router's weight
    for the plan times this, while the hint lives), batch_scale (0 < s <= 16: the engine's own
    batch-token threshold per round times this, while the hint lives - a scale, so that one
    hint means the same to engines with different defaults)}].
    Ack ok with {applied (false: an older version, ignored), hints_version (the newest this node
    holds for the deployment), plans: [the plan ids whose engine took the threshold], unknown:
    [plan ids this node leads no engine for]}. An engine that has no batch-token threshold says
    so in the ack's detail and lists the plan under unknown.

Links and collectives in reports
--------------------------------

`Report.links`: per peer, the latest measurement - bw_gbps (>= 0), latency_us (>= 0 or null),
measured_at (seconds since the epoch, the agent's clock), method (how). `Report.collectives`:
sweeps the agent timed with torch.distributed where it runs (agents/probes/collectives.py):
{op: all_reduce | send_recv, scope: intra | inter, ranks, peer (inter), backend, points:
[[message bytes, seconds], ...] by increasing size, measured_at, method}. A negative or
non-finite figure, or a peer the controller does not know, is refused with a 400 naming the
field, and nothing of the report is stored.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from agents.schema import ListReader, ObjectReader, Problems, SchemaError, read_document
from scheduler.capabilities import EngineCaps
from scheduler.costmodel import Slo
from scheduler.modelspec import ModelSpec
from scheduler.plan import Plan
from scheduler.transition import CommandKind

PROTOCOL_VERSION = 1

NODE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
ENGINE_BACKENDS = ("sim", "torch", "vllm")
ACK_STATUSES = ("ok", "failed", "running")


class NodeCommandKind(enum.StrEnum):
    """Commands about a node itself, outside any transition (module docstring: node commands)."""

    VERIFY_WEIGHTS = "verify_weights"
    PROBE_LINKS = "probe_links"
    APPLY_HINTS = "apply_hints"


TRANSITION_KINDS = tuple(k.value for k in CommandKind)  # sent by scheduler.transition, keyed by deployment and plan
NODE_KINDS = tuple(k.value for k in NodeCommandKind)  # about the node itself: no deployment, no plan
COMMAND_KINDS = TRANSITION_KINDS + NODE_KINDS  # every kind an agent may be sent
# out_of_memory: the plan would book more than 92% of a GPU (scheduler.booking, the same words from
# every agent); unsupported: the node's engine cannot run the plan (scheduler.capabilities);
# tokenizer: a rollout's shadow plan failed its tokenizer check (agents/shadow_check.py)
FAILURE_REASONS = ("preempted", "failed", "conflict", "target_refused", "stale_lease", "timeout", "out_of_memory",
                   "unsupported", "tokenizer")
WEIGHTS_SOURCES = ("host_cache", "disk")  # prepare_plan's ack: where the node read the weights from
MAX_WARMUP_TOKENS = 1_000_000  # the registry's bound on a model's warm-up (console/registry/api.py)

# Generous upper bounds that catch unit mistakes (bytes vs GiB) without limiting real hardware.
_MAX_MEM_BYTES = 4 * 1024**4  # 4 TiB per GPU
_MAX_GPUS_PER_NODE = 64
_MAX_PLANS_PER_NODE = 1024
_MAX_LINKS_PER_REPORT = 256  # one per peer node measured; each is an upsert under the report's write lock
_MAX_COUNTER = 2**31 - 1  # xid_errors, ecc_errors: the console stores them as 32-bit counters
_MAX_SEQUENCES_PER_PLAN = 10**7  # running / waiting: far above any engine's batch or queue
MAX_HINT_TTL_S = 3600.0  # apply_hints: a hint lives at most an hour
_MAX_HINT_WEIGHT = 10.0  # apply_hints: a router weight multiplier (the controller keeps it in [0.5, 2])
_MAX_HINT_BATCH_SCALE = 16.0  # apply_hints: of an engine's own batch-token threshold (the controller: [1/8, 8])
_HINT_DIRECTIONS = ("speed_up", "slow_down", "hold")
_MAX_LINK_GBPS = 100_000.0  # 100 Tb/s: beyond any node link (catches bytes-vs-bits and B/s-vs-Gb/s mistakes)


__all__ = [
    "PROTOCOL_VERSION",
    "SchemaError",
    "GpuInfo",
    "RegisterRequest",
    "RegisterResponse",
    "GpuReport",
    "LinkReport",
    "CollectiveReport",
    "EngineReport",
    "Report",
    "Command",
    "CommandKind",
    "NodeCommandKind",
    "COMMAND_KINDS",
    "NODE_KINDS",
    "TRANSITION_KINDS",
    "FAILURE_REASONS",
    "MAX_HINT_TTL_S",
    "Ack",
    "check_payload",
    "prepare_shape",
    "check_result",
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
    kind: str  # one of COMMAND_KINDS (module docstring: the transition commands and the node commands)
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


def _plan_ids(r: ObjectReader, problems: Problems) -> list[str] | None:
    """The optional `plans` list of a registration or a report: the plan ids the agent runs."""
    plist = r.list("plans", None, max_len=_MAX_PLANS_PER_NODE)
    if plist is None:
        return None
    plans: list[str] = []
    for path, item in plist.items():
        if not isinstance(item, str) or not 1 <= len(item) <= 64:
            problems.add(path, f"must be a plan id (a string of 1 to 64 characters); got {item!r}")
        else:
            plans.append(item)
    return plans


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
    plans = _plan_ids(r, problems)
    capabilities: dict[str, dict[str, Any]] | None = None
    raw_caps = r.raw("capabilities", None)
    if raw_caps is not None:
        if not isinstance(raw_caps, dict):
            r.fail("capabilities", "must be an object of backend name -> capabilities")
        else:
            capabilities = {}
            for name, caps in raw_caps.items():
                where = f"capabilities.{name}"
                if name not in backends:
                    problems.add(where, f"names no backend this agent runs ({', '.join(backends)})")
                    continue
                try:
                    parsed = EngineCaps.from_dict(caps, where)
                except ValueError as exc:
                    path, _, why = str(exc).partition(": ")
                    problems.add(path, why or str(exc))
                    continue
                if parsed.backend != name:
                    problems.add(f"{where}.backend", f"must be {name!r}, the key it is listed under")
                    continue
                capabilities[name] = parsed.to_dict()
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
        plans=None if plans is None else tuple(plans),
        capabilities=capabilities,
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
    full = r.bool("full", True)
    plans = _plan_ids(r, problems)
    gpus: list[GpuReport] = []
    seen: dict[str, str] = {}
    glist = r.list("gpus", min_len=1 if full is not False else 0, max_len=_MAX_GPUS_PER_NODE)
    if glist is not None:
        for g in glist.objects():
            uuid = g.str("uuid", max_len=128)
            used = g.int("mem_used_bytes", min=0, max=_MAX_MEM_BYTES)
            total = g.int("mem_total_bytes", min=1, max=_MAX_MEM_BYTES)
            sm_util = g.num("sm_util", min=0.0, max=1.0)
            temp = g.num("temperature_c", min=-50.0, max=200.0)
            healthy = g.bool("healthy")
            allocatable = g.bool("allocatable", True)
            xid = g.int("xid_errors", 0, min=0, max=_MAX_COUNTER)
            ecc = g.int("ecc_errors", 0, min=0, max=_MAX_COUNTER)
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
    llist = r.list("links", [], max_len=_MAX_LINKS_PER_REPORT)
    if llist is not None:
        for lk in llist.objects():
            peer = _node_id(lk, "peer")
            bw = lk.num("bw_gbps", min=0.0, max=_MAX_LINK_GBPS)
            latency = lk.num("latency_us", None, min=0.0, max=1e8)
            at = lk.num("measured_at", None, min=0.0)
            method = lk.str("method", "", max_len=64, allow_empty=True)
            lk.done()
            if peer is not None and bw is not None:
                if peer == node_id:
                    lk.fail("peer", "must be another node, not the reporting one")
                else:
                    links.append(LinkReport(peer, bw, latency, at, method or ""))
    collectives: list[CollectiveReport] = []
    clist = r.list("collectives", [], max_len=256)
    if clist is not None:
        for c in clist.objects():
            rep = _collective(c, node_id)
            c.done()
            if rep is not None:
                collectives.append(rep)
    engines: list[EngineReport] = []
    elist = r.list("engines", [], max_len=256)
    if elist is not None:
        for e in elist.objects():
            rep = EngineReport(
                plan_id=e.str("plan_id", max_len=128),
                running=e.int("running", min=0, max=_MAX_SEQUENCES_PER_PLAN),
                waiting=e.int("waiting", min=0, max=_MAX_SEQUENCES_PER_PLAN),
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
                slo_violations=e.int("slo_violations", 0, min=0),
            )
            e.done()
            if (isinstance(rep.slo_violations, int) and isinstance(rep.finished, int)
                    and rep.slo_violations > rep.finished):
                e.fail("slo_violations", f"must not exceed finished ({rep.finished}); got {rep.slo_violations}")
            engines.append(rep)
    r.done()
    problems.raise_if_any("report")
    assert node_id is not None and epoch is not None and seq is not None  # noqa: S101
    return Report(node_id, epoch, seq, tuple(gpus), tuple(links), tuple(engines), tuple(collectives),
                  full=full is not False, plans=None if plans is None else tuple(plans))


def _collective(c: ObjectReader, node_id: str | None) -> CollectiveReport | None:
    """One `collectives[i]` entry of a report, or None (its problems recorded by name)."""
    op = c.str("op", choices=("all_reduce", "send_recv"))
    scope = c.str("scope", choices=("intra", "inter"))
    ranks = c.int("ranks", min=2, max=4096)
    peer = _node_id(c, "peer") if c.raw("peer", None) is not None else None
    backend = c.str("backend", "", max_len=16, allow_empty=True)
    at = c.num("measured_at", None, min=0.0)
    method = c.str("method", "", max_len=64, allow_empty=True)
    points: list[tuple[int, float]] = []
    plist = c.list("points", min_len=1, max_len=64)
    ok = True
    if plist is not None:
        last = 0
        for path, item in plist.items():
            good = (isinstance(item, list) and len(item) == 2 and isinstance(item[0], int)
                    and not isinstance(item[0], bool) and isinstance(item[1], int | float)
                    and not isinstance(item[1], bool) and math.isfinite(item[1]) and item[1] > 0)
            if not good:
                c.problems.add(path, "must be [message bytes (an integer >= 1), seconds (a finite number > 0)]")
                ok = False
                continue
            if item[0] <= last:
                c.problems.add(path, f"sizes must increase and be >= 1; got {item[0]} after {last}")
                ok = False
                continue
            last = item[0]
            points.append((int(item[0]), float(item[1])))
    if scope == "inter" and peer is None:
        c.fail("peer", "is required for an inter-node collective")
        ok = False
    if peer is not None and peer == node_id:
        c.fail("peer", "must be another node, not the reporting one")
        ok = False
    if not ok or None in (op, scope, ranks) or not points:
        return None
    return CollectiveReport(op, scope, ranks, tuple(points), peer, backend or "", at, method or "")


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


# -- transition command payloads and ack results (module docstring) ------------------------------
_HEX = frozenset("0123456789abcdef")


def _common(r: ObjectReader) -> None:
    r.str("plan_id", max_len=64)
    r.str("deployment", max_len=64)


def _gpu_map(r: ObjectReader, key: str, *, required: bool = True) -> None:
    raw = r.raw(key) if required else r.raw(key, {})
    if raw is None:
        return
    if not isinstance(raw, dict):
        r.fail(key, "must be an object of GPU uuid -> bytes")
        return
    for uuid, value in raw.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            r.fail(f"{key}.{uuid}", "must be an integer number of bytes >= 0")


def _strings(r: ObjectReader, key: str) -> None:
    items = r.list(key, [])
    if items is not None:
        for path, item in items.items():
            if not isinstance(item, str):
                r.problems.add(path, "must be a string")


def _model_name(r: ObjectReader, key: str) -> None:
    """A model's name, which an agent turns into a folder of its model store: never a path out of it."""
    name = r.str(key, max_len=128)
    if name is not None and (name.startswith("/") or ".." in name.split("/")):
        r.fail(key, "must be a model name, not a path that leaves the model store")


def _prepare(r: ObjectReader) -> None:
    _common(r)
    plan = r.raw("plan")
    if plan is not None:
        try:
            parsed = Plan.from_dict(plan, "plan")
        except ValueError as exc:
            path, _, reason = str(exc).partition(": ")
            r.problems.add(path, reason or str(exc))
        else:
            pid = r.raw("plan_id", None)
            if isinstance(pid, str) and pid != parsed.plan_id:
                r.fail("plan_id", f"does not match the plan's content ({parsed.plan_id})")
    model = r.raw("model", None)
    _model_name(r, "model")
    sha = r.str("weights_sha256", None, max_len=64)
    if sha is not None and (len(sha) != 64 or not set(sha) <= _HEX):
        r.fail("weights_sha256", "must be 64 lowercase hex digits or null")
    spec = r.raw("model_spec", None)
    if spec is not None:
        try:
            shape = ModelSpec.from_dict(spec, r.child_path("model_spec"))
        except ValueError as exc:
            path, _, reason = str(exc).partition(": ")
            r.problems.add(path, reason or str(exc))
        else:
            if isinstance(model, str) and shape.name != model:
                r.fail("model_spec.name", f"must be the payload's model {model!r}; got {shape.name!r}")
    slo = r.obj("slo", None)
    if slo is not None:
        slo.num("ttft_ms", min=0.0, exclusive_min=True)
        slo.num("tpot_ms", min=0.0, exclusive_min=True)
        slo.done()
    r.str("role", choices=("leader", "member"))
    stages = r.list("stages", min_len=1, max_len=256)
    if stages is not None:
        for st in stages.objects():
            st.str("pipeline", choices=("main", "prefill", "decode"))
            st.int("index", min=0)
            layers = st.raw("layers")
            if layers is not None and not (isinstance(layers, list) and len(layers) == 2 and all(
                    isinstance(x, int) and not isinstance(x, bool) for x in layers) and 0 <= layers[0] < layers[1]):
                st.fail("layers", "must be [start, end) with 0 <= start < end")
            st.int("tp", min=1, max=64)
            _strings(st, "gpus")
            ranks = st.list("ranks", min_len=1)
            if ranks is not None:
                for path, item in ranks.items():
                    if isinstance(item, bool) or not isinstance(item, int) or item < 0:
                        st.problems.add(path, "must be an integer rank >= 0")
            st.done()
    _gpu_map(r, "reserve_bytes")
    version = r.obj("model_version", None)
    if version is not None:
        version.int("id", min=1)
        version.str("version", max_len=64)
        version.str("tokenizer", max_len=1024)
        version.int("warmup_tokens", min=0, max=MAX_WARMUP_TOKENS)
        version.done()
    peers = r.raw("peers", {})
    if peers is not None and (not isinstance(peers, dict) or not all(isinstance(v, str) for v in peers.values())):
        r.fail("peers", "must be an object of node id -> data address")


def prepare_shape(payload: Mapping[str, Any]) -> tuple[ModelSpec | None, Slo | None]:
    """A prepare_plan payload's optional model_spec and slo (module docstring), as the simulator
    takes them; None for each one it does not carry. Raises ValueError naming the field, for a
    payload that check_payload did not see."""
    raw_spec, raw_slo = payload.get("model_spec"), payload.get("slo")
    spec = ModelSpec.from_dict(raw_spec, "payload.model_spec") if raw_spec is not None else None
    if raw_slo is None:
        return spec, None
    if not isinstance(raw_slo, Mapping) or set(raw_slo) != {"ttft_ms", "tpot_ms"}:
        raise ValueError("payload.slo: must be an object of ttft_ms and tpot_ms")
    values = [raw_slo[k] for k in ("ttft_ms", "tpot_ms")]
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not _finite_pos(v) for v in values):
        raise ValueError("payload.slo: ttft_ms and tpot_ms must be finite numbers > 0")
    return spec, Slo(float(values[0]), float(values[1]))


def _finite_pos(value: float) -> bool:
    return math.isfinite(value) and value > 0


def _abort(r: ObjectReader) -> None:
    _common(r)
    r.str("reason", "", max_len=2000, allow_empty=True)
    r.num("drain_timeout_s", 0.0, min=0.0)


def _freeze(r: ObjectReader) -> None:
    _common(r)
    r.int("routing_version", min=0)


def _thaw(r: ObjectReader) -> None:
    _common(r)


def _move(r: ObjectReader) -> None:
    _common(r)
    r.int("routing_version", min=1)
    r.str("boundary", "decode_end", choices=("decode_end",))
    moves = r.list("moves", max_len=100_000)
    if moves is not None:
        for m in moves.objects():
            m.str("seq_id", max_len=200)
            action = m.str("action", choices=("migrate", "replay", "finish"))
            moving = action in ("migrate", "replay")
            for key in ("target_plan", "target_node", "target_addr"):
                value = m.str(key, "", max_len=255, allow_empty=True)
                if moving and key != "target_addr" and not value:
                    m.fail(key, f"is required to {action} a sequence")
            m.num("bw_cap_bytes_per_s", 0.0, min=0.0)
            m.bool("lazy", False)
            m.num("est_stall_s", 0.0, min=0.0)
            m.done()


def _release(r: ObjectReader) -> None:
    _common(r)
    r.num("drain_timeout_s", 0.0, min=0.0)
    fb = r.obj("fallback", None)
    if fb is not None:
        fb.str("target_plan", max_len=64)
        fb.str("target_node", max_len=64)
        fb.str("target_addr", "", max_len=255, allow_empty=True)
        fb.int("routing_version", min=1)
        fb.done()


def _probe_links(r: ObjectReader) -> None:
    peers = r.raw("peers")
    if peers is not None:
        if not isinstance(peers, dict) or not 1 <= len(peers) <= 1024:
            r.fail("peers", "must be an object of 1 to 1024 node id -> data address")
        else:
            for node, addr in peers.items():
                if not isinstance(node, str) or not NODE_ID_RE.match(node):
                    r.problems.add(f"payload.peers.{node}", "must be a node id")
                elif not isinstance(addr, str) or not 1 <= len(addr) <= 255:
                    r.problems.add(f"payload.peers.{node}", "must be a data address (host:port)")
    r.int("bulk_bytes", None, min=1, max=1 << 30)


def _apply_hints(r: ObjectReader) -> None:
    r.str("deployment", max_len=64)
    r.int("hints_version", min=1)
    r.num("ttl_s", min=0.0, max=MAX_HINT_TTL_S, exclusive_min=True)
    plans = r.list("plans", min_len=1, max_len=_MAX_PLANS_PER_NODE)
    if plans is not None:
        seen: set[str] = set()
        for h in plans.objects():
            pid = h.str("plan_id", max_len=64)
            if pid is not None:
                if pid in seen:
                    h.fail("plan_id", f"names plan {pid!r} twice")
                seen.add(pid)
            h.str("direction", choices=_HINT_DIRECTIONS)
            h.num("weight_multiplier", min=0.0, max=_MAX_HINT_WEIGHT, exclusive_min=True)
            h.num("batch_scale", min=0.0, max=_MAX_HINT_BATCH_SCALE, exclusive_min=True)
            h.done()


def _sha256(r: ObjectReader, key: str) -> None:
    sha = r.str(key, max_len=64)
    if sha is not None and (len(sha) != 64 or not set(sha) <= _HEX):
        r.fail(key, "must be 64 lowercase hex digits")


def _verify(r: ObjectReader) -> None:
    r.int("model_version_id", min=1)
    _model_name(r, "name")
    r.str("version", max_len=64)
    r.str("weights_uri", max_len=1024)
    _sha256(r, "sha256")
    r.str("engine", choices=("vllm", "torch"))
    r.str("tokenizer", max_len=1024)


_PAYLOADS = {
    CommandKind.PREPARE_PLAN.value: _prepare,
    CommandKind.ABORT_PLAN.value: _abort,
    CommandKind.FREEZE_PLAN.value: _freeze,
    CommandKind.THAW_PLAN.value: _thaw,
    CommandKind.MOVE_SEQUENCES.value: _move,
    CommandKind.RELEASE_PLAN.value: _release,
    NodeCommandKind.VERIFY_WEIGHTS.value: _verify,
    NodeCommandKind.PROBE_LINKS.value: _probe_links,
    NodeCommandKind.APPLY_HINTS.value: _apply_hints,
}


def check_payload(kind: str, payload: Any) -> dict[str, Any]:
    """Validate a command's payload; SchemaError names every bad field ("payload.moves[2].action")."""
    if kind not in _PAYLOADS:
        raise SchemaError({"kind": f"must be one of {', '.join(COMMAND_KINDS)}; got {kind!r}"}, "command")
    problems = Problems()
    r = ObjectReader(payload, "payload", problems)
    if r.ok:
        _PAYLOADS[kind](r)
        r.done()
    problems.raise_if_any(f"{kind} payload")
    return dict(payload)


def _seq_list(items: ListReader) -> None:
    for s in items.objects():
        s.str("seq_id", max_len=200)
        s.int("context_tokens", min=0)
        s.int("generated_tokens", min=0)
        s.int("max_tokens", min=0)
        s.str("state", choices=("running", "waiting"))
        s.bool("kv_lost", False)
        s.done()


def check_result(kind: str, result: Any) -> dict[str, Any]:
    """Validate the result of an ok-ack to a command (module docstring: what each says).
    Keys beyond those documented are allowed (an engine may say more); documented ones must be right."""
    if kind not in _PAYLOADS:
        raise SchemaError({"kind": f"must be one of {', '.join(COMMAND_KINDS)}; got {kind!r}"}, "command")
    problems = Problems()
    r = ObjectReader(result, "result", problems)
    if not r.ok:
        problems.raise_if_any(f"{kind} result")
    if kind == CommandKind.FREEZE_PLAN.value:
        seqs = r.list("sequences", [])
        if seqs is not None:
            _seq_list(seqs)
        r.num("decode_step_s", None, min=0.0)
    elif kind == CommandKind.MOVE_SEQUENCES.value:
        moved = r.list("moved", [])
        if moved is not None:
            for m in moved.objects():
                m.str("seq_id", max_len=200)
                m.str("action", choices=("migrate", "replay", "finish"))
                m.bool("ok", True)
                for key in ("kv_bytes", "replay_tokens", "context_tokens"):
                    m.int(key, 0, min=0)
                m.num("stall_s", 0.0, min=0.0)
    elif kind == CommandKind.PREPARE_PLAN.value:
        _gpu_map(r, "reserved_bytes", required=False)
        r.num("load_s", 0.0, min=0.0)
        sha = r.str("weights_sha256", None, max_len=64)
        if sha is not None and (len(sha) != 64 or not set(sha) <= _HEX):
            r.fail("weights_sha256", "must be 64 lowercase hex digits")
        r.str("weights_source", None, choices=WEIGHTS_SOURCES)
        r.int("weights_bytes", 0, min=0)
    elif kind == NodeCommandKind.VERIFY_WEIGHTS.value:
        _sha256(r, "sha256")
    elif kind == NodeCommandKind.APPLY_HINTS.value:
        r.bool("applied")
        r.int("hints_version", min=0)
        _strings(r, "plans")
        _strings(r, "unknown")
    elif kind == NodeCommandKind.PROBE_LINKS.value:
        links = r.list("links", [])
        if links is not None:
            for lk in links.objects():
                lk.str("peer", max_len=64)
                lk.num("bw_gbps", min=0.0)
                lk.num("latency_us", None, min=0.0)
                lk.num("measured_at", None, min=0.0)
                lk.str("method", "", max_len=64, allow_empty=True)
    problems.raise_if_any(f"{kind} result")
    return dict(result)
