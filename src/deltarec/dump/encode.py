"""Encoding a dump on several cores: chunks become parquet pieces in parallel, shards in order.

A :class:`ParallelShardWriter` has the contract of
:class:`~deltarec.artifacts.shards.ShardWriter` (one SPEC §3 shard per table, rank and dump,
written under a temporary name, durable, then renamed, with its sha256 and size), but each
chunk is encoded (dtype encoding, then pyarrow's parquet encoding, both outside the GIL) on a
shared :class:`EncodePool`, into a piece of its own (:mod:`deltarec.dump.stitch`). Per shard
three helper threads keep the file moving in chunk order:

* the **sink** waits for each piece in turn and appends its body to the file;
* the **hasher** feeds the same bytes to sha256 and then releases the chunk's memory budget;
* the **syncer** (local files with ``fsync``) starts the disk write-back every 64 MiB, so the
  final ``fsync`` finds little left to write.

The shard's footer is written by :meth:`ParallelShardWriter.close`, after every piece.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from deltarec.artifacts import codec
from deltarec.artifacts.root import ArtifactRoot
from deltarec.artifacts.shards import ShardPlace, ShardRows, ShardTarget
from deltarec.artifacts.types import DType, ShardInfo
from deltarec.dump.budget import ARENA_MAX
from deltarec.dump.stitch import MAGIC, Piece, PieceMeta, footer_tail, stitched_footer
from deltarec.faults import failpoint

log = logging.getLogger(__name__)

Encoded = tuple[Piece, ShardRows]
"""An encoded chunk: its parquet piece and its rows as stored (for the publisher hand-off)."""


class PieceArena:
    """Piece buffers kept for reuse, up to ``keep_bytes``.

    A fresh large allocation is mapped and zero-filled by the kernel on first touch, which
    costs about a third of a chunk's encoding; reusing the buffers of written pieces avoids it.
    Buffers are given back only once a piece's bytes are written and hashed.
    """

    def __init__(self, keep_bytes: int = 128 << 20) -> None:
        self.keep_bytes = keep_bytes
        self._free: list[np.ndarray] = []
        self._held = 0
        self._lock = threading.Lock()

    def take(self, size: int) -> np.ndarray:
        """A buffer of at least ``size`` bytes (a kept one up to twice that size, or new)."""
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if size <= b.nbytes <= 2 * size]
            if fits:
                buf = self._free.pop(min(fits, key=lambda i: self._free[i].nbytes))
                self._held -= buf.nbytes
                return buf
        return np.empty(size, np.uint8)

    def give(self, buf: np.ndarray) -> None:
        """Keep ``buf`` for a later piece (dropped when the arena is full)."""
        with self._lock:
            if self._held + buf.nbytes <= self.keep_bytes:
                self._free.append(buf)
                self._held += buf.nbytes


def warm_up_encoding(dtypes: set[DType]) -> None:
    """Encode a one-row piece per row encoding now (before training; collect garbage after).

    The first encoding imports pyarrow's parquet modules and builds their types; on the
    worker's threads, during the first dump, that held the GIL (and its objects set off a
    full garbage collection) while the training thread waited: 117 ms and a 261 ms step on
    an H200 host. A row, not an empty piece: converting rows to Arrow looks ``numpy.ma`` up,
    which numpy imports on first use.
    """
    for dtype in dtypes:
        width = codec.encoded_width(dtype, 1)
        row = ShardRows(
            np.zeros(1, np.int64),
            np.zeros((1, width), codec.element_type(dtype)),
            np.zeros(1, np.int8),
            np.zeros(1, np.int64),
        )
        encode_piece(row, dtype, 1)


def encode_piece(rows: ShardRows, dtype: DType, dim: int, arena: PieceArena | None = None) -> Piece:
    """Encode rows (already in their stored encoding) as a parquet file of their own.

    The writer options are those of :class:`~deltarec.artifacts.shards.ShardWriter`. The
    piece is written into one buffer of a safe upper size (from ``arena`` when given: then
    :attr:`Piece.memory` is that buffer, to give back once the piece is written).
    """
    stored = 4 if DType(dtype) is DType.INT8_ROWWISE else 1  # uint8 is stored as int32
    room = rows.embedding.nbytes * stored + len(rows) * (40 + (dim + 7) // 8) + (256 << 10)
    memory = arena.take(room) if arena is not None else np.empty(room, np.uint8)
    try:
        sink = pa.FixedSizeBufferWriter(pa.py_buffer(memory))
        _write_piece(sink, rows, dtype, dim)
        size = sink.tell()
    except (OSError, pa.ArrowException):  # larger than the estimate: a growing buffer
        grown = pa.BufferOutputStream()
        _write_piece(grown, rows, dtype, dim)
        return Piece.parse(grown.getvalue())
    piece = Piece.parse(pa.py_buffer(memory[:size]))
    piece.memory = memory if arena is not None else None
    return piece


def _write_piece(sink: Any, rows: ShardRows, dtype: DType, dim: int) -> None:
    writer = pq.ParquetWriter(
        sink,
        codec.shard_schema(dtype, dim),
        compression="none",
        use_dictionary=False,
        write_statistics=[codec.KEY, codec.STEP],
    )
    try:
        if len(rows):
            writer.write_table(
                codec.to_arrow(rows.keys, rows.embedding, rows.ops, rows.steps, dtype),
                row_group_size=codec.row_group_rows(dtype, dim),
            )
    finally:
        writer.close()


_SCRATCH_PER_VALUE = {DType.FLOAT32: 0, DType.FLOAT16: 4, DType.INT8_ROWWISE: 10}
"""Bytes per value of a chunk that encoding holds besides its piece, by stored dtype: float16
rows pass through half-float copies, int8_rowwise rows through the quantizer's float
temporaries and pyarrow's uint8 -> int32 cast."""
_SCRATCH_PER_ROW = 128
"""Bytes per row: the key, op and step columns' arrow arrays, levels and statistics."""


