"""DataServer: one per node, an HTTP server on the node's data address serving all its plans.

Endpoints (NDJSON over chunked HTTP/1.1: one JSON object per line):

    POST /data/v1/generate
         {deployment, plan_id, seq_id, prompt_ids, max_tokens, sampling?, routing_version?, priority?}
         (priority: the request's class, lower first; a host whose engine schedules by priority
         uses it - vLLM's priority policy - the others admit first come, first served)
         200: {"i": index, "token": id} ... then exactly one of
              {"done": true, "finish_reason": "length" | "stop"}
              {"moved": {"target_addr", "target_plan", "routing_version"}}  (handed over mid-stream)
              {"error": "..."}
         429 + Retry-After: the plan's waiting queue is full
         409: frozen or unknown plan ({"error", "reason": "frozen" | "unknown_plan"})
         400: bad input ({"error", "param"})
    GET  /data/v1/sequences/<seq_id>/stream?from=N
         the same stream, for a sequence this node holds (or held), from generated token N on;
         404 when it is not here (yet): the reader retries briefly.
    POST /data/v1/accept?deployment=&plan_id=&routing_version=&resume_from=
         body: one KV frame (agents.engines.torch.kvtransfer) - the hand-over, agent to agent.
         200 {"ok": true}; 409 {"error", "reason": "stale_lease" | "target_refused"}; 400 bad frame.
    POST /data/v1/stages
         a plan's leader asks this member to start its stage workers (stages.py documents it):
         200 {"started", "pids"}; 409 not_prepared | weights; 400 bad input ({"error", "param"}).
    POST /data/v1/probe
         body: any bytes (agents/node/links.py times the upload: the same path and client a KV
         frame takes to /data/v1/accept). 200 {"bytes": n} once the whole body was read.
    GET  /data/v1/health   the plans served here and their state

A client that goes away mid-stream cancels its sequence (it is dropped from the engine).
"""

from __future__ import annotations

import json
import logging
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from agents.dataplane.errors import DataPlaneError, Saturated, UnknownPlan
from agents.dataplane.hosting import HostedPlan
from agents.dataplane.stages import MemberRegistry, NotPrepared, stages_problem
from agents.dataplane.stream import SeqStream
from agents.engines.torch.kvtransfer import KVTransferError, decode_kv_state
from scheduler.router.request import PRIORITY_MAX, PRIORITY_MIN

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 32
STREAM_IDLE_S = 300.0
_SEQ_STREAM = re.compile(r"^/data/v1/sequences/([^/]{1,200})/stream$")


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    # socketserver's default listen backlog is 5: a gateway opening a burst of streams at once (100
    # clients arriving together) had connections dropped past it, retried for longer than its
    # connect timeout, and answered "no plan can take a request" (bench.gateway_flood found it).
    request_queue_size = 256

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A reader that closes its pooled keep-alive connection is routine, not a traceback.
        import sys

        if isinstance(sys.exc_info()[1], ConnectionError):
            log.debug("data server: %s closed the connection", client_address)
            return
        super().handle_error(request, client_address)


