"""The replica's HTTP endpoint (stdlib ``http.server``, one thread per request).

=======================================  ==========================================================
request                                  answer
=======================================  ==========================================================
``GET /healthz``                         200 while the process runs
``GET /readyz``                          200 once a generation is served, else 503
``GET /v1/status``                       :class:`~deltarec.serving.types.ReplicaStatus` as JSON
``GET /v1/tables``                       table id -> ``{dim, dtype, kind, rows}``
``POST /v1/rows?table=T``                body: int64 little-endian keys; answer: ``found`` (uint8
                                         ``[n]``), ``versions`` (int64 ``[n]``), then the encoded
                                         rows ``[n, width]`` as stored, little-endian; headers
                                         ``X-Deltarec-Rows``, ``-Width``, ``-Dtype``,
                                         ``-Generation``, ``-Seq`` (the snapshot read)
``GET /v1/keys?table=T&after=K&limit=N`` int64 little-endian keys held, ascending, above ``K``
``POST /v1/lookup``                      JSON ``{"table": T, "ids": [...]}`` -> ``{"generation",
                                         "seq", "rows": [[float, ...], ...]}`` (decoded; a ZCH
                                         table answers an id it does not hold with key -1's row)
``GET /v1/freshness``                    the latest dumps made visible: ``[{generation, seq,
                                         taken_at, visible_at}]``
``GET /metrics``                         Prometheus text (:mod:`deltarec.serving.metrics`)
=======================================  ==========================================================

Every read answers from one pinned snapshot: all of a dump or none of it. Errors come back as
JSON ``{"error": message}`` with 400 (bad request), 404 (unknown table or path) or 503 (not
ready).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import torch
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from deltarec.errors import BadInputError
from deltarec.serving.follow import Follower
from deltarec.serving.metrics import ReplicaMetrics
from deltarec.serving.table import decode_rows
from deltarec.serving.types import NotReadyError, UnknownTableError

log = logging.getLogger(__name__)

MAX_KEYS = 1 << 22
"""The most keys one ``/v1/rows`` or ``/v1/keys`` request takes or returns."""


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    # ---- plumbing --------------------------------------------------------------------------
    def _send(
        self, code: int, body: bytes, ctype: str, headers: dict[str, str] | None = None
    ) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def _json(self, code: int, obj: Any) -> None:
        self._send(code, json.dumps(obj).encode(), "application/json")

    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _route(self, method: str) -> None:
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        handler = getattr(self, f"_{method}_{url.path.strip('/').replace('/', '_')}", None)
        if handler is None:
            self._json(404, {"error": f"no {method.upper()} {url.path}"})
            return
        try:
            handler(query)
        except UnknownTableError as e:
            self._json(404, {"error": str(e)})
        except NotReadyError as e:
            self._json(503, {"error": str(e)})
        except (BadInputError, ValueError, KeyError) as e:
            self._json(400, {"error": str(e)})

    def do_GET(self) -> None:
        self._route("get")

    def do_POST(self) -> None:
        self._route("post")

    # ---- endpoints -------------------------------------------------------------------------
    def _get_healthz(self, _: dict[str, str]) -> None:
        self._send(200, b"ok\n", "text/plain")

    def _get_readyz(self, _: dict[str, str]) -> None:
        ready = self.server.follower.replica.current is not None
        self._send(200 if ready else 503, b"ready\n" if ready else b"not ready\n", "text/plain")

    def _get_v1_status(self, _: dict[str, str]) -> None:
        self._json(200, self.server.follower.status().to_json())

    def _get_v1_tables(self, _: dict[str, str]) -> None:
        self._json(200, self.server.follower.status().tables)

    def _get_v1_freshness(self, _: dict[str, str]) -> None:
        visible = list(self.server.follower.replica.visible)
        self._json(
            200,
            [
                {
                    "generation": v.generation,
                    "seq": v.seq,
                    "taken_at": v.taken_at,
                    "visible_at": v.visible_at,
                }
                for v in visible
            ],
        )

    def _get_metrics(self, _: dict[str, str]) -> None:
        self._send(200, generate_latest(self.server.metrics.registry), CONTENT_TYPE_LATEST)

    def _post_v1_rows(self, query: dict[str, str]) -> None:
        table = query["table"]
        body = self._body()
        if len(body) % 8:
            raise BadInputError(f"/v1/rows: the body holds {len(body)} bytes, not int64 keys")
        keys = np.frombuffer(body, dtype="<i8")
        if len(keys) > MAX_KEYS:
            raise BadInputError(f"/v1/rows: {len(keys)} keys, at most {MAX_KEYS} per request")
        t0 = time.perf_counter()
        with self.server.follower.replica.pinned() as snap:
            state = snap.table(table)
            found, versions, rows = state.read(keys)
            position = snap.position
        self.server.metrics.lookups.labels(table).inc(len(keys))
        self.server.metrics.lookup_seconds.observe(time.perf_counter() - t0)
        payload = (
            found.astype(np.uint8).tobytes()
            + versions.astype("<i8").tobytes()
            + np.ascontiguousarray(rows).tobytes()
        )
        headers = {
            "X-Deltarec-Rows": str(len(keys)),
            "X-Deltarec-Width": str(rows.shape[1]),
            "X-Deltarec-Dtype": state.spec.dtype.value,
            "X-Deltarec-Generation": str(position.generation),
            "X-Deltarec-Seq": str(position.seq),
        }
        self._send(200, payload, "application/octet-stream", headers)

    def _get_v1_keys(self, query: dict[str, str]) -> None:
        table = query["table"]
        limit = min(int(query.get("limit", 65536)), MAX_KEYS)
        with self.server.follower.replica.pinned() as snap:
            keys = snap.table(table).keys_np
            if "after" in query:
                keys = keys[np.searchsorted(keys, int(query["after"]), side="right") :]
            out = np.ascontiguousarray(keys[:limit], dtype="<i8")
        self._send(200, out.tobytes(), "application/octet-stream")

    def _post_v1_lookup(self, _: dict[str, str]) -> None:
        try:
            req = json.loads(self._body() or b"{}")
            table, ids = str(req["table"]), [int(i) for i in req["ids"]]
        except (json.JSONDecodeError, TypeError) as e:
            raise BadInputError(f'/v1/lookup: expected {{"table": T, "ids": [...]}}: {e}') from e
        t0 = time.perf_counter()
        with self.server.follower.replica.pinned() as snap:
            state = snap.table(table)
            rows, _found = state.lookup(torch.tensor(ids, dtype=torch.int64))
            values = decode_rows(rows, state.spec).cpu().tolist()
            position = snap.position
        self.server.metrics.lookups.labels(table).inc(len(ids))
        self.server.metrics.lookup_seconds.observe(time.perf_counter() - t0)
        self._json(200, {"generation": position.generation, "seq": position.seq, "rows": values})


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], follower: Follower) -> None:
        super().__init__(address, _Handler)
        self.follower = follower
        self.metrics = ReplicaMetrics(follower)


class ReplicaServer:
    """Serves a follower's replica over HTTP on a background thread.

    Args:
        follower: the follower (its replica answers the reads).
        host: the address to listen on.
        port: the port (0: any free one; see :attr:`port`).
    """

    def __init__(self, follower: Follower, host: str = "127.0.0.1", port: int = 0) -> None:
        self._server = _Server((host, port), follower)
        self.host = host
        self.port: int = int(self._server.server_address[1])
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """``replica://host:port``: the store URL ``deltarec verify --store`` takes."""
        return f"replica://{self.host}:{self.port}"

    @property
    def metrics(self) -> ReplicaMetrics:
        """The metrics served at ``/metrics``."""
        return self._server.metrics

    def start(self) -> ReplicaServer:
        """Start answering requests (returns self)."""
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="deltarec-replica-http", daemon=True
        )
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Answer requests on this thread until :meth:`close` (from another thread)."""
        self._server.serve_forever()

    def close(self) -> None:
        """Stop answering and release the port (idempotent)."""
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(10)
            self._thread = None
        self._server.server_close()

    def __enter__(self) -> ReplicaServer:
        return self.start()

    def __exit__(self, *_: Any) -> None:
        self.close()


__all__ = ["MAX_KEYS", "ReplicaServer"]
