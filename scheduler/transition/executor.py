"""The executor: starts, advances and aborts transitions through the ports, one idempotent
pass at a time (save the step, then its effects, then judge the results)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from scheduler.costmodel import DEFAULT_EFFICIENCY, Efficiency
from scheduler.modelspec import model_spec
from scheduler.plan import Gear
from scheduler.transition.intents import StepIntents, _shape
from scheduler.transition.moves import lost_gpus, plan_nodes
from scheduler.transition.ports import (
    AgentPort,
    Clock,
    ModelResolver,
    Probe,
    RoutingTable,
    TransitionStore,
    WeightsResolver,
    _no_digest,
    _no_probe,
)
from scheduler.transition.records import (
    CommandIntent,
    MoveStats,
    RoutingState,
    StaleGuard,
    StepRecord,
    TransitionEvent,
    TransitionRecord,
    _merge,
)
from scheduler.transition.vocabulary import (
    DEFAULT_TRANSITION_CONFIG,
    ROLLBACK_TABLE,
    STEP_DEFS,
    TABLE,
    CommandKind,
    Kind,
    Phase,
    Step,
    StepState,
    TransitionConfig,
)


# --- the executor ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Advance:
    """What one `advance` call left behind."""

    record: TransitionRecord | None  # the transition now (None: none was active)
    wake_at_s: float | None = None  # call again at this time at the latest (a timeout, a dwell)
    waiting_for: tuple[str, ...] = ()  # command keys it waits on
    finished: bool = False  # the transition reached DONE or ROLLED_BACK in this call


@dataclass(frozen=True)
class _Wait:
    wake_at_s: float
    keys: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Ok:
    result: Mapping[str, object]
    note: str = ""


@dataclass(frozen=True)
class _Fail:
    reason: str  # preempted | timeout | failed | node_lost | conflict | routing_raced | aborted
    error: str


class Executor(StepIntents):
    """Advances transitions through the table. Stateless: everything is in the store.

    Decide apart from act: each pass reads the record, mirrors what the agents reported
    (acks, lost GPUs, routing), decides the next move with the table, saves it, and only then
    acts. Several executors may run at once for the same transition (two workers, a crashed
    one's redelivered task): conditional saves and guarded, idempotent effects make that safe.
    """

    def __init__(self, store: TransitionStore, agents: AgentPort, routing: RoutingTable, clock: Clock, *,
                 config: TransitionConfig = DEFAULT_TRANSITION_CONFIG, probe: Probe = _no_probe,
                 models: ModelResolver = model_spec, eff: Efficiency = DEFAULT_EFFICIENCY,
                 weights: WeightsResolver = _no_digest) -> None:
        self.store = store
        self.agents = agents
        self.routing = routing
        self.clock = clock
        self.config = config
        self.probe = probe
        self.models = models
        self.eff = eff
        self.weights = weights

    # -- starting --------------------------------------------------------------------------
    def start(self, deployment_id: str, to_gear: Gear, *, kind: Kind = Kind.AUTO, model: str | None = None,
              decision_ref: str | None = None) -> TransitionRecord | None:
        """Claim the next seq and create a transition from the current gear to `to_gear`.
        None when another transition is active (or a racing caller claimed the seq first)."""
        from_gear = self.store.current_gear(deployment_id)
        name = model or to_gear.model
        if to_gear.model != name:
            raise ValueError(f"to_gear.model: {to_gear.model!r} is not the deployment's model {name!r}")
        if from_gear is not None and from_gear.gear_id == to_gear.gear_id:
            raise ValueError(f"to_gear: the deployment already runs gear {to_gear.gear_id}")
        now = self.clock()
        record = TransitionRecord(deployment_id=deployment_id, seq=self.store.last_seq(deployment_id) + 1,
                                  kind=kind, model=name, from_gear=from_gear, to_gear=to_gear,
                                  phase=Phase.PREPARE, created_s=now, decision_ref=decision_ref)
        event = TransitionEvent("created", deployment_id, record.seq, now, Phase.PREPARE,
                                detail=f"{kind.value}: {_shape(from_gear)} -> {to_gear.shape()}")
        return record if self.store.create(record, [event]) else None

    def abort(self, deployment_id: str, reason: str) -> bool:
        """Ask the active transition to roll back (it does at its next advance, if in PREPARE or SWITCH)."""
        active = self.store.active(deployment_id)
        return active is not None and self.store.request_abort(deployment_id, active.seq, reason)

    # -- advancing -------------------------------------------------------------------------
    def advance(self, deployment_id: str, seq: int | None = None, *, max_passes: int = 200) -> Advance:
        """Take every step that can be taken now; return when the transition waits or ends."""
        record: TransitionRecord | None = None
        for _ in range(max_passes):
            record = self.store.load(deployment_id, seq) if seq is not None else self.store.active(deployment_id)
            if record is None:
                return Advance(None)
            if not record.active:
                return Advance(record)
            out = self._pass(record)
            if isinstance(out, _Wait):
                return Advance(self.store.load(deployment_id, record.seq), out.wake_at_s, out.keys)
            if out == "finished":
                return Advance(self.store.load(deployment_id, record.seq), finished=True)
        return Advance(record, self.clock())

    def _pass(self, rec: TransitionRecord) -> _Wait | str:
        """One decision and its action. Returns a wait, 'progressed', 'raced' or 'finished'."""
        now = self.clock()
        cur = rec.current
        running = cur is not None and cur.state is StepState.RUNNING
        if rec.abort_reason and rec.phase in (Phase.PREPARE, Phase.SWITCH):
            if cur is not None and running:
                return self._finish_step(rec, cur, _Fail("aborted", f"aborted: {rec.abort_reason}"), now)
            return self._enter_rollback(rec, now, f"aborted: {rec.abort_reason}")
        if cur is None or not running:
            return self._start_next(rec, now)
        if now < cur.not_before_s:
            return _Wait(cur.not_before_s)
        try:
            local = self._ensure(rec, cur)
        except StaleGuard:
            return "raced"
        self.probe(f"{cur.step.value}.effected")
        verdict = self._judge(rec, cur, now, local)
        if isinstance(verdict, _Wait):
            return verdict
        return self._finish_step(rec, cur, verdict, now)

    def _enter_rollback(self, rec: TransitionRecord, now: float, error: str) -> str:
        events = [TransitionEvent("phase", rec.deployment_id, rec.seq, now, Phase.ROLLBACK, detail=error)]
        saved = self.store.save(replace(rec, phase=Phase.ROLLBACK, error=error), expected_version=rec.version,
                                events=events)
        return "progressed" if saved is not None else "raced"

    # -- choosing and saving the next step ----------------------------------------------------
    def _start_next(self, rec: TransitionRecord, now: float) -> _Wait | str:
        nxt, attempt, phase = self._next_step(rec)
        if nxt is None:
            final = Phase.DONE if rec.phase is Phase.CLEANUP else Phase.ROLLED_BACK
            done = replace(rec, phase=final, finished_s=now)
            events = [TransitionEvent("phase", rec.deployment_id, rec.seq, now, final),
                      TransitionEvent("finished", rec.deployment_id, rec.seq, now, final,
                                      detail=rec.error or f"{final.value}: {_shape(rec.from_gear)} -> "
                                                          f"{rec.to_gear.shape()}")]
            if self.store.save(done, expected_version=rec.version, events=events) is None:
                return "raced"
            self.probe("finish.persisted")
            return "finished"
        intent = self._intent(rec, nxt, attempt)
        previous = rec.attempts(nxt)
        if phase is Phase.SWITCH and previous and previous[-1].reason == "preempted" and rec.new_plans:
            # the preemption killed the shadow plans: bring them back before trying again
            pre = self._commands(rec, nxt, attempt, CommandKind.PREPARE_PLAN,
                                 [(p, plan_nodes(p, self.agents.snapshot()), {}) for p in rec.new_plans],
                                 suffix="re")
            intent = replace(intent, pre=pre, noop=False, timeout_s=intent.timeout_s + self.config.prepare_timeout_s,
                             note=f"re-prepare {len(rec.new_plans)} new plan(s) first; " + intent.note)
        not_before = now + self.config.retry_backoff_s if attempt > 1 else 0.0
        step = StepRecord(step=nxt, attempt=attempt, state=StepState.RUNNING, started_s=now, intent=intent,
                          not_before_s=not_before)
        events = []
        if phase is not rec.phase:
            events.append(TransitionEvent("phase", rec.deployment_id, rec.seq, now, phase))
        events.append(TransitionEvent("step_started", rec.deployment_id, rec.seq, now, phase, nxt, attempt,
                                      intent.note))
        saved = self.store.save(replace(rec, phase=phase, steps=rec.steps + (step,)), expected_version=rec.version,
                                events=events)
        if saved is None:
            return "raced"
        self.probe(f"{nxt.value}.persisted")
        return "progressed"

    def _next_step(self, rec: TransitionRecord) -> tuple[Step | None, int, Phase]:
        """The next step to start (None: the phase path is complete), its attempt, its phase."""
        if rec.phase is Phase.ROLLBACK:
            for d in ROLLBACK_TABLE:
                if not rec.done(d.step):
                    return d.step, len(rec.attempts(d.step)) + 1, Phase.ROLLBACK
            return None, 0, Phase.ROLLBACK
        for d in TABLE:
            if not rec.done(d.step):
                return d.step, len(rec.attempts(d.step)) + 1, d.phase
        return None, 0, Phase.CLEANUP

    def _finish_step(self, rec: TransitionRecord, cur: StepRecord, verdict: _Ok | _Fail,
                     now: float) -> _Wait | str:
        phase = rec.phase
        error, moved, moved_back = rec.error, rec.moved, rec.moved_back
        events: list[TransitionEvent] = []
        if isinstance(verdict, _Ok):
            done = replace(cur, state=StepState.OK, finished_s=now, result=dict(verdict.result))
            if cur.step is Step.MOVE:
                moved = moved.add(MoveStats.from_ack(verdict.result))
            if cur.step is Step.RB_MOVE:
                moved_back = moved_back.add(MoveStats.from_ack(verdict.result))
            events.append(TransitionEvent("step_ok", rec.deployment_id, rec.seq, now, phase, cur.step, cur.attempt,
                                          verdict.note or cur.intent.note))
        else:
            state = StepState.FAILED
            if phase is Phase.PREPARE or (phase is Phase.SWITCH and (
                    verdict.reason == "aborted" or cur.attempt > self.config.switch_retries)):
                phase = Phase.ROLLBACK
                error = f"{cur.step.value} (attempt {cur.attempt}) {verdict.error}"
            elif phase in (Phase.CLEANUP, Phase.ROLLBACK) and cur.attempt >= self.config.cleanup_attempts:
                state = StepState.ABANDONED
                error = "; ".join(e for e in (error, f"{cur.step.value} given up: {verdict.error}") if e)
            done = replace(cur, state=state, finished_s=now, error=verdict.error, reason=verdict.reason)
            kind: Literal["step_failed", "step_abandoned"] = (
                "step_abandoned" if state is StepState.ABANDONED else "step_failed")
            events.append(TransitionEvent(kind, rec.deployment_id, rec.seq, now, rec.phase, cur.step, cur.attempt,
                                          verdict.error))
            if phase is not rec.phase:
                events.append(TransitionEvent("phase", rec.deployment_id, rec.seq, now, phase, detail=error))
        new = replace(rec, phase=phase, steps=rec.steps[:-1] + (done,), error=error, moved=moved,
                      moved_back=moved_back)
        if self.store.save(new, expected_version=rec.version, events=events) is None:
            return "raced"
        self.probe(f"{cur.step.value}.completed")
        return "progressed"

    # -- acting -----------------------------------------------------------------------------
    def _ensure(self, rec: TransitionRecord, cur: StepRecord) -> list[str] | RoutingState | None:
        """Make the step's effects happen (again: every one is idempotent). Returns what a local
        effect answered (reserve: conflicts; routing: the table after the commit)."""
        effect = STEP_DEFS[cur.step].effect
        guard = rec.guard()
        intent = cur.intent
        if intent.noop:
            return None
        if intent.pre:
            self.agents.send(intent.pre, guard)
            answers = self.agents.results([c.key for c in intent.pre])
            if not all((a := answers.get(c.key)) is not None and a.status == "ok" for c in intent.pre):
                return None  # the step's own effect waits for the re-prepare
        if effect == "reserve":
            return self.store.reserve(guard, intent.needs)
        if effect == "unreserve":
            self.store.unreserve(guard, intent.plan_ids)
            return None
        if effect == "routing":
            assert intent.routes is not None  # noqa: S101 - routing steps always carry routes
            now = self.routing.current(rec.deployment_id)
            if now.same_routes(intent.routes) or now.version != intent.base_version:
                return now  # done already, or raced (judged below)
            committed = self.routing.commit(rec.deployment_id, intent.base_version, intent.routes, guard)
            return committed if committed is not None else self.routing.current(rec.deployment_id)
        if intent.commands:
            self.agents.send(intent.commands[:1], guard)
            if len(intent.commands) > 1:
                self.probe(f"{cur.step.value}.partial")
                self.agents.send(intent.commands[1:], guard)
        return None

    # -- judging ----------------------------------------------------------------------------
    def _judge(self, rec: TransitionRecord, cur: StepRecord, now: float,
               local: list[str] | RoutingState | None) -> _Wait | _Ok | _Fail:
        step, intent = cur.step, cur.intent
        effect = STEP_DEFS[step].effect
        if intent.noop:
            return _Ok({}, intent.note)
        # preemption: GPUs of a new plan lost while it is brought in (rolled back in PREPARE,
        # retried in SWITCH)
        if rec.phase in (Phase.PREPARE, Phase.SWITCH) and step is not Step.RESERVE:
            lost = sorted({u for p in rec.new_plans for u in lost_gpus(p, self.agents.snapshot())})
            if lost:
                return _Fail("preempted", f"preempted: GPU(s) {', '.join(lost[:4])} of the new plan(s) lost")
        if intent.pre:
            before = self._judge_commands(rec, cur, intent.pre, now)
            if not isinstance(before, _Ok):
                return before
        if effect == "reserve":
            if isinstance(local, list) and local:
                return _Fail("conflict", "reservation refused: " + "; ".join(local[:3]))
            return _Ok({"booked": {p: len(g) for p, g in intent.needs.items()}})
        if effect == "unreserve":
            return _Ok({"unbooked": list(intent.plan_ids)})
        if effect == "routing":
            assert intent.routes is not None  # noqa: S101
            state = local if isinstance(local, RoutingState) else self.routing.current(rec.deployment_id)
            if not state.same_routes(intent.routes):
                return _Fail("routing_raced", f"routing moved to version {state.version} under the step "
                                              f"(it built on {intent.base_version})")
            if step is Step.CANARY and now < cur.started_s + self.config.canary_dwell_s:
                return _Wait(cur.started_s + self.config.canary_dwell_s)
            return _Ok({"routing_version": state.version})
        return self._judge_commands(rec, cur, intent.commands, now)

    def _judge_commands(self, rec: TransitionRecord, cur: StepRecord, commands: Sequence[CommandIntent],
                        now: float) -> _Wait | _Ok | _Fail:
        results = self.agents.results([c.key for c in commands])
        snap = self.agents.snapshot()
        merged: dict[str, object] = {}
        pending: list[str] = []
        for c in commands:
            res = results.get(c.key)
            if res is not None and res.status == "failed":
                reason = str(res.result.get("reason", "failed")) if isinstance(res.result, Mapping) else "failed"
                return _Fail(reason, f"{c.kind.value} on {c.node_id}: {res.detail or reason}")
            if res is not None and res.status == "ok":
                _merge(merged, c, res.result)
                continue
            if c.node_id not in snap.node_by_id:
                if rec.phase in (Phase.CLEANUP, Phase.ROLLBACK):
                    _merge(merged, c, {"node_lost": True})
                    continue  # the node left: its GPUs, and whatever ran there, are gone
                return _Fail("node_lost", f"{c.kind.value}: node {c.node_id} is gone")
            pending.append(c.key)
        if not pending:
            return _Ok(merged)
        if now > cur.deadline_s:
            return _Fail("timeout", f"timed out after {cur.intent.timeout_s:.0f} s waiting for {len(pending)} "
                                    f"ack(s) ({pending[0]})")
        return _Wait(cur.deadline_s, tuple(pending))
