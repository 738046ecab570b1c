"""Redis store: one hash per table and run, field = key, value = 8-byte version + row (SPEC §5).

Layout (``prefix`` defaults to ``emb:``; ``~`` cannot occur in a table id, so registry keys
never collide with a view). Rows are kept per run (docs/runs.md):

* ``emb:<table id>``: the table's **serving name**, the live view of the run that serves it (the
  first run to provision the table, then the one promoted last), a hash ``key (decimal) ->
  version (int64, little-endian) + encoded row``. A reader does ``HGET emb:sparse.ebc.user_id
  42`` and skips 8 bytes.
* ``emb:~run:<run>:<table id>``: the live view of a run that does not serve the table (parked).
  Promote renames the serving run's hash here and the promoted run's hash to the serving name,
  in one script (:data:`~deltarec.stores.redis.lua.LUA_SWITCH`); every write, merge and read of a
  run's live view finds it wherever it is inside its own script, so none lands on the wrong run.
* ``emb:~tomb:<run>:<table id>``: tombstones ``key -> version`` of a run's deleted keys.
* ``emb:~stage:<run>:<G>:<table id>``: generation ``G``'s staging view, values ``version + op
  byte + row``.
* ``emb:~serves`` (table -> run), ``emb:~floors``, ``emb:~lows`` (per live view a version no
  row of it is below, so a snapshot's sweep of a view holding nothing older is not a scan),
  ``emb:~views``, ``emb:~gens:<run>``,
  ``emb:~progress:<run>:<G>``, ``emb:~snapshots:<run>``, ``emb:~serving:<run>``,
  ``emb:~fresh:<run>``, ``emb:~store`` (the store's random id, :meth:`Registry.store_uuid`):
  the registry.

A batch is one ``MULTI``/``EXEC`` pipeline of server-side Lua scripts that apply the version
guard per row, plus the progress mark, so rows and mark commit together. Snapshot replacement
and ``merge_staging`` are scripts that each take one ``HSCAN`` step of a hash on the server and
return the next cursor: each step is version-guarded and idempotent, so an interrupted merge is
finished by running it again, but a whole generation does not become visible in one instant
(``atomic_merge = False``). Reads and scans come back as one string of keys and one blob of
fixed-width values per script call (:mod:`deltarec.stores.redis.lua`), decoded with numpy;
with hiredis installed, a scan with rows reads plain ``HSCAN`` steps instead
(:mod:`deltarec.stores.redis.scan`).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np
import redis as redis_lib
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.utils import HIREDIS_AVAILABLE

from deltarec.artifacts.types import DType, TableSpec
from deltarec.errors import (
    BadInputError,
    StaleGenerationError,
    StoreError,
    ViewMismatchError,
)
from deltarec.ids import validate_run, validate_table_id
from deltarec.stores.base import Store, first_batch
from deltarec.stores.config import RedisConfig, env_password
from deltarec.stores.redis.legacy import RunlessKeys, migrate_runless
from deltarec.stores.redis.lua import (
    LUA_COUNT,
    LUA_FLOOR,
    LUA_MERGE,
    LUA_READ,
    LUA_REGISTER,
    LUA_SCAN,
    LUA_SWEEP,
    LUA_SWITCH,
    LUA_WRITE,
    pack_version,
    slow_commands,
)
from deltarec.stores.redis.paced import apply_paced, fsync_stall
from deltarec.stores.redis.plain import Outranked, PlainBatch, PlainKeys, write_plain
from deltarec.stores.redis.reads import RedisReads
from deltarec.stores.redis.registry import ERRORS as _ERRORS
from deltarec.stores.redis.registry import RedisRegistry
from deltarec.stores.redis.resp import hset_bodies
from deltarec.stores.rows import checked_arrays
from deltarec.stores.runviews import RunViews
from deltarec.stores.types import (
    Capabilities,
    ProgressMark,
    RowBatch,
    ViewInfo,
    Write,
)

_SWEEP_STEP = 4000
"""Fields per ``HSCAN`` step of a sweep or merge script (each step holds the server briefly)."""


class RedisStore(RedisRegistry, RunViews, RedisReads, Store):
    """The Redis backend (redis-py). The client is thread-safe (a connection pool).

    Args:
        config: the parsed ``redis://`` URL.
    """

    kind = "redis"
    watch_error = redis_lib.WatchError
    scan_on_client = HIREDIS_AVAILABLE
    """Scans with rows read plain ``HSCAN`` steps, parsed by hiredis
    (:mod:`deltarec.stores.redis.scan`); without hiredis, the scan script."""
    _layout_problem: str | None = None
    capabilities = Capabilities(
        deletes=True,
        atomic_marks=True,
        staging=True,
        scan=True,
        snapshot_replace=True,
        writes_block_reads=True,
        batch_bytes=64 << 20,
    )
    """``batch_bytes``: a write is one MULTI/EXEC per batch (8 MB read chunks from the publisher)
    and the mark with the last; several batches per write let the next one be encoded while
    the server applies this one (see :meth:`apply`), and a progress mark every 64 MB."""

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
        self._read_script = self._client.register_script(LUA_READ)
        self._count_script = self._client.register_script(LUA_COUNT)
        self._scan_script = self._client.register_script(LUA_SCAN)
        self._switch_script = self._client.register_script(LUA_SWITCH)
        self._lock = threading.RLock()
        self._held_s = 0.0
        self.last_write_held_s: float | None = None
        """Seconds the last write's transactions took, their encoding left out: what it held
        the server (and so every reader) at most. The read budget sizes writes by it."""
        self.server_timing = False
        """Time writes on the server (``EXEC``'s microseconds in ``INFO commandstats``, one
        more round trip a batch; set by the read budget): ``last_write_held_s`` then counts
        only the server's time (all clients' ``EXEC`` since the write before: never less)."""
        self._exec_usec: int | None = None
        self.unit_rows: int | None = None
        """Rows per server-side unit, set by the read budget: each batch is then written in
        units that reads interleave with, each a transaction of its own, not one
        ``MULTI``/``EXEC`` (see :mod:`deltarec.stores.redis.paced`); None: a transaction per
        batch."""
        self._sender: ThreadPoolExecutor | None = None  # see apply
        self._views_cache: dict[tuple[str, int], ViewInfo] = {}
        with _ERRORS.map_errors(self.describe()):
            self._client.ping()
            keys = RunlessKeys(
                self.prefix, self._reg, self._serving, self._parked, self._stage_hash
            )
            self._layout_problem = migrate_runless(
                self._client, keys, self.describe(), self.watch_error
            )
            if self._client.get(self._reg("store")) is None:  # kept once, by the first opener
                self._client.set(self._reg("store"), uuid.uuid4().hex, nx=True)

    def describe(self) -> str:
        """``redis://host:port/db``."""
        return f"redis://{self.config.host}:{self.config.port}/{self.config.db}"

    def read_stall_note(self) -> str | None:
        """What can stall this server's readers whatever a read budget does, or None.

        Its append-only file's fsync (:func:`~deltarec.stores.redis.paced.fsync_stall`).
        """
        return fsync_stall(self._client)

    def place(self) -> str:
        """See :meth:`Store.place`: server, database and key prefix."""
        c = self.config
        return f"redis://{c.host.lower()}:{c.port}/{c.db}?prefix={c.prefix}"

    # ---- key names -----------------------------------------------------------------------
    def _serving(self, table: str) -> str:
        validate_table_id(table)
        return f"{self.prefix}{table}"

    def _parked(self, run: str, table: str) -> str:
        return f"{self.prefix}~run:{run}:{table}"

    def _stage_hash(self, run: str, stage: int, table: str) -> str:
        return f"{self.prefix}~stage:{run}:{stage}:{table}"

    def _reg(self, name: str, *parts: object) -> str:
        return ":".join([f"{self.prefix}~{name}", *(str(p) for p in parts)])

    def _apply_keys(self, stage: str, run: str, table: str) -> list[str]:
        """The ``KEYS`` of :data:`LUA_WRITE` and :data:`LUA_MERGE`.

        ``stage`` is the staging view, or '' for a live write.
        """
        return [
            stage,
            self._reg("tomb", run, table),
            self._reg("floors"),
            self._parked(run, table),  # the floor's field: the same wherever the view is
            *self._live_keys(run, table),
            self._reg("lows"),
            self._reg("high", run, table),
        ]

    def _live_keys(self, run: str, table: str) -> list[str]:
        """The keys a script needs to find ``run``'s live view of ``table`` (see ``where``)."""
        return [self._reg("serves"), self._serving(table), self._parked(run, table)]

    # ---- views ---------------------------------------------------------------------------
    def provision(
        self, tables: Mapping[str, TableSpec], staging_generation: int | None = None
    ) -> dict[str, ViewInfo]:
        """See :meth:`Store.provision` (records the views; hashes appear on first write).

        A table no run serves yet is served by this run from now on (its serving name is this
        run's live view); a table another run serves keeps serving that run's rows until this
        run is promoted.
        """
        self._check_layout_problem()
        run = self._writer("provisioning views")
        stage = int(staging_generation or 0)
        out: dict[str, ViewInfo] = {}
        with _ERRORS.map_errors(self.describe()):
            for table, spec in tables.items():
                validate_table_id(table)
                name = self._stage_hash(run, stage, table) if stage else self._parked(run, table)
                view = ViewInfo(table, name, spec.dim, DType(spec.dtype), stage, run=run)
                field = f"{run}|{table}|{stage}"
                record = json.dumps({"dim": view.dim, "dtype": view.dtype.value})
                if not self._client.hsetnx(self._reg("views"), field, record):
                    raw = self._client.hget(self._reg("views"), field)
                    old = json.loads(raw or "{}")
                    existing = ViewInfo(
                        table, view.name, int(old["dim"]), DType(old["dtype"]), stage, run=run
                    )
                    if (existing.dim, existing.dtype) != (view.dim, view.dtype):
                        raise ViewMismatchError(
                            view.name, existing.describe(), f"{view.describe()} (table {table!r})"
                        )
                if not stage:
                    self._client.hsetnx(self._reg("serves"), table, run)
                out[table] = view
        self._views_cache.clear()
        return out

    def _check_layout_problem(self) -> None:
        if self._layout_problem:
            raise BadInputError(self._layout_problem)

    def _all_views(self) -> list[ViewInfo]:
        self._check_layout_problem()
        serves = self.serving_runs()
        views = []
        for field, obj in self._records(self._reg("views")):
            run, table, stage = field.split("|")
            if int(stage):
                name = self._stage_hash(run, int(stage), table)
            elif serves.get(table) == run:
                name = self._serving(table)
            else:
                name = self._parked(run, table)
            dtype = DType(obj["dtype"])
            views.append(ViewInfo(table, name, int(obj["dim"]), dtype, int(stage), run=run))
        return views

    # ---- rows ----------------------------------------------------------------------------
    def apply(self, write: Write) -> int:
        """See :meth:`Store.apply`: a MULTI/EXEC per batch, the mark with the last.

        While the server applies one batch (on the store's sender thread), the next one is
        checked and encoded; a batch is sent only after the one before it has been applied, and
        the mark's batch only after all of them, so a failure stops the call before the mark.
        The call never returns or raises with a batch of it still in flight.

        One sender thread per store, for all its writes: a thread started and ended per write
        made glibc hand the short-lived threads' allocator arenas around (a 10M-row publish
        peaked higher; BENCHMARKS.md).
        """
        if self.unit_rows:
            return apply_paced(self, write, self.unit_rows)
        table, batches, mark, staging_generation = write
        batch, it = first_batch(table, batches)
        total = 0
        with self._lock:
            if self._sender is None:
                self._sender = ThreadPoolExecutor(1, thread_name_prefix="deltarec-redis")
            sender = self._sender
        applied: Future[None] | None = None
        try:
            for following in it:
                queue, n, plain = self._prepared(table, batch, None, staging_generation)
                if applied is not None:
                    applied.result()
                applied = sender.submit(self._held, queue, None, plain)
                total += n
                batch = following
            queue, n, plain = self._prepared(table, batch, mark, staging_generation)
            if applied is not None:
                applied.result()
        finally:
            if applied is not None:
                wait([applied])  # after an error too: nothing of this call left in flight
        self._held(queue, mark, plain)
        self.last_write_held_s, self._held_s = self._held_s, 0.0
        return total + n

    def _held(self, queue: Any, mark: ProgressMark | None, plain: PlainBatch | None) -> None:
        """:meth:`_execute_fenced`, its time added to what the write held the server."""
        start = time.perf_counter()
        try:
            self._execute_fenced(queue, mark, plain)
        finally:
            held = time.perf_counter() - start
            if self.server_timing:  # the server's own time for EXEC since the last write
                usec, self._exec_usec = self._exec_usec, self._server_exec_usec()
                if usec is not None and self._exec_usec is not None:
                    held = min(held, max(0, self._exec_usec - usec) / 1e6)
            self._held_s += held

    def _server_exec_usec(self) -> int | None:
        """The server's microseconds spent in ``EXEC`` so far (``INFO commandstats``)."""
        try:
            stats: Any = self._client.info("commandstats")
            return int(stats["cmdstat_exec"]["usec"])
        except (redis_lib.RedisError, KeyError, TypeError, ValueError):
            return None

    def _prepared(
        self,
        table: str,
        batch: RowBatch,
        mark: ProgressMark | None,
        staging_generation: int | None,
        step: int | None = None,
    ) -> tuple[Callable[[Any], None], int, PlainBatch | None]:
        """One batch checked and encoded, ``step`` rows per script or ``HSET``.

        ``step`` defaults to the URL's ``rows_per_script``. Returns what queues its scripts
        (and ``mark``) on a pipeline, its row count, and, for upserts into a live view, the
        rows as plain ``HSET`` (used where no guard can refuse them).
        """
        self._check_mark(mark)
        run = self._writer("writing rows")
        stage = int(staging_generation or 0)
        view = self._view(table, stage)
        keys, ops, versions = checked_arrays(table, view, *batch)
        embedding = np.ascontiguousarray(batch.embedding)
        n = int(keys.shape[0])
        row_width = embedding.shape[1] * embedding.itemsize
        stride = 8 + row_width

        def values() -> np.ndarray:
            """``[n, stride]`` bytes: each row's version (int64 LE) and encoded row."""
            records = np.empty(n, np.dtype([("v", "<i8"), ("e", np.void, row_width)]))
            records["v"] = versions
            records["e"] = embedding.view(np.dtype((np.void, row_width))).reshape(n)
            return records.view(np.uint8).reshape(n, stride)

        step = step or self.config.rows_per_script
        plain = None
        if not stage and n and not ops.any():
            bodies = hset_bodies(keys, values(), step)
            plain = PlainBatch(table, run, int(versions.min()), int(versions.max()), bodies)
        script_keys = self._apply_keys(view.name if stage else "", run, table)

        def queue(pipe: Any) -> None:
            # The scripts' arguments are made only when the scripts are used (a batch written
            # as plain HSET never needs them, nor its keys as decimal text).
            blob = values().reshape(-1).data  # bytes, sliced per script without copies
            op_chars = (ops.astype(np.uint8) + ord("0")).tobytes()
            for s in range(0, n, step):
                args = [
                    min(n, s + step) - s,
                    stride,
                    blob[s * stride : min(n, s + step) * stride],
                    op_chars[s : s + step],
                    "1" if stage else "0",
                    table,
                    run,
                    ",".join(map(str, keys[s : s + step].tolist())),
                ]
                self._write_script(keys=script_keys, args=args, client=pipe)
                for command in slow_commands((min(n, s + step) - s) * stride):
                    pipe.execute_command(*command)  # the slow point, inside each script's turn
            if mark is not None:
                self._mark(pipe, mark, stage)

        return queue, n, plain

    def _plain_keys(self, run: str, table: str, mark: ProgressMark | None) -> PlainKeys:
        return PlainKeys(
            high=self._reg("high", run, table),
            serves=self._reg("serves"),
            floors=self._reg("floors"),
            lows=self._reg("lows"),
            tomb=self._reg("tomb", run, table),
            serving=self._serving(table),
            parked=self._parked(run, table),
            newest=None if mark is None else self._reg("newest", mark.run),
        )

    def _execute_fenced(
        self,
        queue: Callable[[Any], None],
        mark: ProgressMark | None,
        plain: PlainBatch | None = None,
    ) -> None:
        """One MULTI/EXEC of what ``queue`` adds; with a mark, fenced by its generation.

        The run's newest-generation key is WATCHed: a registration of a newer generation
        between the check and EXEC aborts the transaction, which is then checked again.
        ``plain``: the same rows as plain ``HSET``, written so where no guard can refuse them
        (:mod:`deltarec.stores.redis.plain`).
        """
        if plain is not None:
            extra = [] if mark is None else [self._mark_command(mark, 0)]
            extra += slow_commands(sum(len(body) for _, body in plain.bodies))
            with _ERRORS.map_errors(self.describe()):
                try:
                    newest = write_plain(
                        self._client,
                        self._plain_keys(plain.run, plain.table, mark),
                        plain,
                        extra,
                        None if mark is None else mark.generation,
                    )
                except Outranked:
                    newer = -1
                else:
                    newer = -1 if newest is None else newest
                    if newest is None:
                        return
            if mark is not None and newer > mark.generation:
                raise StaleGenerationError(self.describe(), mark.run, mark.generation, newer)
        with _ERRORS.map_errors(self.describe()):
            for _ in range(20):
                pipe = self._client.pipeline(transaction=True)
                try:
                    if mark is not None:
                        key = self._reg("newest", mark.run)
                        pipe.watch(key)
                        held = pipe.get(key)
                        if held is not None and int(held) > mark.generation:
                            raise StaleGenerationError(
                                self.describe(), mark.run, mark.generation, int(held)
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
        pipe.execute_command(*self._mark_command(mark, stage))

    def _mark_command(self, mark: ProgressMark, stage: int) -> tuple[Any, ...]:
        """The ``HSET`` of a progress mark."""
        validate_run(mark.run)
        record = {
            "rows": mark.rows,
            "complete": mark.complete,
            "staging_generation": stage,
            "written_at": time.time(),
        }
        return (
            "HSET",
            self._reg("progress", mark.run, mark.generation),
            f"{mark.seq}|{mark.table}|{mark.rank}",
            json.dumps(record),
        )

    def record_progress(self, mark: ProgressMark) -> None:
        """See :meth:`Registry.record_progress`."""
        self._execute_fenced(lambda pipe: self._mark(pipe, mark, mark.staging_generation), mark)

    def record_progress_many(self, marks: Sequence[ProgressMark]) -> None:
        """See :meth:`Registry.record_progress_many`: one ``MULTI``/``EXEC`` per generation."""
        by_generation: dict[int, list[ProgressMark]] = {}
        for mark in marks:
            by_generation.setdefault(mark.generation, []).append(mark)
        for group in by_generation.values():

            def queue(pipe: Any, group: list[ProgressMark] = group) -> None:
                for mark in group:
                    self._mark(pipe, mark, mark.staging_generation)

            self._execute_fenced(queue, group[-1])

    def _steps(self, script: Any, keys: list[str], args: list[Any]) -> int:
        """Run a cursor script (:data:`LUA_SWEEP`, :data:`LUA_MERGE`) until its ``HSCAN`` ends.

        ``args`` come before the cursor and the count. Returns the sum of its counts. A step
        takes :attr:`unit_rows` fields where a read budget set them (each step holds the server).
        """
        cursor: Any = 0
        total = 0
        step = self.unit_rows or _SWEEP_STEP
        while True:
            with _ERRORS.map_errors(self.describe()):
                cursor, count = script(keys=keys, args=[*args, cursor, step])
            total += int(count)
            if int(cursor) == 0:
                return total

    # ---- snapshot / staging --------------------------------------------------------------
    def sweep_below(self, table: str, version: int) -> None:
        """See :meth:`Store.sweep_below` (floor first, then a chunked, guarded sweep)."""
        run = self._writer("removing rows below a snapshot")
        self._view(table)
        self._sweep(run, table, int(version))

    def _sweep(self, run: str, table: str, version: int) -> None:
        packed = pack_version(version)
        with _ERRORS.map_errors(self.describe()):
            self._floor_script(keys=[self._reg("floors")], args=[self._parked(run, table), packed])
        # found by the script wherever it is now; its low mark may spare the scan
        live = ["", *self._live_keys(run, table), self._reg("lows")]
        for keys in (live, [self._reg("tomb", run, table)]):
            self._steps(self._sweep_script, keys, [table, run, packed])

    def merge_staging(self, run: str, generation: int) -> int:
        """See :meth:`Store.merge_staging`: chunked, guarded, idempotent; not one transaction."""
        self._check_run(run, "merging staging views")
        merged = 0
        snapshots = self._records(self._reg("snapshots", run))
        stages = [
            v for v in self._all_views() if v.staging_generation == generation and v.run == run
        ]
        for stage in stages:
            keys = self._apply_keys(stage.name, run, stage.table)

            while True:
                merged += self._steps(self._merge_script, keys, [stage.table, run])
                with _ERRORS.map_errors(self.describe()):
                    if not self._client.hlen(stage.name):
                        break
            for field, record in snapshots:
                g, _, t = field.split("|", 2)
                if int(g) == generation and t == stage.table and record["swept_at"] is None:
                    self._sweep(run, stage.table, int(record["version"]))
                    record["swept_at"] = time.time()
                    with _ERRORS.map_errors(self.describe()):
                        self._client.hset(self._reg("snapshots", run), field, json.dumps(record))
            with _ERRORS.map_errors(self.describe()):
                self._client.hdel(self._reg("views"), f"{run}|{stage.table}|{generation}")
        self._set_gen_field(run, generation, "merged_at", time.time())
        self._views_cache.clear()
        return merged

    def drop_staging(self, run: str, generation: int) -> int:
        """See :meth:`Store.drop_staging`."""
        self._check_run(run, "dropping staging views")
        stages = [
            v for v in self._all_views() if v.staging_generation == generation and v.run == run
        ]
        for stage in stages:
            with _ERRORS.map_errors(self.describe()):
                self._client.delete(stage.name)
                self._client.hdel(self._reg("views"), f"{run}|{stage.table}|{generation}")
        self._views_cache.clear()
        return len(stages)

    def close(self) -> None:
        """Stop the sender thread and close the connection pool (idempotent)."""
        with self._lock:
            sender, self._sender = self._sender, None
        if sender is not None:
            sender.shutdown(wait=True)
        self._client.close()
