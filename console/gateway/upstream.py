"""The gateway's async reader of the data plane (agents/dataplane/server.py has the protocol).

`follow` yields the generated token ids of one sequence as one uninterrupted stream: when the
leader's stream ends with `moved` (the sequence was handed over at a switch), it continues at
the target's data address with GET /data/v1/sequences/<id>/stream?from=<tokens received>, so
nothing is repeated or lost; the client never sees the seam.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import httpx

NOT_HERE_WAIT_S = 5.0  # a target that has not registered the sequence yet is retried this long
_client: httpx.AsyncClient | None = None
_client_loop: asyncio.AbstractEventLoop | None = None


def client() -> httpx.AsyncClient:
    """One pooled client per event loop (daphne runs one loop; tests may run several)."""
    global _client, _client_loop
    loop = asyncio.get_running_loop()
    if _client is None or _client_loop is not loop:
        _client = httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=5.0),
                                    limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100))
        _client_loop = loop
    return _client


def url(addr: str, path: str) -> str:
    return f"{addr if addr.startswith(('http://', 'https://')) else 'http://' + addr}{path}"


class Refused(Exception):
    """The plan would not admit it: 429 (retry_after_s) or 409 (frozen / unknown plan)."""

    def __init__(self, status: int, message: str, reason: str, retry_after_s: float = 0.0,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.reason, self.retry_after_s, self.param = status, reason, retry_after_s, param


class UpstreamError(Exception):
    """The data plane failed the sequence after it was admitted (an explicit, recorded error)."""


@dataclass
class Followed:
    """What happened to one sequence on its way (for metrics and tests)."""

    handovers: list[dict[str, Any]] = field(default_factory=list)  # each `moved` target
    stalls_s: list[float] = field(default_factory=list)  # gap around each hand-over, as this reader saw it
    failovers: list[str] = field(default_factory=list)  # why each resume on another plan was needed
    finish_reason: str | None = None


async def _refusal(resp: httpx.Response) -> Refused:
    await resp.aread()
    try:
        body = resp.json()
    except ValueError:
        body = {"error": resp.text[:300]}
    msg = str(body.get("error", f"HTTP {resp.status_code}"))
    retry = float(resp.headers.get("Retry-After", "1") or 1) if resp.status_code == 429 else 0.0
    param = body.get("param")
    return Refused(resp.status_code, msg, str(body.get("reason", "")), retry, param if isinstance(param, str) else None)


async def open_generate(addr: str, body: dict[str, Any]) -> httpx.Response:
    """POST /data/v1/generate; the open streaming response, or Refused."""
    c = client()
    resp = await c.send(c.build_request("POST", url(addr, "/data/v1/generate"), json=body), stream=True)
    if resp.status_code != 200:
        err = await _refusal(resp)
        await resp.aclose()
        raise err
    return resp


async def _open_continue(addr: str, seq_id: str, from_index: int) -> httpx.Response:
    c = client()
    deadline = time.monotonic() + NOT_HERE_WAIT_S
    while True:
        req = c.build_request("GET", url(addr, f"/data/v1/sequences/{seq_id}/stream"), params={"from": from_index})
        resp = await c.send(req, stream=True)
        if resp.status_code == 200:
            return resp
        err = await _refusal(resp)
        await resp.aclose()
        if resp.status_code != 404 or time.monotonic() > deadline:
            raise UpstreamError(f"continuing {seq_id} at {addr}: {err}")
        await asyncio.sleep(0.01)


async def follow(resp: httpx.Response, seq_id: str, info: Followed) -> AsyncGenerator[int, None]:
    """Token ids from an open generate stream, across hand-overs (module docstring)."""
    received = 0
    try:
        while True:
            end: dict[str, Any] | None = None
            async for line in resp.aiter_lines():
                if not line.strip():
                    continue
                ev = json.loads(line)
                if "token" in ev:
                    if ev.get("i") != received:
                        raise UpstreamError(f"{seq_id}: token index {ev.get('i')} after {received} tokens")
                    received += 1
                    yield int(ev["token"])
                else:
                    end = ev
                    break
            await resp.aclose()
            if end is None:
                raise UpstreamError(f"{seq_id}: the data plane closed the stream without an end")
            if "error" in end:
                raise UpstreamError(f"{seq_id}: {end['error']}")
            if "moved" not in end:
                info.finish_reason = str(end.get("finish_reason", "stop"))
                return
            target = end["moved"]
            info.handovers.append(target)
            t0 = time.monotonic()
            resp = await _open_continue(str(target["target_addr"]), seq_id, received)
            info.stalls_s.append(time.monotonic() - t0)
    finally:
        await resp.aclose()
