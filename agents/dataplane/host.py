"""PlanHost: one running plan on one node, a TorchEngine driven by one engine thread.

The engine is not thread-safe, so exactly one thread touches it: it runs `step()` while any
sequence is unfinished and, between two steps (the safe boundary of DESIGN.md invariant 2),
runs the operations other threads queued: admit, export + pause, drop, resume, import. Callers
(the data server's HTTP handlers, the agent daemon's command thread) queue an operation and
wait for its result; nothing they do can land in the middle of a decode iteration.

Ownership (invariant 2): a sequence moving away is exported and paused in one operation, so no
step runs between the snapshot and the pause; the bytes travel while the other sequences keep
decoding; only when the target acknowledged the hand-over is it dropped here (resumed here if
the target refused: the rollback). A target accepts a sequence only with a lease (plan, routing
version) newer than any it held for that sequence before.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from functools import partial
from queue import Empty, Queue
from typing import Any, TypeVar

from agents.dataplane.errors import DataPlaneError, Frozen, Refused, Saturated, StaleLease
from agents.dataplane.hosting import DrainThenHandOver, put_back
from agents.dataplane.stream import SeqStream, check_slo_ms, slo_misses
from agents.engines.torch.engine import EngineError, KVCacheFullError, KVState, StepOutput, TorchEngine
from agents.engines.torch.layout import Layout, StageSpec
from agents.engines.torch.remote import Placement
from agents.engines.torch.sampling import SamplingParams
from agents.protocol import EngineReport
from scheduler.buckets import LengthBuckets
from scheduler.plan import Plan

log = logging.getLogger(__name__)

T = TypeVar("T")

OP_TIMEOUT_S = 60.0  # an operation waits at most this long for the engine thread
ENDED_KEEP_S = 120.0  # an ended stream stays readable this long (a reader reconnecting late)
WARMUP_ID = "__warmup__"


def layout_for_plan(plan: dict[str, Any] | Plan) -> Layout:
    """The engine layout of a scheduler Plan: one engine stage per plan stage, same layers and TP."""
    p = plan if isinstance(plan, Plan) else Plan.from_dict(plan)

    def specs(stages: Sequence[Any]) -> tuple[StageSpec, ...]:
        return tuple(StageSpec(s.layer_start, s.layer_end, s.tp) for s in stages)

    if p.mode == "disaggregated":
        return Layout(stages=specs(p.decode_stages), mode="disaggregated", prefill_stages=specs(p.stages))
    return Layout(stages=specs(p.stages))


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


class PlanHost(DrainThenHandOver):
    """One plan on one node (module docstring). Thread-safe: every method may be called from any
    thread except the engine thread itself."""

    def __init__(
        self,
        *,
        deployment: str,
        plan: dict[str, Any],
        model_dir: str,
        layout: Layout | dict[str, Any] | None,
        weights_sha256: str | None,
        max_waiting: int = 64,
        clock: Callable[[], float] = time.monotonic,
        num_kv_blocks: int = 256,
        device: str = "cpu",
        gpus: Sequence[int] | None = None,
        placement: Mapping[str, Placement] | None = None,
        warmup_tokens: int = 1,
        verified_sha256: str | None = None,
        host_kv_bytes: int = 0,
        slo_ms: tuple[float, float] | None = None,
        length_buckets: LengthBuckets | None = None,
        max_context: int | None = None,
    ) -> None:
        """`placement`: for a plan whose stages span nodes, which ranks of each worker group run
        here and which member nodes start the others (TorchEngine's argument); None: all here.
        `warmup_tokens`: generated at start, before the plan is served (the registry's warm-up).
        `verified_sha256`: the digest the node's model store computed for these weights (the
        engine does not hash them again). `host_kv_bytes`: the engine's host KV tier (finished
        sequences' KV kept for the next turn of their conversation; 0: none). `slo_ms`: the
        deployment's (TTFT, TPOT) objectives prepare_plan carried, against which each report counts
        its finished sequences' misses (EngineReport.slo_violations, what the global correction
        reads); None: none counted. `length_buckets`: the engine's batching split by prompt length
        (agents/engines/torch/batching.py); None: one queue. `max_context`: the registered model
        version's cap on prompt + max tokens (prepare_plan's model_version.max_context): the engine
        refuses a longer sequence, naming max_tokens; None: the model's own positions."""
        self.slo_ms = check_slo_ms(slo_ms)
        self.verified_sha256 = verified_sha256
        self.host_kv_bytes = host_kv_bytes
        self.length_buckets = length_buckets
        self.max_context = max_context
        if not isinstance(warmup_tokens, int) or isinstance(warmup_tokens, bool) or warmup_tokens < 0:
            raise ValueError(f"warmup_tokens: must be an integer >= 0, got {warmup_tokens!r}")
        self.warmup_tokens = warmup_tokens
        self.deployment = deployment
        self.plan = dict(plan)
        self.plan_id: str = Plan.from_dict({k: v for k, v in plan.items() if k != "plan_id"}).plan_id
        self.model_dir = str(model_dir)
        if layout is None:
            self.layout = layout_for_plan(plan)
        else:
            self.layout = layout if isinstance(layout, Layout) else Layout.from_dict(layout)
        self.weights_sha256 = weights_sha256
        if not isinstance(max_waiting, int) or max_waiting < 1:
            raise ValueError(f"max_waiting: must be a positive integer, got {max_waiting!r}")
        self.max_waiting = max_waiting
        self.clock = clock
        self.num_kv_blocks = num_kv_blocks
        self.device = device
        self.gpus = tuple(gpus) if gpus is not None else None  # CUDA device indexes for the workers
        self.placement = dict(placement) if placement else None
        self.state = "new"  # new | ready | stopped | broken
        self.error = ""  # why it broke
        self.frozen = False
        self.frozen_version = 0  # the routing version that froze it
        self.engine: TorchEngine | None = None
        self._own_tokens: int | None = None  # the engine's tokens per step before any hint
        self._lock = threading.RLock()
        self._ops: Queue[tuple[Callable[[], Any], Future[Any]]] = Queue()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._streams: dict[str, SeqStream] = {}
        self._leases: dict[str, int] = {}  # seq_id -> newest routing version it was held here under
        self._step_s = 0.0  # decode iteration time, smoothed
        # report window
        self._win_start_s = clock()
        self._win_tokens = 0
        self._win_arrivals = 0
        self._win_prompt: list[int] = []
        self._win_finished: list[SeqStream] = []

    # -- lifetime --------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the workers, warm up (`warmup_tokens`), start the engine thread. Idempotent."""
        with self._lock:
            if self.state != "new":
                if self.state in ("stopped", "broken"):
                    raise Frozen(f"plan {self.plan_id} is {self.state}; build a new PlanHost")
                return
            engine = TorchEngine(self.model_dir, self.layout, device=self.device, gpus=self.gpus,
                                 expected_sha256=self.weights_sha256, verified_sha256=self.verified_sha256,
                                 num_kv_blocks=self.num_kv_blocks, host_kv_bytes=self.host_kv_bytes,
                                 placement=self.placement, length_buckets=self.length_buckets,
                                 max_context=self.max_context)
            try:
                engine.warm_up(self.warmup_tokens, WARMUP_ID)
            except BaseException:
                engine.shutdown()
                raise
            self.engine = engine
            self.state = "ready"
            self._thread = threading.Thread(target=self._loop, name=f"engine-{self.plan_id}", daemon=True)
            self._thread.start()

    def set_batch_scale(self, scale: float | None) -> None:
        """The global correction's scale of the engine's tokens per step (apply_hints:
        agents/node/node_commands.py), from its next step on; None: back to its own. Before the engine
        started: nothing (its own threshold, until the next hint)."""
        with self._lock:
            engine = self.engine
            if engine is None:
                return
            if self._own_tokens is None:
                self._own_tokens = engine.max_tokens_per_step
            engine.max_tokens_per_step = self._own_tokens if scale is None else max(1, int(self._own_tokens * scale))

    def stop(self) -> None:
        """Stop the engine thread and the workers; streams still open end with an error. Idempotent."""
        with self._lock:
            if self.state in ("new", "ready"):
                self.state = "stopped"
            self._stopping.set()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(OP_TIMEOUT_S)
        if self.engine is not None:
            self.engine.shutdown()
        self._end_all({"error": f"plan {self.plan_id} stopped on this node"})

    @property
    def alive(self) -> bool:
        return self.state == "ready"

    @property
    def model_sha256(self) -> str | None:
        """The weights hand-over frames must carry: the engine's own hash once it runs."""
        return self.engine.model_sha256 if self.engine is not None else self.weights_sha256

    # -- the engine thread -----------------------------------------------------------------------

    def _loop(self) -> None:
        assert self.engine is not None  # noqa: S101 - start() sets it before the thread runs
        engine = self.engine
        try:
            while not self._stopping.is_set():
                self._run_ops(block=not engine.has_unfinished())
                if self._stopping.is_set() or not engine.has_unfinished():
                    continue
                t0 = time.perf_counter()
                outputs = engine.step()
                dt = time.perf_counter() - t0
                self._step_s = dt if self._step_s == 0.0 else 0.8 * self._step_s + 0.2 * dt
                self._deliver(outputs)
        except EngineError as exc:
            log.exception("plan %s: the engine failed", self.plan_id)
            with self._lock:
                self.state, self.error = "broken", str(exc)
            self._end_all({"error": f"plan {self.plan_id} failed on this node: {exc}"})
        finally:
            # whatever is still queued gets an answer, never a hang
            while True:
                try:
                    _, fut = self._ops.get_nowait()
                except Empty:
                    break
                fut.set_exception(Frozen(f"plan {self.plan_id} is {self.state}"))

    def _run_ops(self, *, block: bool) -> None:
        try:
            fn, fut = self._ops.get(timeout=0.05) if block else self._ops.get_nowait()
        except Empty:
            return
        while True:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except EngineError as exc:
                    fut.set_exception(Frozen(f"plan {self.plan_id} failed on this node: {exc}"))
                    raise
                except Exception as exc:  # noqa: BLE001 - handed to the caller, who re-raises it
                    fut.set_exception(exc)
            try:
                fn, fut = self._ops.get_nowait()
            except Empty:
                return

    def _deliver(self, outputs: list[StepOutput]) -> None:
        now = self.clock()
        for out in outputs:
            stream = self._streams.get(out.seq_id)
            if stream is None:
                continue  # the warm-up sequence
            stream.append(out.token_id, now)
            self._win_tokens += 1
            if out.finished:
                reason = "length" if stream.generated >= stream.max_tokens else "stop"
                stream.close({"done": True, "finish_reason": reason}, now)
                self._win_finished.append(stream)

    def _submit(self, fn: Callable[[], T]) -> Future[T]:
        fut: Future[T] = Future()
        if self.state != "ready":
            fut.set_exception(Frozen(f"plan {self.plan_id} is {self.state} on this node"))
            return fut
        self._ops.put((fn, fut))
        return fut

    def _call(self, fn: Callable[[], T]) -> T:
        return self._submit(fn).result(OP_TIMEOUT_S)

    def _end_all(self, end: dict[str, Any]) -> None:
        now = self.clock()
        for stream in list(self._streams.values()):
            stream.close(end, now)

    def _live(self) -> list[SeqStream]:
        return [s for s in self._streams.values() if s.end is None]

    def _prune(self) -> None:
        cutoff = self.clock() - ENDED_KEEP_S
        for sid, s in list(self._streams.items()):
            if s.ended_s is not None and s.ended_s < cutoff:
                del self._streams[sid]

    # -- admission -------------------------------------------------------------------------------

    def admit(self, seq_id: str, prompt_ids: Sequence[int], max_tokens: int,
              sampling: SamplingParams | dict[str, Any] | None, *, routing_version: int = 0,
              priority: int = 0) -> SeqStream:
        """Queue a new sequence; its stream fills as the engine decodes. `priority`: its class, lower
        first - the engine prefills by (priority, arrival) and preempts the least urgent class first
        (agents/engines/torch/batching.py); a sequence handed over keeps it (KVState.priority).

        Raises Frozen (frozen, stopped), Saturated (waiting queue full), ValueError (bad input,
        naming the field).
        """
        params = SamplingParams.from_dict(sampling) if isinstance(sampling, dict) else sampling
        with self._lock:
            if self.state != "ready" or self.frozen:
                raise Frozen(f"plan {self.plan_id} is {'frozen' if self.frozen else self.state}: it admits nothing new")
            self._prune()
            waiting = sum(1 for s in self._live() if not s.started)
            if waiting >= self.max_waiting:
                # one decode iteration per queued prefill is a fair guess at when room appears
                retry = max(1.0, round(waiting * max(self._step_s, 0.01)))
                raise Saturated(f"plan {self.plan_id} has {waiting} sequences waiting (max {self.max_waiting})", retry)
            old = self._streams.get(seq_id)
            if old is not None and old.end is None:
                raise ValueError(f"seq_id: {seq_id!r} is already running on this plan")
            stream = SeqStream(seq_id, len(prompt_ids), int(max_tokens), routing_version, self.clock())
            engine = self.engine
            assert engine is not None  # noqa: S101 - state ready

            def add() -> None:
                engine.add_request(seq_id, list(prompt_ids), max_tokens, params, priority=priority)

            fut = self._submit(add)
            self._streams[seq_id] = stream
            self._leases[seq_id] = max(routing_version, self._leases.get(seq_id, 0))
        try:
            fut.result(OP_TIMEOUT_S)
        except ValueError as exc:
            msg = str(exc).replace("max_new_tokens", "max_tokens")
            with self._lock:
                if self._streams.get(seq_id) is stream:
                    del self._streams[seq_id]
            raise ValueError(msg) from None
        with self._lock:
            self._win_arrivals += 1
            self._win_prompt.append(len(prompt_ids))
        return stream

    def stream(self, seq_id: str) -> SeqStream | None:
        with self._lock:
            return self._streams.get(seq_id)

    def cancel(self, seq_id: str) -> bool:
        """The client went away: stop decoding the sequence and forget it."""
        stream = self.stream(seq_id)
        if stream is None or stream.end is not None or self.engine is None:
            return False
        engine = self.engine
        try:
            self._call(lambda: engine.drop(seq_id))
        except DataPlaneError:
            return False
        return stream.close({"error": "cancelled: the client went away"}, self.clock())

    # -- transition commands ---------------------------------------------------------------------

    def freeze(self, routing_version: int) -> dict[str, Any]:
        """freeze_plan: admit nothing new; say what is in flight, at the end of the current iteration."""
        with self._lock:
            self.frozen = True
            self.frozen_version = routing_version
            if self.state != "ready":
                return {"plan_id": self.plan_id, "sequences": [], "decode_step_s": self._step_s}

        def snapshot() -> list[dict[str, Any]]:
            return [{"seq_id": s.seq_id, "context_tokens": s.prompt_tokens + s.generated,
                     "generated_tokens": s.generated, "max_tokens": s.max_tokens,
                     "state": "running" if s.started else "waiting", "kv_lost": False}
                    for s in self._live()]

        try:
            seqs = self._call(snapshot)
        except Frozen:
            seqs = []
        return {"plan_id": self.plan_id, "sequences": seqs, "decode_step_s": self._step_s}

    def thaw(self) -> None:
        """thaw_plan: admit again. Safe if never frozen."""
        with self._lock:
            self.frozen = False

    def move(self, moves: list[dict[str, Any]], routing_version: int) -> dict[str, Any]:
        """move_sequences: hand sequences over in order (active first, lazy ones after).

        Returns the ack result of agents/protocol/: {plan_id, moved: [...]}, plus `reason`
        when any hand-over failed (the agent then acks failed).
        """
        from agents.dataplane.client import send_state  # the wire format lives with the server

        ordered = sorted(moves, key=lambda m: bool(m.get("lazy", False)))
        results: list[dict[str, Any]] = []
        engine = self.engine
        for m in ordered:
            sid, action = str(m.get("seq_id", "")), str(m.get("action", ""))
            stream = self.stream(sid)
            if stream is None or stream.end is not None or engine is None:
                results.append({"seq_id": sid, "action": action, "ok": True, "outcome": "gone"})
                continue
            ctx = stream.prompt_tokens + stream.generated
            if action == "finish":
                results.append({"seq_id": sid, "action": action, "ok": True, "context_tokens": ctx})
                continue
            if action not in ("migrate", "replay"):
                results.append({"seq_id": sid, "action": action, "ok": False, "reason": "failed",
                                "error": f"action: must be migrate, replay or finish, got {action!r}"})
                continue

            def export(sid: str = sid, include_kv: bool = action == "migrate") -> KVState | None:
                if sid not in engine.sequence_ids():
                    return None  # finished between the look and this boundary
                state = engine.export_kv(sid, include_kv=include_kv)
                engine.pause(sid)
                return state

            try:
                state = self._call(export)
            except DataPlaneError as exc:
                results.append({"seq_id": sid, "action": action, "ok": False, "reason": "failed", "error": str(exc)})
                continue
            if state is None:
                results.append({"seq_id": sid, "action": action, "ok": True, "outcome": "gone"})
                continue
            paused_s = self.clock()
            target_addr, target_plan = str(m.get("target_addr", "")), str(m.get("target_plan", ""))
            target = {"target_addr": target_addr, "target_plan": target_plan, "routing_version": routing_version}
            try:
                if not target_addr:
                    raise Refused("target_addr: this data plane needs the target agent's data address")
                send_state(target_addr, state, deployment=self.deployment,
                           plan_id=target_plan, routing_version=routing_version,
                           resume_from=len(state.generated_ids))
            except (DataPlaneError, OSError) as exc:
                reason = exc.code if isinstance(exc, DataPlaneError) else "target_refused"
                self._call(partial(engine.resume, sid))
                results.append({"seq_id": sid, "action": action, "ok": False, "reason": reason,
                                "error": str(exc), "context_tokens": ctx})
                continue
            self._call(partial(engine.drop, sid))
            with self._lock:
                stream.close({"moved": target}, self.clock())
            results.append({"seq_id": sid, "action": action, "ok": True, "context_tokens": len(state.token_ids),
                            "kv_bytes": state.kv_bytes,
                            "replay_tokens": len(state.token_ids) if action == "replay" else 0,
                            "stall_s": self.clock() - paused_s})
        out: dict[str, Any] = {"plan_id": self.plan_id, "moved": results}
        failed = [r for r in results if not r["ok"]]
        if failed:
            reasons = {r.get("reason") for r in failed}
            out["reason"] = next((w for w in ("preempted", "stale_lease", "target_refused") if w in reasons), "failed")
        return out

    def accept(self, state: KVState, lease: tuple[str, int], resume_from: int) -> None:
        """The target side of a hand-over: import `state` between two steps and go on decoding.

        `lease` is (plan_id, routing_version); a version not newer than one this node already held
        the sequence under raises StaleLease. `resume_from` is how many generated tokens came with
        it (readers continue from there). Raises Refused when it cannot take it; changes nothing then.
        """
        plan_id, version = lease
        sid = state.seq_id
        if plan_id != self.plan_id:
            raise Refused(f"target_plan: this node runs {self.plan_id} for {self.deployment}, not {plan_id}")
        generated = list(state.generated_ids)
        if resume_from != len(generated):
            raise Refused(f"resume_from: the state carries {len(generated)} generated tokens, not {resume_from}")
        with self._lock:
            if self.state != "ready":
                raise Refused(f"plan {self.plan_id} is {self.state} on this node")
            held = self._leases.get(sid)
            if held is not None and version <= held:
                raise StaleLease(f"lease version {version} for {sid} is not newer than {held}, which this node had")
            stream = SeqStream(sid, state.num_prompt_tokens, state.max_new_tokens, version, self.clock(),
                               tokens=generated, token_s=[float("nan")] * len(generated),
                               first_local=len(generated))
            engine = self.engine
            assert engine is not None  # noqa: S101 - state ready
            fut = self._submit(lambda: engine.import_kv(sid, state))
            self._leases[sid] = version
            previous = self._streams.get(sid)
            self._streams[sid] = stream
        try:
            fut.result(OP_TIMEOUT_S)
        except (ValueError, KVCacheFullError, DataPlaneError) as exc:
            with self._lock:
                put_back(self._leases, sid, held)
                put_back(self._streams, sid, previous)
            raise Refused(f"cannot take {sid}: {exc}") from None

    def report(self) -> EngineReport:
        """Serving metrics over the interval since the previous report."""
        with self._lock:
            now = self.clock()
            span_s = max(now - self._win_start_s, 1e-9)
            finished, self._win_finished = self._win_finished, []
            tokens, self._win_tokens = self._win_tokens, 0
            arrivals, self._win_arrivals = self._win_arrivals, 0
            prompts, self._win_prompt = self._win_prompt, []
            self._win_start_s = now
            live = self._live()
        ttft = [1000.0 * (s.token_s[0] - s.admitted_s) for s in finished if s.first_local == 0 and s.token_s]
        tpot = []
        for s in finished:
            local = s.token_s[s.first_local:]
            if len(local) > 1:
                tpot.append(1000.0 * (local[-1] - local[0]) / (len(local) - 1))
        kv_usage = 0.0
        if self.engine is not None and self.state == "ready":
            free = self.engine.num_free_blocks()
            kv_usage = max(0.0, min(1.0, 1.0 - min(free.values()) / self.num_kv_blocks)) if free else 0.0
        return EngineReport(
            plan_id=self.plan_id,
            running=sum(1 for s in live if s.started),
            waiting=sum(1 for s in live if not s.started),
            tokens_per_s=tokens / span_s,
            kv_usage=kv_usage,
            ttft_p50_ms=_percentile(ttft, 0.5),
            ttft_p95_ms=_percentile(ttft, 0.95),
            tpot_p50_ms=_percentile(tpot, 0.5),
            tpot_p95_ms=_percentile(tpot, 0.95),
            finished=len(finished),
            slo_violations=slo_misses(finished, self.slo_ms),
            arrivals=arrivals,
            prompt_tokens_mean=statistics.fmean(prompts) if prompts else None,
            output_tokens_mean=statistics.fmean([s.generated for s in finished]) if finished else None,
        )
