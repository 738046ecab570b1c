"""SQLite's write of several batches out of key order: spilled, then applied in key order.

The spill reads its rows back a few at a time here (``SPILL_READ_BYTES`` made tiny), so rows
of one key straddle read chunks. What a write leaves is compared with the same batches written
one at a time, each its own transaction.
"""

from __future__ import annotations

import sqlite3
from typing import Any

import numpy as np
import pytest

from deltarec.artifacts import codec
from deltarec.artifacts.types import TableSpec
from deltarec.errors import InvalidRowError, StaleGenerationError, StoreError
from deltarec.ids import make_version
from deltarec.publish.snapshot import finish_snapshot
from deltarec.stores import ProgressMark, RowBatch, open_store
from deltarec.stores.sql import spill as spillmod
from deltarec.stores.sql import sqlite as sqlite_module

T = "sparse.ebc.user_id"
DIM = 4


@pytest.fixture
def small_reads(monkeypatch):
    """Read chunks of 3 rows; records the chunk sizes read back."""
    sizes: list[int] = []
    real = spillmod.Spill.rows

    def spy(self: Any) -> Any:
        for chunk in real(self):
            sizes.append(len(chunk[0]))
            yield chunk

    record = 8 + 1 + DIM * 4
    monkeypatch.setattr(spillmod, "SPILL_READ_BYTES", 3 * record)
    monkeypatch.setattr(spillmod.Spill, "rows", spy)
    return sizes


def open_at(path: Any) -> Any:
    store = open_store(f"sqlite:///{path}", run="r")
    store.provision({T: TableSpec(dim=DIM)})
    return store


def state(store: Any, keys: np.ndarray) -> tuple[list[bool], list[int], np.ndarray]:
    got = store.read(T, keys)
    return got.found.tolist(), got.versions[got.found].tolist(), got.embedding[got.found]


def test_a_spilled_write_ends_as_its_batches_written_one_by_one(tmp_path, small_reads):
    rng = np.random.default_rng(0)
    key_space = np.arange(60, dtype=np.int64)
    base = rng.normal(size=(60, DIM)).astype(np.float32)
    batches = []
    versions = rng.permutation(np.arange(1, 400))  # no two rows share a version ...
    for i in range(8):
        keys = rng.choice(key_space, size=40, replace=False)  # keys repeat across batches
        emb = codec.encode(rng.normal(size=(40, DIM)).astype(np.float32), codec.DType.FLOAT32)
        ops = (rng.random(40) < 0.2).astype(np.int8)
        v = np.array([make_version(1, int(x)) for x in versions[i * 40 : i * 40 + 40]])
        batches.append(RowBatch(keys, emb, ops, v))
    # ... except 5 keys of the first batch, written again by the last at the same versions,
    # newer than any other row: the later batch wins
    top = np.array([make_version(1, 500 + i) for i in range(5)])
    first = batches[0]
    ops0 = first.ops.copy()
    ops0[:5] = 0
    batches[0] = RowBatch(first.keys, first.embedding, ops0, np.r_[top, first.versions[5:]])
    again = codec.encode(base[:5] + 7, codec.DType.FLOAT32)
    batches.append(RowBatch(first.keys[:5], again, np.zeros(5, np.int8), top))
    spilled, one_by_one = open_at(tmp_path / "a.db"), open_at(tmp_path / "b.db")
    for store in (spilled, one_by_one):
        store.write(
            T,
            key_space,
            codec.encode(base, codec.DType.FLOAT32),
            np.zeros(60, np.int8),
            np.full(60, make_version(1, 200)),
        )
    mark = ProgressMark("r", 1, 5, T, 0, 325, True)
    assert spilled.write_batches(T, batches, mark) == 325
    for batch in batches:
        one_by_one.write_batches(T, [batch])
    assert len(small_reads) > 50 and max(small_reads) == 3  # many chunks: keys straddle them
    a, b = state(spilled, key_space), state(one_by_one, key_space)
    assert a[0] == b[0] and a[1] == b[1]
    np.testing.assert_array_equal(a[2], b[2])
    assert 0 < sum(a[0]) < 60  # some keys deleted, some not
    np.testing.assert_array_equal(spilled.read(T, first.keys[:5]).embedding, again)
    assert [m.rows for m in spilled.progress("r", 1)] == [325]
    spilled.close()
    one_by_one.close()


def test_a_spilled_write_skips_rows_below_the_floor(tmp_path, small_reads):
    store = open_at(tmp_path / "s.db")
    keys = np.arange(10, dtype=np.int64)
    emb = codec.encode(np.ones((10, DIM), np.float32), codec.DType.FLOAT32)
    snap = make_version(2, 0)
    mark = ProgressMark("r", 2, 0, T, 0, 5, True)
    store.write(T, keys[:5], emb[:5], np.zeros(5, np.int8), np.full(5, snap), mark=mark)
    assert finish_snapshot(store, "r", 2, 0, T, world_size=1)
    late = np.array([make_version(1, 9), make_version(2, 1)] * 5, np.int64)
    order = np.array([9, 3, 7, 1, 5, 8, 0, 6, 2, 4])
    parts = [
        RowBatch(
            keys[order[s : s + 2]], emb[order[s : s + 2]], np.zeros(2, np.int8), late[s : s + 2]
        )
        for s in range(0, 10, 2)
    ]
    assert store.write_batches(T, parts) == 10
    got = store.read(T, keys)
    newer = {int(k) for k, v in zip(keys[order], late, strict=True) if v == make_version(2, 1)}
    assert got.found.tolist() == [k < 5 or k in newer for k in range(10)]
    store.close()


