"""The Django implementations of scheduler.transition's ports.

* `DjangoStore` (TransitionStore): Transition rows. `create` claims the next seq with a
  conditional update of Deployment.last_transition_seq and inserts the row (the partial unique
  index refuses a second active one even if the claim were bypassed). `save` is an UPDATE ...
  WHERE version = expected: nothing is saved twice, and a save lands entirely (row, step rows,
  audit entries, the deployment's current gear at DONE) or not at all.
* `DjangoAgentPort` (AgentPort): commands are console.fleet AgentCommand rows issued with the
  step's key (`do_issue_command` returns the existing row for a key seen before); the agent's
  long poll is woken on commit. Acks are read back from the rows; an ok-ack whose result breaks
  the protocol's schema counts as failed, naming the field.
* `DjangoRouting` (RoutingTable): Deployment.routing + routing_version, committed with
  UPDATE ... WHERE routing_version = expected.

Every effect first locks the transition row and checks the guard's version inside the same
database transaction, so an effect is either made while its step is the running one, or not at
all (StaleGuard): a worker that wakes up late cannot act for a step that is over.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from agents.protocol import SchemaError, check_result
from console.audit.chain import record
from console.fleet.actions import do_issue_command
from console.fleet.models import AgentCommand, Gpu, Node
from console.gearbox import live
from console.gearbox.models import ACTIVE_PHASES, Deployment, GpuReservation, Job, Transition, TransitionStep
from console.gearbox.snapshot import fleet_snapshot
from scheduler.plan import Gear
from scheduler.pool.sharing import sharing_conflicts
from scheduler.topology import Snapshot
from scheduler.transition import (
    CommandIntent,
    CommandResult,
    Guard,
    Route,
    RoutingState,
    StaleGuard,
    TransitionEvent,
    TransitionRecord,
)

SYSTEM = "system:transitions"


def _dt(t_s: float | None) -> datetime | None:
    return None if t_s is None else datetime.fromtimestamp(t_s, tz=UTC)


def _from_row(t: Transition) -> TransitionRecord:
    rec = TransitionRecord.from_dict(t.record)
    # the row's columns own these two: the version (conditional saves) and an operator's abort
    return replace(rec, version=t.version, abort_reason=t.abort_reason)


def _dep_pk(name: str) -> int:
    """The deployment's primary key (0 if unknown). Conditional updates and row locks filter on
    the transition table's own columns: an UPDATE ... WHERE id IN (a join) is not re-checked by
    PostgreSQL after it waited for a row lock, so two racing saves could both succeed."""
    pk = Deployment.objects.filter(name=name).values_list("pk", flat=True).first()
    return int(pk or 0)


def _lock_deployment(pk: int) -> None:
    """Lock order, in every transaction that writes transition state: the deployment row first,
    then its transition, then GPU rows, and the audit head (console.audit.chain) last. Operator
    actions take the deployment row first too, so a transaction of theirs and one of the
    executor's queue behind each other instead of deadlocking (one holding the audit head and
    waiting for the deployment, the other the reverse)."""
    list(Deployment.objects.select_for_update().filter(pk=pk).values_list("pk", flat=True))


def _lock(guard: Guard) -> Transition:
    """Lock the transition row if it is still at the guard's version (else StaleGuard)."""
    dep_pk = _dep_pk(guard.deployment_id)
    _lock_deployment(dep_pk)
    row = (Transition.objects.select_for_update()
           .filter(deployment_id=dep_pk, seq=guard.seq, version=guard.version).first())
    if row is None:
        raise StaleGuard(f"{guard.deployment_id}#{guard.seq} moved past version {guard.version}")
    return row


