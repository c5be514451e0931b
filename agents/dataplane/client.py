"""Client side of the data plane's HTTP protocol (server.py documents it), synchronous (httpx).

`send_state` is how one agent hands a sequence to another (KV over the wire, never through the
controller); `stream_tokens` reads a generate or continue stream (tests and tools; the gateway
has its own async reader).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx

from agents.dataplane.errors import (
    DataPlaneError,
    Frozen,
    NotHere,
    Refused,
    Saturated,
    StaleLease,
    UnknownPlan,
)
from agents.engines.torch.engine import KVState
from agents.engines.torch.kvtransfer import encode_kv_state

ACCEPT_TIMEOUT_S = 60.0
# One pooled client for hand-overs: building a client per call costs tens of ms (its SSL context),
# which a sequence would spend standing still. httpx.Client is safe to share between threads.
_client = httpx.Client(timeout=ACCEPT_TIMEOUT_S)


def base_url(addr: str) -> str:
    return addr if addr.startswith(("http://", "https://")) else f"http://{addr}"


def send_state(addr: str, state: KVState, *, deployment: str, plan_id: str, routing_version: int,
               resume_from: int, timeout_s: float = ACCEPT_TIMEOUT_S) -> int:
    """POST one KV frame to the target's data server; returns the frame's bytes.

    Raises StaleLease or Refused when the target says no, OSError when it cannot be reached.
    """
    frame = encode_kv_state(state)
    params: dict[str, str | int] = {"deployment": deployment, "plan_id": plan_id,
                                    "routing_version": routing_version, "resume_from": resume_from}
    try:
        resp = _client.post(f"{base_url(addr)}/data/v1/accept", params=params, content=frame,
                          headers={"Content-Type": "application/octet-stream"}, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise ConnectionError(f"target {addr}: {exc}") from exc
    if resp.status_code == 200:
        return len(frame)
    raise error_from(resp.status_code, json_body(resp), resp.headers)


def probe_upload(addr: str, nbytes: int, *, timeout_s: float = ACCEPT_TIMEOUT_S,
                 clock: Any = None) -> float:
    """Seconds to POST `nbytes` to a peer's data server and hear it got them all: the path a KV
    frame takes (the same pooled client, the same server), for the link probe. OSError when the
    peer cannot be reached or answers otherwise."""
    import time

    now = clock or time.perf_counter
    body = bytes(nbytes)
    started = now()
    try:
        resp = _client.post(f"{base_url(addr)}/data/v1/probe", content=body,
                            headers={"Content-Type": "application/octet-stream"}, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise ConnectionError(f"peer {addr}: {exc}") from exc
    took = now() - started
    if resp.status_code != 200 or json_body(resp).get("bytes") != nbytes:
        raise ConnectionError(f"peer {addr}: the probe got HTTP {resp.status_code} {resp.text[:200]}")
    return float(took)


def json_body(resp: httpx.Response) -> dict[str, Any]:
    """A data server's answer as an object; text that is not one becomes {"error": text}."""
    try:
        body = resp.json()
    except ValueError:
        return {"error": resp.text[:500]}
    return body if isinstance(body, dict) else {"error": str(body)[:500]}


def error_from(status: int, body: dict[str, Any], headers: httpx.Headers | dict[str, str]) -> DataPlaneError:
    """The exception a data server's refusal stands for."""
    msg = str(body.get("error", f"HTTP {status}"))
    reason = body.get("reason")
    if status == 429:
        return Saturated(msg, float(headers.get("Retry-After", "1") or 1))
    if status == 404:
        return NotHere(msg)
    if reason == "stale_lease":
        return StaleLease(msg)
    if reason == "frozen":
        return Frozen(msg)
    if reason == "unknown_plan":
        return UnknownPlan(msg)
    return Refused(msg)


def stream_tokens(addr: str, *, generate: dict[str, Any] | None = None, seq_id: str | None = None,
                  from_index: int = 0, timeout_s: float = 60.0) -> Iterator[dict[str, Any]]:
    """The NDJSON events of POST /data/v1/generate (with `generate`) or of a continued stream."""
    with httpx.Client(base_url=base_url(addr), timeout=timeout_s) as client:
        if generate is not None:
            req = client.build_request("POST", "/data/v1/generate", json=generate)
        else:
            req = client.build_request("GET", f"/data/v1/sequences/{seq_id}/stream", params={"from": from_index})
        resp = client.send(req, stream=True)
        try:
            if resp.status_code != 200:
                resp.read()
                raise error_from(resp.status_code, json_body(resp), resp.headers)
            for line in resp.iter_lines():
                if line.strip():
                    yield json.loads(line)
        finally:
            resp.close()