def test_a_spilled_write_into_a_staging_view_keeps_deletes_as_rows(tmp_path, small_reads):
    store = open_at(tmp_path / "g.db")
    keys = np.arange(20, dtype=np.int64)
    emb = codec.encode(np.ones((20, DIM), np.float32), codec.DType.FLOAT32)
    store.write(T, keys, emb, np.zeros(20, np.int8), np.full(20, make_version(1, 1)))
    store.provision({T: TableSpec(dim=DIM)}, staging_generation=2)
    new = codec.encode(np.full((20, DIM), 2.0, np.float32), codec.DType.FLOAT32)
    ops = (keys < 5).astype(np.int8)
    parts = [
        RowBatch(keys[s::4], new[s::4], ops[s::4], np.full(5, make_version(2, 1))) for s in range(4)
    ]
    store.write_batches(T, parts[::-1], staging_generation=2)
    assert small_reads  # spilled
    np.testing.assert_array_equal(store.read(T, keys).embedding, emb)  # live view untouched
    store.merge_staging("r", 2)
    got = store.read(T, keys)
    assert got.found.tolist() == [False] * 5 + [True] * 15
    np.testing.assert_array_equal(got.embedding[5:], new[5:])
    store.close()


def test_a_bad_row_in_a_later_batch_leaves_nothing_and_no_spill_file(
    tmp_path, small_reads, monkeypatch
):
    monkeypatch.setenv("SQLITE_TMPDIR", str(tmp_path / "spill"))
    (tmp_path / "spill").mkdir()
    made: list[Any] = []
    real = spillmod.tempfile.TemporaryFile

    def temporary_file(**kwargs: Any) -> Any:
        made.append(kwargs.get("dir"))
        return real(**kwargs)

    monkeypatch.setattr(spillmod.tempfile, "TemporaryFile", temporary_file)
    store = open_at(tmp_path / "n.db")
    keys = np.arange(30, dtype=np.int64)[::-1].copy()
    values = np.ones((30, DIM), np.float32)
    values[25, 2] = np.inf
    emb = codec.encode(values, codec.DType.FLOAT32)
    parts = [
        RowBatch(
            keys[s : s + 10],
            emb[s : s + 10],
            np.zeros(10, np.int8),
            np.full(10, make_version(1, 1)),
        )
        for s in range(0, 30, 10)
    ]
    with pytest.raises(InvalidRowError, match="key 4"):
        store.write_batches(T, parts, ProgressMark("r", 1, 1, T, 0, 30, True))
    assert not store.read(T, keys).found.any()
    assert store.progress("r", 1) == []
    assert made and set(made) == {str(tmp_path / "spill")}  # where SQLITE_TMPDIR says
    assert list((tmp_path / "spill").iterdir()) == []  # and left nothing there
    store.close()


def test_a_store_file_locked_by_another_process_at_open_is_a_transient_error(tmp_path):
    """Switching a new file to WAL may answer "locked" at once: the publisher retries that."""
    import sqlite3

    from deltarec.errors import StoreUnavailableError

    path = tmp_path / "store.db"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN EXCLUSIVE")
    with pytest.raises(StoreUnavailableError, match="cannot open"):
        open_store(f"sqlite:///{path}?timeout_s=0.1", run="r")
    holder.execute("ROLLBACK")
    holder.close()
    # the retry, once the lock is gone
    store = open_store(f"sqlite:///{path}?timeout_s=0.1", run="r")
    store.close()
    again = sqlite3.connect(path)  # the first opener switched the file to WAL for good
    assert again.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    again.close()


def test_the_spill_gives_back_a_repeated_key_s_rows_in_the_order_they_were_added():
    dim = 4
    keys = [np.array([9, 3, 5], np.int64), np.array([5, 1, 9], np.int64)]
    with spillmod.Spill() as spill:
        for i, k in enumerate(keys):
            rows = np.full((3, dim), float(i), np.float32)
            spill.add(k, rows, np.full(3, 10 + i, np.int64), np.zeros(3, np.int8), None)
        got = list(spill.rows())
    out_keys = np.concatenate([g[0] for g in got])
    out_versions = np.concatenate([g[2] for g in got])
    assert out_keys.tolist() == [1, 3, 5, 5, 9, 9]
    assert out_versions.tolist() == [11, 10, 10, 11, 10, 11]  # first added, first back


def test_key_order_is_stable_where_a_key_repeats_and_sorted_everywhere():
    rng = np.random.default_rng(3)
    unique = rng.permutation(np.arange(10_000, dtype=np.int64))
    np.testing.assert_array_equal(unique[spillmod.key_order(unique)], np.sort(unique))
    repeated = rng.integers(0, 50, 10_000).astype(np.int64)
    np.testing.assert_array_equal(spillmod.key_order(repeated), np.argsort(repeated, kind="stable"))


