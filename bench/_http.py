"""A small keep-alive HTTP/1.1 client over asyncio streams: one connection, one request at a time.

bench.control_plane plays a thousand agents from one process. A real agent is a process of its
own with its own connections; sharing one httpx.AsyncClient between them measured the client, not
the console: when the fleet's long polls all came back at once, the shared pool's bookkeeping over
~400 connections took the bench's event loop for 8-11 s (py-spy: the console idle in select, its
threads idle, while the bench's reports waited), and each report's latency said so. Here each
agent holds its own two connections (its long poll, its reports) as a real agent does, and a
request costs a few parser lines.

Enough of RFC 9112 for the console's answers: a status line, headers, a body by Content-Length or
chunked. A connection the server closed is opened again on the next request.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any


class HttpError(Exception):
    """No answer: the connection failed, closed, or timed out."""


class Connection:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def request(self, method: str, path: str, *, body: Any = None, token: str = "",
                      timeout: float = 30.0) -> tuple[int, Any]:
        """Send one request and read its answer: (status, parsed JSON body or None)."""
        try:
            return await asyncio.wait_for(self._request(method, path, body, token), timeout)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ValueError) as exc:
            self.close()
            raise HttpError(f"{method} {path}: {exc!r}") from exc

    async def _request(self, method: str, path: str, body: Any, token: str) -> tuple[int, Any]:
        if self._writer is None or self._writer.is_closing():
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        assert self._reader is not None  # noqa: S101 - opened just above
        data = b"" if body is None else json.dumps(body).encode()
        head = [f"{method} {path} HTTP/1.1", f"Host: {self.host}:{self.port}", f"Content-Length: {len(data)}"]
        if body is not None:
            head.append("Content-Type: application/json")
        if token:
            head.append(f"Authorization: Bearer {token}")
        self._writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + data)
        await self._writer.drain()
        status_line, *lines = (await self._reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        status = int(status_line.split(" ", 2)[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines if ln)}
        if headers.get("transfer-encoding", "").lower() == "chunked":
            parts = []
            while True:
                size = int((await self._reader.readuntil(b"\r\n")).split(b";")[0], 16)
                chunk = await self._reader.readexactly(size + 2)
                if size == 0:
                    break
                parts.append(chunk[:-2])
            raw = b"".join(parts)
        else:
            raw = await self._reader.readexactly(int(headers.get("content-length", "0")))
        if headers.get("connection", "").lower() == "close":
            self.close()
        return status, (json.loads(raw) if raw else None)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None
