"""The background worker: encode gathered chunks, write shards, commit each dump across ranks.

The training thread puts, in order, for each dump: :class:`Chunk` items (one table's rows at a
time) and then one :class:`EndOfDump`. A chunk is either rows in host memory or a table's
device staging buffer (:class:`~deltarec.tracking.gather.DeviceRows`), which the worker copies to
pinned host memory chunk by chunk, reserving each chunk's bytes in the host budget first. Each
host chunk is encoded on the :class:`~deltarec.dump.encode.EncodePool` (several cores) and
appended, in order, to the table's :class:`~deltarec.dump.encode.ParallelShardWriter`
(streamed, hashed, temp name); its bytes return to the budget once written and hashed. With an
encoder process (:mod:`deltarec.dump.encoder_process`) the chunks go to it through the shared
ring instead, and it encodes and writes them the same way. At the end of the dump the worker
closes the shards (durable, renamed) and runs the commit protocol:

1. every rank's worker sends its shard list - or the error that stopped it - to every other
   rank over the worker's own gloo group (``all_gather``);
2. if no rank failed, every rank builds the same manifest from all ranks' shards
   (:meth:`~deltarec.artifacts.types.Manifest.from_shards`, the builder that single-process
   writers use through :func:`~deltarec.artifacts.writer.write_dump`); rank 0 writes
   MANIFEST.json (last, atomically) and broadcasts the outcome; every rank then knows
   whether dump ``S`` is committed.

A failure (in any rank) fails the dump on every rank: the error, naming the dump, the table and
the rank, is kept and re-raised on the training thread at its next call. After a failure the
worker writes nothing more and takes part in no further exchange (every rank stops at the same
dump, so no rank waits for another).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from deltarec.artifacts.root import ArtifactRoot
from deltarec.artifacts.shards import ShardPlace, ShardRows
from deltarec.artifacts.types import DumpKind, Manifest, ShardInfo, TableSpec
from deltarec.dump.budget import ARENA_MAX
from deltarec.dump.encode import (
    Encoded,
    EncodePool,
    ParallelShardWriter,
    close_writers,
    encode_rows,
)
from deltarec.dump.encoder_process import EncoderProcess
from deltarec.dump.exchange import Exchange
from deltarec.dump.queue import ByteBoundedQueue, QueueClosedError
from deltarec.errors import DumpError
from deltarec.faults import failpoint
from deltarec.tracking.assemble import Assembly, LocalParts, Part
from deltarec.tracking.gather import DeviceRows, HostRows
from deltarec.tracking.pinned import PinnedRing

log = logging.getLogger(__name__)

DUMP_OVER_WAIT_S = 0.05
"""The longest the worker waits for the training thread's dump to end before copying a
device staging buffer out."""


@dataclass
class Chunk:
    """Rows of one table for dump ``seq``, read at training step ``step``."""

    seq: int
    table: str
    step: int
    rows: HostRows  # a DeviceRows: a table's device staging buffer


@dataclass
class EndOfDump:
    """All chunks of dump ``seq`` were put; close its shards and commit it."""

    seq: int
    kind: DumpKind
    first_step: int
    last_step: int
    taken_at: float | None = None
    """Unix time at which the training thread took the dump (read its rows), if known."""


@dataclass
class _Stop:
    pass


@dataclass
class _DumpState:
    seq: int
    writers: dict[str, ParallelShardWriter] = field(default_factory=dict)
    shards: list[ShardInfo] = field(default_factory=list)
    kept: dict[str, list[ShardRows]] = field(default_factory=dict)
    kept_bytes: int = 0
    assemblies: dict[str, Assembly] = field(default_factory=dict)
    error: tuple[str | None, str] | None = None


OnCommit = Callable[[Manifest, "dict[str, ShardRows] | None"], None]
"""Called on the worker thread after a dump is committed, with this rank's rows when kept."""


