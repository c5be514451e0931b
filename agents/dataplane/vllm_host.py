"""VllmPlanHost: one running plan on one node, served by a supervised vLLM OpenAI server.

The same public face as PlanHost (start, admit, stream, cancel, freeze, thaw, move, accept,
release, report, stop; the same ack shapes), so one DataServer serves either kind.

Each admitted sequence is one streaming POST /v1/completions to the plan's vLLM server, with the
prompt as token ids and `return_token_ids`, read by its own thread into the sequence's SeqStream.

Hand-over is replay only. vLLM keeps its KV blocks inside its engine process and has no API to
export a sequence's KV or import one computed elsewhere, so a sequence moves as its tokens: the
source POSTs a kvtransfer frame without KV (token ids, sampling, budget) to the target's
/data/v1/accept, and the target continues it as a completion whose prompt is prompt + generated
so far (vLLM's prefix cache makes shared prefixes cheap). A `move` asked to migrate is carried
out as replay and reported as such (action "replay", requested "migrate"). A frame that does
carry KV (from a torch source) is accepted the same way: its KV is ignored, its tokens replayed.

Ownership (invariant 2 of DESIGN.md): vLLM cannot pause a request, so a moving sequence is
stopped at the source instead: its reader quits at vLLM's next chunk and closes the request's
connection, which makes vLLM abort it (tokens it produced after the snapshot are dropped). Only
when the target acknowledged is the source stream ended with `moved`; if the target refuses, the
source continues the sequence itself by the same replay (prompt + tokens so far, cheap with the
prefix cache): nothing is lost. Stopping rather than decoding on during the hand-over frees the
source's share of the machine for the target, which is what the client waits for.

Greedy decoding continues token for token: the target computes the next token from exactly the
ids the source had. Seeded sampling does not: vLLM's per-request generator restarts on the
target, so the continuation is correctly distributed but not the same tokens.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import torch

from agents.dataplane.errors import DataPlaneError, Frozen, Refused, Saturated, StaleLease
from agents.dataplane.hosting import DrainThenHandOver, put_back
from agents.dataplane.stream import SeqStream, check_slo_ms, slo_misses
from agents.engines.torch.engine import KVState
from agents.engines.torch.sampling import SamplingParams
from agents.engines.torch.weights import WEIGHTS_FILE, sha256_file
from agents.engines.vllm.engine import EngineError, EngineStatus, RestartPolicy, VllmEngine
from agents.engines.vllm.spec import vllm_spec_for_plan
from agents.protocol import EngineReport

log = logging.getLogger(__name__)

OPEN_TIMEOUT_S = 60.0  # vLLM answers a completion's headers once it has validated it
ENDED_KEEP_S = 120.0  # an ended stream stays readable this long (a reader reconnecting late)


def _vocab_size(model_dir: str) -> int | None:
    try:
        size = json.loads((Path(model_dir) / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError):
        return None
    return size if isinstance(size, int) else None


@dataclass
class _Run:
    """One sequence on this host: its stream and the completion request that feeds it."""

    stream: SeqStream
    body: dict[str, Any]  # the completions request (prompt ids here = original prompt + tokens it came with)
    lock: threading.Lock = field(default_factory=threading.Lock)
    attempt: int = 0  # bumped to stop the current request's reader (a hand-over); a new request reads under the new value
    abandoned: bool = False  # moved away, cancelled or stopped: the reader stops at its next chunk


class VllmPlanHost(DrainThenHandOver):
    """One plan on one node, served by vLLM (module docstring). Thread-safe."""

    def __init__(
        self,
        *,
        deployment: str,
        plan: dict[str, Any],
        model_dir: str,
        weights_sha256: str | None,
        port: int,
        max_model_len: int = 2048,
        gpus: Sequence[int | str] | None = None,
        max_waiting: int = 64,
        clock: Callable[[], float] = time.monotonic,
        python: str | None = None,
        log_dir: str | Path | None = None,
        policy: RestartPolicy | None = None,
        engine_options: dict[str, Any] | None = None,
        warmup_tokens: int = 1,
        slo_ms: tuple[float, float] | None = None,
    ) -> None:
        """`warmup_tokens`: generated once the server is up, before it is served (the registry's
        warm-up for the model; 0: none). `slo_ms`: the deployment's (TTFT, TPOT) objectives
        prepare_plan carried; each report counts the sequences that finished here and missed them
        (EngineReport.slo_violations), from this host's own token clock - vLLM's /metrics has
        histograms, not per-request misses. None: none counted."""
        self.slo_ms = check_slo_ms(slo_ms)
        if not isinstance(warmup_tokens, int) or isinstance(warmup_tokens, bool) or warmup_tokens < 0:
            raise ValueError(f"warmup_tokens: must be an integer >= 0, got {warmup_tokens!r}")
        self.warmup_tokens = warmup_tokens
        self.deployment = deployment
        self.plan = dict(plan)
        self.model_dir = str(model_dir)
        self.spec = vllm_spec_for_plan(plan, model_dir=self.model_dir, served_model_name=deployment, port=port,
                                       max_model_len=max_model_len, gpus=gpus, **(engine_options or {}))
        self.plan_id = self.spec.plan_id
        self.weights_sha256 = weights_sha256
        if not isinstance(max_waiting, int) or max_waiting < 1:
            raise ValueError(f"max_waiting: must be a positive integer, got {max_waiting!r}")
        self.max_waiting = max_waiting
        self.clock = clock
        self.state = "new"  # new | ready | stopped | broken
        self.error = ""
        self.frozen = False
        self.frozen_version = 0
        self.model_sha256: str | None = weights_sha256  # what hand-over frames must carry
        self.vocab_size = _vocab_size(self.model_dir)
        self.engine = VllmEngine(self.spec, python=python, log_dir=log_dir, policy=policy,
                                 on_failure=self._engine_failed)
        self._lock = threading.RLock()
        self._launched = False
        self._runs: dict[str, _Run] = {}
        self._leases: dict[str, int] = {}
        self._http = httpx.Client(timeout=httpx.Timeout(None, connect=5.0),
                                  limits=httpx.Limits(max_connections=1000, max_keepalive_connections=64))
        self._win_start_s = clock()
        self._win_prompt: list[int] = []
        self._win_arrivals = 0
        self._win_finished: list[SeqStream] = []  # ended done here since the last report

    # -- lifetime --------------------------------------------------------------------------------

    def launch(self) -> None:
        """Check the weights and spawn the server without waiting for it (several hosts can then
        load at once); start() waits. Idempotent."""
        with self._lock:
            if self._launched:
                return
            if self.state != "new":
                raise Frozen(f"plan {self.plan_id} is {self.state}; build a new VllmPlanHost")
            weights = Path(self.model_dir) / WEIGHTS_FILE
            if weights.is_file():  # one-file models; sharded ones rely on the registry's own check
                actual = sha256_file(weights)
                if self.weights_sha256 is not None and actual != self.weights_sha256:
                    raise ValueError(f"weights_sha256: the weights in {self.model_dir} hash to {actual}, "
                                     f"not {self.weights_sha256}")
                self.model_sha256 = actual
            self.engine.start(wait=False)
            self._launched = True

    def start(self, timeout_s: float | None = None) -> None:
        """Launch the server (if launch() did not) and wait until it serves. Idempotent."""
        self.launch()
        if self.state == "ready":
            return
        # not under the lock: a big model loads for minutes, and stream() must answer meanwhile
        try:
            self.engine.wait_ready(timeout_s if timeout_s is not None else self.engine.policy.startup_timeout_s + 30)
            self._warm_up()
            self.engine.report()  # the first report covers what follows, not the server's start
        except BaseException:
            self.engine.stop(grace_s=5.0)
            with self._lock:
                if self.state == "new":  # (stop() during the wait leaves it "stopped")
                    self.state = "broken"
            raise
        with self._lock:
            if self.state == "new":
                self.state = "ready"

    def stop(self) -> None:
        """Stop the server; streams still open end with an error. Idempotent."""
        with self._lock:
            if self.state in ("new", "ready"):
                self.state = "stopped"
        self._end_all({"error": f"plan {self.plan_id} stopped on this node"})
        self.engine.stop(grace_s=10.0)
        self._http.close()

    @property
    def alive(self) -> bool:
        return self.state == "ready"

    def _engine_failed(self, status: EngineStatus) -> None:
        # The watchdog gave up on the server: what ran on it is lost (the gateway sees the error).
        with self._lock:
            if self.state == "ready":
                self.state, self.error = "broken", status.failure or "the vLLM server failed"
        self._end_all({"error": f"plan {self.plan_id} failed on this node: {self.error}"})

    def _end_all(self, end: dict[str, Any]) -> None:
        with self._lock:
            runs = list(self._runs.values())
        for run in runs:
            with run.lock:
                run.abandoned = True
                run.stream.close(end, self.clock())

    def _live(self) -> list[SeqStream]:
        return [r.stream for r in self._runs.values() if r.stream.end is None]

    def _prune(self) -> None:
        cutoff = self.clock() - ENDED_KEEP_S
        for sid, r in list(self._runs.items()):
            if r.stream.ended_s is not None and r.stream.ended_s < cutoff:
                del self._runs[sid]

    def _warm_up(self) -> None:
        """Generate `warmup_tokens` before the plan takes traffic, so its first requests do not pay
        for what the first forward passes initialise (allocator, kernels, the prefix cache)."""
        if self.warmup_tokens == 0:
            return
        body = self._body([1], self.warmup_tokens, SamplingParams())
        body["ignore_eos"] = True
        resp = self._open(body)
        try:
            for _ in resp.iter_lines():
                pass
        finally:
            resp.close()

    # -- the completion requests -------------------------------------------------------------------

    def _body(self, token_ids: Sequence[int], max_tokens: int, params: SamplingParams) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.spec.served_model_name, "prompt": list(token_ids),
                                "max_tokens": max_tokens, "temperature": params.temperature,
                                "top_p": params.top_p, "ignore_eos": params.ignore_eos, "stream": True,
                                "return_token_ids": True}
        if params.top_k:
            body["top_k"] = params.top_k
        if not params.greedy:
            body["seed"] = params.seed
        return body

    def _open(self, body: dict[str, Any]) -> httpx.Response:
        """Send one completion; the open stream, or ValueError (vLLM said 400) / Frozen."""
        req = self._http.build_request("POST", f"{self.engine.base_url}/v1/completions", json=body,
                                       timeout=httpx.Timeout(None, connect=5.0, write=OPEN_TIMEOUT_S))
        try:
            resp = self._http.send(req, stream=True)
        except httpx.HTTPError as exc:
            raise Frozen(f"plan {self.plan_id}: its vLLM server cannot be reached: {exc}") from exc
        if resp.status_code == 200:
            return resp
        resp.read()
        resp.close()
        try:
            msg = str(resp.json().get("error", {}).get("message", resp.text))
        except (ValueError, AttributeError):
            msg = resp.text[:500]
        if resp.status_code == 400:
            raise ValueError(f"request: vLLM refused it: {msg[:500]}")
        raise Frozen(f"plan {self.plan_id}: its vLLM server answered {resp.status_code}: {msg[:500]}")

    def _begin(self, run: _Run, resp: httpx.Response) -> None:
        threading.Thread(target=self._read, args=(run, resp, run.attempt), daemon=True,
                         name=f"vllm-seq-{run.stream.seq_id}").start()

    def _read(self, run: _Run, resp: httpx.Response, attempt: int) -> None:
        """Thread body: the completion's SSE chunks into the stream until it ends or is abandoned."""
        end: dict[str, Any] | None = None
        try:
            for line in resp.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    end = {"error": f"plan {self.plan_id}: vLLM failed the sequence: {chunk['error']}"}
                    break
                for choice in chunk.get("choices", []):
                    if not self._deliver(run, attempt, choice.get("token_ids") or []):
                        return
                    if choice.get("finish_reason"):
                        reason = choice["finish_reason"]
                        end = {"done": True, "finish_reason": reason if reason == "length" else "stop"}
            if end is None:
                end = {"error": f"plan {self.plan_id}: vLLM closed the stream of {run.stream.seq_id} unfinished"}
        except (httpx.HTTPError, ValueError) as exc:
            end = {"error": f"plan {self.plan_id} failed on this node: {type(exc).__name__}: {exc}"}
        finally:
            resp.close()  # an abandoned request: vLLM aborts it when its client goes away
        with run.lock:
            if run.abandoned or run.attempt != attempt:
                return
            closed = run.stream.close(end, self.clock())
        if closed and "done" in end:
            with self._lock:
                self._win_finished.append(run.stream)

    def _deliver(self, run: _Run, attempt: int, token_ids: list[int]) -> bool:
        """Append tokens; False once this request was stopped (abandoned, or a hand-over began)."""
        now = self.clock()
        with run.lock:
            if run.abandoned or run.attempt != attempt:
                return False
            for t in token_ids:
                run.stream.append(int(t), now)
        return True

    # -- admission -------------------------------------------------------------------------------

    def admit(self, seq_id: str, prompt_ids: Sequence[int], max_tokens: int,
              sampling: SamplingParams | dict[str, Any] | None, *, routing_version: int = 0,
              priority: int = 0) -> SeqStream:
        """Send a new sequence to vLLM; its stream fills as vLLM decodes. `priority` (lower first)
        goes to vLLM's priority scheduling when the server runs it (spec.scheduling_policy); a
        sequence handed over to another plan continues there at the default priority.

        Raises Frozen (frozen, stopped), Saturated (too many waiting for a first token),
        ValueError (bad input, naming the field).
        """
        params = SamplingParams.from_dict(sampling) if isinstance(sampling, dict) else (sampling or SamplingParams())
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"max_tokens: must be an integer >= 1, got {max_tokens!r}")
        for i, t in enumerate(prompt_ids):
            if self.vocab_size is not None and not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt_ids[{i}]: token id {t} is outside the vocabulary (0..{self.vocab_size - 1})")
        if len(prompt_ids) + max_tokens > self.spec.max_model_len:
            raise ValueError(f"max_tokens: {len(prompt_ids)} prompt tokens + {max_tokens} exceed the plan's "
                             f"max_model_len {self.spec.max_model_len}")
        with self._lock:
            if self.state != "ready" or self.frozen:
                raise Frozen(f"plan {self.plan_id} is {'frozen' if self.frozen else self.state}: it admits nothing new")
            self._prune()
            waiting = sum(1 for s in self._live() if not s.started)
            if waiting >= self.max_waiting:
                raise Saturated(f"plan {self.plan_id} has {waiting} sequences waiting (max {self.max_waiting})", 1.0)
            old = self._runs.get(seq_id)
            if old is not None and old.stream.end is None:
                raise ValueError(f"seq_id: {seq_id!r} is already running on this plan")
            body = self._body(prompt_ids, max_tokens, params)
            if priority and self.spec.scheduling_policy == "priority":
                body["priority"] = priority  # vLLM refuses a priority under fcfs: sent only to priority servers
            run = _Run(SeqStream(seq_id, len(prompt_ids), max_tokens, routing_version, self.clock()), body)
            self._runs[seq_id] = run
            self._leases[seq_id] = max(routing_version, self._leases.get(seq_id, 0))
        try:
            resp = self._open(run.body)
        except (ValueError, DataPlaneError):
            with self._lock:
                if self._runs.get(seq_id) is run:
                    del self._runs[seq_id]
            raise
        self._begin(run, resp)
        with self._lock:
            self._win_arrivals += 1
            self._win_prompt.append(len(prompt_ids))
        return run.stream

    def stream(self, seq_id: str) -> SeqStream | None:
        with self._lock:
            run = self._runs.get(seq_id)
            return run.stream if run is not None else None

    def live_streams(self) -> list[SeqStream]:
        """The sequences running or waiting here now."""
        with self._lock:
            return self._live()

    def cancel(self, seq_id: str) -> bool:
        """The client went away: abort the request in vLLM and forget it."""
        with self._lock:
            run = self._runs.get(seq_id)
        if run is None:
            return False
        with run.lock:
            if run.abandoned or run.stream.end is not None:
                return False
            run.abandoned = True
            return run.stream.close({"error": "cancelled: the client went away"}, self.clock())

    # -- transition commands ---------------------------------------------------------------------

    def freeze(self, routing_version: int) -> dict[str, Any]:
        """freeze_plan: admit nothing new; say what is in flight."""
        with self._lock:
            self.frozen = True
            self.frozen_version = routing_version
            live = self._live() if self.state == "ready" else []
            seqs = [{"seq_id": s.seq_id, "context_tokens": s.prompt_tokens + s.generated,
                     "generated_tokens": s.generated, "max_tokens": s.max_tokens,
                     "state": "running" if s.started else "waiting", "kv_lost": False} for s in live]
        return {"plan_id": self.plan_id, "sequences": seqs, "decode_step_s": self._decode_step_s()}

    def _decode_step_s(self) -> float:
        """The decode iteration now, from vLLM's per-request time per output token (0 if unknown)."""
        try:
            tpot = self.engine.scrape().tpot_s
        except EngineError:
            return 0.0
        q = tpot.quantile(0.5) if tpot is not None else None
        return float(q) if q is not None else 0.0

    def thaw(self) -> None:
        """thaw_plan: admit again. Safe if never frozen."""
        with self._lock:
            self.frozen = False

    def move(self, moves: list[dict[str, Any]], routing_version: int) -> dict[str, Any]:
        """move_sequences, by replay only (module docstring): in order, active first, lazy after."""
        from agents.dataplane.client import send_state  # the wire format lives with the server

        ordered = sorted(moves, key=lambda m: bool(m.get("lazy", False)))
        results: list[dict[str, Any]] = []
        for m in ordered:
            sid, action = str(m.get("seq_id", "")), str(m.get("action", ""))
            with self._lock:
                run = self._runs.get(sid)
            if run is None or run.stream.end is not None:
                results.append({"seq_id": sid, "action": action, "ok": True, "outcome": "gone"})
                continue
            stream = run.stream
            if action == "finish":
                results.append({"seq_id": sid, "action": action, "ok": True,
                                "context_tokens": stream.prompt_tokens + stream.generated})
                continue
            if action not in ("migrate", "replay"):
                results.append({"seq_id": sid, "action": action, "ok": False, "reason": "failed",
                                "error": f"action: must be migrate, replay or finish, got {action!r}"})
                continue
            with run.lock:
                if run.abandoned or stream.end is not None:
                    results.append({"seq_id": sid, "action": action, "ok": True, "outcome": "gone"})
                    continue
                run.attempt += 1  # its reader stops at vLLM's next chunk and aborts the request
                generated = list(stream.tokens)
            paused_s = self.clock()
            state = self._export(run, generated)
            target_addr, target_plan = str(m.get("target_addr", "")), str(m.get("target_plan", ""))
            target = {"target_addr": target_addr, "target_plan": target_plan, "routing_version": routing_version}
            base = {"seq_id": sid, "action": "replay", "context_tokens": len(state.token_ids)}
            if action != "replay":
                base["requested"] = action
            try:
                if not target_addr:
                    raise Refused("target_addr: this data plane needs the target agent's data address")
                send_state(target_addr, state, deployment=self.deployment, plan_id=target_plan,
                           routing_version=routing_version, resume_from=len(generated))
            except (DataPlaneError, OSError) as exc:
                self._resume(run)
                reason = exc.code if isinstance(exc, DataPlaneError) else "target_refused"
                results.append({**base, "ok": False, "reason": reason, "error": str(exc)})
                continue
            with run.lock:
                run.abandoned = True
                stream.close({"moved": target}, self.clock())
            results.append({**base, "ok": True, "kv_bytes": 0, "replay_tokens": len(state.token_ids),
                            "stall_s": self.clock() - paused_s})
        out: dict[str, Any] = {"plan_id": self.plan_id, "moved": results}
        failed = [r for r in results if not r["ok"]]
        if failed:
            reasons = {r.get("reason") for r in failed}
            out["reason"] = next((w for w in ("preempted", "stale_lease", "target_refused") if w in reasons), "failed")
        return out

    def _export(self, run: _Run, generated: list[int]) -> KVState:
        """A replay-only state: the ids the sequence has, no KV (vLLM cannot hand its KV out)."""
        prompt = run.body["prompt"][: run.stream.prompt_tokens]  # a replayed run's body also has what it came with
        params = SamplingParams(temperature=float(run.body["temperature"]), top_p=float(run.body["top_p"]),
                                top_k=int(run.body.get("top_k", 0)), seed=int(run.body.get("seed", 0)),
                                ignore_eos=bool(run.body["ignore_eos"]))
        empty = torch.zeros((0, 0, 0, 0), dtype=torch.float32)
        return KVState(seq_id=run.stream.seq_id, model_sha256=self.model_sha256 or "",
                       token_ids=tuple(prompt) + tuple(generated), num_prompt_tokens=run.stream.prompt_tokens,
                       max_new_tokens=run.stream.max_tokens,
                       sampling=params, sampler_draws=0 if params.greedy else len(generated),
                       num_cached_tokens=0, keys=empty, values=empty.clone())

    def _resume(self, run: _Run) -> None:
        """The rollback of a refused hand-over: continue here by replay of the tokens so far."""
        stream = run.stream
        remaining = stream.max_tokens - stream.generated
        with run.lock:
            if run.abandoned or stream.end is not None:
                return
            if remaining <= 0:
                stream.close({"done": True, "finish_reason": "length"}, self.clock())
                return
            prompt = run.body["prompt"][: stream.prompt_tokens]
            run.body = {**run.body, "prompt": prompt + list(stream.tokens), "max_tokens": remaining}
        try:
            resp = self._open(run.body)
        except (ValueError, DataPlaneError) as exc:
            with run.lock:
                run.abandoned = True
                stream.close({"error": f"plan {self.plan_id}: {stream.seq_id} could not be resumed here "
                                       f"after a refused hand-over: {exc}"}, self.clock())
            return
        self._begin(run, resp)

    def accept(self, state: KVState, lease: tuple[str, int], resume_from: int) -> None:
        """The target side of a hand-over: continue `state` here by replay.

        `lease` is (plan_id, routing_version); a version not newer than one this node already held
        the sequence under raises StaleLease. KV in the frame is ignored (vLLM cannot import it).
        Raises Refused when it cannot take it; changes nothing then.
        """
        plan_id, version = lease
        sid = state.seq_id
        if plan_id != self.plan_id:
            raise Refused(f"target_plan: this node runs {self.plan_id} for {self.deployment}, not {plan_id}")
        generated = list(state.generated_ids)
        if resume_from != len(generated):
            raise Refused(f"resume_from: the state carries {len(generated)} generated tokens, not {resume_from}")
        remaining = state.max_new_tokens - len(generated)
        if len(state.token_ids) + max(remaining, 0) > self.spec.max_model_len:
            raise Refused(f"cannot take {sid}: {len(state.token_ids)} tokens + {remaining} to go exceed "
                          f"max_model_len {self.spec.max_model_len}")
        with self._lock:
            if self.state != "ready":
                raise Refused(f"plan {self.plan_id} is {self.state} on this node")
            held = self._leases.get(sid)
            if held is not None and version <= held:
                raise StaleLease(f"lease version {version} for {sid} is not newer than {held}, which this node had")
            stream = SeqStream(sid, state.num_prompt_tokens, state.max_new_tokens, version, self.clock(),
                               tokens=generated, token_s=[float("nan")] * len(generated),
                               first_local=len(generated))
            run = _Run(stream, self._body(state.token_ids, max(remaining, 1), state.sampling))
            previous = self._runs.get(sid)
            self._runs[sid] = run
            self._leases[sid] = version
        if remaining <= 0:  # its budget was spent at the source: nothing to generate
            stream.close({"done": True, "finish_reason": "length"}, self.clock())
            return
        try:
            resp = self._open(run.body)
        except (ValueError, DataPlaneError) as exc:
            with self._lock:
                put_back(self._leases, sid, held)
                put_back(self._runs, sid, previous)
            raise Refused(f"cannot take {sid}: {exc}") from None
        self._begin(run, resp)

    def _end_released(self, stream: SeqStream, end: dict[str, Any]) -> None:
        with self._lock:
            run = self._runs.get(stream.seq_id)
        if run is not None:
            with run.lock:
                run.abandoned = True  # its vLLM request is dropped when the reader stops
                stream.close(end, self.clock())

    # -- metrics ---------------------------------------------------------------------------------

    def report(self) -> EngineReport:
        """Serving metrics over the interval since the previous report, from vLLM's /metrics.

        Arrivals, the mean prompt and the SLO misses come from this host's own count (vLLM counts
        a replayed sequence as a new request with a longer prompt, and counts no misses); the rest
        is vLLM's.
        """
        rep = self.engine.report()
        with self._lock:
            arrivals, self._win_arrivals = self._win_arrivals, 0
            prompts, self._win_prompt = self._win_prompt, []
            finished, self._win_finished = self._win_finished, []
            self._win_start_s = self.clock()
        # vLLM's count of finished requests and ours are read a moment apart: a sequence that ended in
        # between is in ours and not yet in vLLM's. It is judged in the next interval, so the report
        # keeps its rule (slo_violations <= finished).
        if len(finished) > rep.finished:
            with self._lock:
                self._win_finished[:0] = finished[rep.finished:]
            finished = finished[:rep.finished]
        misses = slo_misses(finished, self.slo_ms)
        return replace(rep, plan_id=self.plan_id, arrivals=arrivals, slo_violations=misses,
                       prompt_tokens_mean=sum(prompts) / len(prompts) if prompts else None)
