"""Every agent of the simulated cluster: agent protocol v1's transition commands, carried out on
FleetSim's engines with modelled durations.

`SimAgents` takes commands (scheduler.transition.CommandIntent) from whoever delivers them - the
replay's `TransitionDriver` from its in-memory mailbox, the live fleet from the console over
HTTP, a test's world - and answers each through `ack` when it is done, once per command key (a
command delivered twice is run once), through the faults injected (agents/sim/faults.py: fail,
hang, lose_gpus):

* prepare_plan: refused, as the real daemon refuses it, when the plan would book more than 92%
  of a GPU beside what is held there (reason out_of_memory) or the node's engine cannot run it
  (unsupported); otherwise the plan's engine starts loading (it holds its memory at once); acked when it
  serves - weights from host memory over each GPU's host link (costmodel.switch_cost's PREPARE
  time, shards already in place free) - or failed ("preempted") when its GPUs are gone.
* freeze_plan: the plan stops admitting; the ack lists its sequences (context, tokens so far,
  running or waiting) and its current round time.
* move_sequences: at the end of the source pipe's round in flight (a safe boundary), each listed
  sequence finishes where it is, migrates (its KV crosses the link at the capped bandwidth, one
  migration at a time per source node) or replays (recomputed on the target). Acked when the
  last migration has landed. A sequence holds a lease - the routing version it was routed
  under, or that its last hand-over carried - and moves only with a newer one (else it stays
  with its owner and the ack says `stale_lease`).
* release_plan: the plan drains what it kept, then frees its GPUs; a sequence still there after
  the drain timeout is handed over by replay to the command's `fallback` plan, under the
  fallback's routing version, or - no fallback, or one that does not serve - ends with an
  explicit error (the ack lists both: handed_over, failed).
* abort_plan: the plan stops admitting; its sequences may finish for the command's
  drain_timeout_s (0: none may), then each still there ends with an explicit error (the ack's
  `failed`).

A PREPARE is refused ("failed") for a plan this deployment is releasing (draining); the same plan
for another deployment is a plan of its own, as on the node daemon (refused only for memory). `lose_node` kills a node's agent: it answers nothing
more, and the plans on its GPUs stop, their sequences ending with an explicit error.
* thaw_plan: it admits again (the routing table says how much).

Every plan prepared, released or aborted goes to its `EventLog` (with the simulator's
per-sequence events, agents/sim/seqlog.py, when the FleetSim has that log).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agents.protocol import prepare_shape
from agents.shadow_check import tokenizer_problem
from agents.sim.cluster import TENANT, Change
from agents.sim.engine import Pipe, PlanEngine, Request
from agents.sim.faults import COMMAND_S, Fault, lost_gpus, take_fault, through_fault
from agents.sim.fleet import FleetSim
from agents.sim.jobs import defer_for_jobs, drop_deferred
from scheduler.booking import plan_memory
from scheduler.capabilities import plan_refusals
from scheduler.costmodel import kv_route
from scheduler.invariants import EventLog, LogEvent
from scheduler.plan import Plan
from scheduler.refusal import Refused
from scheduler.transition import (
    DEFAULT_TRANSITION_CONFIG,
    CommandIntent,
    CommandKind,
    TransitionConfig,
)


@dataclass
class _Move:
    """One move_sequences command being carried out."""

    cmd: CommandIntent
    engine_id: int
    directives: dict[str, Mapping[str, object]]  # seq_id -> directive
    pipes_left: int  # source pipes that have not reached their boundary yet
    landing: int = 0  # migrations in flight
    results: list[dict[str, object]] = field(default_factory=list)


@dataclass(frozen=True)
class StallSample:
    """One handed-over sequence: how long it stood still, and what moved. The
    modelled stall: a migration's transfer (from the pause to the KV landing), a replay's prefill
    on the target; the same figure its ack reports."""

    seq_id: str
    action: str
    context_tokens: int
    stall_s: float
    kv_bytes: int
    replay_tokens: int


Ack = Callable[[CommandIntent, bool, str, Mapping[str, object]], None]


class SimAgents:
    """Every agent of the simulated cluster: carries out agent protocol v1's transition commands
    on the simulator's engines (module docstring) and answers each through `ack` when it is done.

    The transition driver feeds it from the in-memory mailbox; the live fleet can feed it the
    commands the console sends (a protocol Command maps onto a CommandIntent: key = command id,
    node_id, kind, payload, deployment, transition seq, step) and ack over HTTP. The simulator's
    listener must forward `on_ready` and `on_stopped` (engines coming up, stopping, released).
    """

    def __init__(self, sim: FleetSim, ack: Ack, *, config: TransitionConfig = DEFAULT_TRANSITION_CONFIG,
                 log: EventLog | None = None, faults: Sequence[Fault] = ()) -> None:
        self.sim = sim
        self.ack = ack
        self.config = config
        self.log = log if log is not None else EventLog(record_decodes=False)
        self.faults: list[Fault] = list(faults)  # injected (`inject`), used up as they strike
        self._prepares: dict[int, list[CommandIntent]] = {}  # engine id -> prepare commands to ack at ready
        self._releases: dict[int, list[CommandIntent]] = {}  # engine id -> release commands to ack at release
        self._link_free: dict[str, float] = {}  # source node -> its outgoing KV link is busy until then
        self._seen: set[str] = set()  # command keys taken: a command delivered again is not run twice
        self._answered: set[str] = set()  # command keys acked (or swallowed by a hang): answered once
        self._faulted: dict[str, Fault] = {}  # command key -> the fault it drew
        self._striking: set[str] = set()  # command keys whose lose_gpus fault has not struck yet
        self._ending: set[int] = set()  # engine ids whose end these agents answer themselves (evict)
        self._aborts: dict[int, list[Callable[[list[str]], None]]] = {}  # engine id -> aborts draining it
        self._dead: set[str] = set()  # nodes whose agent died (lose_node): nothing runs or answers there
        self._deferred: dict[str, CommandIntent] = {}  # command key -> a PREPARE waiting for jobs to yield
        self.stalls: list[StallSample] = []  # every hand-over done (move_sequences, a release's fallback)

    def inject(self, fault: Fault) -> None:
        """Make the next matching commands misbehave (agents/sim/faults.py)."""
        self.faults.append(fault)

    def execute(self, cmd: CommandIntent) -> None:
        """Carry out one command (acked now or when it is done; once per command key)."""
        if cmd.key in self._seen:
            return
        self._seen.add(cmd.key)
        if cmd.node_id in self._dead:
            return  # nobody there to run it, nor to answer: the controller's step timeout acts
        if cmd.deployment_id not in self.sim.deployments and cmd.kind is not CommandKind.PREPARE_PLAN:
            # not a deployment this fleet runs (a prepare carrying its model_spec and slo would add
            # it): nothing of it runs here, so there is nothing to undo or move
            self._ack(cmd, True, result={"plan_id": cmd.payload.get("plan_id"), "noop": True})
            return
        fault = take_fault(self.faults, cmd) if self.faults else None
        if fault is not None:
            self._faulted[cmd.key] = fault
            if fault.action == "lose_gpus" and cmd.kind is not CommandKind.MOVE_SEQUENCES:
                self._striking.add(cmd.key)  # it is still running when the GPUs go: it fails then
        self._execute(cmd)
        if fault is not None and fault.action == "lose_gpus":
            engine = self._engine(cmd)
            run_s = engine.ready_s - self.sim.now_s if engine is not None and engine.state == "loading" else COMMAND_S
            self.sim.call_at(self.sim.now_s + 0.5 * max(run_s, 0.0), lambda t: self._lose_for(cmd, fault))

    def lose_node(self, node_id: str) -> None:
        """The node's agent dies: it answers nothing more (open commands and new ones go unanswered)
        and every plan with a GPU there stops now, each of its sequences ending with an explicit
        error (their state was on that node)."""
        self._dead.add(node_id)
        node = self.sim.cluster.nodes.get(node_id)
        mine = {g.uuid for g in node.gpus} if node is not None else set()
        for engine in [e for e in self.sim.live.values() if mine.intersection(e.plan.gpu_uuids)]:
            for req in self.sim.evict(engine):
                self.sim.failed(req, self.sim.now_s, f"node {node_id} lost")

    def _lose_for(self, cmd: CommandIntent, fault: Fault) -> None:
        """lose_gpus half way through the command: the plans on its GPUs on its node crash; the
        command, if still open, fails "preempted"."""
        node = self.sim.cluster.nodes.get(cmd.node_id)
        mine = [g.uuid for g in node.gpus] if node is not None else []
        raw = cmd.payload.get("plan")
        engine = self._engine(cmd)
        plan = Plan.from_dict(raw) if isinstance(raw, Mapping) else engine.plan if engine is not None else None
        gpus = lost_gpus(fault, [u for u in (plan.gpu_uuids if plan is not None else ()) if u in mine], sorted(mine))
        self._striking.discard(cmd.key)
        if fault.taken:
            self.sim.set_gpu_owner(gpus, TENANT)  # another tenant takes them (until they are given back)
        else:
            self.sim.break_gpus(gpus)
        if cmd.kind is not CommandKind.MOVE_SEQUENCES:
            self._ack(cmd, False, f"preempted: {len(gpus)} GPU(s) of {cmd.node_id} taken",
                      {"reason": "preempted", "gpus": gpus})

    def listener(self) -> _AgentsListener:
        """A SimListener that tells these agents when engines come up or stop (give it to the
        FleetSim when nothing else listens)."""
        return _AgentsListener(self)

    def _ack(self, cmd: CommandIntent, ok: bool, detail: str = "", result: Mapping[str, object] | None = None
             ) -> None:
        """Answer once per command, through the command's fault, completed with what agent
        protocol v1 says the result holds; a node that left answers nothing."""
        if cmd.key in self._answered or cmd.key in self._striking:
            return  # answered already, or it runs on until its lose_gpus fault strikes (`_lose_for`)
        self._answered.add(cmd.key)
        if cmd.node_id not in self.sim.cluster.nodes or cmd.node_id in self._dead:
            return  # the node left, or its agent died: nobody is there to answer
        answer = through_fault(self._faulted.pop(cmd.key, None), cmd, ok, detail, result or {})
        if answer is None:
            return  # it hangs: never answered
        ok, detail, out = answer
        self.ack(cmd, ok, detail, self._complete(cmd, out) if ok else out)

    def _complete(self, cmd: CommandIntent, result: dict[str, object]) -> dict[str, object]:
        """The parts of an ok result that this node's agent adds (agents/protocol/): the memory
        a prepare reserved and a release freed on this node's GPUs."""
        if cmd.kind not in (CommandKind.PREPARE_PLAN, CommandKind.RELEASE_PLAN) or result.get("noop"):
            return result
        raw = cmd.payload.get("plan")
        engine = self._engine(cmd)
        plan = Plan.from_dict(raw) if isinstance(raw, Mapping) else engine.plan if engine is not None else None
        node = self.sim.cluster.nodes.get(cmd.node_id)
        dep = self.sim.deployments.get(cmd.deployment_id)
        if plan is None or node is None or dep is None:
            return result
        mine = {g.uuid for g in node.gpus}
        held = {u: b for u, b in plan_memory(plan, dep.model).items() if u in mine}
        if cmd.kind is CommandKind.PREPARE_PLAN:
            result.setdefault("reserved_bytes", held)
        else:
            result.setdefault("freed_bytes", held)
            result.setdefault("failed", [])
            result.setdefault("handed_over", [])
        return result

    def _engine(self, cmd: CommandIntent) -> PlanEngine | None:
        if cmd.deployment_id not in self.sim.deployments:
            return None
        return self.sim.engine_of(cmd.deployment_id, str(cmd.payload.get("plan_id", "")))

    def _execute(self, cmd: CommandIntent) -> None:
        kind = cmd.kind
        if kind is CommandKind.PREPARE_PLAN:
            self._prepare(cmd)
        elif kind is CommandKind.FREEZE_PLAN:
            self._freeze(cmd)
        elif kind is CommandKind.THAW_PLAN:
            self._ack(cmd, True, result={"plan_id": cmd.payload.get("plan_id")})
        elif kind is CommandKind.MOVE_SEQUENCES:
            self._move(cmd)
        elif kind is CommandKind.RELEASE_PLAN:
            self._release(cmd)
        elif kind is CommandKind.ABORT_PLAN:
            self._abort(cmd)

    def _prepare(self, cmd: CommandIntent) -> None:
        plan = Plan.from_dict(cmd.payload["plan"])
        if cmd.deployment_id not in self.sim.deployments:
            refused = self._new_deployment(cmd, plan)
            if refused is not None:
                self._ack(cmd, False, refused, {"reason": "failed"})
                return
        # The same plan (same model, same GPUs) running for another deployment is no conflict: the
        # node daemon keys its plans by (deployment, plan_id) and books each one's memory
        # (agents/node/plan_commands.py), so a second deployment's copy is a plan of its own - refused only
        # when it does not fit beside the first (sim.launch: scheduler.booking's words).
        engine = self.sim.engine_of(cmd.deployment_id, plan.plan_id)
        if engine is not None and engine.release_when_empty:
            self._ack(cmd, False, f"plan {plan.plan_id} is being released", {"reason": "failed"})
            return
        if engine is not None and engine.state == "serving":
            self._ack(cmd, True, result={"plan_id": plan.plan_id, "load_s": 0.0})
            return
        if engine is None:
            lost = [u for u in plan.gpu_uuids if not self.sim.gpu_usable(u)]
            if lost:
                self._ack(cmd, False, f"preempted: GPU(s) {', '.join(lost[:3])} are not ours",
                          {"reason": "preempted", "gpus": lost})
                return
            unsupported = plan_refusals(plan, self.sim.snapshot())
            if unsupported:
                self._ack(cmd, False, "; ".join(unsupported), {"reason": "unsupported"})
                return
            vocab = self.sim.deployments[cmd.deployment_id].model.vocab_size
            problem = tokenizer_problem(cmd.payload.get("model_version"), vocab)
            if problem is not None:  # the shadow plan would not serve this version (agents/shadow_check.py)
                self._ack(cmd, False, problem, {"reason": "tokenizer"})
                return
            if defer_for_jobs(self, cmd, plan):  # on GPUs jobs hold: they yield first (agents/sim/jobs.py)
                return
            try:
                engine = self.sim.launch(cmd.deployment_id, plan, source="host", accepting=False)
            except Refused as exc:
                # what the real daemon answers (scheduler.booking): the plan does not fit beside
                # what its GPUs hold; nothing was booked
                self._ack(cmd, False, exc.reason, {"reason": exc.code, "gpus": exc.gpus})
                return
            self.log.add(LogEvent(self.sim.now_s, "plan_prepared", node=cmd.node_id, plan_id=plan.plan_id))
        self._prepares.setdefault(engine.engine_id, []).append(cmd)
        if engine.state == "serving":
            self.on_ready(engine)

    def _new_deployment(self, cmd: CommandIntent, plan: Plan) -> str | None:
        """A PREPARE for a deployment the simulator was not configured with (one created in the
        console) runs it from the model_spec and slo it carries (agents/protocol/); why not, or None.
        Once added it stays known, with that shape, even when this prepare is then refused (its
        memory, its GPUs): a later prepare of it is checked the same way, a different shape refused."""
        where = f"deployment {cmd.deployment_id!r} is not one this fleet was configured with"
        try:
            spec, slo = prepare_shape(cmd.payload)
        except ValueError as exc:
            return f"{exc} ({where})"
        if spec is None:
            return f"payload.model_spec: required: {where}, and the prepare does not say the model's shape"
        if slo is None:
            return f"payload.slo: required: {where}, and the prepare does not say its SLO"
        if spec.name != plan.model:
            return f"payload.model_spec.name: {spec.name!r} is not the plan's model {plan.model!r}"
        self.sim.add_deployment(cmd.deployment_id, spec, slo)
        return None

    def on_ready(self, engine: PlanEngine) -> None:
        for cmd in self._prepares.pop(engine.engine_id, []):
            self._ack(cmd, True, result={"plan_id": engine.plan.plan_id,
                                         "load_s": round(engine.ready_s - engine.started_s, 6)})

    def on_stopped(self, engine: PlanEngine) -> None:
        """An engine stopped (lost GPUs, aborted) or was released: answer what waited on it."""
        reason = "preempted" if engine.state == "dead" else "failed"
        for cmd in self._prepares.pop(engine.engine_id, []):
            self._ack(cmd, False, f"plan {engine.plan.plan_id} stopped while loading", {"reason": reason})
        for finish in self._aborts.pop(engine.engine_id, []):
            finish([])  # drained before its abort's deadline: nothing left to fail
        if engine.engine_id in self._ending:
            return  # its releases are answered where these agents stopped it (`_end`)
        for cmd in self._releases.pop(engine.engine_id, []):
            self.log.add(LogEvent(self.sim.now_s, "plan_released", node=cmd.node_id, plan_id=engine.plan.plan_id))
            self._ack(cmd, True, result={"plan_id": engine.plan.plan_id, "failed": []})

    def _freeze(self, cmd: CommandIntent) -> None:
        engine = self._engine(cmd)
        pid = cmd.payload.get("plan_id")
        if engine is None or engine.state != "serving":
            self._ack(cmd, True, result={"plan_id": pid, "sequences": []})
            return
        engine.accepting = False
        seqs = []
        for req, running in engine_sequences(engine):
            tokens = req.tokens_now()
            seqs.append({"seq_id": str(req.rid), "context_tokens": req.prompt + tokens if req.has_kv or req.decoding
                         else 0, "generated_tokens": tokens, "max_tokens": req.output,
                         "state": "running" if running else "waiting", "kv_lost": False})
        step = max((p.step for p in engine.pipes if p.busy), default=0.0) or engine.profile.pipeline(
            "decode").decode_step_s(1, 512)
        self._ack(cmd, True, result={"plan_id": pid, "sequences": seqs, "decode_step_s": step})

    def _move(self, cmd: CommandIntent) -> None:
        engine = self._engine(cmd)
        raw = cmd.payload.get("moves", [])
        directives = {str(m.get("seq_id")): m for m in raw if isinstance(m, Mapping)} if isinstance(raw, list) else {}
        if engine is None or engine.state != "serving":
            self._ack(cmd, True, result={"plan_id": cmd.payload.get("plan_id"), "moved": [
                {"seq_id": s, "action": m.get("action"), "outcome": "gone", "ok": True}
                for s, m in directives.items()]})
            return
        job = _Move(cmd, engine.engine_id, directives, pipes_left=len(engine.pipes))
        for pipe in engine.pipes:
            if pipe.busy:
                pipe.handover = lambda p, t, job=job: self._hand_over(job, p, t)
                # the safe boundary is the end of the decode iteration in flight, not of the
                # run of iterations the simulator batched ahead: cut the run there
                self.sim.push_events(pipe.poke(self.sim.now_s))
            else:
                self.sim.push_events(self._hand_over(job, pipe, self.sim.now_s))

    def _hand_over(self, job: _Move, pipe: Pipe, t: float) -> list[Any]:
        """At the pipe's safe boundary: the listed sequences leave it, or stay to finish."""
        out: list[Any] = []
        mine = {str(r.rid): r for r in list(pipe.running.values()) + list(pipe.waiting)}
        wanted = {sid for sid, m in job.directives.items() if m.get("action") != "finish" and sid in mine}
        # a hand-over needs a lease newer than the one the sequence holds (invariant 2): a move
        # built on an older routing table (a late or repeated command) leaves it with its owner
        version = _int_or(job.cmd.payload.get("routing_version"), 0)
        for sid in sorted(s for s in wanted if version <= mine[s].lease):
            wanted.discard(sid)
            job.results.append({"seq_id": sid, "action": job.directives[sid].get("action"), "ok": False,
                                "reason": "stale_lease",
                                "error": f"lease version {version} is not newer than {mine[sid].lease}"})
        for sid in [s for s, m in job.directives.items() if m.get("action") == "finish" and s in mine]:
            job.results.append({"seq_id": sid, "action": "finish", "ok": True,
                                "context_tokens": mine[sid].context()})
        taken = pipe.take_running(lambda r: str(r.rid) not in wanted)
        for r in taken:
            self.sim.paused(r, "decode_end")  # the end of the round in flight: a safe boundary
        queued = [r for r in pipe.waiting if str(r.rid) in wanted]
        for r in queued:
            pipe.waiting.remove(r)
            r.pipe = None
            r.engine_id = 0
            self.sim.paused(r, "idle")
        src = pipe.engine
        for req in taken + queued:
            m = job.directives[str(req.rid)]
            out += self._send(job, src, req, m, t)
        job.pipes_left -= 1
        self._maybe_done(job)
        return out

    def _send(self, job: _Move, src: PlanEngine, req: Request, m: Mapping[str, object], t: float) -> list[Any]:
        dst = self.sim.engine_of(src.deployment, str(m.get("target_plan", "")))
        req.lease = max(req.lease, _int_or(job.cmd.payload.get("routing_version"), 0))  # the new owner's lease
        action = str(m.get("action"))
        ctx = req.prompt + req.generated
        if dst is None or dst.state != "serving":
            # the target cannot take it: it is recomputed wherever the router sends it
            if req.has_kv:
                req.drop_kv()
            req.replays += 1
            job.results.append({"seq_id": str(req.rid), "action": action, "ok": False, "reason": "target_refused",
                                "error": f"target plan {m.get('target_plan')} is not serving"})
            return self.sim.dispatch(src.deployment, req, t)
        if action == "migrate" and req.has_kv:
            src_stages = src.plan.decode_stages if src.plan.mode == "disaggregated" else src.plan.stages
            dst_stages = dst.plan.decode_stages if dst.plan.mode == "disaggregated" else dst.plan.stages
            route = kv_route(src_stages, dst_stages, src.model, self.sim.snapshot(), self.sim.eff)
            cap = float(m.get("bw_cap_bytes_per_s", 0.0) or 0.0)  # type: ignore[arg-type]
            per_token = route.s_per_token
            if cap > 0 and route.bytes_per_token:
                per_token = max(per_token, route.bytes_per_token / cap)
            dur = 0.0 if route.bytes_per_token == 0 else route.latency_s + ctx * per_token
            if not math.isfinite(dur):
                action = "replay"
            else:
                node = self.sim.plan_nodes(src.plan)[0]
                start = max(t, self._link_free.get(node, 0.0))
                land = start + dur
                self._link_free[node] = land
                req.migrations += 1
                job.landing += 1
                job.results.append({"seq_id": str(req.rid), "action": "migrate", "ok": True, "context_tokens": ctx,
                                    "kv_bytes": ctx * route.bytes_per_token, "replay_tokens": 0,
                                    "stall_s": round(land - t, 6)})
                self.stalls.append(StallSample(str(req.rid), "migrate", ctx, round(land - t, 6),
                                               int(ctx * route.bytes_per_token), 0))

                def landed(now: float, job: _Move = job) -> None:
                    job.landing -= 1
                    self._maybe_done(job)

                self.sim.call_at(land, landed)
                return dst.expect(req, land)
        # replay (or a sequence that held no KV): recomputed on the target
        if req.has_kv:
            req.drop_kv()
        if req.generated or req.done:
            req.replays += 1
        est = dst.profile.pipeline("prefill").prefill_time_s(max(1, ctx))
        job.results.append({"seq_id": str(req.rid), "action": "replay", "ok": True, "context_tokens": ctx,
                            "kv_bytes": 0, "replay_tokens": ctx, "stall_s": round(est, 6)})
        self.stalls.append(StallSample(str(req.rid), "replay", ctx, round(est, 6), 0, ctx))
        return dst.submit(req, t)

    def _maybe_done(self, job: _Move) -> None:
        if job.pipes_left > 0 or job.landing > 0:
            return
        done = {str(r.get("seq_id")) for r in job.results}
        for sid, m in job.directives.items():
            if sid not in done:
                job.results.append({"seq_id": sid, "action": m.get("action"), "outcome": "gone", "ok": True})
        failed = [r for r in job.results if not r.get("ok", True)]
        result = {"plan_id": job.cmd.payload.get("plan_id"), "moved": job.results}
        if failed:
            reasons = {r.get("reason") for r in failed}
            self._ack(job.cmd, False, f"{len(failed)} sequence(s) could not be handed over",
                      {**result, "reason": "stale_lease" if reasons == {"stale_lease"} else "target_refused"})
        else:
            self._ack(job.cmd, True, result=result)

    def _release(self, cmd: CommandIntent) -> None:
        drop_deferred(self, cmd)
        engine = self._engine(cmd)
        if engine is None or engine.state != "serving":
            self.log.add(LogEvent(self.sim.now_s, "plan_released", node=cmd.node_id,
                                  plan_id=str(cmd.payload.get("plan_id", ""))))
            self._ack(cmd, True, result={"plan_id": cmd.payload.get("plan_id"), "noop": True})
            return
        self._releases.setdefault(engine.engine_id, []).append(cmd)
        if len(self._releases[engine.engine_id]) > 1:
            return  # another node's release of the same plan: one drain serves both
        drain_s = _num_or(cmd.payload.get("drain_timeout_s"), 2 * self.config.drain_budget_s)
        raw = cmd.payload.get("fallback")
        fallback = raw if isinstance(raw, Mapping) else None
        self.sim.retire(engine, "drain")

        def deadline(now: float) -> None:
            if engine.state != "serving":
                return  # drained (released, acked then) or lost with its GPUs
            handed, failed = self._end(engine, f"plan {engine.plan.plan_id} ran out of its {drain_s:g} s drain"
                                       " before it finished", fallback)
            for c in self._releases.pop(engine.engine_id, []):
                self.log.add(LogEvent(self.sim.now_s, "plan_released", node=c.node_id, plan_id=engine.plan.plan_id))
                self._ack(c, True, result={"plan_id": engine.plan.plan_id, "failed": failed, "handed_over": handed})

        self.sim.call_at(self.sim.now_s + drain_s, deadline)

    def _end(self, engine: PlanEngine, why: str, fallback: Mapping[str, object] | None) -> tuple[list[str], list[str]]:
        """The plan stops now; each sequence still there is handed over by replay to `fallback`'s
        plan (with its routing version as the lease) when that plan serves, else ends with `why`.
        Returns (handed over, failed) sequence ids."""
        self._ending.add(engine.engine_id)
        try:
            reqs = self.sim.evict(engine)
        finally:
            self._ending.discard(engine.engine_id)
        dst = None
        if fallback is not None:
            dst = self.sim.engine_of(engine.deployment, str(fallback.get("target_plan", "")))
            if dst is not None and dst.state != "serving":
                dst = None
        version = _int_or(fallback.get("routing_version"), 0) if fallback is not None else 0
        handed: list[str] = []
        failed: list[str] = []
        t = self.sim.now_s
        for req in reqs:
            if dst is None:
                failed.append(str(req.rid))
                self.sim.failed(req, t, why)
                continue
            self.sim.paused(req, "idle")  # its plan stopped: handed over as it stands, recomputed there
            req.lease = max(req.lease, version)
            if req.generated or req.done:
                req.replays += 1
            handed.append(str(req.rid))
            ctx = req.prompt + req.generated
            est = dst.profile.pipeline("prefill").prefill_time_s(max(1, ctx))
            self.stalls.append(StallSample(str(req.rid), "replay", ctx, round(est, 6), 0, ctx))
            self.sim.push_events(dst.submit(req, t))
        return handed, failed

    def _abort(self, cmd: CommandIntent) -> None:
        drop_deferred(self, cmd)
        engine = self._engine(cmd)
        reason = str(cmd.payload.get("reason", "aborted"))
        drain_s = _num_or(cmd.payload.get("drain_timeout_s"), 0.0)

        def done(failed: list[str]) -> None:
            self.log.add(LogEvent(self.sim.now_s, "plan_aborted", node=cmd.node_id,
                                  plan_id=str(cmd.payload.get("plan_id", "")), detail=reason))
            self._ack(cmd, True, result={"plan_id": cmd.payload.get("plan_id"), "failed": failed})

        if engine is None or engine.state not in ("serving", "loading"):
            done([])
            return
        why = f"plan {engine.plan.plan_id} aborted: {reason}"
        if engine.state == "loading" or drain_s <= 0 or engine.empty():
            done(self._end(engine, why, None)[1])
            return
        self._aborts.setdefault(engine.engine_id, []).append(done)
        self.sim.retire(engine, "drain")  # its sequences may finish here for drain_s (acked when it is empty)

        def deadline(now: float) -> None:
            if done in self._aborts.get(engine.engine_id, []):
                self._aborts[engine.engine_id].remove(done)
                done(self._end(engine, why, None)[1] if engine.state == "serving" else [])

        self.sim.call_at(self.sim.now_s + drain_s, deadline)