class _Release:
    """Gives an item's budget bytes back to the queue, and its pinned slot, exactly once."""

    def __init__(self, queue: ByteBoundedQueue, nbytes: int, host: HostRows | None = None) -> None:
        self.queue = queue
        self.nbytes = nbytes
        self.host = host  # its ring slot is given back with the bytes
        self.taken = False  # a writer releases it later
        self._lock = threading.Lock()
        self._done = False

    def __call__(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        if self.host is not None:
            self.host.free()
            self.host = None
        self.queue.release(self.nbytes)


class DumpWorker:
    """The per-rank background writer of one generation.

    Args:
        root: the artifact root.
        run, generation: what is written.
        tables: every table of the generation (manifests list them all, 0 rows if untouched).
        queue: the byte-bounded queue shared with the training thread.
        exchange: the worker's own exchange (gloo group) for the commit.
        fsync: make shards durable before renaming them.
        on_commit: publisher hand-off, called after each commit.
        keep_rows_bytes: keep up to this many encoded bytes of a dump in memory for
            ``on_commit``; a larger dump is handed over without rows (read from artifacts).
        fence: called on rank 0 right before MANIFEST.json is written; if it raises (a newer
            trainer owns the run), the dump fails on every rank and nothing is committed.
        encode_workers: threads that encode chunks (see
            :func:`~deltarec.dump.budget.default_encode_workers`).
        chunk_rows: rows per host chunk copied from a device staging buffer.
        arena_bytes: the encoders' reusable piece buffers, at most.
        pinned: the ring that chunks copied out of device staging buffers lie in (None:
            pinned one by one).
        encoder: the encoder process that encodes and writes the shards
            (:mod:`deltarec.dump.encoder_process`; stopped by :meth:`stop`); None: the
            threads of an :class:`~deltarec.dump.encode.EncodePool` here. With it no rows are
            kept for ``on_commit`` (the publisher reads the committed shards).
        dump_over: set while the training thread is not in a dump. A device staging buffer
            is copied out only once it is set (or after :data:`DUMP_OVER_WAIT_S`): the
            worker's Python work would otherwise take the GIL from the training thread at each
            of the dump's host synchronizations.
    """

    def __init__(
        self,
        root: ArtifactRoot,
        run: str,
        generation: int,
        tables: dict[str, TableSpec],
        queue: ByteBoundedQueue,
        exchange: Exchange,
        fsync: bool = True,
        on_commit: OnCommit | None = None,
        keep_rows_bytes: int = 0,
        fence: Callable[[], None] | None = None,
        encode_workers: int = 1,
        chunk_rows: int = 65536,
        arena_bytes: int = ARENA_MAX,
        pinned: PinnedRing | None = None,
        encoder: EncoderProcess | None = None,
        dump_over: threading.Event | None = None,
    ) -> None:
        self.root = root
        self.encoder = encoder
        self.dump_over = dump_over
        self.pinned = pinned
        self.fence = fence
        self.run = run
        self.generation = generation
        self.tables = tables
        self.queue = queue
        self.exchange = exchange
        self.fsync = fsync
        self.on_commit = on_commit
        self.after_commit: Callable[[Manifest], None] | None = None
        """Called on the worker thread after ``on_commit``, with the manifest only (the
        background compactor's count, :mod:`deltarec.dump.compactor`)."""
        self.keep_rows_bytes = keep_rows_bytes
        self.chunk_rows = chunk_rows
        self.pool = EncodePool(encode_workers if encoder is None else 1, arena_bytes)
        self.committed: list[Manifest] = []
        self._keep_lock = threading.Lock()
        self.failure: DumpError | None = None
        self._cond = threading.Condition()
        self._dump: _DumpState | None = None
        self._thread = threading.Thread(target=self._loop, name="deltarec-dump-worker", daemon=True)
        self._thread.start()

    # ---- training-thread side ------------------------------------------------------------
    def check(self) -> None:
        """Re-raise a failure of the worker (or of another rank's dump) on the caller's thread."""
        if self.failure is not None:
            raise self.failure

    def last_committed_seq(self) -> int | None:
        """The newest committed dump's seq (None if none yet)."""
        with self._cond:
            return self.committed[-1].seq if self.committed else None

    def wait_committed(self, seq: int, timeout: float | None = None) -> Manifest:
        """Wait until dump ``seq`` is committed; raise the dump's failure instead if it failed."""
        with self._cond:
            ok = self._cond.wait_for(
                lambda: (
                    self.failure is not None
                    or any(m.seq == seq for m in self.committed)
                    or not self._thread.is_alive()
                ),
                timeout=timeout,
            )
            self.check()
            for m in self.committed:
                if m.seq == seq:
                    return m
        problem = "timed out waiting for the commit" if not ok else "the dump worker stopped"
        raise DumpError(self.run, self.generation, seq, None, problem)

    def stop(self, timeout: float | None = None) -> bool:
        """Finish what is queued, then stop the thread. Returns False if it is still running."""
        if self._thread.is_alive():
            with contextlib.suppress(QueueClosedError):
                self.queue.put(_Stop(), 0)
            self._thread.join(timeout)
        alive = self._thread.is_alive()
        if not alive:
            self.queue.close()
            self.pool.close()
            if self.encoder is not None:
                self.encoder.stop()
        return not alive

    # ---- worker thread -------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            try:
                item, nbytes = self.queue.get()
            except QueueClosedError:
                return
            if isinstance(item, _Stop):
                self.queue.release(nbytes)
                return
            host = item.rows if isinstance(item, (Chunk, Part)) else None
            release = _Release(self.queue, nbytes, host if isinstance(host, HostRows) else None)
            try:
                if self.failure is None:
                    self._handle(item, release)
            except BaseException as e:
                log.exception("dump worker failed")
                self._fail_local(item, e)
            finally:
                if isinstance(item, Chunk) and isinstance(item.rows, DeviceRows):
                    item.rows.release()
                item = host = None  # drop the host rows before their bytes are released
                if not release.taken:
                    release()
                with self._cond:
                    self._cond.notify_all()

    def _handle(self, item: object, release: _Release) -> None:
        if isinstance(item, Chunk):
            self._write_chunk(item, release)
        elif isinstance(item, Part):
            self._exchange_part(item)
        elif isinstance(item, EndOfDump):
            self._end_dump(item)
        else:
            raise TypeError(f"unexpected dump queue item {item!r}")

    def _state(self, seq: int) -> _DumpState:
        if self._dump is None or self._dump.seq != seq:
            self._abort_writers()
            self._dump = _DumpState(seq)
        return self._dump

    def _write_chunk(self, chunk: Chunk, release: _Release) -> None:
        state = self._state(chunk.seq)
        if state.error is not None:
            return
        try:
            if isinstance(chunk.rows, DeviceRows):
                self._write_staged(state, chunk, chunk.rows)
                return
            # the writer releases the chunk's bytes (they cover its encoded copy too) once
            # written; if the hand-off fails, the loop releases them (releasing is idempotent)
            self._submit(state, chunk.table, chunk.step, chunk.rows, release)
            release.taken = True
        except Exception as e:
            state.error = (chunk.table, f"{type(e).__name__}: {e}")
            log.exception("writing dump %s table %s failed", chunk.seq, chunk.table)

    def _write_staged(self, state: _DumpState, chunk: Chunk, staged: DeviceRows) -> None:
        """Copy a device staging buffer to host chunk by chunk, each within the host budget."""
        if self.dump_over is not None:
            # bounded: the training thread may be waiting for budget this worker frees
            self.dump_over.wait(DUMP_OVER_WAIT_S)
        staged.resolve()
        last: HostRows | None = None
        for start in range(0, len(staged), self.chunk_rows):
            stop = min(start + self.chunk_rows, len(staged))
            nbytes = staged.host_bytes(start, stop, self.pinned)
            self.queue.reserve(nbytes)
            release = _Release(self.queue, nbytes)
            try:
                last = release.host = staged.to_host(start, stop, self.pinned)
                self._submit(state, chunk.table, chunk.step, last, release)
            except BaseException:
                release()
                raise
        if last is not None and last.event is not None:
            last.event.synchronize()  # every copy out of the buffer is done (one copy stream)
        staged.release()

    def _submit(
        self, state: _DumpState, table: str, step: int, host: HostRows, release: _Release
    ) -> None:
        if self.encoder is not None:
            self.encoder.send_chunk(state.seq, table, step, host, release)
            return
        spec = self.tables[table]

        def job() -> Encoded:
            host.wait()
            keys, values, ops = host.numpy()
            return encode_rows(keys, values, ops, step, spec.dtype, spec.dim, self.pool.arena)

        self._writer(state, table).write(job, release, self._keeper(state, table))

    def _writer(self, state: _DumpState, table: str) -> ParallelShardWriter:
        writer = state.writers.get(table)
        if writer is None:
            spec = self.tables[table]
            writer = ParallelShardWriter(
                self.root,
                ShardPlace(self.run, self.generation, state.seq, table, self.exchange.rank),
                spec.dtype,
                spec.dim,
                self.pool,
                fsync=self.fsync,
            )
            state.writers[table] = writer
        return writer

    def _write_assembled(
        self, state: _DumpState, part: Part, keys: np.ndarray, values: np.ndarray
    ) -> None:
        """Encode and write an assembled table's rows (all upserts) of ``part``."""
        table, step = part.table, part.step
        if self.encoder is not None:
            self.encoder.send_rows(state.seq, table, step, keys, values, None)
            return
        spec = self.tables[table]

        def job() -> Encoded:
            return encode_rows(keys, values, None, step, spec.dtype, spec.dim, self.pool.arena)

        self._writer(state, table).write(job, None, self._keeper(state, table))

    def _exchange_part(self, part: Part) -> None:
        """One part of an assembled table: its round(s) of the exchange on the worker's group.

        Collectives run even after a local write error (the other ranks are waiting in the
        same rounds); the error then fails the dump at the commit, on every rank.
        """
        state = self._state(part.seq)
        asm = state.assemblies.get(part.table)
        if asm is None:
            counts = self.exchange.all_gather(part.count)
            asm = Assembly(part.table, part.mode, self.tables[part.table].dim, max(counts))
            state.assemblies[part.table] = asm
        payload = None
        if part.rows is not None and state.error is None:
            try:
                payload = part.payload()
            except Exception as e:
                state.error = (part.table, f"{type(e).__name__}: {e}")
        if part.count > 0:
            self._round(state, asm, part, payload)
        if part.index >= part.count - 1:  # this rank's last part: rounds the others still need
            while asm.done < asm.rounds:
                self._round(state, asm, part, None)

    def _round(self, state: _DumpState, asm: Assembly, part: Part, payload: object) -> None:
        got = self.exchange.gather((payload, part.columns), dst=part.writer_rank)
        try:
            if got is None or state.error is not None:
                return
            whole = asm.assemble([g[0] for g in got], [g[1] for g in got])
            if whole is not None and len(whole[0]):
                self._write_assembled(state, part, whole[0], whole[1])
        except Exception as e:
            state.error = (part.table, f"{type(e).__name__}: {e}")
            log.exception("assembling dump %s table %s failed", part.seq, part.table)
        finally:
            asm.done += 1

    def _keeper(self, state: _DumpState, table: str) -> Callable[[ShardRows], None] | None:
        if self.on_commit is None or self.encoder is not None:
            return None
        return lambda rows: self._keep(state, table, rows)

    def _keep(self, state: _DumpState, table: str, rows: ShardRows) -> None:
        """Keep a copy of written rows for ``on_commit`` (called by the shards' sink threads)."""
        with self._keep_lock:
            if state.kept_bytes < 0:
                return
            size = rows.embedding.nbytes + rows.keys.nbytes + rows.ops.nbytes + rows.steps.nbytes
            if state.kept_bytes + size > self.keep_rows_bytes:
                state.kept.clear()
                state.kept_bytes = -1  # too large: hand over without rows
                return
            copy = ShardRows(
                rows.keys.copy(), rows.embedding.copy(), rows.ops.copy(), rows.steps.copy()
            )
            state.kept.setdefault(table, []).append(copy)
            state.kept_bytes += size

    def _end_dump(self, end: EndOfDump) -> None:
        state = self._state(end.seq)
        if state.error is None:
            self._close_writers(state)
        if state.error is not None:
            self._abort_writers()
        manifest = self._commit(end, state)
        self._dump = None
        with self._cond:
            self.committed.append(manifest)
            self._cond.notify_all()
        if self.on_commit is not None:
            kept = None
            if state.kept_bytes >= 0 and self.encoder is None:
                kept = {t: ShardRows.concat(parts) for t, parts in state.kept.items()}
            self.on_commit(manifest, kept)
        if self.after_commit is not None:
            self.after_commit(manifest)

    def _close_writers(self, state: _DumpState) -> None:
        """Close every shard of the dump, all at once (each waits for its chunks and fsync)."""
        if self.encoder is not None:
            self._close_remote(state)
            return
        for table, result in close_writers(state.writers):
            if isinstance(result, ShardInfo):
                state.shards.append(result)
            elif state.error is None:
                state.error = (table, f"{type(result).__name__}: {result}")

    def _close_remote(self, state: _DumpState) -> None:
        """Close the dump's shards in the encoder process (durable and renamed, or failed)."""
        assert self.encoder is not None
        try:
            shards, error = self.encoder.close_dump(state.seq)
        except Exception as e:
            if state.error is None:
                state.error = (None, f"{type(e).__name__}: {e}")
            return
        state.shards.extend(ShardInfo(**s) for s in shards)
        if error is not None and state.error is None:
            state.error = error

    def _commit(self, end: EndOfDump, state: _DumpState) -> Manifest:
        rank = self.exchange.rank
        mine = {
            "shards": [s.to_json() for s in state.shards],
            "error": state.error,
            "taken_at": end.taken_at,
        }
        everyone = self.exchange.all_gather(mine)
        for r, payload in enumerate(everyone):
            if payload["error"] is not None:
                table, problem = payload["error"]
                raise DumpError(self.run, self.generation, end.seq, table, f"rank {r}: {problem}")
        manifest = Manifest.from_shards(
            self.run,
            self.generation,
            end.seq,
            end.kind,
            end.first_step,
            end.last_step,
            self.exchange.world_size,
            (ShardInfo(**s) for payload in everyone for s in payload["shards"]),
            tables=self.tables,
            extra=_taken_at(everyone),
        )
        outcome: str | None = None
        if rank == 0:
            try:
                failpoint("commit.manifest")
                if self.fence is not None:
                    self.fence()
            except Exception as e:
                outcome = f"not committed: {e}"
            else:
                try:
                    self.root.commit_manifest(manifest)
                except Exception as e:
                    outcome = f"rank 0 could not write MANIFEST.json: {type(e).__name__}: {e}"
        outcome = self.exchange.broadcast(outcome, src=0)
        if outcome is not None:
            raise DumpError(self.run, self.generation, end.seq, None, outcome)
        return manifest

    def _fail_local(self, item: object, e: BaseException) -> None:
        if isinstance(e, DumpError):
            err = e
        else:
            seq = getattr(item, "seq", -1)
            table = getattr(item, "table", None)
            err = DumpError(self.run, self.generation, seq, table, f"{type(e).__name__}: {e}")
            err.__cause__ = e
        self._abort_writers()
        with self._cond:
            self.failure = err
            self._cond.notify_all()

    def _abort_writers(self) -> None:
        if self._dump is None:
            return
        if self.encoder is not None:
            self.encoder.abort_dump(self._dump.seq)
        for writer in self._dump.writers.values():
            try:
                writer.abort()
            except Exception:
                log.warning("could not remove a temporary shard of dump %s", self._dump.seq)
        self._dump.writers.clear()


def _taken_at(everyone: list[dict[str, object]]) -> dict[str, object]:
    """MANIFEST.json's ``taken_at``: when the first rank took the dump (freshness starts)."""
    times = [float(str(p["taken_at"])) for p in everyone if p.get("taken_at") is not None]
    if not times:
        return {}
    first = datetime.datetime.fromtimestamp(min(times), tz=datetime.timezone.utc)
    return {"taken_at": first.strftime("%Y-%m-%dT%H:%M:%S.%fZ")}


def queue_parts(
    queue: ByteBoundedQueue, seq: int, table: str, step: int, parts: LocalParts
) -> None:
    """Queue this rank's part of an assembled table for the worker: always one item at least."""
    head = (seq, table, step, parts.mode, parts.writer_rank, parts.columns)
    index = 0
    for host in parts.chunks:
        queue.put(Part(*head, index, parts.count, host), host.nbytes)
        index += 1
    if index != parts.count:
        raise RuntimeError(f"table {table}: {index} parts gathered, {parts.count} announced")
    if parts.count == 0:
        queue.put(Part(*head, 0, 0, None), 0)
