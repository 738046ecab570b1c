"""The replica's HTTP API, an ASGI application (served by uvicorn: :mod:`deltarec.serving.http`).

=======================================  ==========================================================
request                                  answer
=======================================  ==========================================================
``GET /healthz``                         200 while the process runs
``GET /readyz``                          200 once a generation is served and its run serves; 503
``GET /v1/status``                       :class:`~deltarec.stores.ReplicaStatus` as JSON
                                         (without store details: see :func:`public_status`)
``GET /v1/tables``                       table id -> ``{dim, dtype, kind, rows}``
``POST /v1/rows?table=T``                body: int64 little-endian keys; answer: ``found`` (uint8
                                         ``[n]``), ``versions`` (int64 ``[n]``), then the encoded
                                         rows ``[n, width]`` as stored, little-endian; headers
                                         ``X-Deltarec-Rows``, ``-Width``, ``-Dtype``,
                                         ``-Generation``, ``-Seq`` (the snapshot read)
``GET /v1/keys?table=T&after=K&limit=N`` int64 little-endian keys held, ascending, above ``K``
``POST /v1/lookup``                      JSON ``{"table": T, "ids": [...]}`` -> ``{"generation",
                                         "seq", "rows": [[float, ...], ...]}`` (decoded; a ZCH
                                         table answers an id it does not hold with key -1's row);
                                         with ``Accept: application/octet-stream``: float32
                                         little-endian ``[n, dim]``, headers ``X-Deltarec-Rows``,
                                         ``-Dim``, ``-Generation``, ``-Seq``
``GET /v1/freshness``                    the latest dumps made visible: ``[{generation, seq,
                                         taken_at, visible_at}]``
``POST /v1/score``                       with ``deltarec serve --score``: the example model's
                                         scores from the served point's dense and sparse state
                                         (:mod:`deltarec.serving.score`)
``GET /metrics``                         Prometheus text (:mod:`deltarec.serving.metrics`)
=======================================  ==========================================================

Every read answers from one pinned snapshot: all of a dump or none of it. Errors come back as
JSON ``{"error": message}``: 400 (malformed), 401 (``/v1/*`` without the bearer token, when
one is set), 404 (unknown table or path), 408 (a body not received in time), 413 (over a
bound of :class:`~deltarec.serving.limits.ServeLimits`, with ``X-Deltarec-Max-Keys``), 503
(not ready; or busy, with ``Retry-After``). Every bound is checked before the body is read or
the work is done, and each request holds its bytes (body and answer) in one budget while in
flight, so the replica's memory stays bounded whatever clients send.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from deltarec.artifacts import codec
from deltarec.errors import BadInputError
from deltarec.serving.asgi import Budget, Refused, Request
from deltarec.serving.follow import Follower
from deltarec.serving.limits import JSON_VALUE_BYTES, ServeLimits
from deltarec.serving.metrics import ReplicaMetrics
from deltarec.serving.table import TableState, decode_rows
from deltarec.serving.types import NotReadyError, UnknownTableError

if TYPE_CHECKING:
    from deltarec.serving.score import ExampleScorer

log = logging.getLogger(__name__)

STATUS_ERROR = "the last follow round failed; the replica's log holds the details"
"""What ``GET /v1/status`` answers in ``error`` (the text may name the store's host or user)."""

_JSON_VALUES_PER_PIECE = 1 << 16
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://\S+")

Handler = Callable[[Request], Awaitable[None]]


def public_status(status: dict[str, Any]) -> dict[str, Any]:
    """``status`` as ``GET /v1/status`` answers it: no store host, user, database or URL.

    A failed round's text (``error``) may quote the store's connection error, so it is
    replaced by :data:`STATUS_ERROR` (the log keeps it); every URL in any other text is cut
    to its scheme.
    """
    out = dict(status)
    if out.get("error"):
        out["error"] = STATUS_ERROR
    return _scrub(out)  # type: ignore[no-any-return]


def _scrub(value: Any) -> Any:
    if isinstance(value, str):
        return _URL.sub(lambda m: m.group(0).split("://", 1)[0] + "://...", value)
    if isinstance(value, dict):
        return {k: _scrub(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_scrub(v) for v in value]
    return value


class ReplicaApp:
    """The replica's HTTP API (an ASGI 3 application).

    Args:
        follower: the follower whose replica answers the reads.
        metrics: where lookups and refusals are counted (served at ``/metrics``).
        limits: the bounds every request is checked against.
        token: the bearer token ``/v1/*`` requires (None: open).
        scorer: answers ``POST /v1/score`` from the served point (:mod:`deltarec.serving.score`);
            None: no such endpoint.
    """

    def __init__(
        self,
        follower: Follower,
        metrics: ReplicaMetrics,
        limits: ServeLimits,
        token: str | None = None,
        scorer: ExampleScorer | None = None,
    ) -> None:
        self.follower, self.metrics, self.limits = follower, metrics, limits
        self._token = token.encode() if token else None
        self._budget = Budget(limits.max_inflight_bytes)
        self._pool = ThreadPoolExecutor(limits.max_workers, thread_name_prefix="deltarec-replica")
        self._routes: dict[tuple[str, str], Handler] = {
            ("GET", "/healthz"): self._healthz,
            ("GET", "/readyz"): self._readyz,
            ("GET", "/metrics"): self._metrics,
            ("GET", "/v1/status"): self._status,
            ("GET", "/v1/tables"): self._tables,
            ("GET", "/v1/freshness"): self._freshness,
            ("GET", "/v1/keys"): self._keys,
            ("POST", "/v1/rows"): self._rows,
            ("POST", "/v1/lookup"): self._lookup,
        }
        if scorer is not None:
            self._routes[("POST", "/v1/score")] = self._scorer(scorer)

    def close(self) -> None:
        """Stop the worker threads (requests still in flight get no answer)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Answer one ASGI ``http`` request (every failure before the answer is an answer)."""
        if scope["type"] != "http":
            return
        req = Request(scope, receive, send, self.limits.request_timeout_s)
        try:
            handler = self._routes.get((req.method, req.path))
            if handler is None:
                raise Refused(404, f"no {req.method} {req.path}")
            if req.path.startswith("/v1/"):
                self._authorize(req)
            await handler(req)
        except TimeoutError as e:
            if not req.started:
                await self._refuse(req, e)
                return
            # The client did not read the answer in time: returning unfinished makes the
            # server close the connection, which frees the request's bytes.
            log.warning(
                "replica: %s %s: the client did not read the answer within %g s; closed",
                req.method,
                req.path,
                self.limits.request_timeout_s,
            )
        except Exception as e:  # every failure before the answer is an answer
            if req.started:
                raise
            await self._refuse(req, e)

    async def _refuse(self, req: Request, e: Exception) -> None:
        if isinstance(e, Refused):
            status, message, headers = e.status, e.message, e.headers
        elif isinstance(e, UnknownTableError):
            status, message, headers = 404, str(e), {}
        elif isinstance(e, NotReadyError):
            status, message, headers = 503, str(e), {}
        elif isinstance(e, BadInputError):
            status, message, headers = 400, str(e), {}
        else:
            log.exception("replica: %s %s failed", req.method, req.path)
            status, message, headers = 500, f"{req.path}: internal error ({type(e).__name__})", {}
        self.metrics.refused.labels(str(status)).inc()
        await req.error(status, message, headers)

    def _authorize(self, req: Request) -> None:
        if self._token is None:
            return
        scheme, _, given = req.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self._token):
            return
        raise Refused(
            401,
            f"{req.path}: this replica requires a bearer token (Authorization: Bearer ...)",
            {"WWW-Authenticate": 'Bearer realm="deltarec"'},
        )

    async def _work(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on a worker thread: the event loop goes on reading and writing meanwhile.

        Measured on a loaded 2-core machine, even a 1-id lookup is answered at about twice the
        rate this way than on the event loop (bench/bench_replica_load.py).
        """
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    def _table(self, name: str) -> TableState:
        snap = self.follower.replica.current
        if snap is None:
            raise NotReadyError(f"the replica of run {self.follower.run!r} holds no generation yet")
        return snap.table(name)

    async def _json(self, req: Request, obj: Any, status: int = 200) -> None:
        await req.answer(status, [json.dumps(obj).encode()], "application/json")

    # ---- open endpoints ----------------------------------------------------------------------
    async def _healthz(self, req: Request) -> None:
        await req.answer(200, [b"ok\n"], "text/plain")

    async def _readyz(self, req: Request) -> None:
        ready, why = self.follower.readiness()
        await req.answer(200 if ready else 503, [f"{why}\n".encode()], "text/plain")

    async def _metrics(self, req: Request) -> None:
        await req.answer(200, [generate_latest(self.metrics.registry)], CONTENT_TYPE_LATEST)

    # ---- /v1 ---------------------------------------------------------------------------------
    async def _status(self, req: Request) -> None:
        await self._json(req, public_status(self.follower.status().to_json()))

    async def _tables(self, req: Request) -> None:
        await self._json(req, self.follower.status().tables)

    async def _freshness(self, req: Request) -> None:
        visible = list(self.follower.replica.visible)
        await self._json(
            req,
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

    async def _keys(self, req: Request) -> None:
        query = req.query()
        table = _text(query, "table", req.path)
        cap = min(self.limits.max_keys, self.limits.max_answer_bytes // 8)
        limit = min(_int(query, "limit", req.path, 65536, lo=0), cap)
        after = _int(query, "after", req.path, None)
        self._table(table)  # 404 / 503 before any room is taken

        def keys() -> np.ndarray:
            with self.follower.replica.pinned() as snap:
                held = snap.table(table).keys_np
                if after is not None:
                    held = held[np.searchsorted(held, after, side="right") :]
                return np.ascontiguousarray(held[:limit], dtype="<i8")

        async with self._budget.hold(limit * 8, self.limits.queue_timeout_s):
            out = await self._work(keys)
            await req.answer(200, [out], "application/octet-stream")

    async def _rows(self, req: Request) -> None:
        table = _text(req.query(), "table", req.path)
        state = self._table(table)
        row_bytes = (
            9
            + codec.encoded_width(state.spec.dtype, state.spec.dim)
            * np.dtype(codec.element_type(state.spec.dtype)).itemsize
        )
        most = self._most_keys(row_bytes, self.limits.max_keys)
        over = {"X-Deltarec-Max-Keys": str(most)}
        declared = req.content_length(
            most * 8,
            f"{req.path}: {req.headers.get('content-length', 0)} body bytes, over {most} keys of "
            f"table {table!r} ({row_bytes} answer bytes a key); at most {most} per request",
            over,
        )
        if declared is not None and declared % 8:
            raise BadInputError(f"{req.path}: the body holds {declared} bytes, not int64 keys")
        n_most = most if declared is None else declared // 8
        # The body and its keys, the rows read and the answer built from them: twice each.
        async with self._budget.hold(n_most * 2 * (8 + row_bytes), self.limits.queue_timeout_s):
            body = await req.body(most * 8, over)
            if len(body) % 8:
                raise BadInputError(f"{req.path}: the body holds {len(body)} bytes, not int64 keys")
            keys = np.frombuffer(body, dtype="<i8")
            found, versions, rows, position, state = await self._work(
                lambda: self._read(table, keys)
            )
            self.metrics.lookups.labels(table).inc(len(keys))
            headers = {
                "X-Deltarec-Rows": str(len(keys)),
                "X-Deltarec-Width": str(rows.shape[1]),
                "X-Deltarec-Dtype": state.spec.dtype.value,
                "X-Deltarec-Generation": str(position.generation),
                "X-Deltarec-Seq": str(position.seq),
            }
            parts = [found.astype(np.uint8), versions.astype("<i8"), np.ascontiguousarray(rows)]
            await req.answer(200, parts, "application/octet-stream", headers)

    def _read(self, table: str, keys: np.ndarray) -> tuple[Any, ...]:
        with self.metrics.lookup_seconds.time(), self.follower.replica.pinned() as snap:
            state = snap.table(table)
            found, versions, rows = state.read(keys)
            return found, versions, rows, snap.position, state

    async def _lookup(self, req: Request) -> None:
        declared = req.content_length(self.limits.max_body_bytes(rows=False))
        body_most = self.limits.max_body_bytes(rows=False) if declared is None else declared
        # Before the body is parsed its table is unknown: room for its ids (at least two bytes
        # each in the JSON) at the widest table; the exact bound is checked once parsed.
        snap = self.follower.replica.current
        widest = max((s.spec.dim for s in snap.tables.values()), default=1) if snap else 1
        ids_most = min(self.limits.max_ids, body_most // 2)
        answer_most = min(ids_most * widest * JSON_VALUE_BYTES, self.limits.max_answer_bytes)
        # The parsed ids take up to 8 bytes of list per 2 bytes of JSON (more for ids that are
        # not small ints, which take more JSON too); the rows looked up and decoded, 8 a value.
        answer_most += ids_most * widest * 8 + body_most * 8
        binary = "application/octet-stream" in req.headers.get("accept", "")
        async with self._budget.hold(body_most + answer_most, self.limits.queue_timeout_s):
            body = await req.body(self.limits.max_body_bytes(rows=False))
            table, ids, values, position = await self._work(
                lambda: self._lookup_rows(req.path, body, binary)
            )
            self.metrics.lookups.labels(table).inc(len(ids))
            if binary:
                headers = {
                    "X-Deltarec-Rows": str(values.shape[0]),
                    "X-Deltarec-Dim": str(values.shape[1]),
                    "X-Deltarec-Generation": str(position.generation),
                    "X-Deltarec-Seq": str(position.seq),
                }
                await req.answer(200, [values], "application/octet-stream", headers)
            else:
                await req.answer(200, values, "application/json")

    def _lookup_rows(self, path: str, body: bytes | bytearray, binary: bool) -> tuple[Any, ...]:
        """Parse, bound, look up and encode one lookup (on a worker thread).

        Returns ``(table, ids, answer, position)``: the answer is float32 little-endian
        ``[n, dim]`` when ``binary``, else the JSON text's pieces.
        """
        table, ids = _parse_lookup(body)
        dim = self._table(table).spec.dim
        most = self._most_keys(dim * (4 if binary else JSON_VALUE_BYTES), self.limits.max_ids)
        if len(ids) > most:
            raise Refused(
                413,
                f"{path}: {len(ids)} ids of table {table!r} (dim {dim}); at most {most} "
                "per request",
                {"X-Deltarec-Max-Keys": str(most)},
            )
        with self.metrics.lookup_seconds.time(), self.follower.replica.pinned() as snap:
            state = snap.table(table)
            position = snap.position
            if len(ids) == 0:  # no rows to decode (an int8 table's empty view cannot be)
                values = np.zeros((0, state.spec.dim), np.float32)
            else:
                rows, _found = state.lookup(torch.from_numpy(ids))
                values = decode_rows(rows, state.spec).cpu().numpy()
        if binary:
            return table, ids, np.ascontiguousarray(values, dtype="<f4"), position
        head = b'{"generation": %d, "seq": %d, "rows": [' % (position.generation, position.seq)
        return table, ids, [head, *_json_rows(values), b"]}"], position

    def _scorer(self, scorer: ExampleScorer) -> Handler:
        """``POST /v1/score``: bounded as a lookup (body and ids), scored on a worker thread."""

        async def score(req: Request) -> None:
            body_most = self.limits.max_body_bytes(rows=False)
            req.content_length(body_most)
            # working copies: the parsed ids and the rows they read (float32, at the widest dim)
            snap = self.follower.replica.current
            widest = max((t.spec.dim for t in snap.tables.values()), default=1) if snap else 1
            work = self.limits.max_ids * (8 + 4 * widest)
            async with self._budget.hold(body_most + work, self.limits.queue_timeout_s):
                body = await req.body(body_most)
                most = self.limits.max_ids
                inputs = await self._work(lambda: scorer.parse(body, most))
                answer = await self._work(lambda: scorer.score(inputs))
            await self._json(req, answer)

        return score

    def _most_keys(self, key_bytes: int, cap: int) -> int:
        """The most keys one request may name when each answers ``key_bytes`` bytes."""
        return max(1, min(cap, self.limits.max_answer_bytes // max(1, key_bytes)))


def _json_rows(values: np.ndarray) -> list[bytes]:
    """``values [n, dim]`` as the JSON items of a list of rows, a block of rows at a time.

    Only one block is ever Python floats (``tolist``), not the whole answer.
    """
    per = max(1, _JSON_VALUES_PER_PIECE // max(1, values.shape[1]))
    out: list[bytes] = []
    for i in range(0, values.shape[0], per):
        if out:
            out.append(b", ")
        out.append(json.dumps(values[i : i + per].tolist())[1:-1].encode())
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _parse_lookup(body: bytes | bytearray) -> tuple[str, np.ndarray]:
    """``{"table": T, "ids": [int, ...]}`` -> (table, int64 ids); anything else: 400."""
    expected = '/v1/lookup: expected {"table": "<table>", "ids": [<int64>, ...]}'
    try:
        req = json.loads(body or b"{}", parse_constant=_no_constant)
    except RecursionError as e:
        raise BadInputError(f"{expected}; the body nests too deeply") from e
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, NaN/Infinity
        raise BadInputError(f"{expected}; the body is not JSON: {e}") from e
    if not isinstance(req, dict):
        raise BadInputError(f"{expected}; got a JSON {type(req).__name__}")
    table, ids = req.get("table"), req.get("ids")
    if not isinstance(table, str) or not isinstance(ids, list):
        raise BadInputError(f"{expected}; got table {_kind(table)} and ids {_kind(ids)}")
    if not all(type(i) is int for i in ids):
        bad = next(i for i in ids if type(i) is not int)
        raise BadInputError(f"{expected}; an id is {_kind(bad)}: {json.dumps(bad)[:40]}")
    try:
        return table, np.array(ids, dtype=np.int64).reshape(-1)
    except OverflowError as e:
        raise BadInputError(f"{expected}; an id is outside int64") from e


def _kind(value: Any) -> str:
    return "missing" if value is None else f"a {type(value).__name__}"


def _text(query: dict[str, str], name: str, path: str) -> str:
    if name not in query:
        raise BadInputError(f"{path}: the query needs {name}=")
    return query[name]


def _int(query: dict[str, str], name: str, path: str, default: Any, lo: int = _INT64_MIN) -> Any:
    if name not in query:
        return default
    text = query[name]
    try:
        value = int(text)
    except ValueError as e:
        raise BadInputError(f"{path}: {name}={text[:32]!r} is not an integer") from e
    if not lo <= value <= _INT64_MAX:
        raise BadInputError(f"{path}: {name}={value} is outside [{lo}, {_INT64_MAX}]")
    return value


__all__ = ["STATUS_ERROR", "ReplicaApp", "public_status"]
