"""The replica's HTTP server: uvicorn (httptools) serving :class:`~deltarec.serving.api.ReplicaApp`.

One event loop on a thread of its own reads requests and writes answers; lookups, readback
and their encoding run on a bounded pool of worker threads. The bounds of
:class:`~deltarec.serving.limits.ServeLimits` hold at every stage: a request line and headers
must arrive within ``header_timeout_s`` and ``max_head_bytes`` (checked here, in the
connection, before uvicorn buffers them: 408 / 431); open connections beyond
``max_connections`` get 503; bodies, answers and the bytes in flight are bounded by the
application. The endpoints are listed in :mod:`deltarec.serving.api`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from deltarec.errors import DeltarecError
from deltarec.serving.api import ReplicaApp
from deltarec.serving.follow import Follower
from deltarec.serving.limits import ServeLimits
from deltarec.serving.metrics import ReplicaMetrics

log = logging.getLogger(__name__)

_END_OF_HEAD = b"\r\n\r\n"


def _raw_error(status: int, reason: str, message: str) -> bytes:
    body = json.dumps({"error": message}).encode()
    return (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"connection: close\r\n\r\n%s" % (status, reason.encode(), len(body), body)
    )


def _guarded_protocol(limits: ServeLimits) -> type[HttpToolsProtocol]:
    """The httptools protocol of uvicorn, which also bounds the time and bytes of a request's head.

    Uvicorn arms no timer before a request's headers are complete and buffers its URL and
    headers without a limit: a client that sends nothing, or headers for ever, would hold the
    connection (and its memory) until it leaves.
    """

    class GuardedProtocol(HttpToolsProtocol):
        _in_head = True
        _head_bytes = 0
        _head_tail = b""
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._in_head:
                if self._head_timer is None:
                    self._arm()
                if not self._head_fits(data):
                    self._refuse(
                        431, "Request Header Fields Too Large", "the request's head is over"
                    )
                    return
            super().data_received(data)

        def on_headers_complete(self) -> None:
            self._in_head, self._head_bytes, self._head_tail = False, 0, b""
            self._disarm()
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._in_head = True  # the next bytes are the next request's head

        def _head_fits(self, data: bytes) -> bool:
            room = limits.max_head_bytes - self._head_bytes
            if len(data) <= room:
                self._head_bytes += len(data)
                self._head_tail = (self._head_tail + data)[-3:]
                return True
            # Over the limit only if the head does not end within it (the rest is a body).
            return _END_OF_HEAD in self._head_tail + data[: max(0, room)]

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(limits.header_timeout_s, self._head_timeout)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            if not self._in_head or self.transport.is_closing():
                return
            if self.cycle is not None and not self.cycle.response_complete:
                self.transport.close()  # an answer is still going out: no room for a 408
                return
            self._refuse(408, "Request Timeout", "the request's head did not arrive in time")

        def _refuse(self, status: int, reason: str, what: str) -> None:
            self._disarm()
            if not self.transport.is_closing():
                limit = f"{limits.max_head_bytes} bytes, {limits.header_timeout_s:g} s"
                self.transport.write(_raw_error(status, reason, f"{what} ({limit})"))
                self.transport.close()

    return GuardedProtocol


class _Server(uvicorn.Server):
    """uvicorn's server without its signal handlers: the caller decides when it stops."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _bind(host: str, port: int, backlog: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=backlog)
    except OSError as e:
        raise DeltarecError(f"the replica cannot listen on {host}:{port}: {e}") from e


class ReplicaServer:
    """Serves a follower's replica over HTTP (uvicorn) on a background thread.

    Args:
        follower: the follower (its replica answers the reads).
        host: the address to listen on (bound here: the port is taken when this returns).
        port: the port (0: any free one; see :attr:`port`).
        limits: the request bounds (default: :class:`~deltarec.serving.limits.ServeLimits`).
        token: the bearer token ``/v1/*`` requires (None: open); the health endpoints and
            ``/metrics`` never require it.
        scorer: answers ``POST /v1/score`` (:class:`~deltarec.serving.score.ExampleScorer`);
            None: no scoring endpoint.

    Raises:
        DeltarecError: the address cannot be bound.
    """

    def __init__(
        self,
        follower: Follower,
        host: str = "127.0.0.1",
        port: int = 0,
        limits: ServeLimits | None = None,
        token: str | None = None,
        scorer: Any = None,
    ) -> None:
        self.limits = limits or ServeLimits()
        self._metrics = ReplicaMetrics(follower)
        self._app = ReplicaApp(follower, self._metrics, self.limits, token, scorer)
        self._socket = _bind(host, port, backlog=2048)
        self.host = host
        self.port: int = int(self._socket.getsockname()[1])
        config = uvicorn.Config(
            self._app,
            http=_guarded_protocol(self.limits),
            lifespan="off",
            log_config=None,
            log_level="warning",
            access_log=False,
            server_header=False,
            limit_concurrency=self.limits.max_connections,
            timeout_keep_alive=self.limits.keepalive_s,  # type: ignore[arg-type]
            timeout_graceful_shutdown=5,
        )
        self._server = _Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """``replica://host:port``: the store URL ``deltarec verify --store`` takes."""
        return f"replica://{self.host}:{self.port}"

    @property
    def metrics(self) -> ReplicaMetrics:
        """The metrics served at ``/metrics``."""
        return self._metrics

    def start(self, timeout: float = 30.0) -> ReplicaServer:
        """Start answering requests on a background thread (returns self once it answers)."""
        self._thread = threading.Thread(
            target=self.serve_forever, name="deltarec-replica-http", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise DeltarecError(f"the replica's HTTP server on port {self.port} did not start")
            time.sleep(0.005)
        return self

    def serve_forever(self) -> None:
        """Answer requests on this thread until :meth:`close` (from another thread)."""
        self._server.run(sockets=[self._socket])

    def close(self) -> None:
        """Stop answering and release the port (idempotent)."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(15)
            self._thread = None
        self._app.close()
        self._socket.close()

    def __enter__(self) -> ReplicaServer:
        return self.start()

    def __exit__(self, *_: Any) -> None:
        self.close()


__all__ = ["ReplicaServer"]