def _spill_of(rows: int, batches: int) -> Any:
    spill = spillmod.Spill()
    rng = np.random.default_rng(5)
    keys = rng.permutation(rows * batches).astype(np.int64)
    for part in np.array_split(keys, batches):
        emb = np.repeat(part[:, None].astype(np.float32), DIM, axis=1)
        spill.add(part, emb, np.full(len(part), 7, np.int64), np.zeros(len(part), np.int8), None)
    return spill


def test_the_read_back_thread_gives_every_chunk_in_key_order(small_reads):
    with _spill_of(50, 4) as spill, spill.rows_ahead() as chunks:
        got = list(chunks)
    keys = np.concatenate([c[0] for c in got])
    assert keys.tolist() == list(range(200))
    np.testing.assert_array_equal(np.concatenate([c[1] for c in got])[:, 0], keys)
    assert len(small_reads) == len(got) > 1


def test_the_read_back_thread_raises_a_read_error_where_its_chunk_would_come(
    small_reads, monkeypatch
):
    def fail(*_: Any) -> None:
        raise spillmod.StoreError("spill file ended early")

    with _spill_of(50, 4) as spill:
        monkeypatch.setattr(spillmod, "_read_exactly", fail)
        with spill.rows_ahead() as chunks, pytest.raises(spillmod.StoreError, match="ended"):
            list(chunks)


def test_the_read_back_thread_stops_when_its_reader_leaves_early(small_reads):
    with _spill_of(50, 4) as spill:
        reader = spill.rows_ahead()
        with reader as chunks:
            next(iter(chunks))
        assert reader._job.done()  # its kept thread left the spill's rows


def test_a_file_that_is_not_a_database_is_refused_and_its_connection_closed(tmp_path, monkeypatch):
    opened: list[sqlite3.Connection] = []
    real = sqlite3.connect

    def connect(*args, **kwargs):  # type: ignore[no-untyped-def]
        opened.append(real(*args, **kwargs))
        return opened[-1]

    monkeypatch.setattr(sqlite_module.sqlite3, "connect", connect)
    path = tmp_path / "not.db"
    path.write_bytes(b"this is not an SQLite database file, just text" * 100)
    with pytest.raises(StoreError, match=r"not\.db"):
        open_store(f"sqlite:///{path}")
    assert len(opened) == 1
    with pytest.raises(sqlite3.ProgrammingError, match="closed"):
        opened[0].execute("SELECT 1")


def _rows_of(seq: int, keys: np.ndarray) -> RowBatch:
    n = len(keys)
    embedding = np.full((n, DIM), float(seq), np.float32)
    return RowBatch(keys, embedding, np.zeros(n, np.int8), np.full(n, make_version(1, seq)))


def test_write_parts_writes_each_part_s_mark_and_none_for_a_superseded_generation(tmp_path):
    store = open_at(tmp_path / "marks.db")
    registry = store.registry
    registry.register_generation("r", 1)
    keys = np.arange(6, dtype=np.int64)
    marks = [ProgressMark("r", 1, 1, T, rank, 2, True) for rank in range(3)]
    store.write_parts(T, iter([_rows_of(1, keys)]), marks)
    assert [(m.seq, m.rank, m.rows, m.complete) for m in registry.progress("r", 1)] == [
        (1, 0, 2, True),
        (1, 1, 2, True),
        (1, 2, 2, True),
    ]
    registry.register_generation("r", 2)  # generation 1 is superseded: its writer is fenced
    late = [ProgressMark("r", 1, 2, T, rank, 2, True) for rank in range(3)]
    with pytest.raises(StaleGenerationError):
        store.write_parts(T, iter([_rows_of(2, keys)]), late)
    assert {m.seq for m in registry.progress("r", 1)} == {1}  # no mark of dump 2
    assert state(store, keys)[1] == [make_version(1, 1)] * 6  # and none of its rows


def test_a_snapshot_completes_from_marks_read_once_as_from_marks_read_for_it(tmp_path):
    store = open_at(tmp_path / "snap.db")
    registry = store.registry
    registry.register_generation("r", 1)
    keys = np.arange(4, dtype=np.int64)
    store.write_parts(T, iter([_rows_of(1, keys)]), [ProgressMark("r", 1, 1, T, 0, 4, True)])
    reads: list[int] = []

    def progress() -> list[ProgressMark]:
        reads.append(1)
        return registry.progress("r", 1)

    # one rank of two in: not complete, whichever way the marks come
    assert not finish_snapshot(store, "r", 1, 1, T, world_size=2, progress=progress)
    assert not finish_snapshot(store, "r", 1, 1, T, world_size=2)
    store.write_parts(T, iter([_rows_of(1, keys[:0])]), [ProgressMark("r", 1, 1, T, 1, 0, True)])
    assert finish_snapshot(store, "r", 1, 1, T, world_size=2, progress=progress)
    assert reads == [1, 1]
    assert registry.snapshot("r", 1, 1, T) is not None
