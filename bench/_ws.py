"""A small asyncio websocket client (RFC 6455) for the benches: text frames in, text frames out.

The benches watch the console's live pages the way a browser does - one socket per page, JSON
text frames - without a browser's own CPU in the measurement, and the venv has no websocket
client library (daphne serves them through autobahn/twisted, a server). Enough of RFC 6455 for
that: the opening handshake with a session cookie and an Origin, masked client frames,
fragmented server messages, ping -> pong, close.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import struct
from typing import Any

_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455 section 1.3
_TEXT, _BINARY, _CLOSE, _PING, _PONG, _CONT = 0x1, 0x2, 0x8, 0x9, 0xA, 0x0


class WebsocketClosed(Exception):
    """The server closed the socket (code, when it said one)."""

    def __init__(self, code: int | None) -> None:
        super().__init__(f"websocket closed (code {code})")
        self.code = code


class Websocket:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer
        self.bytes_received = 0
        self.messages_received = 0  # text messages, pings of the console included (what an ack counts)

    @classmethod
    async def connect(cls, host: str, port: int, path: str, *, cookie: str = "") -> Websocket:
        reader, writer = await asyncio.open_connection(host, port, limit=64 * 1024 * 1024)
        key = base64.b64encode(os.urandom(16)).decode()
        lines = [f"GET {path} HTTP/1.1", f"Host: {host}:{port}", "Upgrade: websocket", "Connection: Upgrade",
                 f"Sec-WebSocket-Key: {key}", "Sec-WebSocket-Version: 13", f"Origin: http://{host}:{port}"]
        if cookie:
            lines.append(f"Cookie: {cookie}")
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        status = head.split(b"\r\n", 1)[0]
        if b" 101 " not in status:
            writer.close()
            raise ConnectionError(f"{path}: the server did not switch protocols ({status.decode(errors='replace')})")
        accept = base64.b64encode(hashlib.sha1(key.encode() + _GUID).digest()).decode()  # noqa: S324 - RFC 6455
        if accept.encode() not in head:
            writer.close()
            raise ConnectionError(f"{path}: bad Sec-WebSocket-Accept")
        return cls(reader, writer)

    async def _send_frame(self, opcode: int, payload: bytes) -> None:
        mask = os.urandom(4)
        n = len(payload)
        if n < 126:
            header = struct.pack("!BB", 0x80 | opcode, 0x80 | n)
        elif n < 1 << 16:
            header = struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, n)
        else:
            header = struct.pack("!BBQ", 0x80 | opcode, 0x80 | 127, n)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        self._writer.write(header + mask + masked)
        await self._writer.drain()

    async def send_json(self, message: Any) -> None:
        await self._send_frame(_TEXT, json.dumps(message).encode())

    async def _frame(self) -> tuple[bool, int, bytes]:
        b1, b2 = await self._reader.readexactly(2)
        n = b2 & 0x7F
        if n == 126:
            (n,) = struct.unpack("!H", await self._reader.readexactly(2))
        elif n == 127:
            (n,) = struct.unpack("!Q", await self._reader.readexactly(8))
        mask = await self._reader.readexactly(4) if b2 & 0x80 else b""
        data = await self._reader.readexactly(n)
        if mask:
            data = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
        self.bytes_received += n
        return bool(b1 & 0x80), b1 & 0x0F, data

    async def recv_json(self) -> Any:
        """The next text message, parsed (pings answered on the way)."""
        parts: list[bytes] = []
        while True:
            try:
                fin, opcode, data = await self._frame()
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                raise WebsocketClosed(None) from exc
            if opcode == _PING:
                await self._send_frame(_PONG, data)
                continue
            if opcode == _CLOSE:
                raise WebsocketClosed(struct.unpack("!H", data[:2])[0] if len(data) >= 2 else None)
            if opcode in (_TEXT, _BINARY, _CONT):
                parts.append(data)
                if fin:
                    self.messages_received += 1
                    return json.loads(b"".join(parts))

    async def ack(self) -> None:
        """Tell the console every message so far was handled, as live.js does (a socket that never
        acks is closed with 4409 once FLEXPIPE_WS_MAX_UNACKED_BYTES are outstanding)."""
        await self.send_json({"type": "ack", "count": self.messages_received})

    async def close(self) -> None:
        try:
            await self._send_frame(_CLOSE, struct.pack("!H", 1000))
        except (ConnectionError, RuntimeError):
            pass
        self._writer.close()
