"""A small shard read in one go: its bytes checked, then decoded from those same bytes.

:func:`~deltarec.artifacts.shards.iter_shard` with ``verify`` opens a shard twice (once to hash
it, once for Arrow to stream it) and streams it in bounded batches: right for shards of any
size, but a fixed cost of a few milliseconds a shard that dominates when a dump has thousands
of small shards (hundreds of ranks) or a backlog has thousands of small dumps. Here a shard of
at most ``limit`` bytes is opened once through :meth:`ArtifactRoot.open_listed` (the same
trust-boundary checks), read whole, its size and sha256 compared with the manifest's, and
parsed from the checked bytes: what was hashed is exactly what is decoded. Memory is the
shard's bytes and its rows, so callers use it for shards they would hold whole anyway.
"""

from __future__ import annotations

import functools
import hashlib
import posixpath
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow._parquet as _parquet

from deltarec.artifacts import codec, shardpool
from deltarec.artifacts.root import ArtifactRoot
from deltarec.artifacts.shards import ShardRows
from deltarec.artifacts.types import DType, ShardInfo
from deltarec.errors import ArtifactError, ChecksumError

WHOLE_SHARD_BYTES = 64 << 20
"""Shards up to this size are read whole by the callers that hold their rows anyway."""
PREFETCH_BYTES = 128 << 20
"""At most this many bytes of shards are read ahead at once by :meth:`CheckedShards.prefetch`."""


def checked_bytes(root: ArtifactRoot, dump_dir: str, shard: ShardInfo) -> bytes:
    """The shard's bytes, read once, if their size and sha256 are the manifest's.

    Raises:
        ArtifactError: the shard is missing or not a regular file inside ``dump_dir``.
        ChecksumError: its size or sha256 differs (the message names the manifest's figures
            only, as :func:`~deltarec.artifacts.shards.check_shard`'s does).
    """
    try:
        data = root.read_listed(dump_dir, shard.path, shard.bytes + 1)  # a larger one: refused
    except FileNotFoundError:
        path = posixpath.join(dump_dir, shard.path)
        raise ArtifactError(root.url(path), "shard listed in the manifest is missing") from None
    if len(data) != shard.bytes or hashlib.sha256(data).hexdigest() != shard.sha256:
        raise ChecksumError(
            root.url(posixpath.join(dump_dir, shard.path)),
            f"content does not match the manifest's sha256 {shard.sha256} ({shard.bytes} bytes)",
        )
    return data


def read_whole_shard(
    root: ArtifactRoot, dump_dir: str, shard: ShardInfo, dtype: DType
) -> ShardRows:
    """The rows of one shard, its bytes checked against the manifest before they are decoded.

    Raises: as :func:`read_whole_table`.
    """
    return ShardRows.from_arrow(read_whole_table(root, dump_dir, shard), dtype)


def read_whole_table(root: ArtifactRoot, dump_dir: str, shard: ShardInfo) -> pa.Table:
    """One shard as an Arrow table, its bytes checked against the manifest before decoding.

    Raises:
        ArtifactError: the shard is missing, not a regular file inside ``dump_dir``, or not
            readable parquet.
        ChecksumError: its size or sha256 differs from the manifest's, or it holds another
            number of rows.
    """
    data = checked_bytes(root, dump_dir, shard)
    try:
        table = _decode(data)
    except (pa.ArrowInvalid, OSError) as e:
        path = root.url(posixpath.join(dump_dir, shard.path))
        raise ArtifactError(path, f"unreadable parquet: {e}") from e
    if table.num_rows != shard.rows:
        raise ChecksumError(
            root.url(posixpath.join(dump_dir, shard.path)),
            f"holds {table.num_rows} rows, the manifest says {shard.rows}",
        )
    return table


def _decode(data: bytes) -> pa.Table:
    """Every column of a parquet file held in memory, decoded into the system allocator.

    No pre-buffering and no threads: on a small in-memory file Arrow's I/O and decoding pools
    cost more than the decoding (~0.5 ms a 2,000-row shard, 2.5-4.4 ms with them). The system
    allocator, not Arrow's default (mimalloc): callers keep thousands of these small tables
    alive at once (a dump of hundreds of ranks), and with mimalloc each shard's decoding then
    took 2-5 times as long (fresh pages for every few shards; 50-60 us a 176-row shard with
    malloc, 110-300 us with mimalloc). The parquet reader beneath ``pq.ParquetFile``, which
    takes no memory pool, also skips its Python set-up (~10 us a shard).
    """
    reader = _parquet.ParquetReader(memory_pool=pa.system_memory_pool())
    reader.open(pa.BufferReader(data), pre_buffer=False)
    return reader.read_all(use_threads=False)