class DjangoStore:
    """TransitionStore over Transition rows (module docstring)."""

    def __init__(self, *, actor: str = SYSTEM) -> None:
        self.actor = actor

    def active(self, deployment_id: str) -> TransitionRecord | None:
        row = Transition.objects.filter(deployment__name=deployment_id, phase__in=ACTIVE_PHASES).first()
        return _from_row(row) if row is not None else None

    def load(self, deployment_id: str, seq: int) -> TransitionRecord | None:
        row = Transition.objects.filter(deployment__name=deployment_id, seq=seq).first()
        return _from_row(row) if row is not None else None

    def last_seq(self, deployment_id: str) -> int:
        value = Deployment.objects.filter(name=deployment_id).values_list("last_transition_seq", flat=True).first()
        return int(value or 0)

    def current_gear(self, deployment_id: str) -> Gear | None:
        raw = Deployment.objects.filter(name=deployment_id).values_list("current_gear", flat=True).first()
        return Gear.from_dict(raw) if raw else None

    def create(self, rec: TransitionRecord, events: Sequence[TransitionEvent]) -> bool:
        now = timezone.now()
        ref = rec.decision_ref or ""
        decision_id = int(ref) if ref.isdigit() else None
        actor: str | None = None
        try:
            with transaction.atomic():
                # the claim: only one caller moves last_transition_seq from seq - 1 to seq
                claimed = Deployment.objects.filter(name=rec.deployment_id, last_transition_seq=rec.seq - 1).update(
                    last_transition_seq=rec.seq, updated_at=now)
                if claimed != 1:
                    return False
                dep = Deployment.objects.get(name=rec.deployment_id)
                row = Transition.objects.create(
                    deployment=dep, seq=rec.seq, kind=rec.kind.value, phase=rec.phase.value, version=rec.version,
                    from_gear=rec.from_gear.to_dict() if rec.from_gear else None, to_gear=rec.to_gear.to_dict(),
                    decision_id=decision_id, record=rec.to_dict(), actor=actor or self.actor, created_at=now,
                    updated_at=now)
                self._audit(row, events, actor or self.actor)
        except IntegrityError:
            return False  # the partial unique index: another transition is active
        transaction.on_commit(lambda: live.push_transition(rec.deployment_id, rec.seq))
        return True

    def save(self, rec: TransitionRecord, *, expected_version: int,
             events: Sequence[TransitionEvent]) -> TransitionRecord | None:
        now = timezone.now()
        cur = rec.current
        dep_pk = _dep_pk(rec.deployment_id)
        with transaction.atomic():
            _lock_deployment(dep_pk)
            saved = replace(rec, version=expected_version + 1)
            n = Transition.objects.filter(deployment_id=dep_pk, seq=rec.seq, version=expected_version).update(
                version=expected_version + 1, record=saved.to_dict(), phase=rec.phase.value,
                step=cur.step.value if cur else "", attempt=cur.attempt if cur else 0, error=rec.error,
                kv_bytes_migrated=rec.moved.kv_bytes_migrated, tokens_replayed=rec.moved.tokens_replayed,
                seqs_migrated=rec.moved.seqs_migrated, seqs_replayed=rec.moved.seqs_replayed,
                seqs_finished=rec.moved.seqs_finished, seqs_failed=rec.moved.seqs_failed,
                stall_s_max=rec.moved.stall_s_max, updated_at=now, finished_at=_dt(rec.finished_s))
            if n != 1:
                return None
            row = Transition.objects.get(deployment_id=dep_pk, seq=rec.seq)
            if cur is not None:
                TransitionStep.objects.update_or_create(
                    transition=row, step=cur.step.value, attempt=cur.attempt,
                    defaults={"phase": cur.phase.value, "state": cur.state.value,
                              "started_at": _dt(cur.started_s) or now, "finished_at": _dt(cur.finished_s),
                              "note": cur.intent.note, "error": cur.error, "reason": cur.reason,
                              "commands": [c.key for c in cur.intent.pre + cur.intent.commands],
                              "result": _jsonable(cur.result)})
            if rec.phase.value == "done":
                self._commit_gear(row, rec, now)
            self._audit(row, events, self.actor)
        transaction.on_commit(lambda: live.push_transition(rec.deployment_id, rec.seq))
        return replace(saved, abort_reason=row.abort_reason)

    def _commit_gear(self, row: Transition, rec: TransitionRecord, now: datetime) -> None:
        """At DONE the target is the deployment's gear - and a rollout's version the one it serves."""
        dep = Deployment.objects.select_related("model_version").get(pk=row.deployment_id)
        changes: dict[str, object] = {"current_gear": rec.to_gear.to_dict(), "updated_at": now}
        version = row.model_version
        if version is not None and version.pk != dep.model_version_id:
            changes["model_version"] = version
            before = dep.model_version.version if dep.model_version is not None else None
            record("gearbox.version_rolled_out", actor=self.actor, at=now, deployment=dep.name,
                   transition_seq=row.seq, summary=f"{dep.name}: now serves {version.name} {version.version}"
                                                   f" (was {before or 'no registry version'})",
                   before={"model_version": before}, after={"model_version": version.version},
                   data={"model_version_id": version.pk, "sha256": version.sha256})
            from console.registry import live as registry_live

            for pk in {version.pk, dep.model_version_id} - {None}:
                transaction.on_commit(lambda pk=pk: registry_live.push_version(pk))
        Deployment.objects.filter(pk=row.deployment_id).update(**changes)

    def request_abort(self, deployment_id: str, seq: int, reason: str) -> bool:
        with transaction.atomic():
            dep_pk = _dep_pk(deployment_id)
            _lock_deployment(dep_pk)
            row = (Transition.objects.select_for_update()
                   .filter(deployment_id=dep_pk, seq=seq, phase__in=ACTIVE_PHASES).first())
            if row is None:
                return False
            if not row.abort_reason:
                Transition.objects.filter(pk=row.pk).update(abort_reason=reason, version=F("version") + 1,
                                                            updated_at=timezone.now())
                record("gearbox.transition_abort_requested", actor=self.actor, at=timezone.now(),
                       summary=f"{deployment_id} transition #{seq}: roll back requested ({reason[:120]})",
                       deployment=deployment_id, transition_seq=seq, decision_id=row.decision_id,
                       data={"reason": reason, "phase": row.phase})
        return True

    def reserve(self, guard: Guard, needs: Mapping[str, Mapping[str, int]]) -> list[str]:
        with transaction.atomic():
            row = _lock(guard)
            gpus = sorted({u for plan in needs.values() for u in plan})
            # lock the GPUs' rows (in one order): two deployments booking one GPU queue up here
            list(Gpu.objects.select_for_update().filter(uuid__in=gpus).order_by("uuid").values_list("pk", flat=True))
            holders: dict[str, set[str]] = {u: set() for u in gpus}
            for u, name in GpuReservation.objects.filter(gpu_uuid__in=gpus).values_list("gpu_uuid", "deployment__name"):
                holders[u].add(name)
            conflicts = sharing_conflicts(guard.deployment_id, holders, int(settings.FLEXPIPE_MAX_MODELS_PER_GPU))
            # a fine-tune or batch job books its GPUs whole: nothing is booked beside it (the tick asks
            # it to yield before it starts a transition there: console/gearbox/admission.py)
            for job, uuids in Job.objects.filter(state__in=Job.HOLDING).values_list("name", "gpu_uuids"):
                conflicts += [f"GPU {u} is held by job {job} (it yields first)" for u in sorted(set(uuids) & set(gpus))]
            if conflicts:
                return conflicts
            now = timezone.now()
            for plan_id, per_gpu in needs.items():
                for u, b in per_gpu.items():
                    GpuReservation.objects.get_or_create(
                        gpu_uuid=u, deployment_id=row.deployment_id, plan_id=plan_id,
                        defaults={"mem_bytes": b, "transition_seq": guard.seq, "created_at": now})
        return []

    def unreserve(self, guard: Guard, plan_ids: Sequence[str]) -> None:
        with transaction.atomic():
            row = _lock(guard)
            GpuReservation.objects.filter(deployment_id=row.deployment_id, plan_id__in=list(plan_ids)).delete()

    def _audit(self, row: Transition, events: Sequence[TransitionEvent], actor: str) -> None:
        """One audit entry per event, linked to the transition and its decision (invariant 7 chain)."""
        for ev in events:
            what = {"created": "transition created", "step_started": f"{ev.step} started (attempt {ev.attempt})",
                    "step_ok": f"{ev.step} ok", "step_failed": f"{ev.step} failed (attempt {ev.attempt})",
                    "step_abandoned": f"{ev.step} given up", "phase": f"phase {ev.phase.value}",
                    "finished": f"finished: {ev.phase.value}"}[ev.kind]
            record(f"gearbox.transition_{ev.kind}", actor=actor, at=_dt(ev.t_s) or timezone.now(),
                   summary=f"{ev.deployment_id} transition #{ev.seq}: {what}" + (f" - {ev.detail}" if ev.detail else ""),
                   deployment=ev.deployment_id, transition_seq=ev.seq, decision_id=row.decision_id,
                   data={"phase": ev.phase.value, "step": ev.step.value if ev.step else None, "attempt": ev.attempt,
                         "detail": ev.detail, "kind": row.kind})


