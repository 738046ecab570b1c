"""The replica's ASGI plumbing: one request's body and answer, and the bytes all requests hold.

:class:`Request` reads a body within a deadline and a size bound and writes an answer in pieces
that a slow reader must drain within a deadline; :class:`Budget` holds the bytes every request
in flight needs, and makes a request that finds no room wait, then refuses it (503).
:class:`Refused` is an error answered before the work. Used by :mod:`deltarec.serving.api`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import urllib.parse
from collections.abc import AsyncIterator
from typing import Any

from deltarec.errors import BadInputError

SEND_PIECE = 1 << 20
"""An answer goes out in pieces of at most this many bytes, each after the last has drained."""
DRAIN_BYTES = 16 << 20
"""A refused body declared this long or shorter is read and dropped before the answer."""
_JOIN_BYTES = 1 << 16

if sys.version_info >= (3, 11):
    _deadline = asyncio.timeout
else:  # pragma: no cover - Python 3.10

    @contextlib.asynccontextmanager
    async def _deadline(delay: float) -> AsyncIterator[None]:
        """``asyncio.timeout`` of Python 3.11: cancel the block after ``delay`` s (TimeoutError)."""
        task = asyncio.current_task()
        assert task is not None
        fired = []
        handle = asyncio.get_running_loop().call_later(
            delay, lambda: (fired.append(True), task.cancel())
        )
        try:
            yield
        except asyncio.CancelledError as e:
            if fired:
                raise TimeoutError from e
            raise
        finally:
            handle.cancel()


class Refused(Exception):
    """A request answered with an error before its work (status, message, extra headers)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, dict(headers or {})


class Budget:
    """Bytes the requests in flight may hold together; a request waits for room, bounded."""

    def __init__(self, total: int) -> None:
        self.total, self.free = total, total
        self._cond: asyncio.Condition | None = None

    @contextlib.asynccontextmanager
    async def hold(self, nbytes: int, timeout: float) -> AsyncIterator[None]:
        """Hold ``nbytes`` for the block; wait up to ``timeout`` s for room, else 503."""
        if self._cond is None:  # created on the serving loop
            self._cond = asyncio.Condition()
        cond, nbytes = self._cond, max(0, min(nbytes, self.total))
        async with cond:
            if self.free < nbytes:
                try:
                    await asyncio.wait_for(cond.wait_for(lambda: self.free >= nbytes), timeout)
                except asyncio.TimeoutError as e:
                    raise Refused(
                        503,
                        f"busy: no room for {nbytes} bytes within {timeout:g} s",
                        {"Retry-After": "1"},
                    ) from e
            self.free -= nbytes
        try:
            yield
        finally:
            async with cond:
                self.free += nbytes
                cond.notify_all()


class Request:
    """One HTTP request of the ASGI server: its head, body reader and answer writer."""

    def __init__(self, scope: dict[str, Any], receive: Any, send: Any, timeout: float) -> None:
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        self._query: bytes = scope.get("query_string", b"")
        self._receive, self._send, self._timeout = receive, send, timeout
        self.started = False
        self.unread = self.method == "POST"  # a body may follow the head
        self.broken = False

    def query(self) -> dict[str, str]:
        """The query's parameters (the last of a repeated name)."""
        try:
            pairs = urllib.parse.parse_qsl(
                self._query.decode("latin-1"), keep_blank_values=True, max_num_fields=16
            )
        except ValueError as e:
            raise BadInputError(f"{self.path}: the query is not valid: {e}") from e
        return dict(pairs)

    def content_length(
        self, limit: int, over: str | None = None, headers: Any = None
    ) -> int | None:
        """The declared body length (None: chunked); over ``limit``: 413 before reading it."""
        text = self.headers.get("content-length")
        if text is None:
            return None
        if not text.isdigit():
            raise BadInputError(f"{self.path}: Content-Length {text[:32]!r} is not a length")
        n = int(text)
        if n > limit:
            raise Refused(
                413, over or f"{self.path}: a body of {n} bytes; at most {limit}", headers
            )
        return n

    async def body(self, limit: int, headers: Any = None) -> bytearray:
        """The body, refused (413) once over ``limit`` and (408) if not all there in time."""
        buf = bytearray()
        try:
            async with _deadline(self._timeout):
                while True:
                    message = await self._receive()
                    if message["type"] == "http.disconnect":
                        raise Refused(400, f"{self.path}: the client left before the body")
                    buf += message.get("body", b"")
                    if len(buf) > limit:
                        raise Refused(413, f"{self.path}: the body is over {limit} bytes", headers)
                    if not message.get("more_body", False):
                        self.unread = False
                        return buf
        except TimeoutError as e:
            raise Refused(
                408, f"{self.path}: the body was not received within {self._timeout:g} s"
            ) from e
        finally:
            self.broken = self.unread  # a body refused part-read is not drained

    async def answer(
        self,
        status: int,
        parts: list[Any],
        ctype: str,
        headers: dict[str, str] | None = None,
        close: bool = False,
    ) -> None:
        """Send ``parts`` (bytes-like) as one answer, in pieces a slow reader must drain.

        Raises:
            TimeoutError: the client did not read the answer within the request timeout (the
                server then closes the connection).
        """
        views = [memoryview(p).cast("B") for p in parts]
        size = sum(map(len, views))
        head = [(b"content-type", ctype.encode()), (b"content-length", b"%d" % size)]
        head += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        if close:
            head.append((b"connection", b"close"))
        if size <= _JOIN_BYTES:  # one write for a small answer
            views = [memoryview(b"".join(views))]
        pieces = [v[i : i + SEND_PIECE] for v in views for i in range(0, len(v), SEND_PIECE)]
        self.started = True
        async with _deadline(self._timeout):
            await self._send({"type": "http.response.start", "status": status, "headers": head})
            for i, piece in enumerate(pieces or [memoryview(b"")], 1):
                more = i < len(pieces)
                await self._send({"type": "http.response.body", "body": piece, "more_body": more})

    async def error(self, status: int, message: str, headers: dict[str, str]) -> None:
        """A JSON ``{"error": message}`` answer.

        A body refused before it was read is read and dropped first when it is declared and
        at most :data:`DRAIN_BYTES` (a client that sends it whole then reads the answer, not a
        reset); otherwise the connection is closed after the answer.
        """
        close = self.unread and not await self._drain()
        body = json.dumps({"error": message}).encode()
        await self.answer(status, [body], "application/json", headers, close=close)

    async def _drain(self) -> bool:
        text = self.headers.get("content-length", "")
        if self.broken or not text.isdigit() or int(text) > DRAIN_BYTES:
            return False
        if self.headers.get("expect", "").lower() == "100-continue":
            return False  # the client waits for this answer and will not send the body
        try:
            async with _deadline(self._timeout):
                while True:
                    message = await self._receive()
                    if message["type"] != "http.request" or not message.get("more_body"):
                        return message["type"] == "http.request"
        except TimeoutError:
            return False


__all__ = ["DRAIN_BYTES", "SEND_PIECE", "Budget", "Refused", "Request"]
