"""NodeAgent: one GPU node's agent - registers, reports, long-polls commands, runs plans, acks.

Threads: the caller's thread runs `run()` (register, then a report every `report_interval_s` or
at once after a command changed something); a poller long-polls the controller's commands; each
command runs on a small pool, with the commands of one plan one after another (a plan lock).

The handlers of the commands are NodeAgent's mixins: agents/node/plan_commands.py (a plan's
transition commands, the plans this node holds and the memory booked for them) and
agents/node/node_commands.py (verify_weights, probe_links, apply_hints); agents/node/state.py holds
what they share. This module holds the lifecycle, the transport and the reports.

Invariants:
- A command id runs at most once. Its ack is kept (`acks`); the same id delivered again - after a
  lost ack, a re-poll, a restart of the controller - is answered with the kept ack and does
  nothing else. A command still running is not started twice.
- The registration and every report list the plans this node holds (`running_plans`). A plan whose
  engine failed for good is given up by the main loop (`_give_up_failed`): stopped, unbooked, not
  listed again - the controller replaces it (agents/protocol/: what runs).
- Every ok-ack's result passes agents.protocol.check_result before it leaves; a result that would
  break the protocol is sent as a failed ack instead (reason "failed"), never half right.
- Reports show booked memory as used (the static probe's GPUs have no real memory to measure; NVML
  measures what the engines really hold).
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import httpx

from agents.client import AgentClient, ControllerError
from agents.node.links import LinkProber
from agents.node.node_commands import NodeCommands
from agents.node.plan_commands import PlanCommands
from agents.node.plans import Backend
from agents.node.state import NodeState, PlanSlot, _Outcome
from agents.probes import Probe
from agents.protocol import (
    FAILURE_REASONS,
    NODE_KINDS,
    Ack,
    CollectiveReport,
    Command,
    CommandKind,
    EngineReport,
    GpuReport,
    NodeCommandKind,
    RegisterRequest,
    Report,
    SchemaError,
    check_payload,
    check_result,
)
from scheduler.capabilities import DEFAULT_CAPS, EngineCaps
from scheduler.control.correction import HintBook
from scheduler.refusal import Refused

log = logging.getLogger("agents.node")

AGENT_VERSION = "node-1"


def default_node_id() -> str:
    name = socket.gethostname().split(".")[0] or "node"
    return "".join(c if c.isalnum() or c in "._-" else "-" for c in name)[:64]


class NodeAgent(PlanCommands, NodeCommands):
    """The agent daemon of one node (module docstring)."""

    def __init__(self, *, controller: str, join_token: str, probe: Probe, backend: Backend | None,
                 backend_name: str, node_id: str, data_addr: str | None = None, hostname: str | None = None,
                 rack: str | None = None, long_poll_s: float = 10.0, report_interval_s: float | None = None,
                 book_memory: bool = True, workers: int = 4, clock: Callable[[], float] = time.monotonic,
                 token_file: Path | None = None, capabilities: EngineCaps | None = None,
                 links: LinkProber | None = None) -> None:
        self.controller = controller
        self.join_token = join_token
        self.probe = probe
        self.backend = backend
        self.backend_name = backend_name
        self.node_id = node_id
        self.data_addr = data_addr
        self.hostname = hostname or socket.gethostname()
        self.rack = rack
        self.long_poll_s = long_poll_s
        self.fixed_interval_s = report_interval_s
        self.book_memory = book_memory  # add booked memory to what the probe reports as used
        # what its engine can run (reported at registration; PREPAREs beyond it are refused)
        self.capabilities = capabilities if capabilities is not None else DEFAULT_CAPS.get(backend_name)
        self.links = links if links is not None else LinkProber()  # links to peers (probe_links, periodic)
        # collective sweeps measured on this node's GPUs (agents/probes/collectives.py), reported as they are
        self.collectives: tuple[CollectiveReport, ...] = ()
        self.clock = clock
        self.state = NodeState()
        self.client = AgentClient(controller, join_token, token_file=token_file)
        self.plans: dict[tuple[str, str], PlanSlot] = {}
        self.hints = HintBook()  # the global correction's hints (apply_hints)
        self._hinted: set[tuple[str, str]] = set()  # plans whose engine runs a hinted threshold now
        self.acks: dict[int, Ack] = {}  # command id -> the ack sent (or to send)
        self.executed: Counter[str] = Counter()  # command kinds actually run (not answered from `acks`)
        self.timings: dict[int, float] = {}  # command id -> seconds it took
        self._running: set[int] = set()
        self._plan_locks: dict[tuple[str, str], threading.Lock] = {}
        self._lock = threading.Lock()  # plans, acks, _running, the state
        self._http_lock = threading.Lock()  # self.client is used by the report loop and the ack senders
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"cmd-{node_id}")
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        self._unsent: list[tuple[int, Ack]] = []

    # -- registration and reports -----------------------------------------------------------------
    def register(self) -> None:
        held = self.running_plans()  # nothing after a restart: the controller drops the rest from its gears
        req = RegisterRequest(node_id=self.node_id, hostname=self.hostname[:255], agent_version=AGENT_VERSION,
                              gpus=self.probe.gpus(), rack=self.rack, backends=(self.backend_name,),
                              data_addr=self.data_addr, plans=held,
                              capabilities={self.backend_name: self.capabilities.to_dict()}
                              if self.capabilities is not None else None)
        with self._http_lock:
            resp = self.client.register(req)
        with self._lock:
            self.state.epoch, self.state.seq, self.state.dirty = resp.epoch, 0, True
            self.state.report_interval_s = self.fixed_interval_s or resp.report_interval_s
        log.info("%s registered (epoch %d, %d GPUs, report every %g s)", self.node_id, resp.epoch,
                 len(req.gpus), self.state.report_interval_s)

    def _serve_data(self) -> None:
        """Start this node's data server before registering: peers probe the link to it (and
        send it KV) as soon as the controller names it."""
        serve = getattr(self.backend, "server", None)
        if callable(serve) and self.data_addr:
            try:
                serve()
            except OSError as exc:
                log.warning("%s: data server on %s not started: %s", self.node_id, self.data_addr, exc)

    def gpu_reports(self) -> tuple[GpuReport, ...]:
        reports = self.probe.report()
        if not self.book_memory:
            return reports
        booked = self.booked()
        return tuple(replace(g, mem_used_bytes=min(g.mem_total_bytes, g.mem_used_bytes + booked.get(g.uuid, 0)))
                     for g in reports)

    def engine_reports(self) -> tuple[EngineReport, ...]:
        with self._lock:
            engines = [s.engine for s in self.plans.values() if s.engine is not None and s.ready]
        out = []
        for engine in engines:
            try:
                out.append(engine.report())
            except Exception as exc:  # noqa: BLE001 - one engine's bad metrics must not stop the node's report
                log.warning("%s: no report from plan %s: %s", self.node_id, engine.plan_id, exc)
        return tuple(out)

    def running_plans(self) -> tuple[str, ...]:
        """The plans this node holds part of now, as leader or member: what its registration and
        every report list (agents.protocol: a plan not listed is one the controller replaces)."""
        with self._lock:
            return tuple(sorted({slot.plan_id for slot in self.plans.values()}))

    def report(self) -> None:
        with self._lock:
            self.state.seq += 1
            epoch, seq = self.state.epoch, self.state.seq
        body = Report(node_id=self.node_id, epoch=epoch, seq=seq, gpus=self.gpu_reports(),
                      engines=self.engine_reports(), links=self.links.reports(),
                      collectives=self.collectives, plans=self.running_plans())
        with self._http_lock:
            self.client.report(body)
        with self._lock:
            self.state.dirty = False
            self.state.last_report_s = self.clock()

    def _recover(self, exc: ControllerError) -> None:
        if exc.status == 401:
            # The controller forgot us (a fresh database): enroll again with the join token.
            log.warning("%s: %s; enrolling again", self.node_id, exc)
            self.client.token = self.join_token
            self.state.epoch = 0
        elif exc.status == 409:
            log.warning("%s: %s; registering again", self.node_id, exc)
            self.state.epoch = 0
        else:
            log.error("%s: %s", self.node_id, exc)

    def step(self) -> None:
        """One pass of the main loop: (re)register, acks left unsent, a report when due."""
        try:
            if self.state.epoch == 0:
                self._serve_data()
                self.register()
                self._start_poller()
            self._flush_acks()
            self._give_up_failed()
            self._lapse_hints()
            if self.links.due():
                self._reprobe()
            due = self.clock() - self.state.last_report_s >= self.state.report_interval_s
            if self.state.dirty or due:
                self.report()
        except ControllerError as exc:
            self._recover(exc)
        except httpx.HTTPError as exc:
            log.warning("%s: controller unreachable (%s)", self.node_id, exc.__class__.__name__)
            self.state.dirty = True

    def run(self, tick_s: float = 0.2) -> None:
        """Until stop(): step every `tick_s`."""
        while not self._stop.is_set():
            self.step()
            self._stop.wait(tick_s)

    def stop(self) -> None:
        self._stop.set()

    def wait(self, timeout_s: float) -> bool:
        """Sleep up to `timeout_s`; True once stop() was called."""
        return self._stop.wait(timeout_s)

    def close(self, stop_engines: bool = True) -> None:
        """Stop the loops; stop every engine this node runs (its GPUs come back free).

        Engines first: a supervisor (honcho, systemd) gives a few seconds after SIGTERM, and the
        poller may sit in a long poll for `long_poll_s` - it is a daemon thread, left to end with
        the process when it does not answer within a second.
        """
        self._stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        if stop_engines:
            with self._lock:
                slots = list(self.plans.values())
                self.plans.clear()
            for slot in slots:
                if slot.engine is not None:
                    self._stop_engine(slot.engine)
                self._leave(slot)
        if self.backend is not None:
            self.backend.close()
        if self._poller is not None:
            self._poller.join(timeout=1.0)
        self.client.close()
        self.probe.close()

    # -- commands in ----------------------------------------------------------------------------------
    def _start_poller(self) -> None:
        if self._poller is None and self.long_poll_s > 0:
            self._poller = threading.Thread(target=self._poll_loop, name=f"poll-{self.node_id}", daemon=True)
            self._poller.start()

    def _poll_loop(self) -> None:
        client = AgentClient(self.controller, self.client.token)
        try:
            while not self._stop.is_set():
                client.token = self.client.token
                try:
                    cmds = client.pull_commands(self.state.after_command, self.long_poll_s)
                except (ControllerError, httpx.HTTPError) as exc:
                    if self._stop.is_set():
                        return
                    log.debug("%s: command poll failed (%s)", self.node_id, exc)
                    self._stop.wait(1.0)
                    continue
                if self._stop.is_set():
                    return  # closing: the pool takes nothing new; the console's step timeout resends them
                for c in cmds:
                    self.state.after_command = max(self.state.after_command, c.id)
                    self.submit(c)
        finally:
            client.close()

    def submit(self, cmd: Command) -> None:
        """Run a pulled command on the pool (once per id; a repeated id re-sends its kept ack)."""
        with self._lock:
            kept = self.acks.get(cmd.id)
            if kept is None:
                if cmd.id in self._running:
                    return
                self._running.add(cmd.id)
        if kept is not None:
            self._send_ack(cmd.id, kept)
            return
        log.info("%s <- %s %s (%s #%s %s)", self.node_id, cmd.id, cmd.kind, cmd.deployment, cmd.transition_seq,
                 cmd.step)
        self._pool.submit(self._run_and_ack, cmd)

    def _run_and_ack(self, cmd: Command) -> None:
        try:
            ack = self.handle(cmd)
        except Exception:  # noqa: BLE001 - a bug in one command must not kill the pool thread silently
            log.exception("%s: command %s crashed", self.node_id, cmd.id)
            ack = Ack("failed", "the agent crashed running it; see its log", {"reason": "failed"})
            with self._lock:
                self.acks[cmd.id] = ack
                self._running.discard(cmd.id)
        self._send_ack(cmd.id, ack)

    def _send_ack(self, command_id: int, ack: Ack) -> None:
        try:
            with self._http_lock:
                self.client.ack(command_id, ack)
            log.info("%s -> ack %s %s %s", self.node_id, command_id, ack.status, ack.detail[:100])
        except ControllerError as exc:
            log.warning("%s: ack of command %s refused: %s", self.node_id, command_id, exc)
        except httpx.HTTPError as exc:
            log.warning("%s: ack of command %s not delivered (%s); keeping it", self.node_id, command_id,
                        exc.__class__.__name__)
            with self._lock:
                self._unsent.append((command_id, ack))
        self.state.dirty = True  # what the command did (memory booked or freed) is reported at once

    def _flush_acks(self) -> None:
        with self._lock:
            unsent, self._unsent = self._unsent, []
        for cid, ack in unsent:
            self._send_ack(cid, ack)

    # -- running one command ----------------------------------------------------------------------------
    def handle(self, cmd: Command) -> Ack:
        """Run `cmd` once and return its ack; the same id again returns the kept ack (module docstring)."""
        with self._lock:
            kept = self.acks.get(cmd.id)
            if kept is not None:
                self._running.discard(cmd.id)
                return kept
            self._running.add(cmd.id)
        started = self.clock()
        try:
            out = self._execute(cmd)
        except Refused as exc:
            if type(exc) is not Refused:
                # a data plane's own answer (agents.dataplane.errors) that escaped the command: a
                # crash of it, as before they were one Refused (`_run_and_ack`)
                raise
            out = _Outcome("failed", exc.reason, {"reason": exc.code, **({"gpus": exc.gpus} if exc.gpus else {}),
                                                  **exc.detail})
        if out.status == "ok":
            try:
                check_result(cmd.kind, out.result)
            except SchemaError as exc:
                out = _Outcome("failed", f"the engine's answer breaks the protocol: {exc}", {"reason": "failed"})
        elif out.result.get("reason") not in FAILURE_REASONS:
            out.result["reason"] = "failed"
        ack = Ack(out.status, out.detail[:2000], out.result)
        with self._lock:
            self.acks[cmd.id] = ack
            self._running.discard(cmd.id)
            self.timings[cmd.id] = self.clock() - started
        return ack

    def _execute(self, cmd: Command) -> _Outcome:
        try:
            payload = check_payload(cmd.kind, cmd.payload)
        except SchemaError as exc:  # an unknown kind too, named "kind"
            return _Outcome("failed", "; ".join(f"{k}: {v}" for k, v in exc.errors.items()), {"reason": "failed"})
        if cmd.kind in NODE_KINDS:
            # About the node, not a plan: no plan lock (the payload names no deployment or plan_id).
            self.executed[cmd.kind] += 1
            return {NodeCommandKind.VERIFY_WEIGHTS: self._verify_weights,
                    NodeCommandKind.PROBE_LINKS: self._probe_links,
                    NodeCommandKind.APPLY_HINTS: self._apply_hints}[NodeCommandKind(cmd.kind)](payload)
        kind = CommandKind(cmd.kind)
        key = (str(payload["deployment"]), str(payload["plan_id"]))
        with self._lock:
            lock = self._plan_locks.setdefault(key, threading.Lock())
        with lock:
            self.executed[kind.value] += 1
            handler = {
                CommandKind.PREPARE_PLAN: self._prepare,
                CommandKind.ABORT_PLAN: self._abort,
                CommandKind.FREEZE_PLAN: self._freeze,
                CommandKind.THAW_PLAN: self._thaw,
                CommandKind.MOVE_SEQUENCES: self._move,
                CommandKind.RELEASE_PLAN: self._release,
            }[kind]
            return handler(key, payload)


__all__ = ["AGENT_VERSION", "NodeAgent", "PlanSlot", "default_node_id"]