class DjangoAgentPort:
    """AgentPort over console.fleet's command rows (module docstring)."""

    def __init__(self, *, clock: Callable[[], float] = time.time, snapshot_ttl_s: float = 0.5) -> None:
        self.clock = clock
        self.snapshot_ttl_s = snapshot_ttl_s
        self._snap: tuple[float, Snapshot] | None = None

    def send(self, commands: Sequence[CommandIntent], guard: Guard) -> None:
        now = timezone.now()
        with transaction.atomic():
            _lock(guard)
            nodes = {n.node_id: n for n in Node.objects.filter(node_id__in={c.node_id for c in commands})}
            for c in commands:
                node = nodes.get(c.node_id)
                if node is None:
                    continue  # the node is gone: the step sees it in the snapshot and decides
                do_issue_command(node, key=c.key, kind=c.kind.value, payload=c.payload, now=now,
                                 deployment=c.deployment_id, transition_seq=c.seq, step=c.step.value)

    def results(self, keys: Sequence[str]) -> Mapping[str, CommandResult]:
        out: dict[str, CommandResult] = {}
        for cmd in AgentCommand.objects.filter(key__in=list(keys)):
            status = {"pending": "pending", "delivered": "pending", "running": "running", "ok": "ok",
                      "failed": "failed"}[cmd.state]
            result = cmd.result if isinstance(cmd.result, dict) else {}
            if status == "ok":
                try:
                    check_result(cmd.kind, result)
                except SchemaError as exc:
                    out[cmd.key] = CommandResult(cmd.key, "failed", f"the agent's answer breaks the protocol: {exc}",
                                                 {"reason": "failed"})
                    continue
            out[cmd.key] = CommandResult(cmd.key, status, cmd.detail, result)  # type: ignore[arg-type]
        return out

    def snapshot(self) -> Snapshot:
        now = self.clock()
        if self._snap is None or now - self._snap[0] > self.snapshot_ttl_s:
            self._snap = (now, fleet_snapshot(datetime.fromtimestamp(now, tz=UTC)))
        return self._snap[1]

    def data_addr(self, node_id: str) -> str:
        return str(Node.objects.filter(node_id=node_id).values_list("data_addr", flat=True).first() or "")


