"""Into SQLite, the ranks' parts of a dump go in one transaction per table: rows in one key-ordered
pass, every part's mark with them; never half applied, and part by part where they cannot."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from deltarec.artifacts import ArtifactRoot, codec
from deltarec.artifacts.types import DumpKind, TableSpec
from deltarec.errors import ChecksumError, InvalidRowError
from deltarec.publish import DumpPublisher, heldparts
from deltarec.stores import open_store
from deltarec.stores.sql.sqlite import SqliteStore
from deltarec.stores.types import ProgressMark
from deltarec.testing.dumps import new_generation, random_rows, write_dump

T = "sparse.ebc.user_id"
U = "sparse.ebc.item_id"
TABLES = {T: TableSpec(dim=16, num_embeddings=10_000), U: TableSpec(dim=8, num_embeddings=10_000)}


@pytest.fixture
def writes(monkeypatch) -> list[tuple[str, list[tuple[int, int, bool]]]]:
    """Every SQLite transaction of rows: its table and the marks ``(rank, rows, complete)``."""
    seen: list[tuple[str, list[tuple[int, int, bool]]]] = []
    real = SqliteStore.write_parts

    def counting(self, table, batches, marks, staging_generation=None, before_commit=None):
        seen.append((table, [(m.rank, m.rows, m.complete) for m in marks]))
        return real(self, table, batches, marks, staging_generation, before_commit)

    monkeypatch.setattr(SqliteStore, "write_parts", counting)
    return seen


def _snapshot(tmp_path, bad: tuple[int, int] | None = None):
    """Two ranks, two tables, keys of the ranks interleaved and out of order in each shard."""
    root = ArtifactRoot(str(tmp_path / "art"))
    info = new_generation(root, "r", TABLES, world_size=2)
    keys = np.random.default_rng(0).permutation(np.arange(600, dtype=np.int64))
    parts = {
        table: {rank: random_rows(keys[rank::2], spec, 7 + rank) for rank in (0, 1)}
        for table, spec in TABLES.items()
    }
    if bad is not None:
        rank, row = bad
        parts[U][rank].embedding[row, 3] = np.float32("inf")
    manifest = write_dump(root, info, 0, parts, kind=DumpKind.SNAPSHOT)
    return root, manifest, parts


def _store(tmp_path) -> SqliteStore:
    store = open_store(f"sqlite:///{tmp_path / 'store.db'}", run="r")
    assert isinstance(store, SqliteStore)
    return store


def test_the_parts_of_each_table_go_in_one_transaction_with_both_marks(tmp_path, writes):
    root, _, parts = _snapshot(tmp_path)
    store = _store(tmp_path)
    pub = DumpPublisher(store, root, "r")
    results = pub.publish_generation(1)
    assert [(p.rank, p.rows, sorted(p.tables)) for p in results] == [
        (0, 600, sorted(TABLES)),
        (1, 600, sorted(TABLES)),
    ]
    assert writes == [(U, [(0, 300, True), (1, 300, True)]), (T, [(0, 300, True), (1, 300, True)])]
    for table, spec in TABLES.items():  # every part's rows counted, once a table
        labels = {"table": table, "mode": "direct"}
        assert pub.metrics.value("deltarec_publish_rows_total", labels) == 600
        row = codec.row_bytes(spec.dtype, spec.dim)
        assert pub.metrics.value("deltarec_publish_bytes_total", labels) == 600 * row
    for table in TABLES:
        for rows in parts[table].values():
            got = store.read(table, rows.keys)
            assert got.found.all()
            np.testing.assert_array_equal(got.embedding, rows.embedding)
    marks = {(m.table, m.rank): (m.rows, m.complete) for m in store.progress("r", 1)}
    assert marks == {(t, r): (300, True) for t in TABLES for r in (0, 1)}
    assert all(store.snapshot("r", 1, 0, t) is not None for t in TABLES)  # completed once
    assert {f.rank for f in store.freshness("r", 1)} == {0, 1}
    store.close()


@pytest.mark.parametrize("held", [True, False], ids=["read-whole", "streamed"])
def test_a_bad_row_in_the_second_rank_applies_nothing_of_either_part(
    tmp_path, writes, monkeypatch, held
):
    if not held:  # parts too large to hold: streamed, the first table checked while written
        monkeypatch.setattr(heldparts, "HELD_BYTES", 0)
    root, _, parts = _snapshot(tmp_path, bad=(1, 250))
    store = _store(tmp_path)
    with pytest.raises(InvalidRowError, match=r"sparse\.ebc\.item_id.*dump 0 rank 1") as err:
        DumpPublisher(store, root, "r").publish_generation(1)
    assert err.value.key == int(parts[U][1].keys[250])
    # held: every row checked before the first write; streamed: the first table's write aborted
    assert writes == ([] if held else [(U, [(0, 300, True), (1, 300, True)])])
    for table in TABLES:
        assert not store.read(table, parts[table][0].keys).found.any()
    assert store.progress("r", 1) == []
    store.close()


def test_a_started_part_resumes_on_its_own_after_its_mark(tmp_path, writes):
    root, manifest, parts = _snapshot(tmp_path)
    store = _store(tmp_path)
    pub = DumpPublisher(store, root, "r")
    pub.prepare(1)
    first = parts[T][0].slice(0, 100)  # rank 0 wrote 100 rows of T, then stopped
    versions = np.full(100, manifest.version, np.int64)
    store.write(
        T,
        first.keys,
        first.embedding,
        first.ops,
        versions,
        ProgressMark("r", 1, 0, T, 0, 100, False),
    )
    writes.clear()
    results = pub.publish_generation(1)
    assert [(p.rank, p.skipped_rows) for p in results] == [(0, 100), (1, 0)]
    assert all(len(marks) == 1 for _, marks in writes)  # part by part
    for table in TABLES:
        for rows in parts[table].values():
            np.testing.assert_array_equal(store.read(table, rows.keys).embedding, rows.embedding)
    store.close()


def test_parts_too_large_for_one_transaction_together_go_part_by_part(tmp_path, writes):
    root, _, parts = _snapshot(tmp_path)
    store = _store(tmp_path)
    one_part = 300 * (16 * 4 + 24)  # the batch bytes of one part of T: two do not fit
    DumpPublisher(store, root, "r", batch_bytes=one_part).publish_generation(1)
    assert all(len(marks) == 1 for _, marks in writes)
    for table in TABLES:
        for rows in parts[table].values():
            np.testing.assert_array_equal(store.read(table, rows.keys).embedding, rows.embedding)
    store.close()


@pytest.mark.parametrize("held", [True, False], ids=["read-whole", "streamed"])
def test_a_shard_not_matching_its_sha256_applies_nothing_though_checked_after_its_rows_are_read(
    tmp_path, monkeypatch, held
):
    if not held:  # streamed: the sha256 checked after the rows are read, before the commit
        monkeypatch.setattr(heldparts, "HELD_BYTES", 0)
    root, manifest, parts = _snapshot(tmp_path)
    other = ArtifactRoot(str(tmp_path / "other"))
    info = new_generation(other, "r", TABLES, world_size=2)
    changed = {
        t: {r: random_rows(p.keys, TABLES[t], 99 + r) for r, p in ranks.items()}
        for t, ranks in parts.items()
    }
    write_dump(other, info, 0, changed, kind=DumpKind.SNAPSHOT)
    for shard in manifest.shards:  # rank 1's shard of the table written first, other values
        if shard.rank == 1 and shard.table == U:
            src = os.path.join(other.dump_dir("r", 1, 0), shard.path)
            shutil.copyfile(src, os.path.join(root.dump_dir("r", 1, 0), shard.path))
    store = _store(tmp_path)
    with pytest.raises(ChecksumError, match="rank-00001"):
        DumpPublisher(store, root, "r").publish_generation(1)
    for table in TABLES:
        for rows in parts[table].values():
            assert not store.read(table, rows.keys).found.any()
    assert store.progress("r", 1) == []
    store.close()
