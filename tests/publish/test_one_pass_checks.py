"""A part that goes in one SQL transaction is checked as it is written: read once, never half
applied."""

from __future__ import annotations

import numpy as np
import pytest

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


@pytest.fixture(params=["sqlite", "postgres"])
def url(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store.db'}"
    return f"{request.getfixturevalue('postgres_server').url}?schema=onepass{tmp_path.name[-12:]}"


@pytest.fixture
def reads(monkeypatch) -> list[str]:
    """Every shard the publisher opens, by path (a shard read twice appears twice)."""
    opened: list[str] = []
    real = rows_module.iter_shard

    def counting(root, dump_dir, shard, *args, **kwargs):
        opened.append(shard.path)
        return real(root, dump_dir, shard, *args, **kwargs)

    monkeypatch.setattr(rows_module, "iter_shard", counting)
    return opened


def _dump(tmp_path, bad_key: int | None = None):
    root = ArtifactRoot(str(tmp_path / "art"))
    info = new_generation(root, "r", {T: TABLES[T]}, world_size=1)
    rows = random_rows(range(300), TABLES[T], 1)
    if bad_key is not None:
        rows.embedding[bad_key, 5] = np.float32("nan")
    return root, write_dump(root, info, 1, {T: {0: rows}}), rows


def test_a_part_in_one_transaction_is_read_once_and_published_whole(url, tmp_path, reads):
    root, manifest, rows = _dump(tmp_path)
    store = open_store(url, run="r")
    DumpPublisher(store, root, "r").publish_dump(manifest, 0)
    assert reads == [s.path for s in manifest.shards]  # one read: checked while written
    got = store.read(T, rows.keys)
    assert got.found.all()
    np.testing.assert_array_equal(got.embedding, rows.embedding)
    assert [(m.rows, m.complete) for m in store.progress("r", 1)] == [(300, True)]
    store.close()


def test_a_bad_row_in_a_later_read_chunk_aborts_the_transaction_and_applies_nothing(
    url, tmp_path, reads, monkeypatch
):
    monkeypatch.setattr(parts_module, "READ_BYTES", 50 * 64)  # 50 rows per read chunk
    root, manifest, rows = _dump(tmp_path, bad_key=290)  # in the sixth chunk
    store = open_store(url, run="r")
    with pytest.raises(InvalidRowError, match=r"sparse\.ebc\.user_id.*dump 1 rank 0") as err:
        DumpPublisher(store, root, "r").publish_dump(manifest, 0)
    assert err.value.key == 290
    assert len(reads) == 1  # no first pass: the write itself found it
    assert not store.read(T, rows.keys).found.any()
    assert store.progress("r", 1) == []
    store.close()


def test_a_part_over_several_transactions_is_checked_whole_before_the_first(url, tmp_path, reads):
    root, manifest, rows = _dump(tmp_path, bad_key=290)
    store = open_store(url, run="r")
    publisher = DumpPublisher(store, root, "r", batch_bytes=100 * 64)  # 3 transactions
    with pytest.raises(InvalidRowError) as err:
        publisher.publish_dump(manifest, 0)
    assert err.value.key == 290 and len(reads) == 1  # the first pass found it
    assert not store.read(T, rows.keys).found.any()
    assert store.progress("r", 1) == []
    store.close()


def test_with_two_tables_the_second_is_checked_before_the_first_is_written(url, tmp_path, reads):
    root = ArtifactRoot(str(tmp_path / "art"))
    info = new_generation(root, "r", TABLES, world_size=1)
    first = random_rows(range(300), TABLES[U], 1)  # sparse.ebc.item_id sorts first
    second = random_rows(range(100), TABLES[T], 2)
    second.embedding[7, 0] = np.float32("inf")
    manifest = write_dump(root, info, 1, {U: {0: first}, T: {0: second}})
    store = open_store(url, run="r")
    with pytest.raises(InvalidRowError, match=r"sparse\.ebc\.user_id") as err:
        DumpPublisher(store, root, "r").publish_dump(manifest, 0)
    assert err.value.key == 7
    assert not store.read(U, first.keys).found.any()
    assert store.progress("r", 1) == []
    store.close()
