"""Redis store: one hash per table, field = key, value = 8-byte version + packed row (SPEC §5).

Layout (``prefix`` defaults to ``emb:``; ``~`` cannot occur in a table id, so registry keys
never collide with a view):

* ``emb:<table id>``: the live view, a hash ``key (decimal) -> version (int64, little-endian)
  + encoded row``. A reader does ``HGET emb:sparse.ebc.user_id 42`` and skips 8 bytes.
* ``emb:~tomb:<table id>``: tombstones ``key -> version`` of deleted keys.
* ``emb:~stage:<G>:<table id>``: generation ``G``'s staging view, values ``version + op byte +
  row``.
* ``emb:~floors``, ``emb:~views``, ``emb:~gens:<run>``, ``emb:~progress:<run>:<G>``,
  ``emb:~snapshots:<run>``, ``emb:~serving:<run>``, ``emb:~fresh:<run>``: the registry.

A batch is one ``MULTI``/``EXEC`` pipeline of server-side Lua scripts that apply the version
guard per row, plus the progress mark, so rows and mark commit together. Snapshot replacement
and ``merge_staging`` walk a hash with ``HSCAN`` and apply an atomic script per chunk: each step
is version-guarded and idempotent, so an interrupted merge is finished by running it again,
but a whole generation does not become visible in one instant (``atomic_merge = False``).
"""

from __future__ import annotations

import json
import struct
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import redis as redis_lib
from redis.backoff import NoBackoff
from redis.retry import Retry

from deltarec.artifacts.types import DType, TableSpec
from deltarec.errors import (
    BadInputError,
    StaleGenerationError,
    StoreError,
    ViewMismatchError,
)
from deltarec.ids import make_version, validate_run, validate_table_id
from deltarec.stores.base import Registry, Store
from deltarec.stores.config import RedisConfig, env_password
from deltarec.stores.errors import DriverErrors
from deltarec.stores.redislua import (
    LUA_FLOOR,
    LUA_MERGE,
    LUA_REGISTER,
    LUA_SWEEP,
    LUA_WRITE,
    pack_version,
)
from deltarec.stores.rows import checked_arrays
from deltarec.stores.types import (
    Capabilities,
    FreshnessRecord,
    ProgressMark,
    ReadResult,
    ServingPointer,
    SnapshotRecord,
    ViewInfo,
)

_SCAN_CHUNK = 1000
_READ_CHUNK = 10000
_ERRORS = DriverErrors(
    redis_lib.RedisError,
    lambda e: isinstance(e, (redis_lib.ConnectionError, redis_lib.TimeoutError)),
)
"""redis-py's errors as the store contract's (see :mod:`deltarec.stores.errors`)."""


