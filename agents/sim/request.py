"""One request's life in the simulator: what it asks (prompt, output, priority, deadline, prompt
blocks), where it is (its pipe, its KV, its decode progress) and what happened to it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agents.sim.engine import Pipe


class Request:
    """One request's life in the simulator. Mutable and slotted: a replay holds ~10^5 of them."""

    __slots__ = (
        "rid", "deployment", "arrival_s", "prompt", "output", "first_token_s", "finish_s",
        "generated", "need", "done", "has_kv", "ctx0", "d0", "gen0", "epoch", "pipe", "decoding",
        "preemptions", "replays", "migrations", "error", "engine_id", "paused_until", "lease",
        "priority", "deadline_at", "blocks", "blocks_in", "route_req", "predicted_ttft_s", "routed_plan",
        "owner", "owner_engine", "owner_lease", "paused_on", "paused_at",
    )

    def __init__(self, rid: int, deployment: str, arrival_s: float, prompt: int, output: int, *,
                 priority: int = 0, deadline_s: float | None = None, blocks: tuple[int, ...] = ()) -> None:
        self.rid = rid
        self.deployment = deployment
        self.arrival_s = arrival_s
        self.prompt = prompt
        self.output = output
        self.first_token_s: float | None = None
        self.finish_s: float | None = None
        self.generated = 0  # tokens emitted so far (exact while not decoding; see tokens_now)
        self.need = prompt  # tokens the current prefill pass computes (prompt, or prompt + generated)
        self.done = 0  # of those, computed so far
        self.has_kv = False  # its KV is in place: it can decode without a prefill
        self.ctx0 = 0  # while decoding: context when it joined the decoding set
        self.d0 = 0  # ... the pipe's decode clock then
        self.gen0 = 0  # ... and its tokens then
        self.epoch = 0  # bumps whenever it leaves a pipe: finish-heap entries of older epochs are stale
        self.pipe: Pipe | None = None  # the pipe that runs it (None while queued outside engines)
        self.decoding = False  # in its pipe's decoding set
        self.preemptions = 0  # KV dropped for lack of memory (recomputed)
        self.replays = 0  # KV lost or dropped by a gear change (recomputed on another plan)
        self.migrations = 0  # KV moved to another plan
        self.error: str | None = None  # set when it ends with an explicit error
        self.engine_id = 0  # the engine that owns it (0: none)
        self.paused_until = 0.0  # a migration in flight lands then
        # the routing version of its lease (DESIGN.md invariant 2): the table's version when the
        # router gave it to its plan, or the version a hand-over carried; a hand-over must be newer
        self.lease = 0
        self.priority = priority  # lower is served first (vLLM's convention; queues.WaitQueue)
        self.deadline_at = None if deadline_s is None else arrival_s + deadline_s  # first token wanted by then
        self.blocks = blocks  # hashes of its prompt's blocks (prefix cache and router)
        self.blocks_in = 0  # of those, how many its pipe's prefix cache holds from this pass
        self.route_req: object = None  # its scheduler.router RouteRequest, made once
        self.predicted_ttft_s: float | None = None  # what the router predicted when it routed it
        self.routed_plan = ""  # the plan the router gave it to
        # its owner as the per-sequence log (agents/sim/seqlog.py) last recorded it: only kept
        # while the simulator has an event log
        self.owner = ""  # plan id ("": none - new, or returned to the router)
        self.owner_engine = 0  # that plan's engine
        self.owner_lease = 0  # the lease it was given to its owner with
        self.paused_on = ""  # the owner that paused it at a safe boundary, for a hand-over
        self.paused_at = ""  # ... and that boundary (decode_end | idle)

    def tokens_now(self) -> int:
        """Tokens emitted so far (reads the pipe's decode clock while decoding)."""
        if self.decoding and self.pipe is not None:
            return self.gen0 + self.pipe.clock - self.d0
        return self.generated

    def context(self) -> int:
        """Tokens in its KV cache (or to recompute): prompt + what it generated."""
        return self.prompt + self.tokens_now()

    def drop_kv(self) -> None:
        """Forget its KV: the next pass recomputes prompt + generated tokens."""
        self.has_kv = False
        self.need = self.prompt + self.generated
        self.done = 0
        self.blocks_in = 0
