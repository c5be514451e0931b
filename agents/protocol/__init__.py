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

This package is pure Python (no Django): the console validates incoming bodies with the
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
    Optional model_version ({id, version, tokenizer, warmup_tokens, max_context?}: the registry
    version the plan loads; max_context, when given, caps prompt + max tokens of every sequence
    the plan takes, below the model's own context: the engine refuses a longer one, naming
    max_tokens, as the gateway does): an agent that can read that tokenizer checks the shadow plan with it before it
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

What lives where
----------------

    rules.py     the protocol's version, the names it knows (command kinds, failure reasons,
                 backends, ack statuses) and the bounds its checks apply
    messages.py  the messages as dataclasses (RegisterRequest, Report, Command, Ack, ...), each
                 with the `to_dict()` an agent sends
    parse.py     `parse_*`: a message body to its dataclass, or a SchemaError naming every bad key
    commands.py  `check_payload` and `check_result`: a command's payload and an ok-ack's result,
                 each kind's schema (the sections above); `prepare_shape`

Everything the rest of the code imports is re-exported here: import from `agents.protocol`.
"""

from __future__ import annotations

from agents.protocol.commands import check_payload, check_result, prepare_shape
from agents.protocol.messages import (
    Ack,
    CollectiveReport,
    Command,
    EngineReport,
    GpuInfo,
    GpuReport,
    LinkReport,
    RegisterRequest,
    RegisterResponse,
    Report,
)
from agents.protocol.parse import (
    parse_ack,
    parse_command,
    parse_register,
    parse_register_response,
    parse_report,
)
from agents.protocol.rules import (
    ACK_STATUSES,
    COMMAND_KINDS,
    ENGINE_BACKENDS,
    FAILURE_REASONS,
    MAX_CONTEXT_TOKENS,
    MAX_HINT_TTL_S,
    MAX_WARMUP_TOKENS,
    NODE_ID_RE,
    NODE_KINDS,
    PROTOCOL_VERSION,
    TRANSITION_KINDS,
    WEIGHTS_SOURCES,
    NodeCommandKind,
)
from agents.schema import SchemaError
from scheduler.transition import CommandKind

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
    "NODE_ID_RE",
    "ENGINE_BACKENDS",
    "ACK_STATUSES",
    "WEIGHTS_SOURCES",
    "MAX_CONTEXT_TOKENS",
    "MAX_WARMUP_TOKENS",
]