def encode_scratch_bytes(dtype: DType, dim: int, rows: int) -> int:
    """Memory one chunk's encoding holds besides its budget bytes, while it runs (a bound).

    Per value of the chunk's largest row group (:data:`~deltarec.artifacts.codec.
    ROW_GROUP_VALUES` at most), pyarrow holds 8 bytes of levels and page buffers; per value of
    the chunk, the dtype's temporaries (:data:`_SCRATCH_PER_VALUE`); per row
    :data:`_SCRATCH_PER_ROW`; plus 320 KiB (the piece buffer's 256 KiB of room for parquet's
    metadata, and the writer's own buffers). Fitted with a margin to numpy's (traced) and
    pyarrow's peak allocations, measured with pyarrow 26 / numpy 2 on chunks of 65536 x 16,
    65536 x 128, 4096 x 1024 and 100 x 32 rows of each dtype (``tests/dump/test_parallel_encode.py``
    checks the bound): for 65536 x 128 float32 rows 14.6 MB were used and 16.8 MB are
    budgeted; one row group of the whole chunk would have used 51 MB.
    """
    width = codec.encoded_width(dtype, dim)
    group = min(rows, codec.row_group_rows(dtype, dim)) * width
    per_value = _SCRATCH_PER_VALUE[DType(dtype)]
    return 8 * group + per_value * rows * dim + _SCRATCH_PER_ROW * rows + (320 << 10)


def encode_rows(
    keys: np.ndarray,
    values: np.ndarray,
    ops: np.ndarray | None,
    step: int,
    dtype: DType,
    dim: int,
    arena: PieceArena | None = None,
) -> Encoded:
    """Encode float rows with the table's dtype, then as a parquet piece."""
    encoded = codec.encode(values, dtype)
    rows = ShardRows(
        keys=keys.astype(np.int64, copy=False),
        embedding=encoded,
        ops=np.zeros(len(keys), np.int8) if ops is None else ops.astype(np.int8, copy=False),
        steps=np.full(len(keys), step, dtype=np.int64),
    )
    return encode_piece(rows, dtype, dim, arena), rows


def close_writers(
    writers: dict[str, ParallelShardWriter],
) -> list[tuple[str, ShardInfo | BaseException]]:
    """Close every shard of a dump at once (each waits for its chunks and its fsync).

    Returns each table's :class:`ShardInfo`, or the exception that failed it, in the order
    of ``writers``.
    """
    items = list(writers.items())
    results: list[ShardInfo | BaseException | None] = [None] * len(items)

    def close(i: int) -> None:
        try:
            results[i] = items[i][1].close()
        except BaseException as e:  # reported to the caller, in table order
            results[i] = e

    threads = [
        threading.Thread(target=close, args=(i,), name="deltarec-shard-close", daemon=True)
        for i in range(1, len(items))
    ]
    for t in threads:
        t.start()
    if items:
        close(0)
    for t in threads:
        t.join()
    out: list[tuple[str, ShardInfo | BaseException]] = []
    for (table, _), result in zip(items, results, strict=True):
        assert result is not None
        out.append((table, result))
    return out


