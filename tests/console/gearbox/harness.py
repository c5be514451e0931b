"""Django-side transition tests: a fleet in the database, and simulated agents acting on it.

`enroll_fleet` registers nodes and reports their GPUs through console.fleet's actions, as
agents would. `DbAgents` is agents.sim.world's mailbox over the AgentCommand rows: it
takes each node's open commands (as the long poll hands them out) and answers through
do_ack_command - the same action the HTTP ack endpoint calls, which also sends command_acked.
`django_log` rebuilds the invariant checker's event log from the audit chain and the command
rows, so a run through Django (or through a Celery worker) is checked like an in-memory one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from datetime import datetime

from django.utils import timezone

from agents.protocol import GpuInfo, GpuReport, NodeCommandKind, RegisterRequest, Report
from agents.sim.world import SimWorld
from console.audit.models import AuditEntry
from console.fleet.actions import (
    do_ack_command,
    do_ingest_report,
    do_register_node,
    mark_delivered,
    open_commands,
)
from console.fleet.models import AgentCommand, Node
from console.gearbox.actions import do_sync_deployment
from console.gearbox.models import Deployment
from console.gearbox.ports import DjangoRouting
from console.gearbox.snapshot import fleet_snapshot
from scheduler.invariants import EventLog, LogEvent
from scheduler.modelspec import model_spec
from scheduler.plan import Gear, Plan, Stage
from scheduler.transition import CommandIntent, CommandKind, CommandStatus, Step
from tests.builders import JOIN_TOKEN

M8 = model_spec("Llama-3-8B")
GIB = 2**30


def uuid(node: str, i: int) -> str:
    return f"GPU-{node}-{i}"


def gear(node: str, gpus: list[int], kv: int = 200_000) -> Gear:
    plan = Plan(M8.name, "colocated", (Stage(0, M8.num_layers, tuple(uuid(node, i) for i in gpus)),),
                kv_reserve_tokens=kv)
    return Gear(M8.name, (plan,), (1.0,))


class FleetReporter:
    """Reports for enrolled nodes, the way agents send them (epoch, increasing seq)."""

    def __init__(self) -> None:
        self.seq: dict[str, int] = {}
        self.gone: set[str] = set()  # GPUs another tenant holds
        self.extra: dict[str, int] = {}  # bytes our plans hold per GPU

    def report(self, node_id: str, gpus: int = 8, plans: Iterable[str] | None = None) -> None:
        """`plans`: what the agent says it runs (None: it does not say, as an older agent)."""
        node = Node.objects.get(node_id=node_id)
        self.seq[node_id] = self.seq.get(node_id, 0) + 1
        total = 80 * GIB
        reports = tuple(GpuReport(uuid(node_id, i), min(total, 600 * 2**20 + self.extra.get(uuid(node_id, i), 0)),
                                  total, 0.1, 40.0, True, uuid(node_id, i) not in self.gone) for i in range(gpus))
        do_ingest_report(node, Report(node_id, node.epoch, self.seq[node_id], reports,
                                      plans=None if plans is None else tuple(sorted(plans))), now=timezone.now())


def enroll_fleet(nodes: Mapping[str, str] | None = None, gpus: int = 8) -> FleetReporter:
    """Register nodes (id -> rack) with H100s in one NVLink domain each, and report them once."""
    rep = FleetReporter()
    for node_id, rack in (nodes or {"a1": "A", "b1": "B"}).items():
        req = RegisterRequest(node_id, f"{node_id}.test", "test",
                              tuple(GpuInfo(uuid(node_id, i), i, "H100-SXM", 80 * GIB, "nvl0") for i in range(gpus)),
                              rack=rack, data_addr=f"{node_id}.test:7070")
        do_register_node(req, token=JOIN_TOKEN, now=timezone.now())
        rep.report(node_id, gpus)
    return rep


def make_deployment(name: str = "chat", baseline: Gear | None = None, **kw: object) -> Deployment:
    dep, _ = do_sync_deployment(name=name, model_name=M8.name, ttft_ms=2000, tpot_ms=100, priority=0,
                                baseline=baseline or gear("a1", [0, 1]), actor="system:test", **kw)  # type: ignore[arg-type]
    return dep


class DbAgents:
    """The simulated agents' mailbox over AgentCommand rows (module docstring)."""

    def __init__(self) -> None:
        self.after: dict[str, int] = {}
        self.ids: dict[str, tuple[str, int]] = {}

    def take(self, node_id: str) -> list[CommandIntent]:
        node = Node.objects.filter(node_id=node_id).first()
        if node is None:
            return []
        cmds = open_commands(node, self.after.get(node_id, 0))
        if cmds:
            mark_delivered(cmds, now=timezone.now())
            self.after[node_id] = max(c.id for c in cmds)
        out = []
        for c in cmds:
            key = f"cmd-{c.id}"
            self.ids[key] = (node_id, c.id)
            if c.kind == NodeCommandKind.PROBE_LINKS.value:
                # the simulated agents measure no link (the snapshot assumes the rack defaults)
                self.ack(key, "ok", "simulated: no link measured", {"links": []})
                continue
            out.append(CommandIntent(key, node_id, CommandKind(c.kind), dict(c.payload), c.deployment,
                                     c.transition_seq or 0, Step(c.step), 1))
        return out

    def ack(self, key: str, status: CommandStatus, detail: str = "", result: Mapping[str, object] | None = None
            ) -> None:
        node_id, cid = self.ids[key]
        do_ack_command(Node.objects.get(node_id=node_id), cid, status=status, detail=detail,
                       result=json.loads(json.dumps(dict(result or {}))), now=timezone.now())