class DataServer:
    """Serves the plans of one node (any HostedPlan) on `host:port` (port 0: any free port)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._hosts: dict[tuple[str, str], HostedPlan] = {}
        self._lock = threading.Lock()
        # Member side of cross-node groups (stages.py); a node without a torch backend has none.
        self.members: MemberRegistry | None = None
        handler = type("Handler", (_Handler,), {"dataserver": self})
        self._httpd = _HTTPServer((host, port), handler)
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"{host!s}:{port}"

    def start(self) -> DataServer:
        if self._thread is None:
            self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                            name=f"dataserver-{self.address}", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(5.0)

    # -- the plans served ------------------------------------------------------------------------

    def add(self, host: HostedPlan) -> None:
        with self._lock:
            self._hosts[(host.deployment, host.plan_id)] = host

    def remove(self, deployment: str, plan_id: str) -> HostedPlan | None:
        with self._lock:
            return self._hosts.pop((deployment, plan_id), None)

    def host(self, deployment: str, plan_id: str) -> HostedPlan:
        with self._lock:
            h = self._hosts.get((deployment, plan_id))
        if h is None:
            raise UnknownPlan(f"plan_id: {plan_id!r} of deployment {deployment!r} does not run on this node")
        return h

    def hosts(self) -> list[HostedPlan]:
        with self._lock:
            return list(self._hosts.values())

    def find_stream(self, seq_id: str) -> tuple[HostedPlan, SeqStream] | None:
        """The newest stream of `seq_id` here (by lease version), live ones first."""
        found = [(h, s) for h in self.hosts() if (s := h.stream(seq_id)) is not None]
        if not found:
            return None
        return max(found, key=lambda hs: (hs[1].end is None, hs[1].lease_version))

    def __enter__(self) -> DataServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    dataserver: DataServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        log.debug("%s " + format, self.address_string(), *args)

    # -- plumbing --------------------------------------------------------------------------------

    def _send_json(self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _refuse(self, exc: DataPlaneError) -> None:
        if isinstance(exc, Saturated):
            retry = str(max(1, round(exc.retry_after_s)))
            self._send_json(429, {"error": str(exc), "reason": exc.code}, {"Retry-After": retry})
        else:
            self._send_json(409, {"error": str(exc), "reason": exc.code})

    def _read_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        if length < 0 or length > MAX_BODY_BYTES:
            raise ValueError(f"Content-Length: {length} is out of range")
        return self.rfile.read(length) if length else b""

    def _stream(self, host: HostedPlan, stream: SeqStream, from_index: int) -> None:
        """Write the stream's events as NDJSON chunks until its end event."""
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        try:
            for event in stream.events(from_index, idle_timeout_s=STREAM_IDLE_S,
                                       alive=lambda: host.state == "ready" or stream.end is not None):
                data = json.dumps(event, separators=(",", ":")).encode() + b"\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            host.cancel(stream.seq_id)  # the reader went away: stop decoding for nobody
            self.close_connection = True

    # -- endpoints -------------------------------------------------------------------------------

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        url = urlsplit(self.path)
        if url.path == "/data/v1/health":
            plans = [{"deployment": h.deployment, "plan_id": h.plan_id, "state": h.state, "frozen": h.frozen}
                     for h in self.dataserver.hosts()]
            self._send_json(200, {"plans": plans})
            return
        match = _SEQ_STREAM.match(url.path)
        if match is None:
            self._send_json(404, {"error": f"no endpoint {url.path}"})
            return
        seq_id = match.group(1)
        raw_from = parse_qs(url.query).get("from", ["0"])[0]
        if not raw_from.isdigit():
            self._send_json(400, {"error": f"from: must be an integer >= 0, got {raw_from!r}", "param": "from"})
            return
        found = self.dataserver.find_stream(seq_id)
        if found is None:
            self._send_json(404, {"error": f"sequence {seq_id!r} is not on this node", "reason": "not_here"})
            return
        self._stream(found[0], found[1], int(raw_from))

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        url = urlsplit(self.path)
        try:
            body = self._read_body()
        except ValueError as exc:
            self._send_json(400, {"error": str(exc)})
            return
        if url.path == "/data/v1/generate":
            self._generate(body)
        elif url.path == "/data/v1/accept":
            self._accept(url.query, body)
        elif url.path == "/data/v1/stages":
            self._stages(body)
        elif url.path == "/data/v1/probe":
            self._send_json(200, {"bytes": len(body)})  # read in full above: the upload is what is timed
        else:
            self._send_json(404, {"error": f"no endpoint {url.path}"})

    def _generate(self, raw: bytes) -> None:
        try:
            body = json.loads(raw or b"null")
        except ValueError as exc:
            self._send_json(400, {"error": f"body: not JSON ({exc})", "param": "body"})
            return
        problem = _generate_problem(body)
        if problem is not None:
            self._send_json(400, {"error": f"{problem[0]}: {problem[1]}", "param": problem[0]})
            return
        try:
            host = self.dataserver.host(body["deployment"], body["plan_id"])
            extra = {"priority": body["priority"]} if body.get("priority") else {}  # hosts that order by it
            stream = host.admit(body["seq_id"], body["prompt_ids"], body["max_tokens"], body.get("sampling"),
                                routing_version=int(body.get("routing_version", 0)), **extra)
        except DataPlaneError as exc:
            self._refuse(exc)
            return
        except ValueError as exc:
            param, _, reason = str(exc).partition(": ")
            self._send_json(400, {"error": str(exc), "param": param if reason else None})
            return
        self._stream(host, stream, 0)

    def _stages(self, raw: bytes) -> None:
        try:
            body = json.loads(raw or b"null")
        except ValueError as exc:
            self._send_json(400, {"error": f"body: not JSON ({exc})", "param": "body"})
            return
        problem = stages_problem(body)
        if problem is not None:
            self._send_json(400, {"error": f"{problem[0]}: {problem[1]}", "param": problem[0]})
            return
        members = self.dataserver.members
        try:
            if members is None:
                raise NotPrepared("this node runs no torch stage workers for other nodes")
            started = members.start(body)
        except DataPlaneError as exc:
            self._send_json(409, {"error": str(exc), "reason": exc.code})
            return
        self._send_json(200, started)

    def _accept(self, query: str, frame: bytes) -> None:
        q = {k: v[0] for k, v in parse_qs(query).items()}
        for key in ("deployment", "plan_id", "routing_version", "resume_from"):
            if key not in q:
                self._send_json(400, {"error": f"{key}: required", "param": key})
                return
        if not (q["routing_version"].isdigit() and q["resume_from"].isdigit()):
            self._send_json(400, {"error": "routing_version, resume_from: must be integers >= 0"})
            return
        try:
            host = self.dataserver.host(q["deployment"], q["plan_id"])
        except DataPlaneError:
            self._send_json(409, {"error": f"target_plan: {q['plan_id']} of {q['deployment']} does not run here",
                                  "reason": "target_refused"})
            return
        try:
            state = decode_kv_state(frame, expect_model_sha256=host.model_sha256)
        except KVTransferError as exc:
            self._send_json(400, {"error": str(exc), "reason": "target_refused"})
            return
        try:
            host.accept(state, (q["plan_id"], int(q["routing_version"])), int(q["resume_from"]))
        except DataPlaneError as exc:
            self._send_json(409, {"error": str(exc), "reason": exc.code})
            return
        self._send_json(200, {"ok": True, "seq_id": state.seq_id})


def _generate_problem(body: Any) -> tuple[str, str] | None:
    """The first bad field of a generate body and why, or None."""
    if not isinstance(body, dict):
        return "body", "must be a JSON object"
    for key in ("deployment", "plan_id", "seq_id"):
        if not isinstance(body.get(key), str) or not body[key]:
            return key, "must be a non-empty string"
    ids = body.get("prompt_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        return "prompt_ids", "must be a non-empty list of token ids"
    mt = body.get("max_tokens")
    if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
        return "max_tokens", "must be an integer >= 1"
    sampling = body.get("sampling")
    if sampling is not None and not isinstance(sampling, dict):
        return "sampling", "must be an object or null"
    rv = body.get("routing_version", 0)
    if not isinstance(rv, int) or isinstance(rv, bool) or rv < 0:
        return "routing_version", "must be an integer >= 0"
    prio = body.get("priority", 0)
    if not isinstance(prio, int) or isinstance(prio, bool) or not PRIORITY_MIN <= prio <= PRIORITY_MAX:
        return "priority", f"must be an integer in [{PRIORITY_MIN}, {PRIORITY_MAX}]"
    return None


__all__ = ["DataServer"]