class EncodePool:
    """The threads that encode every shard's chunks of one dump worker.

    Args:
        workers: number of threads (>= 1).
        arena_bytes: piece buffers kept for reuse, at most (the dumper's share of its host
            budget: :func:`~deltarec.dump.budget.plan_host_budget`).
    """

    def __init__(self, workers: int, arena_bytes: int = ARENA_MAX) -> None:
        if workers < 1:
            raise ValueError(f"encode workers must be >= 1, got {workers}")
        self.workers = workers
        self.arena = PieceArena(arena_bytes)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="deltarec-encode")

    def submit(self, job: Callable[[], Encoded]) -> Future[Encoded]:
        """Run ``job`` on a pool thread."""
        return self._pool.submit(job)

    def close(self) -> None:
        """Finish the jobs submitted, then stop the threads."""
        self._pool.shutdown(wait=True)


@dataclass
class _Pending:
    future: Future[Encoded]
    release: Callable[[], None] | None
    on_rows: Callable[[ShardRows], None] | None


class _Stop:
    pass


_STOP = _Stop()


class ParallelShardWriter(ShardTarget):
    """One table's shard of one rank and dump, its chunks encoded on an :class:`EncodePool`.

    Args:
        root: the artifact root.
        place: which shard.
        dtype, dim: the table's encoding.
        pool: the encoding threads.
        fsync: make the file durable before the rename (local disks).
        max_pending: chunks submitted and not yet written before :meth:`write` waits.
    """

    _SYNC_EVERY = 64 << 20
    _WRITE_BLOCK = 1 << 20

    def __init__(
        self,
        root: ArtifactRoot,
        place: ShardPlace,
        dtype: DType,
        dim: int,
        pool: EncodePool,
        fsync: bool = True,
        max_pending: int | None = None,
    ) -> None:
        super().__init__(root, place, dtype, dim, fsync)
        self.pool = pool
        self.size = 0
        self._metas: list[PieceMeta] = []
        self._sha = hashlib.sha256()
        self._error: BaseException | None = None
        self._closed = False
        self._fd = -1
        self._stream: Any = None
        if root.is_local:
            self._fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        else:
            self._stream = root.fs.open(self.tmp, "wb")
        bound = max_pending if max_pending is not None else 2 * pool.workers + 2
        self._pending: queue.Queue[_Pending | _Stop] = queue.Queue(maxsize=bound)
        self._hashing: queue.Queue[tuple[Piece | None, memoryview | None, _Pending | None]] = (
            queue.Queue(4)
        )
        self._written = 0
        self._synced = 0
        self._sync_cond = threading.Condition()
        self._sync_stop = False
        self._syncer: threading.Thread | None = None
        self._append(memoryview(MAGIC))
        self._sha.update(MAGIC)
        self._sink = self._thread(self._sink_loop, "sink")
        self._hasher = self._thread(self._hash_loop, "sha256")
        self._syncer = self._thread(self._sync_loop, "sync") if self._fd >= 0 and fsync else None

    def _thread(self, target: Callable[[], None], what: str) -> threading.Thread:
        t = threading.Thread(target=target, name=f"deltarec-shard-{what}", daemon=True)
        t.start()
        return t

    # ---- the worker's side -----------------------------------------------------------------
    def write(
        self,
        job: Callable[[], Encoded],
        release: Callable[[], None] | None = None,
        on_rows: Callable[[ShardRows], None] | None = None,
    ) -> None:
        """Encode a chunk on the pool (``job``) and append it after the chunks before it.

        ``release`` is called exactly once, when the chunk's bytes are written and hashed
        (or dropped after a failure); ``on_rows`` gets the stored rows, in chunk order.
        Waits while ``max_pending`` chunks are in flight.
        """
        if self._closed:
            raise RuntimeError("shard writer already closed")
        try:
            future = self.pool.submit(job)
        except BaseException:
            if release is not None:
                release()
            raise
        self._pending.put(_Pending(future, release, on_rows))

    def close(self) -> ShardInfo:
        """Wait for every chunk, write the footer, make the file durable, rename it into place.

        Raises:
            Exception: the first failure of an encoding job or of a write.
        """
        if self._closed:
            raise RuntimeError("shard writer already closed")
        self._closed = True
        self._finish_threads()
        if self._error is not None:
            self._discard()
            raise self._error
        try:
            if not self._metas:  # no rows: a file with the schema and no row group
                empty = ShardRows.empty(self.dtype, self.dim)
                self._metas.append(encode_piece(empty, self.dtype, self.dim).meta())
            footer = stitched_footer(self._metas)
            tail = footer + footer_tail(footer)
            self._append(memoryview(tail))
            self._sha.update(tail)
            self._make_durable()
        except BaseException:
            self._discard()
            raise
        self.root.publish_file(self.tmp, self.final)
        return ShardInfo(
            path=self.relpath,
            table=self.table,
            rank=self.rank,
            rows=self.rows,
            bytes=self.size,
            sha256=self._sha.hexdigest(),
        )

    def abort(self) -> None:
        """Drop the chunks in flight (releasing their bytes) and the temporary file."""
        if self._closed and self._sink is None:
            return
        self._closed = True
        if self._error is None:
            self._error = RuntimeError("shard writer aborted")
        self._finish_threads()
        self._discard()

    # ---- helper threads ----------------------------------------------------------------------
    def _finish_threads(self) -> None:
        if self._sink is None:
            return
        self._pending.put(_STOP)
        self._sink.join()
        self._hasher.join()
        if self._syncer is not None:
            with self._sync_cond:
                self._sync_stop = True
                self._sync_cond.notify_all()
            self._syncer.join()
        self._sink = None  # type: ignore[assignment]

    def _sink_loop(self) -> None:
        while True:
            item = self._pending.get()
            if isinstance(item, _Stop):
                self._hashing.put((None, None, None))
                return
            body: memoryview | None = None
            piece: Piece | None = None
            try:
                if self._error is not None:
                    item.future.cancel()
                piece, rows = item.future.result()
                if self._error is None:
                    body = piece.body
                    self._append(body)
                    self._metas.append(piece.meta())
                    self.rows += piece.rows
                    failpoint("shard.write")  # crash tests: a shard half written
                    if item.on_rows is not None:
                        item.on_rows(rows)
            except BaseException as e:  # re-raised by close()
                body = None
                if self._error is None:
                    self._error = e
                    log.warning("encoding or writing a chunk of %s failed: %r", self.table, e)
            self._hashing.put((piece, body, item))

    def _hash_loop(self) -> None:
        while True:
            piece, body, item = self._hashing.get()
            if item is None:
                return
            try:
                if body is not None and self._error is None:
                    self._sha.update(body)
            finally:
                body = None
                if piece is not None and piece.memory is not None:
                    self.pool.arena.give(piece.memory)  # written and hashed: reusable
                piece = None
                if item.release is not None:
                    item.release()

    def _sync_loop(self) -> None:
        while True:
            with self._sync_cond:
                self._sync_cond.wait_for(
                    lambda: self._sync_stop or self._written - self._synced >= self._SYNC_EVERY
                )
                if self._sync_stop:
                    return
                target = self._written
            try:
                os.fdatasync(self._fd)
            except OSError as e:
                if self._error is None:
                    self._error = e
                return
            self._synced = target

    def _append(self, data: memoryview) -> None:
        if self._fd >= 0:
            view = data.cast("B") if data.format != "B" else data
            while view.nbytes:
                # 1 MiB per call: one write of a whole piece (tens of MB) racing the syncer's
                # fdatasync cost 3 CPU-s per GB on a VM, against 0.5 in 1 MiB writes
                n = os.write(self._fd, view[: self._WRITE_BLOCK])
                view = view[n:]
        else:
            self._stream.write(data)
        self.size += data.nbytes
        if self._syncer is not None:
            with self._sync_cond:
                self._written = self.size
                if self._written - self._synced >= self._SYNC_EVERY:
                    self._sync_cond.notify_all()

    def _make_durable(self) -> None:
        if self._fd >= 0:
            if self.fsync:
                os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1
        else:
            self._stream.flush()
            self._stream.close()
            self._stream = None

    def _discard(self) -> None:
        try:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            elif self._stream is not None:
                self._stream.close()
                self._stream = None
        finally:
            with contextlib.suppress(FileNotFoundError):
                self.root.fs.rm(self.tmp)
