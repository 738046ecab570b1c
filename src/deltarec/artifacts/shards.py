"""Writing and reading parquet shards: streamed, hashed while written, verified when read.

A :class:`ShardWriter` streams row groups into a temporary file while computing its sha256, so
memory stays bounded by one row group whatever the shard size; ``close()`` makes the file
durable and renames it into place. :func:`iter_shard` (the one shard reader; in batches, with
an option for bounded memory) and :func:`read_shard` (a whole shard) check sha256 and size
against the manifest entry before the first row and the row count after the last one.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import posixpath
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from deltarec import threads
from deltarec.artifacts import codec
from deltarec.artifacts.root import ArtifactRoot, shard_relpath
from deltarec.artifacts.types import DType, ShardInfo
from deltarec.errors import ArtifactError, ChecksumError

_HASH_CHUNK = 8 << 20
READ_BUFFER = 1 << 20
"""Read buffer of :func:`iter_shard` with ``bounded_memory``."""
READ_ROWS = 8192
"""Rows per parquet record batch of :func:`iter_shard` with ``bounded_memory``."""


@dataclass
class ShardRows:
    """Rows of one shard (or one batch of it), encoded as stored."""

    keys: np.ndarray  # int64 [n]
    embedding: np.ndarray  # [n, encoded_width] of codec.element_type(dtype)
    ops: np.ndarray  # int8 [n]
    steps: np.ndarray  # int64 [n]

    def __len__(self) -> int:
        return int(self.keys.shape[0])

    @classmethod
    def empty(cls, dtype: DType, dim: int) -> ShardRows:
        """No rows, with the column types of a table of ``dtype`` and ``dim``."""
        return cls(
            np.empty(0, np.int64),
            np.empty((0, codec.encoded_width(dtype, dim)), codec.element_type(dtype)),
            np.empty(0, np.int8),
            np.empty(0, np.int64),
        )

    def slice(self, start: int, stop: int) -> ShardRows:
        """Rows ``start:stop`` (views, no copies)."""
        return ShardRows(
            self.keys[start:stop],
            self.embedding[start:stop],
            self.ops[start:stop],
            self.steps[start:stop],
        )

    @classmethod
    def concat(cls, parts: list[ShardRows]) -> ShardRows:
        """The rows of ``parts`` (at least one) one after the other; one part is returned as is."""
        if len(parts) == 1:
            return parts[0]
        return cls(
            keys=np.concatenate([p.keys for p in parts]),
            embedding=np.concatenate([p.embedding for p in parts]),
            ops=np.concatenate([p.ops for p in parts]),
            steps=np.concatenate([p.steps for p in parts]),
        )

    @classmethod
    def from_arrow(cls, table: pa.Table | pa.RecordBatch, dtype: DType) -> ShardRows:
        """Split a shard table into numpy columns."""
        return cls(
            keys=table.column(codec.KEY).to_numpy(),
            embedding=codec.embedding_matrix(table.column(codec.EMBEDDING), dtype),
            ops=table.column(codec.OP).to_numpy(),
            steps=table.column(codec.STEP).to_numpy(),
        )


class _HashingFile:
    """A write-only file wrapper that hashes and counts every byte written.

    The bytes go to the file at once; a copy is hashed on a helper thread (sha256 releases
    the GIL), so hashing overlaps the parquet encoding instead of adding to it. At most
    ``_QUEUED`` blocks of ``_BLOCK`` bytes wait for the hasher; a shard smaller than one block
    is hashed inline at the end and starts no thread.
    """

    _BLOCK = 4 << 20
    _QUEUED = 2

    def __init__(self, raw: BinaryIO) -> None:
        self.raw = raw
        self.size = 0
        self.closed = False
        self._sha = hashlib.sha256()
        self._buf = bytearray()
        self._blocks: queue.Queue[bytearray | None] = queue.Queue(maxsize=self._QUEUED)
        self._hasher: threading.Thread | None = None  # started at the first full block

    def _hash_blocks(self) -> None:
        while (block := self._blocks.get()) is not None:
            self._sha.update(block)

    def write(self, data: Any) -> int:
        mv = memoryview(data).cast("B")
        written = self.raw.write(mv)
        self._buf += mv
        self.size += mv.nbytes
        if len(self._buf) >= self._BLOCK:
            if self._hasher is None:
                self._hasher = threading.Thread(
                    target=self._hash_blocks, name="deltarec-shard-sha256", daemon=True
                )
                self._hasher.start()
            self._blocks.put(self._buf)
            self._buf = bytearray()
        return written

    def finish(self) -> None:
        """Hash what is left and stop the helper thread, if one was started (idempotent)."""
        if self._hasher is not None:
            self._blocks.put(None)
            self._hasher.join()
            self._hasher = None
        if self._buf:
            self._sha.update(self._buf)
            self._buf = bytearray()

    @property
    def sha(self) -> Any:
        """The sha256 of every byte written (finishes the hashing)."""
        self.finish()
        return self._sha

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self.raw.flush()

    def close(self) -> None:  # closed by ShardWriter
        self.closed = True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False


class _ReadBackHasher:
    """sha256 of a local file while it is written, by reading it back on a helper thread.

    The writer reports how many bytes the file holds (:meth:`advance`); a helper thread reads
    them back from the page cache in large blocks (``preadv`` into one buffer; hashing and
    reading release the GIL) and, with ``sync_every``, starts the disk write-back every so many
    bytes (``fdatasync``), so the final fsync has little left. A file smaller than one block
    is hashed inline by :meth:`result` and starts no thread.
    """

    _BLOCK = 8 << 20

    def __init__(self, path: str, sync_every: int | None) -> None:
        self._fd = os.open(path, os.O_RDONLY)
        self._sync_every = sync_every
        self._sha = hashlib.sha256()
        self._buf = bytearray(self._BLOCK)
        self._hashed = 0
        self._synced = 0
        self._target = 0
        self._last = False
        self._stopping = False
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def advance(self, size: int, last: bool = False) -> None:
        """The file now holds ``size`` bytes (``last``: and no more will come)."""
        with self._cond:
            self._target = size
            self._last = last
            self._cond.notify()
        if self._thread is None and not last and size - self._hashed >= self._BLOCK:
            self._thread = threading.Thread(
                target=self._run, name="deltarec-shard-sha256", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(
                        lambda: self._last or self._target - self._hashed >= self._BLOCK
                    )
                    end, last = self._target, self._last
                if self._stopping:
                    return
                self._hash_to(end if last else end - (end - self._hashed) % self._BLOCK)
                if last:
                    return
                if self._sync_every and self._hashed - self._synced >= self._sync_every:
                    os.fdatasync(self._fd)
                    self._synced = self._hashed
        except BaseException as e:  # reported by result()
            self._error = e

    def _hash_to(self, end: int) -> None:
        view = memoryview(self._buf)
        while self._hashed < end:
            n = os.preadv(self._fd, [view[: min(self._BLOCK, end - self._hashed)]], self._hashed)
            if n <= 0:
                raise OSError(f"short read hashing the shard at byte {self._hashed} of {end}")
            self._sha.update(view[:n])
            self._hashed += n

    def result(self) -> tuple[str, int]:
        """Wait for the hash of every byte (after ``advance(size, last=True)``): digest, size."""
        try:
            if self._thread is not None:
                self._thread.join()
                self._thread = None
                if self._error is not None:
                    raise self._error
            else:
                self._hash_to(self._target)
            return self._sha.hexdigest(), self._hashed
        finally:
            self.close()

    def close(self) -> None:
        """Stop the helper thread and close the read descriptor (idempotent)."""
        if self._thread is not None:
            self._stopping = True
            self.advance(self._target, last=True)
            self._thread.join()
            self._thread = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class _LocalShardFile:
    """A local temporary shard: pyarrow writes it natively (no Python in the write path)."""

    _SYNC_EVERY = 64 << 20

    def __init__(self, path: str, fsync: bool) -> None:
        self.sink = pa.OSFile(path, "wb")
        self.fsync = fsync
        try:
            self._hasher = _ReadBackHasher(path, self._SYNC_EVERY if fsync else None)
        except BaseException:
            self.sink.close()
            raise

    def written(self) -> None:
        """A row group was written: let the hasher catch up."""
        self._hasher.advance(self.sink.tell())

    def finish(self) -> tuple[str, int]:
        """The writer has closed: fsync (while the hash finishes), close; sha256 and size."""
        self._hasher.advance(self.sink.tell(), last=True)
        try:
            if self.fsync:
                os.fsync(self.sink.fileno())
        finally:
            self.sink.close()
        return self._hasher.result()

    def abort(self) -> None:
        """Close without finishing."""
        try:
            self._hasher.close()
        finally:
            self.sink.close()


class _StreamShardFile:
    """A temporary shard on any fsspec filesystem, hashed while it streams through Python."""

    def __init__(self, root: ArtifactRoot, path: str) -> None:
        self._raw: BinaryIO = root.open(path, "wb")
        self.sink = _HashingFile(self._raw)

    def written(self) -> None:
        """Nothing to do: every byte was hashed as it was written."""

    def finish(self) -> tuple[str, int]:
        """The writer has closed: flush and close the stream; sha256 and size."""
        self._raw.flush()
        self._raw.close()
        return self.sink.sha.hexdigest(), self.sink.size

    def abort(self) -> None:
        """Close without finishing."""
        try:
            self._raw.close()
        finally:
            self.sink.finish()


@dataclass(frozen=True)
class ShardPlace:
    """Which shard: one table's rows of one rank in one dump of a run's generation."""

    run: str
    generation: int
    seq: int
    table: str
    rank: int


class ShardTarget:
    """Where one table's shard of one rank and dump is written: its paths and its encoding.

    The set-up every shard writer shares: the shard's relative path in the manifest, its
    final path, the temporary path it is written under, and the dump folder (created).

    Args:
        root: the artifact root.
        place: which shard.
        dtype, dim: the table's encoding.
        fsync: make the file durable before the rename (local disks).
    """

    def __init__(
        self, root: ArtifactRoot, place: ShardPlace, dtype: DType, dim: int, fsync: bool = True
    ) -> None:
        self.root = root
        self.table = place.table
        self.rank = place.rank
        self.dtype = DType(dtype)
        self.dim = dim
        self.fsync = fsync
        self.relpath = shard_relpath(place.table, place.rank)
        self.final = root.shard_path(
            place.run, place.generation, place.seq, place.table, place.rank
        )
        self.tmp = root.tmp_path(self.final)
        self.rows = 0
        root.makedirs(posixpath.dirname(self.final))
        self._open()

    def _open(self) -> None:
        """Open the temporary file (a writer's own; called last by ``__init__``)."""


class ShardWriter(ShardTarget):
    """Stream one table's rows of one rank into ``<dump>/<table>/rank-<R>.parquet``.

    On a local root pyarrow writes the temporary file natively and the sha256 is computed by
    reading the file back (page-cache hot) on a helper thread, which also starts the disk
    write-back early; on other filesystems the bytes stream through a hashing wrapper.

    Args:
        root: the artifact root.
        place: which shard.
        dtype, dim: the table's encoding.
        fsync: make the file durable before the rename (local disks).
    """

    def _open(self) -> None:
        self._file: _LocalShardFile | _StreamShardFile = (
            _LocalShardFile(self.tmp, self.fsync)
            if self.root.is_local
            else _StreamShardFile(self.root, self.tmp)
        )
        self._writer = pq.ParquetWriter(
            self._file.sink,
            codec.shard_schema(self.dtype, self.dim),
            compression="none",
            use_dictionary=False,
            write_statistics=[codec.KEY, codec.STEP],
        )
        self._closed = False

    def write(self, rows: ShardRows) -> None:
        """Append encoded rows (row groups of ``codec.row_group_rows`` rows, from each call)."""
        if len(rows) == 0:
            return
        self._writer.write_table(
            codec.to_arrow(rows.keys, rows.embedding, rows.ops, rows.steps, self.dtype),
            row_group_size=codec.row_group_rows(self.dtype, self.dim),
        )
        self._file.written()
        self.rows += len(rows)

    def close(self) -> ShardInfo:
        """Finish the file, make it durable, rename it into place and describe it."""
        if self._closed:
            raise RuntimeError("shard writer already closed")
        self._closed = True
        self._writer.close()
        digest, size = self._file.finish()
        self.root.publish_file(self.tmp, self.final)
        return ShardInfo(
            path=self.relpath,
            table=self.table,
            rank=self.rank,
            rows=self.rows,
            bytes=size,
            sha256=digest,
        )

    def abort(self) -> None:
        """Drop the temporary file (after a failure)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._writer.close()
            self._file.abort()
        finally:
            with contextlib.suppress(FileNotFoundError):
                self.root.fs.rm(self.tmp)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is not None:
            self.abort()


def file_sha256(root: ArtifactRoot, directory: str, relpath: str) -> tuple[str, int]:
    """sha256 hex digest and size of a file an artifact lists, read in chunks.

    Opened through :meth:`ArtifactRoot.open_listed` (regular files inside ``directory`` only).
    A local file is read into one reused buffer (no fresh memory per chunk).
    """
    sha = hashlib.sha256()
    size = 0
    with root.open_listed(directory, relpath) as f:
        if isinstance(f, str):
            buf = bytearray(_HASH_CHUNK)
            view = memoryview(buf)
            with open(f, "rb", buffering=0) as raw:
                while n := raw.readinto(buf):
                    sha.update(view[:n])
                    size += n
            return sha.hexdigest(), size
        while chunk := f.read(_HASH_CHUNK):
            sha.update(chunk)
            size += len(chunk)
    return sha.hexdigest(), size


def check_shard(root: ArtifactRoot, dump_dir: str, shard: ShardInfo) -> None:
    """Raise :class:`ChecksumError` unless the shard's sha256 and size match its manifest entry.

    The message names the manifest's figures only: the digest and size of what is on disk are
    not printed (the file may be one the writer of the manifest should not learn about).
    """
    path = posixpath.join(dump_dir, shard.path)
    try:
        digest, size = file_sha256(root, dump_dir, shard.path)
    except FileNotFoundError:
        raise ArtifactError(root.url(path), "shard listed in the manifest is missing") from None
    if digest != shard.sha256 or size != shard.bytes:
        raise ChecksumError(
            root.url(path),
            f"content does not match the manifest's sha256 {shard.sha256} ({shard.bytes} bytes)",
        )


class _LaterCheck:
    """:func:`check_shard` on a kept thread (:mod:`deltarec.threads`).

    :meth:`result` waits for it and raises its error.
    """

    def __init__(self, root: ArtifactRoot, dump_dir: str, shard: ShardInfo) -> None:
        self._error: BaseException | None = None
        self._job = threads.start(lambda: self._run(root, dump_dir, shard), "shard-sha256")

    def _run(self, root: ArtifactRoot, dump_dir: str, shard: ShardInfo) -> None:
        try:
            check_shard(root, dump_dir, shard)
        except BaseException as e:  # raised by result()
            self._error = e

    def result(self) -> None:
        """Wait for the check; raise what it raised (ChecksumError, ArtifactError)."""
        self._job.join()
        if self._error is not None:
            raise self._error


def iter_shard(
    root: ArtifactRoot,
    dump_dir: str,
    shard: ShardInfo,
    dtype: DType,
    batch_rows: int = 65536,
    verify: bool = True,
    bounded_memory: bool = False,
    verify_later: list[Callable[[], None]] | None = None,
) -> Iterator[ShardRows]:
    """Yield a shard's rows in batches.

    By default pyarrow reads a whole column chunk (a row group) at a time and yields batches
    of at most ``batch_rows``. With ``bounded_memory`` (the publisher's reader) the file is
    streamed through a ``READ_BUFFER`` read buffer in record batches of at most ``READ_ROWS``
    rows (no threads, no pre-buffering), joined into batches of ``batch_rows`` or slightly more
    (the last may be shorter): memory is about two batches whatever the shard or row-group
    size.

    With ``verify_later`` the sha256 starts on a thread once the last rows are decoded (the
    file is in the page cache by then) instead of before the first, and its wait (which raises
    what the check found) is appended to the list: the caller must call it before anything it
    wrote from these rows becomes visible. Only for a caller that applies all the rows in one
    transaction and commits after the waits (the publisher's parts written together): the
    hashing then overlaps the store's statements instead of the decoding.

    Raises:
        ChecksumError: with ``verify``, the file's sha256 and size (checked before the first
            row) differ from the manifest's; always, the row count (checked at the end).
        ArtifactError: the shard is missing or not readable parquet.
    """
    path = posixpath.join(dump_dir, shard.path)
    later = verify_later if verify else None
    if verify and later is None:
        check_shard(root, dump_dir, shard)
    seen = 0
    try:
        with contextlib.ExitStack() as stack:
            # A local shard is read by Arrow itself: no Python file object (and GIL) per read.
            f = stack.enter_context(root.open_listed(dump_dir, shard.path))
            if bounded_memory:
                pf = stack.enter_context(
                    pq.ParquetFile(f, buffer_size=READ_BUFFER, pre_buffer=False)
                )
                batches = pf.iter_batches(batch_size=min(READ_ROWS, batch_rows), use_threads=False)
            else:
                pf = stack.enter_context(pq.ParquetFile(f))
                batches = pf.iter_batches(batch_size=batch_rows)
            for rows in _joined(batches, dtype, batch_rows if bounded_memory else 0):
                seen += len(rows)
                yield rows
    except FileNotFoundError:
        raise ArtifactError(root.url(path), "shard listed in the manifest is missing") from None
    except (pa.ArrowInvalid, OSError) as e:
        if later is not None:
            check_shard(root, dump_dir, shard)  # a file not matching its sha256 says so first
        raise ArtifactError(root.url(path), f"unreadable parquet: {e}") from e
    if later is not None:
        later.append(_LaterCheck(root, dump_dir, shard).result)
    if seen != shard.rows:
        raise ChecksumError(root.url(path), f"holds {seen} rows, the manifest says {shard.rows}")


def _joined(batches: Iterator[pa.RecordBatch], dtype: DType, join_rows: int) -> Iterator[ShardRows]:
    """Record batches as rows; with ``join_rows``, joined until at least that many are held."""
    parts: list[ShardRows] = []
    held = 0
    for batch in batches:
        part = ShardRows.from_arrow(batch, dtype)
        if not join_rows:
            yield part
            continue
        parts.append(part)
        held += len(part)
        if held >= join_rows:
            yield ShardRows.concat(parts)
            parts, held = [], 0
    if parts:
        yield ShardRows.concat(parts)


def read_shard(
    root: ArtifactRoot, dump_dir: str, shard: ShardInfo, dtype: DType, verify: bool = True
) -> ShardRows:
    """Read a whole shard into memory (see :func:`iter_shard`)."""
    parts = list(iter_shard(root, dump_dir, shard, dtype, batch_rows=1 << 20, verify=verify))
    if not parts:
        return ShardRows.empty(dtype, 0)
    return ShardRows.concat(parts)