class DjangoRouting:
    """RoutingTable over Deployment.routing (module docstring)."""

    def __init__(self, *, actor: str = SYSTEM) -> None:
        self.actor = actor

    def current(self, deployment_id: str) -> RoutingState:
        row = Deployment.objects.filter(name=deployment_id).values("routing_version", "routing").first()
        if row is None:
            return RoutingState(deployment_id, 0, ())
        return RoutingState(deployment_id, row["routing_version"],
                            tuple(Route.from_dict(r, f"routing[{i}]") for i, r in enumerate(row["routing"])))

    def commit(self, deployment_id: str, expected_version: int, routes: Sequence[Route],
               guard: Guard) -> RoutingState | None:
        with transaction.atomic():
            row = _lock(guard)
            body = [r.to_dict() for r in routes]
            n = Deployment.objects.filter(name=deployment_id, routing_version=expected_version).update(
                routing_version=expected_version + 1, routing=body, updated_at=timezone.now())
            if n != 1:
                return None
            record("gearbox.routing_committed", actor=self.actor, at=timezone.now(),
                   summary=f"{deployment_id} routing v{expected_version + 1}: "
                           + ", ".join(f"{r.plan.shape()} {r.weight:.0%}{' frozen' if r.frozen else ''}"
                                       for r in routes),
                   deployment=deployment_id, transition_seq=guard.seq, decision_id=row.decision_id,
                   data={"step": row.step, "attempt": row.attempt},
                   before={"version": expected_version}, after={"version": expected_version + 1, "routes": [
                       {"plan_id": r.plan_id, "weight": r.weight, "frozen": r.frozen} for r in routes]})
        transaction.on_commit(lambda: live.push_routing(deployment_id))
        return RoutingState(deployment_id, expected_version + 1, tuple(routes))


def _jsonable(value: Mapping[str, object]) -> dict[str, object]:
    return {str(k): v for k, v in value.items()}


__all__ = ["DjangoAgentPort", "DjangoRouting", "DjangoStore"]