class SimAgents:
    """Every enrolled node's agent and engines (agents.sim.world.SimWorld: the one simulator) on the
    wall clock, acting through the DB."""

    def __init__(self, *, seed: int = 3) -> None:
        self.log = EventLog()
        self.mailbox = DbAgents()
        self.routing = DjangoRouting()
        # the fleet's clock is the wall clock, so its events merge with the console's in time order
        now = timezone.now()
        self.fleet = SimWorld(fleet_snapshot(now), self.mailbox, self.routing.current, self.log, seed=seed,
                              start_s=now.timestamp())

    def now_s(self) -> float:
        return time.time()

    def run(self, seconds: float = 0.0) -> None:
        self.fleet.advance_to(self.now_s() + seconds)

    def run_out(self, max_s: float = 3600.0) -> None:
        """Simulate ahead of the wall clock until every admitted request has ended (at most
        `max_s` simulated seconds): for when nothing else acts any more."""
        end = self.now_s() + max_s
        t = self.now_s()
        while self.fleet.open_sequences() and t < end:
            t += 10.0
            self.fleet.advance_to(t)


def _t(at: datetime) -> float:
    return at.timestamp()


def django_log(deployment: str, agents_log: EventLog | None = None) -> list[LogEvent]:
    """The checker's event log of a deployment, from the audit chain and the command rows."""
    events: list[tuple[float, int, LogEvent]] = []
    kinds = {"gearbox.transition_created": "created", "gearbox.transition_step_started": "step_started",
             "gearbox.transition_step_ok": "step_ok", "gearbox.transition_step_failed": "step_failed",
             "gearbox.transition_step_abandoned": "step_abandoned", "gearbox.transition_phase": "phase",
             "gearbox.transition_finished": "finished"}
    for e in AuditEntry.objects.filter(deployment=deployment).order_by("seq"):
        body = json.loads(e.body)
        data = body.get("data") or {}
        if e.event_type in kinds:
            events.append((_t(e.at), e.seq, LogEvent(_t(e.at), kinds[e.event_type], deployment=deployment,  # type: ignore[arg-type]
                                                     seq=e.transition_seq or 0, step=data.get("step") or "",
                                                     attempt=data.get("attempt") or 0, phase=data.get("phase") or "")))
        elif e.event_type == "gearbox.routing_committed":
            after = body.get("after") or {}
            events.append((_t(e.at), e.seq, LogEvent(
                _t(e.at), "routing_committed", deployment=deployment, seq=e.transition_seq or 0,
                step=data.get("step", ""), attempt=data.get("attempt", 0), version=after.get("version", 0),
                plans=tuple((r["plan_id"], r["weight"], r["frozen"]) for r in after.get("routes", [])))))
    for c in AgentCommand.objects.filter(deployment=deployment):
        parts = c.key.split("/")
        attempt = int(parts[3]) if len(parts) > 3 and parts[3].isdigit() else 0
        events.append((_t(c.created_at), 0, LogEvent(_t(c.created_at), "command_issued", deployment=deployment,
                                                     seq=c.transition_seq or 0, step=c.step, attempt=attempt,
                                                     node=c.node.node_id, plan_id=str(c.payload.get("plan_id", "")))))
    for e in agents_log or ():
        events.append((e.t_s, 0, e))
    events.sort(key=lambda x: (x[0], x[1]))
    return [e for _, _, e in events]
