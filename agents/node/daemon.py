"""NodeAgent: one GPU node's agent - registers, reports, long-polls commands, runs plans, acks.

Threads: the caller's thread runs `run()` (register, then a report every `report_interval_s` or
at once after a command changed something); a poller long-polls the controller's commands; each
command runs on a small pool, with the commands of one plan one after another (a plan lock).

Invariants:
- A command id runs at most once. Its ack is kept (`acks`); the same id delivered again - after a
  lost ack, a re-poll, a restart of the controller - is answered with the kept ack and does
  nothing else. A command still running is not started twice.
- Each transition command is idempotent on the plan's state too (a retry is a new command id):
  prepare of a prepared plan acks ok at once; abort, thaw and release of a plan this node does not
  hold ack ok with `noop: true`; freeze of one acks no sequences; move names each sequence "gone".
- Node commands (verify_weights, probe_links, apply_hints) run outside every plan lock: they name
  no plan lock's key. apply_hints (scheduler/control/correction.py) keeps the hints in the node's
  HintBook and sets the batch-token threshold of each plan it leads whose engine has one (the
  torch engine: tokens per step; a vLLM server fixes max_num_batched_tokens when it starts, so its
  plans are listed `unknown`); each main-loop pass (`step`) returns an engine whose hint lapsed
  to its own threshold. The weight multiplier is the router's, not the node's: nothing here. Links to the peers `probe_links` named are probed again every FLEXPIPE_LINK_PROBE_S
  (agents/node/links.py) and every report carries the latest figure per peer.
- The registration and every report list the plans this node holds (`running_plans`). A plan whose
  engine failed for good is given up by the main loop (`_give_up_failed`): stopped, unbooked, not
  listed again - the controller replaces it (agents/protocol.py: what runs).
- Every ok-ack's result passes agents.protocol.check_result before it leaves; a result that would
  break the protocol is sent as a failed ack instead (reason "failed"), never half right.
- A plan's GPUs keep its reserve_bytes booked from prepare until abort or release; a prepare that
  fails books nothing. A prepare that would book more than 92% of a GPU beside what is used and
  booked there is refused (reason out_of_memory, scheduler.booking's words); one whose plan this
  node's engine cannot run is refused too (reason unsupported, scheduler.capabilities' words). Reports show booked memory as used (the static probe's GPUs have no real
  memory to measure; NVML measures what the engines really hold).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from agents.client import AgentClient, ControllerError
from agents.node.links import LinkProber
from agents.node.plans import Backend, ModelStore, PlanEngine
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
from scheduler.booking import REFUSAL_REASON, refuse_booking
from scheduler.capabilities import DEFAULT_CAPS, EngineCaps, engine_refusals
from scheduler.control.correction import HintBook, hints_from_payload
from scheduler.plan import Plan
from scheduler.refusal import Refused

log = logging.getLogger("agents.node")

AGENT_VERSION = "node-1"


@dataclass
class PlanSlot:
    """One plan this node holds part of."""

    deployment: str
    plan_id: str
    role: str  # leader | member
    reserve_bytes: dict[str, int]  # GPU uuid -> bytes booked for it
    engine: PlanEngine | None = None  # the leader's engine
    part: Any = None  # a member's stage workers of the plan (torch: agents.dataplane.stages.MemberStages)
    frozen: bool = False
    ready: bool = False  # the engine started (a vLLM server can take a minute): it has metrics to report
    load_s: float = 0.0
    prepared_at_s: float = 0.0


@dataclass
class NodeState:
    epoch: int = 0
    seq: int = 0
    report_interval_s: float = 15.0
    dirty: bool = True
    last_report_s: float = -1e18
    after_command: int = 0


@dataclass
class _Outcome:
    status: str
    detail: str = ""
    result: dict[str, Any] = field(default_factory=dict)


def _slo_ms(payload: dict[str, Any]) -> tuple[float, float] | None:
    """A prepare's optional slo (check_payload validated it: ttft_ms, tpot_ms > 0) as the host takes it."""
    slo = payload.get("slo")
    return (float(slo["ttft_ms"]), float(slo["tpot_ms"])) if isinstance(slo, dict) else None


