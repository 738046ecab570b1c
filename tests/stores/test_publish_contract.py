"""Publishing dumps into every backend: resume after a crash, outages, bad rows, snapshots."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from deltarec.artifacts import ArtifactRoot
from deltarec.artifacts.types import DType, DumpKind, TableKind, TableSpec
from deltarec.errors import InvalidRowError
from deltarec.ids import make_version
from deltarec.publish import DumpPublisher, PublishMetrics, RetryPolicy
from deltarec.stores import open_store
from deltarec.testing.dumps import new_generation, random_rows, write_dump

T = "sparse.ebc.user_id"
Z = "sparse.zch.ad_id"
TABLES = {
    T: TableSpec(dim=16, num_embeddings=10_000),
    Z: TableSpec(dim=8, dtype=DType.FLOAT16, kind=TableKind.ZCH),
}
FAST_RETRY = RetryPolicy(initial_s=0.05, max_s=0.5, deadline_s=60)


class Crash(Exception):
    pass


def two_rank_dump(root, info, seq, seed, kind=DumpKind.DELTA, n=600):
    """Rank r holds keys r, r+2, ... of T; ZCH ids -1, 10 (evicted), 20 (rank 0), 11 (evicted),
    21 (rank 1)."""
    t = TABLES[T]
    z = TABLES[Z]
    zops = np.array([0, 1, 0], np.int8)
    rows = {
        T: {r: random_rows(np.arange(r, 2 * n, 2), t, seed + r) for r in range(2)},
        Z: {r: random_rows([-1, 10 + r, 20 + r][r:], z, seed, zops[r:]) for r in range(2)},
    }
    return write_dump(root, info, seq, rows, kind=kind), rows


def read_all(store, table, keys):
    return store.read(table, np.asarray(keys, np.int64))


def test_crash_between_batches_resumes_without_loss_or_duplicates(backend, tmp_path):
    root = ArtifactRoot(str(tmp_path / "art"))
    info = new_generation(root, "r", TABLES, world_size=2)
    _, rows = two_rank_dump(root, info, 1, seed=3)
    written: list[int] = []

    def crash_after_three(mark, n):
        written.append(n)
        if len(written) == 3:
            raise Crash("process died")

    store = open_store(backend.url, run="r")
    first = DumpPublisher(store, root, "r", batch_bytes=100 * 64, after_batch=crash_after_three)
    with pytest.raises(Crash):
        first.publish_generation(info.generation)
    store.close()
    before = sum(written)
    assert 0 < before < 1200

    store = open_store(backend.url, run="r")
    resumed: list[int] = []
    second = DumpPublisher(
        store, root, "r", batch_bytes=100 * 64, after_batch=lambda m, n: resumed.append(n)
    )
    parts = second.publish_generation(info.generation)
    assert sum(resumed) == 1200 + 5 - before  # resumed after the last committed mark
    assert {(p.seq, p.rank) for p in parts} == {(1, 0), (1, 1)}
    for r in range(2):
        got = read_all(store, T, rows[T][r].keys)
        assert got.found.all()
        np.testing.assert_array_equal(got.embedding, rows[T][r].embedding)
        assert set(got.versions.tolist()) == {make_version(1, 1)}
    assert sum(len(k) for k in store.scan_keys(T)) == 1200
    assert read_all(store, Z, [-1, 11, 21]).found.tolist() == [True, False, True]
    marks = store.progress("r", 1)
    assert all(m.complete for m in marks) and len(marks) == 4
    assert {m.rows for m in marks if m.table == T} == {600}
    assert second.publish_generation(info.generation) == []  # nothing pending any more
    store.close()


def test_store_down_for_seconds_then_back_loses_nothing(backend, tmp_path):
    root = ArtifactRoot(str(tmp_path / "art"))
    info = new_generation(root, "r", TABLES, world_size=2)
    two_rank_dump(root, info, 1, seed=1)
    store = open_store(backend.url, run="r")
    metrics = PublishMetrics()
    publisher = DumpPublisher(
        store, root, "r", batch_bytes=200 * 64, retry=FAST_RETRY, metrics=metrics
    )
    publisher.publish_generation(1)
    _, rows = two_rank_dump(root, info, 2, seed=2)
    backend.down()
    failure: list[BaseException] = []

    def publish() -> None:
        try:
            publisher.publish_generation(1)
        except BaseException as e:  # pragma: no cover - reported below
            failure.append(e)

    worker = threading.Thread(target=publish)
    try:
        worker.start()
        deadline = time.monotonic() + 60
        while metrics.value("deltarec_publish_retries_total") < 3:  # the store refused it
            assert worker.is_alive(), failure  # it retries while the store is down
            assert time.monotonic() < deadline, "publish did not retry within 60 s"
            time.sleep(0.01)
        assert worker.is_alive()  # still retrying
    finally:
        backend.up()
    worker.join(60)
    assert not failure, failure
    assert metrics.value("deltarec_publish_retries_total") > 0
    for r in range(2):
        got = read_all(store, T, rows[T][r].keys)
        np.testing.assert_array_equal(got.embedding, rows[T][r].embedding)
        assert set(got.versions.tolist()) == {make_version(1, 2)}
    assert all(m.complete for m in store.progress("r", 1))
    store.close()


def test_nan_row_fails_naming_table_dump_key_and_applies_nothing(backend, tmp_path):
    root = ArtifactRoot(str(tmp_path / "art"))
    info = new_generation(root, "r", TABLES, world_size=1)
    good = random_rows(range(300), TABLES[T], 1)
    bad = random_rows([5, 6, 7], TABLES[Z], 2)
    bad.embedding[2, 3] = np.float16("nan")
    manifest = write_dump(root, info, 4, {T: {0: good}, Z: {0: bad}})
    store = open_store(backend.url, run="r")
    publisher = DumpPublisher(store, root, "r", batch_bytes=50 * 64)
    with pytest.raises(InvalidRowError) as err:
        publisher.publish_dump(manifest, 0)
    assert "sparse.zch.ad_id" in str(err.value) and "dump 4" in str(err.value)
    assert err.value.key == 7
    assert not read_all(store, T, good.keys).found.any()
    assert store.progress("r", 1) == []
    store.close()


def test_snapshot_publication_replaces_the_table(backend, tmp_path):
    root = ArtifactRoot(str(tmp_path / "art"))
    info = new_generation(root, "r", TABLES, world_size=2)
    two_rank_dump(root, info, 1, seed=1, n=100)  # keys 0..199
    store = open_store(backend.url, run="r")
    publisher = DumpPublisher(store, root, "r")
    publisher.publish_generation(1)
    info2 = new_generation(root, "r", TABLES, world_size=2)
    snap = {T: {r: random_rows(np.arange(r, 100, 2), TABLES[T], 9 + r) for r in range(2)}}
    write_dump(root, info2, 0, snap, kind=DumpKind.SNAPSHOT)
    publisher.publish_dump(root.read_manifest("r", info2.generation, 0), 0)
    assert sum(len(k) for k in store.scan_keys(T)) == 200  # rank 1's part is not in yet
    publisher.publish_dump(root.read_manifest("r", info2.generation, 0), 1)
    assert sorted(np.concatenate(list(store.scan_keys(T))).tolist()) == list(range(100))
    got = read_all(store, T, snap[T][1].keys)
    np.testing.assert_array_equal(got.embedding, snap[T][1].embedding)
    store.close()


def test_staged_generation_is_invisible_until_merged(backend, tmp_path):
    root = ArtifactRoot(str(tmp_path / "art"))
    info = new_generation(root, "r", TABLES, world_size=2)
    _, rows = two_rank_dump(root, info, 1, seed=4, n=50)
    store = open_store(backend.url, run="r")
    DumpPublisher(store, root, "r", mode="staged").publish_generation(1)
    assert not read_all(store, T, rows[T][0].keys).found.any()
    store.merge_staging("r", 1)
    got = read_all(store, T, rows[T][0].keys)
    np.testing.assert_array_equal(got.embedding, rows[T][0].embedding)
    assert read_all(store, Z, [-1, 11, 21]).found.tolist() == [True, False, True]
    store.close()
