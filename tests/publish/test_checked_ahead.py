"""Into a store that is not SQL, the next rank's part is checked on a thread while this one is
written: each shard read once to be checked and once to be written, errors where they were."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import deltarec.publish.ahead as ahead_module
import deltarec.publish.parts as parts_module
import deltarec.publish.rows as rows_module
from deltarec.artifacts import ArtifactRoot
from deltarec.artifacts.types import TableSpec
from deltarec.errors import InvalidRowError
from deltarec.publish import DumpPublisher
from deltarec.stores import open_store
from deltarec.testing.dumps import new_generation, random_rows, write_dump

T = "sparse.ebc.user_id"
U = "sparse.ebc.item_id"
TABLES = {T: TableSpec(dim=16, num_embeddings=10_000), U: TableSpec(dim=8, num_embeddings=10_000)}
_PREFIXES = itertools.count()


@pytest.fixture
def store(redis_server):
    s = open_store(f"{redis_server.url}?prefix=ahead{next(_PREFIXES)}:", run="r")
    yield s
    s.close()


@pytest.fixture
def reads(monkeypatch) -> list[tuple[str, bool]]:
    """Every shard the publisher opens: its path and whether its sha256 was checked."""
    opened: list[tuple[str, bool]] = []
    real = rows_module.iter_shard

    def counting(root, dump_dir, shard, *args, **kwargs):
        opened.append((shard.path, bool(kwargs.get("verify"))))
        return real(root, dump_dir, shard, *args, **kwargs)

    monkeypatch.setattr(rows_module, "iter_shard", counting)
    return opened


def _dump(tmp_path, ranks: int, bad: tuple[int, str, int] | None = None):
    """A dump of both tables by ``ranks`` ranks; ``bad``: (rank, table, row) holds a NaN."""
    root = ArtifactRoot(str(tmp_path / "art"))
    info = new_generation(root, "r", TABLES, world_size=ranks)
    rows = {
        table: {r: random_rows(range(r, 600, ranks), spec, r) for r in range(ranks)}
        for table, spec in TABLES.items()
    }
    if bad is not None:
        rank, table, row = bad
        rows[table][rank].embedding[row, 3] = np.float32("nan")
    return root, write_dump(root, info, 1, rows), rows


def test_every_part_is_read_once_checked_and_once_written(store, tmp_path, reads, monkeypatch):
    root, manifest, rows = _dump(tmp_path, ranks=3)
    ahead: list[int] = []
    real = ahead_module.check_part

    def spy(pub, manifest, rank, tables):
        ahead.append(rank)
        return real(pub, manifest, rank, tables)

    monkeypatch.setattr(ahead_module, "check_part", spy)
    results = DumpPublisher(store, root, "r").publish_generation(1)
    assert [p.rank for p in results] == [0, 1, 2]
    assert ahead == [1, 2]  # checked on the thread; rank 0 by its own pass
    checked = sorted(path for path, verify in reads if verify)
    written = sorted(path for path, verify in reads if not verify)
    assert checked == written == sorted(s.path for s in manifest.shards)
    for table in TABLES:
        for part in rows[table].values():
            got = store.read(table, part.keys)
            assert got.found.all()
            np.testing.assert_array_equal(got.embedding, part.embedding)


def test_a_bad_row_in_a_later_part_is_raised_at_its_turn_with_the_parts_before_it_written(
    store, tmp_path
):
    root, _, rows = _dump(tmp_path, ranks=3, bad=(1, U, 7))
    publisher = DumpPublisher(store, root, "r")
    done: list[int] = []
    with pytest.raises(InvalidRowError, match=r"item_id.*dump 1 rank 1") as err:
        publisher.publish_generation(1, on_part=lambda p: done.append(p.rank))
    assert err.value.key == int(rows[U][1].keys[7])
    assert done == [0]
    assert {(m.rank, m.table) for m in store.progress("r", 1)} == {(0, T), (0, U)}
    for table in TABLES:
        assert store.read(table, rows[table][0].keys).found.all()
        assert not store.read(table, rows[table][1].keys).found.any()
        assert not store.read(table, rows[table][2].keys).found.any()


def test_rows_in_memory_reach_a_store_that_is_not_sql_a_read_chunk_at_a_time(
    store, tmp_path, monkeypatch
):
    """A write of several read chunks' rows from memory hands them over a read chunk at a time
    (each its own MULTI/EXEC, the mark with the last), as rows read from the shards come."""
    monkeypatch.setattr(parts_module, "READ_BYTES", 50 * (16 * 4 + 24))  # 50 rows of T
    root, manifest, rows = _dump(tmp_path, ranks=1)
    writes: list[tuple[str, list[int], bool]] = []
    real = store.apply

    def spy(write):
        batches = list(write.batches)
        writes.append((write.table, [len(b.keys) for b in batches], write.mark is not None))
        return real(write._replace(batches=batches))

    monkeypatch.setattr(store, "apply", spy)
    memory = {table: rows[table][0] for table in TABLES}
    DumpPublisher(store, root, "r").publish_dump(manifest, 0, memory)
    assert (T, [50] * 12, True) in writes  # 600 rows of dim 16 in one write: 12 chunks
    for table in TABLES:
        got = store.read(table, memory[table].keys)
        np.testing.assert_array_equal(got.embedding, memory[table].embedding)