class RedisStore(Store, Registry):
    """The Redis backend (redis-py). The client is thread-safe (a connection pool).

    Args:
        config: the parsed ``redis://`` URL.
    """

    kind = "redis"
    capabilities = Capabilities(
        deletes=True,
        atomic_marks=True,
        atomic_merge=False,
        staging=True,
        scan=True,
        snapshot_replace=True,
    )

    def __init__(self, config: RedisConfig) -> None:
        self.config = config
        self.prefix = config.prefix
        self._client = redis_lib.Redis(
            host=config.host,
            port=config.port,
            db=config.db,
            username=config.username,
            password=env_password("REDIS_PASSWORD"),
            socket_timeout=config.socket_timeout_s,
            socket_connect_timeout=config.socket_timeout_s,
            retry=Retry(NoBackoff(), 0),  # the publisher's retry policy decides, visibly
        )
        self._write_script = self._client.register_script(LUA_WRITE)
        self._merge_script = self._client.register_script(LUA_MERGE)
        self._sweep_script = self._client.register_script(LUA_SWEEP)
        self._floor_script = self._client.register_script(LUA_FLOOR)
        self._register_script = self._client.register_script(LUA_REGISTER)
        self._lock = threading.RLock()
        self._views_cache: dict[tuple[str, int], ViewInfo] = {}
        with _ERRORS.map_errors(self.describe()):
            self._client.ping()

    def describe(self) -> str:
        """``redis://host:port/db``."""
        return f"redis://{self.config.host}:{self.config.port}/{self.config.db}"

    # ---- key names -----------------------------------------------------------------------
    def _hash(self, table: str, stage: int = 0) -> str:
        validate_table_id(table)
        return f"{self.prefix}~stage:{stage}:{table}" if stage else f"{self.prefix}{table}"

    def _reg(self, name: str, *parts: object) -> str:
        return ":".join([f"{self.prefix}~{name}", *(str(p) for p in parts)])

    # ---- views ---------------------------------------------------------------------------
    def provision(
        self, tables: Mapping[str, TableSpec], staging_generation: int | None = None
    ) -> dict[str, ViewInfo]:
        """See :meth:`Store.provision` (records the views; hashes appear on first write)."""
        stage = int(staging_generation or 0)
        out: dict[str, ViewInfo] = {}
        with _ERRORS.map_errors(self.describe()):
            for table, spec in tables.items():
                view = ViewInfo(table, self._hash(table, stage), spec.dim, DType(spec.dtype), stage)
                field = f"{table}|{stage}"
                record = json.dumps({"dim": view.dim, "dtype": view.dtype.value})
                if not self._client.hsetnx(self._reg("views"), field, record):
                    raw = self._client.hget(self._reg("views"), field)
                    old = json.loads(raw or "{}")
                    existing = ViewInfo(
                        table, view.name, int(old["dim"]), DType(old["dtype"]), stage
                    )
                    if (existing.dim, existing.dtype) != (view.dim, view.dtype):
                        raise ViewMismatchError(
                            view.name, existing.describe(), f"{view.describe()} (table {table!r})"
                        )
                out[table] = view
        self._views_cache.clear()
        return out

    def _records(self, key: str) -> list[tuple[str, Any]]:
        """Every field of the registry hash ``key`` with its JSON record, decoded."""
        with _ERRORS.map_errors(self.describe()):
            raw = self._client.hgetall(key)
        return [(_text(field), json.loads(value)) for field, value in raw.items()]

    def _all_views(self) -> list[ViewInfo]:
        views = []
        for field, obj in self._records(self._reg("views")):
            table, _, stage = field.rpartition("|")
            views.append(
                ViewInfo(
                    table,
                    self._hash(table, int(stage)),
                    int(obj["dim"]),
                    DType(obj["dtype"]),
                    int(stage),
                )
            )
        return views

    def views(self, staging_generation: int | None = None) -> dict[str, ViewInfo]:
        """See :meth:`Store.views`."""
        stage = int(staging_generation or 0)
        return {v.table: v for v in self._all_views() if v.staging_generation == stage}

    def _view(self, table: str, staging_generation: int | None = None) -> ViewInfo:
        key = (table, int(staging_generation or 0))
        if key not in self._views_cache:
            for v in self._all_views():
                self._views_cache[(v.table, v.staging_generation)] = v
        try:
            return self._views_cache[key]
        except KeyError:
            raise BadInputError(
                f"table {table!r} is not provisioned in {self.describe()}; "
                "run `deltarec provision` first"
            ) from None

    # ---- rows ----------------------------------------------------------------------------
    def write(
        self,
        table: str,
        keys: np.ndarray,
        embedding: np.ndarray,
        ops: np.ndarray,
        versions: np.ndarray,
        mark: ProgressMark | None = None,
        staging_generation: int | None = None,
    ) -> int:
        """See :meth:`Store.write`: one MULTI/EXEC of version-guarded scripts and the mark."""
        stage = int(staging_generation or 0)
        view = self._view(table, stage)
        keys, ops, versions = checked_arrays(table, view, keys, embedding, ops, versions)
        n = int(keys.shape[0])
        row_width = embedding.shape[1] * embedding.itemsize
        records = np.empty(n, np.dtype([("v", "<i8"), ("e", np.void, row_width)]))
        records["v"] = versions
        records["e"] = (
            np.ascontiguousarray(embedding).view(np.dtype((np.void, row_width))).reshape(n)
        )
        blob = records.tobytes()
        stride = 8 + row_width
        op_chars = (ops.astype(np.uint8) + ord("0")).tobytes()
        key_text = [str(k) for k in keys.tolist()]
        live = self._hash(table)

        def queue(pipe: Any) -> None:
            step = self.config.rows_per_script
            for s in range(0, n, step):
                e = min(n, s + step)
                self._write_script(
                    keys=[view.name, self._reg("tomb", table), self._reg("floors"), live],
                    args=[
                        e - s,
                        stride,
                        blob[s * stride : e * stride],
                        op_chars[s:e],
                        "1" if stage else "0",
                        *key_text[s:e],
                    ],
                    client=pipe,
                )
            if mark is not None:
                self._mark(pipe, mark, stage)

        self._execute_fenced(queue, mark)
        return n

    def _execute_fenced(self, queue: Callable[[Any], None], mark: ProgressMark | None) -> None:
        """One MULTI/EXEC of what ``queue`` adds; with a mark, fenced by its generation.

        The run's newest-generation key is WATCHed: a registration of a newer generation
        between the check and EXEC aborts the transaction, which is then checked again.
        """
        with _ERRORS.map_errors(self.describe()):
            for _ in range(20):
                pipe = self._client.pipeline(transaction=True)
                try:
                    if mark is not None:
                        key = self._reg("newest", mark.run)
                        pipe.watch(key)
                        newest = pipe.get(key)
                        if newest is not None and int(newest) > mark.generation:
                            raise StaleGenerationError(
                                self.describe(), mark.run, mark.generation, int(newest)
                            )
                        pipe.multi()
                    queue(pipe)
                    pipe.execute()
                    return
                except redis_lib.WatchError:
                    continue
                finally:
                    pipe.reset()
            raise StoreError(f"{self.describe()}: the write kept racing with registrations")

    def _mark(self, pipe: Any, mark: ProgressMark, stage: int) -> None:
        validate_run(mark.run)
        record = {
            "rows": mark.rows,
            "complete": mark.complete,
            "staging_generation": stage,
            "written_at": time.time(),
        }
        pipe.hset(
            self._reg("progress", mark.run, mark.generation),
            f"{mark.seq}|{mark.table}|{mark.rank}",
            json.dumps(record),
        )

    def record_progress(self, mark: ProgressMark) -> None:
        """See :meth:`Registry.record_progress`."""
        self._execute_fenced(lambda pipe: self._mark(pipe, mark, mark.staging_generation), mark)

    def read(
        self, table: str, keys: np.ndarray, staging_generation: int | None = None
    ) -> ReadResult:
        """See :meth:`Store.read`."""
        view = self._view(table, staging_generation)
        keys = np.asarray(keys, dtype=np.int64)
        out = ReadResult.none_found(view, len(keys))
        skip = 9 if view.staging_generation else 8  # a staged row carries its op byte
        with _ERRORS.map_errors(self.describe()):
            for s in range(0, len(keys), _READ_CHUNK):
                fields = [str(k) for k in keys[s : s + _READ_CHUNK].tolist()]
                for i, value in enumerate(self._client.hmget(view.name, fields), start=s):
                    if value is None or (skip == 9 and value[8:9] == b"1"):
                        continue
                    out.found[i] = True
                    raw = bytes(value)  # type: ignore[arg-type]
                    out.versions[i] = struct.unpack_from("<q", raw)[0]
                    out.embedding[i] = np.frombuffer(raw, dtype=out.embedding.dtype, offset=skip)
        return out

    def scan_keys(self, table: str, batch_rows: int = 65536) -> Iterator[np.ndarray]:
        """See :meth:`Store.scan_keys` (hash order, not sorted)."""
        name = self._view(table).name
        for fields in self._hscan(name, batch_rows):
            yield np.asarray([int(f) for f in fields], dtype=np.int64)

    def _hscan(self, name: str, count: int) -> Iterator[list[bytes]]:
        cursor = 0
        while True:
            with _ERRORS.map_errors(self.describe()):
                cursor, page = self._client.hscan(name, cursor, count=count)
            if page:
                yield [bytes(f) for f in page]  # type: ignore[arg-type]
            if cursor == 0:
                return

    def _chunked(self, name: str, fn: Callable[[list[bytes]], Any]) -> None:
        for fields in self._hscan(name, _SCAN_CHUNK):
            for s in range(0, len(fields), _SCAN_CHUNK):
                with _ERRORS.map_errors(self.describe()):
                    fn(fields[s : s + _SCAN_CHUNK])

    # ---- snapshot / staging --------------------------------------------------------------
    def sweep_below(self, table: str, version: int) -> None:
        """See :meth:`Store.sweep_below` (floor first, then a chunked, guarded sweep)."""
        self._view(table)
        self._sweep(table, int(version))

    def snapshot(self, run: str, generation: int, seq: int, table: str) -> SnapshotRecord | None:
        """See :meth:`Registry.snapshot`."""
        with _ERRORS.map_errors(self.describe()):
            raw = self._client.hget(self._reg("snapshots", run), f"{generation}|{seq}|{table}")
        if raw is None:
            return None
        r = json.loads(raw)
        swept = r["swept_at"]
        return SnapshotRecord(
            run,
            generation,
            seq,
            table,
            int(r["staging_generation"]),
            int(r["version"]),
            None if swept is None else float(swept),
        )

    def record_snapshot(self, record: SnapshotRecord) -> None:
        """See :meth:`Registry.record_snapshot`."""
        validate_run(record.run)
        value = {
            "version": record.version,
            "staging_generation": record.staging_generation,
            "swept_at": record.swept_at,
        }
        field = f"{record.generation}|{record.seq}|{record.table}"
        with _ERRORS.map_errors(self.describe()):
            self._client.hset(self._reg("snapshots", record.run), field, json.dumps(value))

    def _sweep(self, table: str, version: int) -> None:
        live = self._hash(table)
        packed = pack_version(version)
        with _ERRORS.map_errors(self.describe()):
            self._floor_script(keys=[self._reg("floors")], args=[live, packed])
        for name in (live, self._reg("tomb", table)):

            def sweep(fields: list[bytes], name: str = name) -> None:
                self._sweep_script(keys=[name], args=[packed, *fields])

            self._chunked(name, sweep)

    def merge_staging(self, run: str, generation: int) -> int:
        """See :meth:`Store.merge_staging`: chunked, guarded, idempotent; not one transaction."""
        validate_run(run)
        merged = 0
        snapshots = self._records(self._reg("snapshots", run))
        for stage in [v for v in self._all_views() if v.staging_generation == generation]:
            live = self._hash(stage.table)
            keys = [stage.name, live, self._reg("tomb", stage.table), self._reg("floors")]

            def merge(fields: list[bytes], keys: list[str] = keys) -> None:
                nonlocal merged
                merged += int(self._merge_script(keys=keys, args=fields))

            while True:
                self._chunked(stage.name, merge)
                with _ERRORS.map_errors(self.describe()):
                    if not self._client.hlen(stage.name):
                        break
            for field, record in snapshots:
                g, _, t = field.split("|", 2)
                if int(g) == generation and t == stage.table and record["swept_at"] is None:
                    self._sweep(stage.table, int(record["version"]))
                    record["swept_at"] = time.time()
                    with _ERRORS.map_errors(self.describe()):
                        self._client.hset(self._reg("snapshots", run), field, json.dumps(record))
            with _ERRORS.map_errors(self.describe()):
                self._client.hdel(self._reg("views"), f"{stage.table}|{generation}")
        self._set_gen_field(run, generation, "merged_at", time.time())
        self._views_cache.clear()
        return merged

    def drop_staging(self, run: str, generation: int) -> int:
        """See :meth:`Store.drop_staging`."""
        validate_run(run)
        stages = [v for v in self._all_views() if v.staging_generation == generation]
        for stage in stages:
            with _ERRORS.map_errors(self.describe()):
                self._client.delete(stage.name)
                self._client.hdel(self._reg("views"), f"{stage.table}|{generation}")
        self._views_cache.clear()
        return len(stages)

    # ---- registry ------------------------------------------------------------------------
    def _set_gen_field(self, run: str, generation: int, field: str, value: float) -> None:
        key = self._reg("gens", run)
        with _ERRORS.map_errors(self.describe()):
            raw = self._client.hget(key, str(generation))
            record = json.loads(raw) if raw else {"registered_at": value}
            record[field] = value
            self._client.hset(key, str(generation), json.dumps(record))

    def register_generation(self, run: str, generation: int) -> None:
        """See :meth:`Registry.register_generation`."""
        validate_run(run)
        record = json.dumps({"registered_at": time.time()})
        with _ERRORS.map_errors(self.describe()):
            self._register_script(
                keys=[self._reg("gens", run), self._reg("newest", run)],
                args=[str(int(generation)), record],
            )

    def generations(self, run: str) -> list[int]:
        """See :meth:`Registry.generations`."""
        with _ERRORS.map_errors(self.describe()):
            return sorted(int(g) for g in self._client.hkeys(self._reg("gens", run)))

    def progress(self, run: str, generation: int) -> list[ProgressMark]:
        """See :meth:`Registry.progress`."""
        marks = []
        for field, r in self._records(self._reg("progress", run, generation)):
            seq, table, rank = field.split("|")
            marks.append(
                ProgressMark(
                    run,
                    generation,
                    int(seq),
                    table,
                    int(rank),
                    int(r["rows"]),
                    bool(r["complete"]),
                    int(r["staging_generation"]),
                    float(r["written_at"]),
                )
            )
        return sorted(marks, key=lambda m: (m.seq, m.table, m.rank))

    def record_freshness(self, record: FreshnessRecord) -> None:
        """See :meth:`Registry.record_freshness` (the first record is kept)."""
        value = json.dumps({"committed_at": record.committed_at, "visible_at": record.visible_at})
        with _ERRORS.map_errors(self.describe()):
            self._client.hsetnx(
                self._reg("fresh", record.run),
                f"{record.generation}|{record.seq}|{record.rank}",
                value,
            )

    def freshness(self, run: str, generation: int | None = None) -> list[FreshnessRecord]:
        """See :meth:`Registry.freshness`."""
        out = []
        for field, obj in self._records(self._reg("fresh", run)):
            g, s, r = (int(p) for p in field.split("|"))
            if generation is None or g == generation:
                out.append(FreshnessRecord(run, g, s, r, obj["committed_at"], obj["visible_at"]))
        return sorted(out, key=lambda f: (f.generation, f.seq, f.rank))

    def set_serving(self, run: str, generation: int, seq: int, note: str = "") -> ServingPointer:
        """See :meth:`Registry.set_serving`."""
        validate_run(run)
        make_version(generation, seq)
        last = self.get_serving(run)
        now = max(time.time(), (last.promoted_at + 1e-6) if last else 0.0)
        pointer = ServingPointer(run, generation, seq, now, note)
        record = {"generation": generation, "seq": seq, "promoted_at": now, "note": note}
        with _ERRORS.map_errors(self.describe()):
            self._client.rpush(self._reg("serving", run), json.dumps(record))
        return pointer

    def serving_history(self, run: str) -> list[ServingPointer]:
        """See :meth:`Registry.serving_history`."""
        with _ERRORS.map_errors(self.describe()):
            raw = self._client.lrange(self._reg("serving", run), 0, -1)
        out = []
        for value in raw:
            o = json.loads(value)
            out.append(ServingPointer(run, o["generation"], o["seq"], o["promoted_at"], o["note"]))
        return out

    def close(self) -> None:
        """Close the connection pool (idempotent)."""
        self._client.close()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