def default_node_id() -> str:
    name = socket.gethostname().split(".")[0] or "node"
    return "".join(c if c.isalnum() or c in "._-" else "-" for c in name)[:64]


class NodeAgent:
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

    def booked(self) -> dict[str, int]:
        """GPU uuid -> bytes booked by the plans held now."""
        out: dict[str, int] = {}
        with self._lock:
            for slot in self.plans.values():
                for u, b in slot.reserve_bytes.items():
                    out[u] = out.get(u, 0) + b
        return out

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

    def _slot(self, key: tuple[str, str]) -> PlanSlot | None:
        with self._lock:
            return self.plans.get(key)

    def _prepare(self, key: tuple[str, str], p: dict[str, Any]) -> _Outcome:
        deployment, plan_id = key
        slot = self._slot(key)
        if slot is not None:
            return _Outcome("ok", "already prepared", {"plan_id": plan_id, "reserved_bytes": slot.reserve_bytes,
                                                      "load_s": slot.load_s, "already": True})
        want = {str(u): int(b) for u, b in p["reserve_bytes"].items()}
        self._check_engine(p)
        self._check_gpus(want)
        slot = PlanSlot(deployment, plan_id, str(p["role"]), want, prepared_at_s=self.clock())
        with self._lock:
            self.plans[key] = slot  # booked now, so a concurrent prepare sees the memory taken
        t0 = self.clock()
        try:
            if slot.role == "leader":
                if self.backend is None:
                    raise Refused(f"this node runs no engine backend ({self.backend_name})")
                engine = self.backend.make(deployment, p["plan"], plan_id, str(p["model"]), p.get("weights_sha256"),
                                           stages=list(p.get("stages") or []), peers=dict(p.get("peers") or {}),
                                           warmup_tokens=int((p.get("model_version") or {}).get("warmup_tokens", 1)),
                                           slo_ms=_slo_ms(p))
                slot.engine = engine
                engine.start()
            elif self.backend is not None:
                # Registered before the ack: the leader's engine asks for our ranks as soon as its own
                # prepare runs, and is told to retry (409) until this point.
                slot.part = self.backend.join(deployment, p["plan"], plan_id, str(p["model"]),
                                              p.get("weights_sha256"), stages=list(p.get("stages") or []),
                                              node_id=self.node_id)
        except Exception as exc:
            with self._lock:
                self.plans.pop(key, None)
            if slot.engine is not None:
                self._stop_engine(slot.engine)
            self._leave(slot)
            if isinstance(exc, Refused):
                raise
            log.exception("%s: prepare of %s failed", self.node_id, plan_id)
            raise Refused(f"plan {plan_id}: the engine did not start: {exc}") from exc
        slot.load_s = self.clock() - t0
        slot.ready = True
        log.info("%s: plan %s of %s prepared as %s in %.2f s", self.node_id, plan_id, deployment, slot.role,
                 slot.load_s)
        result: dict[str, Any] = {"plan_id": plan_id, "reserved_bytes": want, "load_s": round(slot.load_s, 4)}
        digest = self._weights_digest(str(p["model"]))
        if digest is not None:
            result["weights_sha256"] = digest  # hashed here before loading: the registry verifies the version
        checkout = getattr(slot.engine, "checkout", None) or getattr(slot.part, "checkout", None)
        if checkout is not None:
            result["weights_source"], result["weights_bytes"] = checkout.source, checkout.weights_bytes
        return _Outcome("ok", f"prepared ({slot.role}, weights from {result.get('weights_source', 'disk')})",
                        result)

    def _weights_digest(self, model: str) -> str | None:
        """What this node's model store computed for the weights it loaded (None when it hashed none)."""
        store = getattr(self.backend, "models", None)
        return store.digest_of(model) if isinstance(store, ModelStore) else None

    def _verify_weights(self, p: dict[str, Any]) -> _Outcome:
        """verify_weights: hash the weights this node holds for model `name` (agents/protocol.py).

        Ok with the digest whether or not it is the registry's (the console decides: verified or
        quarantined); failed when this node holds no such weights, naming the model and the folder.
        """
        name = str(p["name"])
        store = getattr(self.backend, "models", None)
        if not isinstance(store, ModelStore):
            raise Refused(f"model {name!r}: node {self.node_id} holds no model store (backend "
                          f"{self.backend_name}), so it has no weights to hash")
        weights, digest = store.hash_held(name)
        same = "the registry's" if digest == p["sha256"] else f"not the registry's {str(p['sha256'])[:16]}..."
        return _Outcome("ok", f"model {name!r}: {weights} has sha256 {digest[:16]}..., {same}", {"sha256": digest})

    def _probe_links(self, p: dict[str, Any]) -> _Outcome:
        """probe_links: measure the named peers now and keep probing them (agents/node/links.py)."""
        peers = {str(n): str(a) for n, a in dict(p["peers"]).items() if str(n) != self.node_id}
        self.links.tell(peers)
        if p.get("bulk_bytes"):
            self.links.bulk_bytes = int(p["bulk_bytes"])
        measured = self.links.probe()
        self.state.dirty = True  # the new figures go out with the next report at once
        detail = ", ".join(f"{r.peer} {r.bw_gbps:.2f} Gb/s" for r in measured) or "no peer answered"
        return _Outcome("ok", f"links measured: {detail}",
                        {"links": [{k: v for k, v in r.__dict__.items() if v is not None} for r in measured]})

    def _apply_hints(self, p: dict[str, Any]) -> _Outcome:
        """apply_hints: hold the hints; set each led plan's threshold where its engine has one."""
        deployment, version, ttl_s, hints = hints_from_payload(p)
        with self._lock:
            if not self.hints.apply(deployment, version, ttl_s, hints, self.clock()):
                held = self.hints.versions[deployment]
                return _Outcome("ok", f"hints {version} of {deployment} ignored: {held} is newer",
                                {"applied": False, "hints_version": held, "plans": [], "unknown": []})
            slots = {h.plan_id: self.plans.get((deployment, h.plan_id)) for h in hints}
            self._hinted.update((deployment, h.plan_id) for h in hints if slots[h.plan_id] is not None)
        took, unknown, why = [], [], []
        for h in hints:
            slot = slots[h.plan_id]
            setter = getattr(slot.engine, "set_batch_scale", None) if slot is not None else None
            if slot is None or slot.role != "leader" or setter is None:
                unknown.append(h.plan_id)
                if slot is not None and slot.role == "leader":
                    why.append(f"{h.plan_id}: its engine sets its batch threshold when it starts")
                continue
            setter(h.batch_scale)
            took.append(h.plan_id)
        detail = "; ".join([f"hints {version} of {deployment}: {len(took)} plan(s)", *why])
        return _Outcome("ok", detail, {"applied": True, "hints_version": version, "plans": took, "unknown": unknown})

    def _lapse_hints(self) -> None:
        """The local side of a global loop that went quiet: an engine whose hint lapsed goes back
        to its own threshold."""
        now = self.clock()
        with self._lock:
            lapsed = [k for k in self._hinted if self.hints.live(k[0], k[1], now) is None]
            self._hinted.difference_update(lapsed)
            slots = [self.plans.get(k) for k in lapsed]
        for slot in slots:
            setter = getattr(slot.engine, "set_batch_scale", None) if slot is not None else None
            if setter is not None:
                setter(None)

    def _reprobe(self) -> None:
        """The periodic link probe (FLEXPIPE_LINK_PROBE_S), on the command pool: never in the way of
        reports or commands."""
        def run() -> None:
            try:
                self.links.probe()
                self.state.dirty = True
            except Exception:  # noqa: BLE001 - a failed round must not kill the pool thread
                log.exception("%s: the periodic link probe failed", self.node_id)

        try:
            self._pool.submit(run)
        except RuntimeError:  # the pool is shut down: the agent is closing
            pass

    def _check_gpus(self, want: dict[str, int]) -> None:
        """Refused unless every GPU is ours, healthy, allocatable and has the memory free."""
        reports = {g.uuid: g for g in self.probe.report()}
        not_ours = sorted(u for u in want if u not in reports)
        if not_ours:
            raise Refused(f"GPU(s) {', '.join(not_ours)} are not on node {self.node_id}", "preempted", gpus=not_ours)
        lost = sorted(u for u in want if not reports[u].healthy or not reports[u].allocatable)
        if lost:
            raise Refused(f"GPU(s) {', '.join(lost)} are unhealthy or held by another tenant", "preempted",
                          gpus=lost)
        booked = self.booked() if self.book_memory else {}
        over = refuse_booking(want, {u: g.mem_used_bytes + booked.get(u, 0) for u, g in reports.items()},
                              {u: g.mem_total_bytes for u, g in reports.items()})
        if over is not None:
            # scheduler.booking: the words every agent (and the simulated ones) refuses with
            raise Refused(over.message(), REFUSAL_REASON, gpus=[over.gpu])

    def _check_engine(self, p: dict[str, Any]) -> None:
        """Refused unless this node's engine can run the plan (scheduler.capabilities: the
        planner's filter, in the same words)."""
        if self.capabilities is None:
            return
        try:
            plan = Plan.from_dict(p["plan"])
        except ValueError as exc:
            raise Refused(f"plan: {exc}", field="plan") from None
        nodes = sorted({self.node_id, *(str(n) for n in (p.get("peers") or {}))})
        problems = engine_refusals(plan, nodes, {self.node_id: self.capabilities})
        if problems:
            raise Refused("; ".join(problems), "unsupported")

    def _stop_engine(self, engine: PlanEngine) -> None:
        try:
            engine.stop()
        except Exception:  # noqa: BLE001 - stopping must go on for the other plans
            log.exception("%s: plan %s did not stop cleanly", self.node_id, engine.plan_id)
        if self.backend is not None:
            self.backend.forget(engine)

    def _leave(self, slot: PlanSlot) -> None:
        """Stop a member's stage workers of `slot`'s plan (none: nothing to do)."""
        part, slot.part = slot.part, None
        if part is not None and self.backend is not None:
            try:
                self.backend.leave(part)
            except Exception:  # noqa: BLE001 - stopping must go on for the other plans
                log.exception("%s: the stage workers of plan %s did not stop cleanly", self.node_id, slot.plan_id)

    def _give_up_failed(self) -> None:
        """Give up each plan whose engine failed for good (the vLLM watchdog's restarts ran out; a
        torch worker died, or the GPU under it): its engine stopped, its memory unbooked, its slot
        gone - so the report that follows at once no longer lists it and the controller replaces it
        (its undo commands then ack noop). Under the plan's lock; a command running on the plan
        (its release, its abort) ends it instead, or the next pass does."""
        with self._lock:
            failed = [k for k, s in self.plans.items() if s.ready and s.engine is not None and s.engine.failed]
        for key in failed:
            with self._lock:
                lock = self._plan_locks.setdefault(key, threading.Lock())
            if not lock.acquire(blocking=False):
                continue
            try:
                slot = self._drop(key)
                if slot is None:
                    continue
                log.warning("%s: plan %s of %s failed for good; given up", self.node_id, slot.plan_id,
                            slot.deployment)
                if slot.engine is not None:
                    self._stop_engine(slot.engine)
                self._leave(slot)
                with self._lock:
                    self._hinted.discard(key)
                    self.state.dirty = True
            finally:
                lock.release()

    def _drop(self, key: tuple[str, str]) -> PlanSlot | None:
        with self._lock:
            return self.plans.pop(key, None)

    def _abort(self, key: tuple[str, str], p: dict[str, Any]) -> _Outcome:
        slot = self._slot(key)
        if slot is None:
            return _Outcome("ok", "nothing to abort", {"plan_id": key[1], "failed": [], "noop": True})
        failed: list[str] = []
        if slot.engine is not None:
            r = slot.engine.release(float(p.get("drain_timeout_s", 0.0)), None)
            failed = [str(s) for s in r.get("failed", [])]
            self._stop_engine(slot.engine)
        self._leave(slot)
        self._drop(key)
        return _Outcome("ok", f"aborted: {p.get('reason', '')}"[:200], {"plan_id": key[1], "failed": failed})

    def _freeze(self, key: tuple[str, str], p: dict[str, Any]) -> _Outcome:
        slot = self._slot(key)
        if slot is None or slot.engine is None:
            return _Outcome("ok", "no such plan here: nothing in flight",
                            {"plan_id": key[1], "sequences": [], "noop": slot is None})
        result = slot.engine.freeze(int(p["routing_version"]))
        slot.frozen = True
        return _Outcome("ok", f"frozen with {len(result.get('sequences', []))} sequence(s)",
                        {**result, "plan_id": key[1]})

    def _thaw(self, key: tuple[str, str], p: dict[str, Any]) -> _Outcome:
        slot = self._slot(key)
        if slot is None or slot.engine is None:
            return _Outcome("ok", "nothing to thaw", {"plan_id": key[1], "noop": slot is None})
        slot.engine.thaw()
        slot.frozen = False
        return _Outcome("ok", "admitting again", {"plan_id": key[1]})

    def _move(self, key: tuple[str, str], p: dict[str, Any]) -> _Outcome:
        moves = [dict(m) for m in p.get("moves", [])]
        slot = self._slot(key)
        if slot is None or slot.engine is None:
            gone = [{"seq_id": m["seq_id"], "action": m["action"], "ok": True, "outcome": "gone",
                     "context_tokens": 0, "kv_bytes": 0, "replay_tokens": 0, "stall_s": 0.0} for m in moves]
            return _Outcome("ok", "no such plan here: every sequence is gone", {"plan_id": key[1], "moved": gone})
        result = {**slot.engine.move(moves, int(p["routing_version"])), "plan_id": key[1]}
        bad = [m for m in result.get("moved", []) if isinstance(m, dict) and m.get("ok") is False]
        if bad:
            reason = next((m["reason"] for m in bad if m.get("reason") in FAILURE_REASONS), "failed")
            detail = "; ".join(f"{m.get('seq_id')}: {m.get('error', m.get('reason', 'failed'))}" for m in bad[:5])
            return _Outcome("failed", f"{len(bad)} hand-over(s) failed: {detail}", {**result, "reason": reason})
        return _Outcome("ok", f"{len(result.get('moved', []))} sequence(s) handled", result)

    def _release(self, key: tuple[str, str], p: dict[str, Any]) -> _Outcome:
        slot = self._slot(key)
        if slot is None:
            return _Outcome("ok", "nothing to release", {"plan_id": key[1], "freed_bytes": 0, "failed": [],
                                                         "handed_over": [], "noop": True})
        result: dict[str, Any] = {"failed": [], "handed_over": []}
        if slot.engine is not None:
            result = dict(slot.engine.release(float(p.get("drain_timeout_s", 0.0)), p.get("fallback")))
            self._stop_engine(slot.engine)
        self._leave(slot)
        self._drop(key)
        freed = sum(slot.reserve_bytes.values())
        return _Outcome("ok", f"released, {freed} bytes freed", {**result, "plan_id": key[1], "freed_bytes": freed})


__all__ = ["AGENT_VERSION", "NodeAgent", "PlanSlot", "default_node_id"]
