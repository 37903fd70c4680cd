"""A small HTTP/1.1 server for JSON requests on asyncio (the standard library's), enough for OpenAI clients on the
same host: requests with a Content-Length body, keep-alive connections, JSON answers. No TLS, no chunked bodies, no
streaming."""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Awaitable, Callable

logger = logging.getLogger("grpo")

MAX_HEADER_BYTES = 64 * 1024
MAX_BODY_BYTES = 64 * 1024 * 1024
REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 411: "Length Required",
           413: "Payload Too Large", 500: "Internal Server Error", 503: "Service Unavailable"}

# (method, path, body bytes) -> (status, JSON-able body)
Handler = Callable[[str, str, bytes], Awaitable[tuple[int, object]]]


class JSONServer:
    def __init__(self, handler: Handler, host: str = "127.0.0.1", port: int = 0):
        self.handler = handler
        self.host, self.port = host, port
        self._server = None
        self._connections: set[asyncio.StreamWriter] = set()

    async def start(self) -> int:
        """Listen; returns the port (a free one when asked for 0)."""
        self._server = await asyncio.start_server(self._serve, self.host, self.port, limit=MAX_HEADER_BYTES)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in list(self._connections):
                writer.close()
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections.add(writer)
        try:
            while True:
                request = await self._read_request(reader)
                if request is None:
                    return
                method, path, headers, body = request
                if isinstance(body, tuple):  # the request could not be read: answer, then close
                    await self._respond(writer, body[0], {"error": {"message": body[1], "type": "invalid_request"}},
                                        keep_alive=False)
                    return
                try:
                    status, answer = await self.handler(method, path, body)
                except Exception as exc:  # a bug behind the route: the client hears it, the server goes on
                    logger.exception("agent endpoint: %s %s failed", method, path)
                    status, answer = 500, {"error": {"message": f"{type(exc).__name__}: {exc}", "type": "server_error"}}
                keep_alive = headers.get("connection", "").lower() != "close"
                await self._respond(writer, status, answer, keep_alive)
                if not keep_alive:
                    return
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            return  # the client went away, or sent something that is not HTTP
        finally:
            self._connections.discard(writer)
            writer.close()

    async def _read_request(self, reader: asyncio.StreamReader):
        line = await reader.readline()
        if not line:
            return None
        parts = line.decode("latin-1").split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise ValueError("not an HTTP/1.x request line")
        method, path = parts[0].upper(), parts[1]
        headers = {}
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if "chunked" in headers.get("transfer-encoding", "").lower():
            return method, path, headers, (411, "chunked request bodies are not supported; send a Content-Length")
        length = int(headers.get("content-length") or 0)
        if length > MAX_BODY_BYTES:
            return method, path, headers, (413, f"the body is over {MAX_BODY_BYTES} bytes")
        body = await reader.readexactly(length) if length else b""
        return method, path, headers, body

    @staticmethod
    async def _respond(writer: asyncio.StreamWriter, status: int, answer, keep_alive: bool) -> None:
        payload = json.dumps(answer).encode("utf-8")
        head = (f"HTTP/1.1 {status} {REASONS.get(status, 'Unknown')}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\nConnection: {'keep-alive' if keep_alive else 'close'}\r\n\r\n")
        writer.write(head.encode("latin-1") + payload)
        await writer.drain()