class _AgentsListener:
    def __init__(self, agents: SimAgents) -> None:
        self.agents = agents

    def on_cluster_change(self, sim: FleetSim, t: float, changes: Sequence[Change],
                          broke: Mapping[str, Sequence[PlanEngine]]) -> None:
        return None

    def on_ready(self, sim: FleetSim, t: float, engine: PlanEngine) -> None:
        self.agents.on_ready(engine)

    def on_released(self, sim: FleetSim, t: float, engine: PlanEngine) -> None:
        self.agents.on_stopped(engine)


def engine_sequences(engine: PlanEngine) -> list[tuple[Request, bool]]:
    """Every sequence an engine holds, with whether it is in the running batch."""
    out: list[tuple[Request, bool]] = []
    seen: set[int] = set()
    for pipe in engine.pipes:
        for req in pipe.running.values():
            if req.rid not in seen:
                seen.add(req.rid)
                out.append((req, True))
    for pipe in engine.pipes:
        for req in pipe.waiting:
            if req.rid not in seen:
                seen.add(req.rid)
                out.append((req, False))
    for req in engine.in_flight.values():
        if req.rid not in seen:
            seen.add(req.rid)
            out.append((req, True))
    return out


def _int_or(v: object, default: int) -> int:
    return int(v) if isinstance(v, int | float) and not isinstance(v, bool) else default


def _num_or(v: object, default: float) -> float:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else default
