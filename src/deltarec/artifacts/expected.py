"""Rows of a replay's expected state, read from the shards and base parts that hold them.

:class:`ExpectedTable` is the latest record of every key (from :mod:`deltarec.artifacts.lineage`),
with where each record's row lies (a shard of a dump or a part of a base); its rows are read on
demand, by key (:meth:`ExpectedTable.load`) or in order (:class:`ExpectedRows`).
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import posixpath
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from deltarec.artifacts import codec
from deltarec.artifacts.root import ArtifactRoot
from deltarec.artifacts.types import DType, Op, ShardInfo, TableSpec
from deltarec.artifacts.wholeshard import CheckedShards
from deltarec.errors import ArtifactError


@dataclass(frozen=True)
class ShardRef:
    """Where a shard lies: its dump directory and manifest entry."""

    dump_dir: str
    shard: ShardInfo
    version: int


def _read_columns(
    root: ArtifactRoot,
    ref: ShardRef,
    columns: list[str],
    checked: CheckedShards | None = None,
) -> dict[str, np.ndarray]:
    """``columns`` of one shard; with ``checked``, a small one from its checked bytes."""
    if checked is not None:
        cols = checked.read(ref.dump_dir, ref.shard, columns)
        if cols is not None:
            return cols  # type: ignore[return-value]
    path = posixpath.join(ref.dump_dir, ref.shard.path)
    try:
        # ParquetFile, not read_table: read_table imports pyarrow.dataset (~0.1 s per process).
        # Locally Arrow's own memory-mapped reader: no Python file in the loop. No pre-buffering
        # (its I/O pool costs a small shard more than its decoding: thousands of shards a dump).
        with root.open_listed(ref.dump_dir, ref.shard.path) as f, contextlib.ExitStack() as own:
            # a native file: no filesystem lookup for the path
            source = own.enter_context(pa.memory_map(f)) if isinstance(f, str) else f
            with pq.ParquetFile(source, pre_buffer=False) as pf:
                table = pf.read(columns=columns, use_threads=False)
    except FileNotFoundError:
        raise ArtifactError(root.url(path), "shard listed in the manifest is missing") from None
    except (OSError, pa.ArrowException) as e:  # a truncated file is ArrowInvalid, not OSError
        raise ArtifactError(root.url(path), f"unreadable parquet: {e}") from e
    if table.num_rows != ref.shard.rows:
        raise ArtifactError(
            root.url(path), f"holds {table.num_rows} rows, the manifest says {ref.shard.rows}"
        )
    return {c: table.column(c) for c in columns}


def _one_run(idx: np.ndarray) -> bool:
    """True if ``idx`` is ``a, a+1, ..., b`` (non-empty)."""
    return (
        len(idx) > 0
        and int(idx[-1]) - int(idx[0]) + 1 == len(idx)
        and bool((np.diff(idx) == 1).all())
    )


def _row_groups(
    root: ArtifactRoot, ref: ShardRef, checked: CheckedShards | None = None
) -> tuple[contextlib.ExitStack, Any, list[int]]:
    """A shard opened for reading row groups: ``(what closes it, reader, first row of each)``.

    Closing the returned stack closes the reader and the file. A shard ``checked`` still holds
    is served from its decoded columns as one row group (the stack then closes nothing).
    """
    held = checked.held(ref.dump_dir, ref.shard) if checked is not None else None
    if held is not None:
        return contextlib.ExitStack(), _HeldGroups(held), [0, held.num_rows]
    path = posixpath.join(ref.dump_dir, ref.shard.path)
    stack = contextlib.ExitStack()
    try:
        # Read through (not memory-mapped): row group after row group into buffers that Arrow's
        # pool reuses, instead of faulting in the whole file and decoding the column at once.
        f = stack.enter_context(root.open_listed(ref.dump_dir, ref.shard.path))
        source = stack.enter_context(pa.OSFile(f)) if isinstance(f, str) else f  # no fs lookup
        reader = pq.ParquetFile(source, pre_buffer=False)
        stack.callback(reader.close)
    except FileNotFoundError:
        stack.close()
        raise ArtifactError(root.url(path), "shard listed in the manifest is missing") from None
    except (OSError, pa.ArrowException) as e:
        stack.close()
        raise ArtifactError(root.url(path), f"unreadable parquet: {e}") from e
    except BaseException:
        stack.close()
        raise
    meta = reader.metadata
    if meta.num_rows != ref.shard.rows:
        stack.close()
        raise ArtifactError(
            root.url(path), f"holds {meta.num_rows} rows, the manifest says {ref.shard.rows}"
        )
    return stack, reader, _starts(meta)


class _HeldGroups:
    """A shard decoded whole, read as a one-row-group parquet reader is."""

    def __init__(self, table: pa.Table) -> None:
        self._table = table

    def read_row_group(self, group: int, columns: list[str], use_threads: bool) -> pa.Table:
        assert group == 0
        return self._table.select(columns)


def _starts(meta: Any) -> list[int]:
    """The first row of each row group, and the row count last."""
    starts = np.cumsum([0] + [meta.row_group(i).num_rows for i in range(meta.num_row_groups)])
    return starts.tolist()  # type: ignore[no-any-return]


def _fill_rows(
    root: ArtifactRoot,
    ref: ShardRef,
    rows: np.ndarray,
    out: np.ndarray,
    dst: np.ndarray,
    dtype: DType,
    checked: CheckedShards | None = None,
) -> None:
    """``out[dst] = embedding[rows]`` of one shard, reading only the row groups that hold rows.

    A run of consecutive rows into consecutive destinations (a whole snapshot shard) is block
    copied row group by row group; other rows are gathered per row group.
    """
    opened, reader, starts = _row_groups(root, ref, checked)
    path = root.url(posixpath.join(ref.dump_dir, ref.shard.path))
    run = _one_run(dst) and _one_run(rows)
    order = None if run else np.argsort(rows, kind="stable")
    ordered = rows if order is None else rows[order]
    try:
        for g in range(len(starts) - 1):
            lo, hi = np.searchsorted(ordered, [starts[g], starts[g + 1]])
            if lo == hi:
                continue
            try:
                column = reader.read_row_group(
                    g, columns=[codec.EMBEDDING], use_threads=False
                ).column(0)
            except (OSError, pa.ArrowException) as e:
                raise ArtifactError(path, f"unreadable parquet: {e}") from e
            values = codec.embedding_matrix(column, dtype)
            if order is None:
                out[dst[lo] : dst[lo] + (hi - lo)] = values[ordered[lo] - starts[g] :][: hi - lo]
            else:
                pick = order[lo:hi]
                out[dst[pick]] = values[rows[pick] - starts[g]]
    finally:
        opened.close()


@dataclass
class ExpectedTable:
    """The expected state of one table: the latest record of every key ever seen.

    Attributes:
        table: table id.
        spec: the table's spec (from the newest generation of the lineage).
        keys: int64, sorted, unique: every key with a record (present or absent).
        versions: int64 version of each key's latest record.
        ops: int8: ``Op.UPSERT`` (present) or ``Op.EVICTED`` (absent: evicted, or removed by
            a later snapshot).
        steps: int64 training step the latest record was read at.
    """

    table: str
    spec: TableSpec
    keys: np.ndarray
    versions: np.ndarray
    ops: np.ndarray
    steps: np.ndarray
    _refs: list[ShardRef] = field(repr=False, default_factory=list)
    _ref_idx: np.ndarray = field(repr=False, default_factory=lambda: np.empty(0, np.int32))
    _row_idx: np.ndarray = field(repr=False, default_factory=lambda: np.empty(0, np.int64))
    _root: ArtifactRoot | None = field(repr=False, default=None)
    _checked: CheckedShards | None = field(repr=False, default=None)

    @property
    def present(self) -> np.ndarray:
        """Boolean mask of keys that serving must hold."""
        return self.ops == Op.UPSERT

    def present_keys(self) -> np.ndarray:
        """Sorted keys that serving must hold."""
        return self.keys[self.present]

    def index_of(self, keys: np.ndarray) -> np.ndarray:
        """Positions of ``keys`` in :attr:`keys`, ``-1`` where a key has no record."""
        keys = np.asarray(keys, dtype=np.int64)
        n = len(keys)
        if n and len(self.keys):  # keys that are one run of records (an ordered scan's batch)
            first = int(np.searchsorted(self.keys, keys[0]))
            if np.array_equal(self.keys[first : first + n], keys):
                return np.arange(first, first + n, dtype=np.int64)
        if n > 1024 and not (keys[1:] >= keys[:-1]).all():
            # Keys in no order (a scan in the store's own order): numpy's binary search is
            # faster on sorted queries (each starts where the last one ended), by more than
            # the sort of the queries costs.
            order = np.argsort(keys)
            pos = np.empty(n, np.int64)
            pos[order] = np.searchsorted(self.keys, keys[order])
        else:
            pos = np.searchsorted(self.keys, keys)
        pos = np.minimum(pos, max(len(self.keys) - 1, 0))
        hit = (len(self.keys) > 0) & (self.keys[pos] == keys) if len(self.keys) else None
        if hit is None:
            return np.full(keys.shape, -1, dtype=np.int64)
        return np.where(hit, pos, -1)

    def load(self, keys: np.ndarray) -> np.ndarray:
        """Encoded rows ``[n, encoded_width]`` of the latest records of ``keys``.

        For an absent key (``op == 1``) the row is the one its record carries (the fallback
        row of an evicted ZCH id; zeros for a key removed by a snapshot).

        Raises:
            KeyError: if a key has no record.
        """
        if keys is self.keys:  # every record (verify --all): no lookup, no gathered copies
            ref_idx, row_idx = self._ref_idx, self._row_idx
        else:
            idx = self.index_of(keys)
            if (idx < 0).any():
                missing = np.asarray(keys)[idx < 0][:5].tolist()
                raise KeyError(f"table {self.table!r}: no expected record for keys {missing}")
            ref_idx, row_idx = self._ref_idx[idx], self._row_idx[idx]
        held = _from_blocks(self, ref_idx, row_idx, view=False)
        if held is not None:
            return held
        width = codec.encoded_width(self.spec.dtype, self.spec.dim)
        out = _allocate((len(ref_idx), width), codec.element_type(self.spec.dtype))
        out[ref_idx < 0] = 0  # removed by a snapshot: no row to load
        assert self._root is not None or len(ref_idx) == 0
        for r in np.unique(ref_idx[ref_idx >= 0]):
            sel = np.nonzero(ref_idx == r)[0]
            ref = self._refs[int(r)]
            _fill_rows(self._root, ref, row_idx[sel], out, sel, self.spec.dtype, self._checked)  # type: ignore[arg-type]
        return out

    def load_in_shard_order(self) -> tuple[np.ndarray, np.ndarray]:
        """Every record's encoded row, in shard order: ``(rows, at)``, with ``rows[at[p]]``.

        Record ``p``'s row is ``rows[at[p]]``. For reading every record in an order of the
        store's own (a Redis or PostgreSQL scan): where :meth:`load` scatters each shard's rows
        into key order (a sort of each shard's rows and a copy to random places), this copies
        every shard's rows in file order, a row group at a time; of a shard whose rows are not
        all records, those that are, in file order. ``rows`` holds one row per record and a zero
        row (for records removed by a snapshot): the memory :meth:`load` of every key takes.
        """
        width = codec.encoded_width(self.spec.dtype, self.spec.dim)
        ref_idx, row_idx = self._ref_idx, self._row_idx
        rows = _allocate((len(ref_idx) + 1, width), codec.element_type(self.spec.dtype))
        at = np.full(len(ref_idx), len(ref_idx), np.int64)  # the zero row, until a shard's
        rows[len(ref_idx)] = 0
        start = 0
        for r in np.unique(ref_idx[ref_idx >= 0]).tolist():
            sel = np.flatnonzero(ref_idx == r)
            ref = self._refs[r]
            mine = row_idx[sel]
            if len(mine) == ref.shard.rows:  # every row of the shard (rows are distinct)
                used = np.arange(len(mine), dtype=np.int64)
                at[sel] = start + mine
            else:
                used = np.sort(mine)
                at[sel] = start + np.searchsorted(used, mine)
            dst = np.arange(start, start + len(used), dtype=np.int64)
            assert self._root is not None
            _fill_rows(self._root, ref, used, rows, dst, self.spec.dtype, self._checked)
            start += len(used)
        return rows, at


class ExpectedRows:
    """Encoded rows of an :class:`ExpectedTable`'s records by position, read as asked.

    For reading every record in key order (``verify --all`` against an ordered store scan)
    without holding the whole table in memory: each shard keeps its last decoded row group, so
    a batch of consecutive records of one shard is a view of it, and each row group is decoded
    once as long as the positions asked for advance through every shard in order. If they do
    not (row groups decoded more than twice over on average, or more than ``cache_bytes`` of
    row groups held at once), the whole table is loaded with :meth:`ExpectedTable.load` and
    served from memory. Use it as a context manager: it holds the shards open.
    """

    def __init__(self, table: ExpectedTable, cache_bytes: int = 256 << 20) -> None:
        self._table = table
        self._cache_bytes = cache_bytes
        # ref -> _row_groups(...)
        self._open: dict[int, tuple[contextlib.ExitStack, Any, list[int]]] = {}
        self._groups: dict[int, tuple[int, np.ndarray]] = {}  # ref -> (row group, its rows)
        self._decoded = 0
        self._all: np.ndarray | None = None
        self._at = np.empty(0, np.int64)  # record -> its row in _all

    def __enter__(self) -> ExpectedRows:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    def close(self) -> None:
        """Close the shards and drop the cached rows (idempotent)."""
        for opened, _, _ in self._open.values():
            opened.close()
        self._open.clear()
        self._groups.clear()

    @property
    def streamed(self) -> bool:
        """False once the rows were loaded whole (the positions did not advance in order)."""
        return self._all is None

    def take(self, pos: np.ndarray) -> np.ndarray:
        """Rows ``[len(pos), encoded_width]`` of the records at positions ``pos`` (read-only)."""
        t = self._table
        ref_idx, row_idx = t._ref_idx[pos], t._row_idx[pos]
        held = _from_blocks(t, ref_idx, row_idx) if self._all is None else None
        if held is not None:
            return held
        if self._all is None and (self._thrashing() or self._scattered(ref_idx, row_idx)):
            self.close()
            self._all, self._at = self._table.load_in_shard_order()
        if self._all is not None:
            return _gather(self._all, self._at[pos])
        if len(pos) and ref_idx[0] >= 0 and (ref_idx == ref_idx[0]).all() and _one_run(row_idx):
            r, first = int(ref_idx[0]), int(row_idx[0])
            start, values = self._group(r, first)
            if first + len(pos) <= start + len(values):  # one row group holds them: a view
                return values[first - start : first - start + len(pos)]
        width = codec.encoded_width(t.spec.dtype, t.spec.dim)
        out = np.zeros((len(pos), width), dtype=codec.element_type(t.spec.dtype))
        for r, sel in _by_ref(ref_idx):
            rows = row_idx[sel]
            starts = self._shard(r)[2]
            if len(starts) == 2:  # one row group (a shard held decoded): no search
                out[sel] = self._group(r, 0)[1][rows]
                continue
            group = np.searchsorted(np.asarray(starts), rows, side="right") - 1
            for g in np.unique(group).tolist():
                mine = group == g
                start, values = self._group(r, int(starts[g]))
                out[sel[mine]] = values[rows[mine] - start]
        return out

    def _scattered(self, ref_idx: np.ndarray, row_idx: np.ndarray) -> bool:
        """Whether the row groups these records lie in hold far more rows than they are.

        Records read in each shard's order touch their rows' row groups and at most one more
        per shard at either end; records out of shard order (random keys read in key order)
        touch most row groups of every shard at each batch, and would decode the whole table
        again and again: that is known at the first batch, before any row group is decoded.
        """
        touched, slack = 0, 0
        for r, sel in _by_ref(ref_idx):
            starts = self._shard(r)[2]
            if len(starts) == 2:  # one row group: touched whole, within its slack
                touched += starts[1]
                slack += 2 * starts[1]
                continue
            sizes = np.diff(starts)
            groups = np.unique(np.searchsorted(starts, row_idx[sel], side="right") - 1)
            touched += int(sizes[groups].sum())
            slack += 2 * int(sizes.max())
        return touched > 2 * len(row_idx) + slack

    def _thrashing(self) -> bool:
        groups = sum(len(starts) - 1 for _, _, starts in self._open.values())
        held = sum(values.nbytes for _, values in self._groups.values())
        return self._decoded > 2 * groups + 16 or held > self._cache_bytes

    def _shard(self, r: int) -> tuple[Any, Any, list[int]]:
        if r not in self._open:
            assert self._table._root is not None
            t = self._table
            self._open[r] = _row_groups(t._root, t._refs[r], t._checked)  # type: ignore[arg-type]
        return self._open[r]

    def _group(self, r: int, row: int) -> tuple[int, np.ndarray]:
        """The first row and the decoded rows of the row group of shard ``r`` holding ``row``."""
        _, reader, starts = self._shard(r)
        g = int(np.searchsorted(starts, row, side="right")) - 1
        cached = self._groups.get(r)
        if cached is None or cached[0] != g:
            try:
                column = reader.read_row_group(
                    g, columns=[codec.EMBEDDING], use_threads=False
                ).column(0)
            except (OSError, pa.ArrowException) as e:
                ref, root = self._table._refs[r], self._table._root
                where = root.url(posixpath.join(ref.dump_dir, ref.shard.path))  # type: ignore[union-attr]
                raise ArtifactError(where, f"unreadable parquet: {e}") from e
            cached = (g, codec.embedding_matrix(column, self._table.spec.dtype))
            self._groups[r] = cached
            self._decoded += 1
        return starts[g], cached[1]


def _from_blocks(
    t: ExpectedTable, ref_idx: np.ndarray, row_idx: np.ndarray, view: bool = True
) -> np.ndarray | None:
    """The rows of records ``(ref_idx, row_idx)``, if every record's shard lies in a block.

    A dump's shards of one table read as a group (:meth:`CheckedShards.read_group`) are one
    array: the records of a batch spanning many small shards are a gather per block (with
    ``view``, a view where they are consecutive rows of one block), not a read per shard.
    Records removed by a snapshot get zero rows. None if a record's shard is in no block.
    """
    if t._checked is None or not len(ref_idx):
        return None
    block_of, first_of = t._checked.locate(t._refs)
    live = ref_idx >= 0
    every = bool(live.all())
    named = ref_idx if every else ref_idx[live]
    if not len(named):
        return None
    blocks = block_of[named]
    if (blocks < 0).any():
        return None
    at = first_of[named] + (row_idx if every else row_idx[live])
    b = int(blocks[0])
    if every and (blocks == b).all():
        rows = t._checked.block_rows(b, t.spec.dtype)
        return _gather(rows, at) if view else rows[at]
    width = codec.encoded_width(t.spec.dtype, t.spec.dim)
    out = np.zeros((len(ref_idx), width), dtype=codec.element_type(t.spec.dtype))
    dst = np.flatnonzero(live)
    for b, sel in _by_ref(blocks):
        out[dst[sel]] = t._checked.block_rows(b, t.spec.dtype)[at[sel]]
    return out


_POPULATE_BYTES = 32 << 20
"""Arrays this large are allocated with their pages mapped at once (:func:`_allocate`)."""


def _by_ref(ref_idx: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """``(ref, its positions in ref_idx)`` of each shard named (``-1``, removed, left out).

    One sort instead of a scan of the batch per shard, which a batch spanning thousands of
    small shards (hundreds of ranks) would repeat for each.
    """
    order = np.argsort(ref_idx, kind="stable")
    ordered = ref_idx[order]
    cuts = np.flatnonzero(ordered[1:] != ordered[:-1]) + 1
    bounds = [0, *cuts.tolist(), len(order)]
    return [
        (int(ordered[a]), order[a:b])
        for a, b in itertools.pairwise(bounds)
        if b > a and ordered[a] >= 0
    ]


def _allocate(shape: tuple[int, int], dtype: np.dtype) -> np.ndarray:
    """An uninitialized array; a large one with all of its pages mapped up front.

    Rows are scattered into it in random order; faulting its fresh pages in one at a time
    costs several times the copy itself on a VM (about 2 ms per MB), ``MAP_POPULATE`` maps
    them in one call. The memory is returned when the array is dropped.
    """
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    populate = getattr(mmap, "MAP_POPULATE", 0)
    if nbytes < _POPULATE_BYTES or not populate:
        return np.empty(shape, dtype)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate
    return np.frombuffer(mmap.mmap(-1, nbytes, flags=flags), dtype).reshape(shape)


def _gather(rows: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """``rows[pos]``, as a view when ``pos`` is one ascending run."""
    if _one_run(pos):
        return rows[int(pos[0]) : int(pos[-1]) + 1]
    return rows[pos]
