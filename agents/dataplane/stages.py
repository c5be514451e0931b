"""Stage workers across nodes, the data plane's part: the leader asks, the member starts.

    POST /data/v1/stages   (on a member's data address; server.py routes it here)
         {deployment, plan_id, group: main | prefill | decode, ranks: [[stage index, tp rank], ...],
          listener: "host:port", authkey: hex, weights_sha256: hex, timeout_s, num_threads}
         200 {"started": [[stage index, tp rank], ...], "pids": [...]}: the ranks of `ranks` that
             this node holds (from its own prepare_plan), now starting and connecting back
         409 {"error", "reason": "not_prepared"}: prepare_plan of that plan has not arrived (yet);
             the leader retries until its group timeout
         409 {"error", "reason": "weights"}: the weights here hash to something else
         400 {"error", "param"}: bad input, naming the field

The leader sends every rank it does not hold to every peer of the plan; each member starts the
ones its prepare_plan placed on it and says which. This needs no placement map in prepare_plan
(every node already knows its own ranks), so a console that predates cross-node groups drives it
unchanged.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from agents.dataplane.client import base_url, json_body
from agents.dataplane.errors import DataPlaneError
from agents.engines.torch.remote import RemoteStart, StageProcesses

GROUPS = ("main", "prefill", "decode")
RETRY_S = 0.2  # between two asks while the member has not prepared the plan yet


class NotPrepared(DataPlaneError):
    code = "not_prepared"


class WrongWeights(DataPlaneError):
    code = "weights"


def stages_problem(body: Any) -> tuple[str, str] | None:
    """The first bad field of a stages request and why, or None."""
    if not isinstance(body, dict):
        return "body", "must be a JSON object"
    for key in ("deployment", "plan_id"):
        if not isinstance(body.get(key), str) or not body[key]:
            return key, "must be a non-empty string"
    if body.get("group") not in GROUPS:
        return "group", f"must be one of {list(GROUPS)}"
    ranks = body.get("ranks")
    if not isinstance(ranks, list) or not ranks:
        return "ranks", "must be a non-empty list of [stage index, tp rank]"
    for i, pair in enumerate(ranks):
        if not (isinstance(pair, list) and len(pair) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in pair)):
            return f"ranks[{i}]", "must be [stage index, tp rank], integers >= 0"
    listener = body.get("listener")
    host, _, port = listener.rpartition(":") if isinstance(listener, str) else ("", "", "")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return "listener", "must be 'host:port'"
    authkey = body.get("authkey")
    if not isinstance(authkey, str) or len(authkey) != 64 or not all(c in "0123456789abcdef" for c in authkey):
        return "authkey", "must be 64 lowercase hex digits"
    sha = body.get("weights_sha256")
    if not isinstance(sha, str) or len(sha) != 64:
        return "weights_sha256", "must be 64 hex digits"
    t = body.get("timeout_s")
    if isinstance(t, bool) or not isinstance(t, int | float) or not 0 < t <= 3600:
        return "timeout_s", "must be a number of seconds in (0, 3600]"
    n = body.get("num_threads", 1)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 256:
        return "num_threads", "must be an integer in [1, 256]"
    return None


@dataclass
class MemberStages:
    """One plan's part on a member node: which ranks are its own (from its prepare_plan), the
    model folder its ModelStore checked, and the worker processes once the leader asked."""

    deployment: str
    plan_id: str
    node_id: str
    model_dir: str
    weights_sha256: str
    ranks: dict[str, dict[tuple[int, int], int | None]]  # group -> (stage, tp rank) -> CUDA index or None
    processes: StageProcesses = field(default_factory=StageProcesses)

    def start(self, body: dict[str, Any]) -> dict[str, Any]:
        """Start the requested ranks that are ours (`stages_problem` already passed)."""
        if body["weights_sha256"] != self.weights_sha256:
            raise WrongWeights(f"weights_sha256: node {self.node_id} holds weights {self.weights_sha256[:16]}..., "
                               f"the leader runs {body['weights_sha256'][:16]}...")
        ours = self.ranks.get(body["group"], {})
        mine = [(si, r, ours[(si, r)]) for si, r in (tuple(p) for p in body["ranks"]) if (si, r) in ours]
        host, _, port = body["listener"].rpartition(":")
        request = RemoteStart(body["group"], tuple((si, r) for si, r, _ in mine), (host, int(port)),
                              bytes.fromhex(body["authkey"]), float(body["timeout_s"]), int(body.get("num_threads", 1)))
        pids = self.processes.start(request, mine, host=self.node_id, model_dir=self.model_dir) if mine else []
        return {"started": [[si, r] for si, r, _ in mine], "pids": pids}

    def stop(self) -> None:
        self.processes.stop()


class MemberRegistry:
    """The plans this node has prepared as a member, for the stages endpoint to look up."""

    def __init__(self) -> None:
        self._parts: dict[tuple[str, str], MemberStages] = {}
        self._lock = threading.Lock()

    def add(self, part: MemberStages) -> None:
        with self._lock:
            self._parts[(part.deployment, part.plan_id)] = part

    def remove(self, deployment: str, plan_id: str) -> MemberStages | None:
        with self._lock:
            return self._parts.pop((deployment, plan_id), None)

    def start(self, body: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            part = self._parts.get((body["deployment"], body["plan_id"]))
        if part is None:
            raise NotPrepared(f"plan_id: {body['plan_id']} of {body['deployment']} is not prepared on this node")
        return part.start(body)

    def close(self) -> None:
        with self._lock:
            parts, self._parts = list(self._parts.values()), {}
        for part in parts:
            part.stop()


@dataclass(frozen=True)
class HttpStageSite:
    """The leader's handle on one member: POST /data/v1/stages to its data address."""

    name: str  # node id
    addr: str  # its data address
    deployment: str
    plan_id: str
    weights_sha256: str

    def start_workers(self, request: RemoteStart) -> list[tuple[int, int]]:
        """Ask until the member answers 200 (it may not have prepared the plan yet: 409
        not_prepared, or its data server may not be up yet) or the request's timeout passes."""
        host, port = request.listener_addr
        body = {"deployment": self.deployment, "plan_id": self.plan_id, "group": request.group,
                "ranks": [list(k) for k in request.ranks], "listener": f"{host}:{port}",
                "authkey": request.authkey.hex(), "weights_sha256": self.weights_sha256,
                "timeout_s": request.timeout_s, "num_threads": request.num_threads}
        deadline = time.monotonic() + request.timeout_s
        last = "no answer"
        while True:
            try:
                resp = httpx.post(f"{base_url(self.addr)}/data/v1/stages", json=body,
                                  timeout=max(1.0, min(30.0, deadline - time.monotonic())))
            except httpx.HTTPError as exc:
                last = f"{self.addr} unreachable ({exc.__class__.__name__})"
            else:
                answer = json_body(resp)
                if resp.status_code == 200:
                    return [(int(a), int(b)) for a, b in answer.get("started", [])]
                if not (resp.status_code == 409 and answer.get("reason") == NotPrepared.code):
                    raise RuntimeError(f"{self.addr} refused (HTTP {resp.status_code}): {answer.get('error')}")
                last = str(answer.get("error"))
            if time.monotonic() + RETRY_S >= deadline:
                raise RuntimeError(f"not ready within {request.timeout_s:g} s: {last}")
            time.sleep(RETRY_S)