class CheckedShards:
    """Small shards read once for a whole command: checked, then decoded from the same bytes.

    A replay (:func:`~deltarec.artifacts.lineage.expected_state`) given one reads each shard of
    at most :data:`WHOLE_SHARD_BYTES` through :func:`checked_bytes` (the trust-boundary open,
    size and sha256 before any decoding), decodes every column from those bytes, and keeps the
    decoded table while ``budget`` bytes of tables allow, so the rows read later for a
    comparison come from memory: a dump of thousands of small shards costs one open and one
    decoding a shard instead of three of each (checksum, keys, rows). Shards beyond the budget
    are checked all the same and reopened for their rows; larger shards keep the streamed path
    (:meth:`read` returns None for them).

    The small shards of one table in one dump (a rank's each) are held as one block
    (:meth:`read_group`): their rows one after the other in one table, so that the replay and
    the comparison take a dump of hundreds of ranks in whole-array operations, not shard by
    shard (:meth:`locate`, :meth:`block_rows`). Each shard is still read, checked and decoded
    on its own.
    """

    def __init__(self, root: ArtifactRoot, budget: int = 256 << 20) -> None:
        self.root = root
        self.budget = budget
        self._held = 0
        self._checked: set[tuple[str, str]] = set()
        self._tables: dict[tuple[str, str], pa.Table] = {}
        self._blocks: dict[int, tuple[pa.Table, list[tuple[str, str]]]] = {}  # and members
        self._in_block: dict[tuple[str, str], tuple[int, int]] = {}  # (block, first row)
        self._next_block = 0
        self._matrices: dict[int, np.ndarray] = {}
        self._located: tuple[Sequence[Any], int, np.ndarray, np.ndarray] | None = None
        self._fetched: dict[tuple[tuple[str, str], ...], list[pa.Table]] = {}

    def prefetch(self, dump_dir: str, groups: Sequence[Sequence[ShardInfo]]) -> None:
        """Read ``groups[0]`` and the next groups (a table's shards each) now, if it pays.

        Where :func:`~deltarec.artifacts.shardpool.can_pool` (a dump of hundreds of ranks on a
        local root), the groups from the first on, up to :data:`PREFETCH_BYTES` of shards, are
        read with a forked child reading a share, each shard checked as :meth:`read` does;
        :meth:`read_group` then takes their tables from here. Nothing is done if the first
        group was fetched already or is not one :meth:`read_group` reads as a block; groups
        after it that are not are left out.

        Raises:
            ArtifactError, ChecksumError: as :meth:`read`, for the first bad shard.
        """
        if not groups or self._key(dump_dir, groups[0]) in self._fetched:
            return
        window: list[Sequence[ShardInfo]] = []
        nbytes = 0
        for g in groups:
            size = sum(s.bytes for s in g)
            if window and nbytes + size > min(PREFETCH_BYTES, self.budget):
                break
            if self._groupable(dump_dir, g):
                window.append(g)
                nbytes += size
            elif not window:
                return
        if not shardpool.can_pool(sum(len(g) for g in window), self.root.is_local):
            return
        read = functools.partial(read_whole_table, self.root, dump_dir)
        for group, tables in zip(window, shardpool.read_groups(window, read, True), strict=True):
            self._fetched[self._key(dump_dir, group)] = tables

    @staticmethod
    def _key(dump_dir: str, shards: Sequence[ShardInfo]) -> tuple[tuple[str, str], ...]:
        return tuple((dump_dir, s.path) for s in shards)

    def _groupable(self, dump_dir: str, shards: Sequence[ShardInfo]) -> bool:
        """Whether :meth:`read_group` reads ``shards`` as a block (small, none read before)."""
        return all(
            s.bytes <= WHOLE_SHARD_BYTES and (dump_dir, s.path) not in self._checked for s in shards
        )

    def read(
        self, dump_dir: str, shard: ShardInfo, columns: list[str]
    ) -> dict[str, pa.ChunkedArray] | None:
        """``columns`` of a small shard from its checked bytes, or None for a large shard.

        Raises:
            ArtifactError: as :func:`read_whole_table` (missing, not a regular file inside
                ``dump_dir``, unreadable parquet).
            ChecksumError: its size, sha256 or row count differs from the manifest's.
        """
        if shard.bytes > WHOLE_SHARD_BYTES:
            return None
        table = self.held(dump_dir, shard)
        if table is None:
            table = read_whole_table(self.root, dump_dir, shard)  # digest before decoding
            self._hold((dump_dir, shard.path), table)
        return self._columns(table, dump_dir, shard, columns)

    def read_group(
        self, dump_dir: str, shards: Sequence[ShardInfo], columns: list[str]
    ) -> dict[str, pa.ChunkedArray] | None:
        """``columns`` of several small shards of one table, their rows one after the other.

        Each shard is read, checked and decoded as :meth:`read` does, before the next (or was,
        by :meth:`prefetch`); the decoded tables are held as one block. None, having read
        nothing, if a shard is large or was read before; None, with every shard read and held
        on its own, if their schemas differ (then :meth:`read` each).

        Raises:
            ArtifactError, ChecksumError: as :meth:`read`, for the first bad shard.
        """
        keys = self._key(dump_dir, shards)
        tables = self._fetched.pop(keys, None)
        if tables is None:
            if not self._groupable(dump_dir, shards):
                return None
            tables = [read_whole_table(self.root, dump_dir, s) for s in shards]
        try:
            block = pa.concat_tables(tables).combine_chunks()
        except (pa.ArrowInvalid, pa.ArrowTypeError):  # shards of other schemas (column order)
            if len(tables) != len(keys):  # runs of shards (prefetched): one table a shard
                tables = [read_whole_table(self.root, dump_dir, s) for s in shards]
            for key, table in zip(keys, tables, strict=True):
                self._hold(key, table)
            return None
        self._checked.update(keys)
        size = _size(block)
        if self._held + size <= self.budget:
            self._held += size
            b = self._next_block
            self._next_block += 1
            self._blocks[b] = (block, list(keys))
            first = 0
            for key, shard in zip(keys, shards, strict=True):
                self._in_block[key] = (b, first)
                first += shard.rows
        return self._columns(block, dump_dir, shards[0], columns)

    def _columns(
        self, table: pa.Table, dump_dir: str, shard: ShardInfo, columns: list[str]
    ) -> dict[str, pa.ChunkedArray]:
        try:
            return {c: table.column(c) for c in columns}
        except KeyError as e:
            path = self.root.url(posixpath.join(dump_dir, shard.path))
            raise ArtifactError(path, f"unreadable parquet: no column {e}") from None

    def _hold(self, key: tuple[str, str], table: pa.Table) -> None:
        self._checked.add(key)
        size = _size(table)
        if self._held + size <= self.budget:
            self._tables[key] = table
            self._held += size

    def checked(self, dump_dir: str, shard: ShardInfo) -> bool:
        """Whether this shard was read and found to match its manifest entry."""
        return (dump_dir, shard.path) in self._checked

    def held(self, dump_dir: str, shard: ShardInfo) -> pa.Table | None:
        """The shard's decoded columns, if still held (else reopen it)."""
        key = (dump_dir, shard.path)
        table = self._tables.get(key)
        if table is not None or key not in self._in_block:
            return table
        b, first = self._in_block[key]
        return self._blocks[b][0].slice(first, shard.rows)

    def keep_only(self, keep: set[tuple[str, str]]) -> None:
        """Drop the decoded shards not in ``keep`` (``(dump_dir, path)``: no row is needed).

        A block goes once none of its shards is kept.
        """
        for key in [k for k in self._tables if k not in keep]:
            self._held -= _size(self._tables.pop(key))
        for b, (block, members) in list(self._blocks.items()):
            if keep.isdisjoint(members):
                del self._blocks[b]
                self._matrices.pop(b, None)
                self._held -= _size(block)
                for key in members:
                    del self._in_block[key]
        self._located = None

    def locate(self, refs: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
        """For each of ``refs`` (``dump_dir`` and ``shard``), its block and first row there.

        Returns:
            ``(block, first)``: int64 arrays; block ``-1`` where the shard is in no block.
            Computed once for one list of refs (a replay's, shared by its tables).
        """
        known = self._located
        if known is not None and known[0] is refs and known[1] == len(refs):
            return known[2], known[3]
        where = [self._in_block.get((r.dump_dir, r.shard.path), (-1, 0)) for r in refs]
        found = np.array(where, np.int64).reshape(-1, 2)
        self._located = (refs, len(refs), found[:, 0], found[:, 1])
        return found[:, 0], found[:, 1]

    def block_rows(self, block: int, dtype: DType) -> np.ndarray:
        """The encoded rows (embedding column) of a block, as one ``[rows, width]`` array."""
        rows = self._matrices.get(block)
        if rows is None:
            rows = codec.embedding_matrix(self._blocks[block][0].column(codec.EMBEDDING), dtype)
            self._matrices[block] = rows
        return rows


def _size(table: pa.Table) -> int:
    """The bytes a decoded table holds (``nbytes`` walks every array: slower on small ones)."""
    return int(table.get_total_buffer_size())
