"""Agent protocol v1's rules: its version, the names it knows and the bounds its checks apply
(agents.protocol: the package docstring says what each means)."""

from __future__ import annotations

import enum
import re

from scheduler.transition import CommandKind

PROTOCOL_VERSION = 1

NODE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
ENGINE_BACKENDS = ("sim", "torch", "vllm")
ACK_STATUSES = ("ok", "failed", "running")


class NodeCommandKind(enum.StrEnum):
    """Commands about a node itself, outside any transition (package docstring: node commands)."""

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
MAX_CONTEXT_TOKENS = 10_000_000  # the registry's bound on a model version's max_context (console/registry/api.py)

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
