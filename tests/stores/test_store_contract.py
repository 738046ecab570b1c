"""The store contract (SPEC §5), run against every backend on real servers."""

from __future__ import annotations

import numpy as np
import pytest

from deltarec.artifacts import codec
from deltarec.artifacts.types import DType, TableKind, TableSpec
from deltarec.errors import BadInputError, InvalidRowError, ViewMismatchError
from deltarec.ids import make_version
from deltarec.publish.snapshot import finish_snapshot
from deltarec.stores import FreshnessRecord, ProgressMark, RowBatch, open_store

T = "sparse.ebc.user_id"
Z = "sparse.zch.ad_id"
SPEC = {T: TableSpec(dim=8), Z: TableSpec(dim=4, dtype=DType.INT8_ROWWISE, kind=TableKind.ZCH)}


def rows(keys, dim=8, seed=0, dtype=DType.FLOAT32):
    values = np.random.default_rng(seed).normal(size=(len(keys), dim)).astype(np.float32)
    return np.asarray(keys, np.int64), codec.encode(values, dtype)


def write(store, table, keys, emb, version, ops=None, **kw):
    n = len(keys)
    ops = np.zeros(n, np.int8) if ops is None else np.asarray(ops, np.int8)
    return store.write(table, keys, emb, ops, np.full(n, version, np.int64), **kw)


@pytest.fixture
def store(any_backend):
    s = open_store(any_backend.url, run="r")
    s.provision(SPEC)
    yield s
    s.close()


@pytest.mark.featurestore_cannot(
    "no row versions are kept and keys cannot be listed (test_featurestore.py checks the values)"
)
def test_rows_written_read_back_identical_for_every_dtype(store):
    keys, emb = rows(range(100))
    write(store, T, keys, emb, make_version(1, 1))
    zkeys, zemb = rows([-1, 7, 10**12], dim=4, dtype=DType.INT8_ROWWISE)
    write(store, Z, zkeys, zemb, make_version(1, 1))
    got = store.read(T, np.array([5, 99, 1000, 0]))
    assert got.found.tolist() == [True, True, False, True]
    np.testing.assert_array_equal(got.embedding[[0, 1, 3]], emb[[5, 99, 0]])
    assert got.versions.tolist() == [make_version(1, 1)] * 2 + [0, make_version(1, 1)]
    zgot = store.read(Z, zkeys)
    np.testing.assert_array_equal(zgot.embedding, zemb)
    assert sorted(np.concatenate(list(store.scan_keys(T, batch_rows=30))).tolist()) == list(
        range(100)
    )


@pytest.mark.featurestore_cannot(
    "no row versions: the newest MERGE wins (the publisher orders writes)"
)
def test_older_version_never_overwrites_newer(store):
    keys, new = rows(range(10), seed=1)
    _, old = rows(range(10), seed=2)
    write(store, T, keys, new, make_version(2, 1))
    write(store, T, keys, old, make_version(1, 9))
    got = store.read(T, keys)
    np.testing.assert_array_equal(got.embedding, new)
    assert set(got.versions.tolist()) == {make_version(2, 1)}
    write(store, T, keys[:3], old[:3], make_version(2, 2))
    np.testing.assert_array_equal(store.read(T, keys[:3]).embedding, old[:3])


@pytest.mark.featurestore_cannot("no row versions and no key listing to compare")
def test_replaying_a_batch_changes_nothing(store):
    keys, emb = rows(range(50))
    mark = ProgressMark("r", 1, 1, T, 0, 50, True)
    write(store, T, keys, emb, make_version(1, 1), mark=mark)
    before = store.read(T, keys)
    write(store, T, keys, emb, make_version(1, 1), mark=mark)
    after = store.read(T, keys)
    np.testing.assert_array_equal(before.embedding, after.embedding)
    np.testing.assert_array_equal(before.versions, after.versions)
    marks = store.registry.progress("r", 1)
    assert [(m.seq, m.table, m.rank, m.rows, m.complete) for m in marks] == [(1, T, 0, 50, True)]
    assert sum(len(k) for k in store.scan_keys(T)) == 50


@pytest.mark.featurestore_cannot("no deletes: an evicted id holds its fallback row")
def test_delete_leaves_tombstone_that_late_older_upsert_cannot_resurrect(store):
    keys, emb = rows([1, 2, 3], dim=4, dtype=DType.INT8_ROWWISE)
    write(store, Z, keys, emb, make_version(1, 1))
    write(store, Z, keys[:1], emb[:1], make_version(1, 2), ops=[1])
    assert store.read(Z, keys).found.tolist() == [False, True, True]
    write(store, Z, keys[:1], emb[:1], make_version(1, 1))  # late replay of the older upsert
    assert not store.read(Z, keys[:1]).found[0]
    write(store, Z, keys[1:2], emb[1:2], make_version(1, 0), ops=[1])  # older delete: no effect
    assert store.read(Z, keys[1:2]).found[0]
    write(store, Z, keys[:1], emb[2:3], make_version(1, 3))  # re-admitted later
    got = store.read(Z, keys[:1])
    assert got.found[0] and got.versions[0] == make_version(1, 3)
    np.testing.assert_array_equal(got.embedding[0], emb[2])


@pytest.mark.featurestore_cannot("no deletes: a snapshot is written like a delta")
def test_snapshot_removes_keys_it_lacks_and_blocks_older_writes(store):
    keys, emb = rows(range(10))
    write(store, T, keys, emb, make_version(1, 3))
    snap = make_version(2, 0)
    for rank, part in enumerate((keys[:3], keys[3:5])):
        mark = ProgressMark("r", 2, 0, T, rank, len(part), True)
        write(store, T, part, emb[part], snap, mark=mark)
        done = finish_snapshot(store, "r", 2, 0, T, world_size=2)
        assert done is (rank == 1)
    assert sorted(np.concatenate(list(store.scan_keys(T))).tolist()) == list(range(5))
    write(store, T, keys[7:8], emb[7:8], make_version(1, 4))  # a late writer of generation 1
    assert not store.read(T, keys[7:8]).found[0]
    write(store, T, keys[7:8], emb[7:8], make_version(2, 1))
    assert store.read(T, keys[7:8]).found[0]
    assert finish_snapshot(store, "r", 2, 0, T, world_size=2)  # idempotent


def test_nan_row_is_rejected_and_nothing_of_the_batch_is_written(store):
    keys, emb = rows(range(20))
    emb[13, 2] = np.inf
    with pytest.raises(InvalidRowError, match=r"sparse\.ebc\.user_id.*key 13.*NaN/Inf"):
        write(store, T, keys, emb, make_version(1, 1), mark=ProgressMark("r", 1, 1, T, 0, 20, True))
    assert not store.read(T, keys).found.any()
    assert store.registry.progress("r", 1) == []
    with pytest.raises(InvalidRowError, match="shape"):
        write(store, T, keys, emb[:, :4], make_version(1, 1))
    with pytest.raises(InvalidRowError, match="key -5"):
        write(store, T, np.array([-5], np.int64), emb[:1], make_version(1, 1))


def test_provision_is_idempotent_and_names_both_on_mismatch(store, any_backend):
    again = open_store(any_backend.url, run="r")
    try:
        views = again.provision(SPEC)
        assert views[T].dim == 8 and set(again.views()) == {T, Z}
        with pytest.raises(ViewMismatchError, match=r"dim=8 dtype=float32.*dim=16 dtype=float32"):
            again.provision({T: TableSpec(dim=16)})
        with pytest.raises(ViewMismatchError, match="float16"):
            again.provision({T: TableSpec(dim=8, dtype=DType.FLOAT16)})
        with pytest.raises(BadInputError, match="not provisioned"):
            again.read("other.table", np.array([1]))
    finally:
        again.close()


@pytest.mark.featurestore_cannot("no staging views")
def test_staged_rows_become_live_only_after_merge(store):
    keys, emb = rows(range(6))
    write(store, T, keys, emb, make_version(1, 1))
    store.provision(SPEC, staging_generation=2)
    _, new = rows(range(6), seed=5)
    write(store, T, keys[:4], new[:4], make_version(2, 1), staging_generation=2)
    write(store, T, keys[4:5], new[4:5], make_version(2, 1), ops=[1], staging_generation=2)
    np.testing.assert_array_equal(store.read(T, keys).embedding, emb)
    assert store.read(T, keys[:4], staging_generation=2).found.all()
    store.merge_staging("r", 2)
    got = store.read(T, keys)
    assert got.found.tolist() == [True] * 4 + [False, True]
    np.testing.assert_array_equal(got.embedding[:4], new[:4])
    np.testing.assert_array_equal(got.embedding[5], emb[5])
    assert set(store.views()) == {T, Z}


@pytest.mark.featurestore_cannot("no staging views")
def test_dropped_staging_views_never_reach_live(store):
    keys, emb = rows(range(4))
    write(store, T, keys, emb, make_version(1, 1))
    store.provision(SPEC, staging_generation=2)
    _, new = rows(range(4), seed=7)
    write(store, T, keys, new, make_version(2, 1), staging_generation=2)
    assert store.drop_staging("r", 2) == len(SPEC)
    assert store.drop_staging("r", 2) == 0
    np.testing.assert_array_equal(store.read(T, keys).embedding, emb)
    with pytest.raises(BadInputError, match="not provisioned"):
        store.read(T, keys, staging_generation=2)
    assert set(store.views()) == {T, Z}


@pytest.mark.featurestore_cannot("no staging views")
def test_staging_merges_from_a_store_opened_later(store, any_backend):
    # promote runs in another process than the publisher: its store object has no view cache
    keys, emb = rows(range(3))
    store.provision(SPEC, staging_generation=3)
    write(store, T, keys, emb, make_version(3, 1), staging_generation=3)
    later = open_store(any_backend.url, run="r")
    try:
        later.merge_staging("r", 3)
        got = later.read(T, keys)
        assert got.found.all()
        np.testing.assert_array_equal(got.embedding, emb)
    finally:
        later.close()


def test_registry_keeps_generations_serving_history_and_freshness(store):
    store.registry.register_generation("r", 2)
    store.registry.register_generation("r", 1)
    store.registry.register_generation("r", 2)
    assert store.registry.generations("r") == [1, 2]
    assert store.registry.get_serving("r") is None
    store.registry.set_serving("r", 1, 4)
    p = store.registry.set_serving("r", 2, 0, note="rollback")
    assert store.registry.get_serving("r") == p
    assert [(s.generation, s.seq) for s in store.registry.serving_history("r")] == [(1, 4), (2, 0)]
    store.registry.record_freshness(FreshnessRecord("r", 1, 3, 0, 100.0, 101.5))
    store.registry.record_freshness(
        FreshnessRecord("r", 1, 3, 0, 100.0, 999.0)
    )  # first one is kept
    [f] = store.registry.freshness("r", 1)
    assert f.lag_s == pytest.approx(1.5)


@pytest.mark.featurestore_cannot("no key listing and no row versions")
def test_scan_rows_returns_every_live_row_with_its_version(store):
    keys, emb = rows(range(0, 70, 3))
    write(store, T, keys, emb, make_version(1, 2))
    write(store, T, keys[:2], emb[:2], make_version(1, 3), ops=[1, 1])  # deleted: not scanned
    seen: dict[int, tuple[int, bytes]] = {}
    for k, got in store.scan_rows(T, batch_rows=7):
        assert got.found.all()
        for i, key in enumerate(k.tolist()):
            seen[key] = (int(got.versions[i]), got.embedding[i].tobytes())
    assert sorted(seen) == keys[2:].tolist()
    for i, key in enumerate(keys.tolist()[2:], start=2):
        assert seen[key] == (make_version(1, 2), emb[i].tobytes())


def batches_of(keys, emb, version, size, ops=None):
    ops = np.zeros(len(keys), np.int8) if ops is None else np.asarray(ops, np.int8)
    versions = np.full(len(keys), version, np.int64)
    return [
        RowBatch(keys[s : s + size], emb[s : s + size], ops[s : s + size], versions[s : s + size])
        for s in range(0, len(keys), size)
    ]


@pytest.mark.featurestore_cannot("no row versions and no deletes")
def test_write_batches_applies_every_batch_and_the_mark(store):
    order = np.random.default_rng(3).permutation(1000)
    keys, emb = rows(order.tolist())
    keys[:3] = [2**62 + 1, 2**53 + 1, 10**15]  # beyond float precision: exact round trip
    mark = ProgressMark("r", 1, 1, T, 0, 1000, True)
    assert store.write_batches(T, batches_of(keys, emb, make_version(1, 1), 64), mark) == 1000
    got = store.read(T, keys)
    assert got.found.all() and set(got.versions.tolist()) == {make_version(1, 1)}
    np.testing.assert_array_equal(got.embedding, emb)
    assert [(m.rows, m.complete) for m in store.registry.progress("r", 1)] == [(1000, True)]
    # a second call: newer rows, older rows, deletes and upserts mixed in its batches
    _, new = rows(order.tolist(), seed=9)
    parts = batches_of(keys[:300], new[:300], make_version(1, 2), 50)
    parts += batches_of(keys[300:400], new[300:400], make_version(1, 0), 50)  # older: ignored
    parts += batches_of(keys[400:420], new[400:420], make_version(1, 2), 7, ops=[1] * 20)
    store.write_batches(T, parts, ProgressMark("r", 1, 2, T, 0, 420, True))
    got = store.read(T, keys)
    np.testing.assert_array_equal(got.embedding[:300], new[:300])
    np.testing.assert_array_equal(got.embedding[300:400], emb[300:400])
    assert not got.found[400:420].any() and got.found[420:].all()
    assert got.versions[:300].tolist() == [make_version(1, 2)] * 300
    # one batch of mixed versions and ops, in random order
    k2, e2 = keys[400:440], new[400:440]
    ops = np.array([0, 1] * 20, np.int8)
    versions = np.where(np.arange(40) % 3 == 0, make_version(1, 3), make_version(1, 4))
    store.write(T, k2, e2, ops, versions)
    got = store.read(T, k2)
    assert got.found.tolist() == [op == 0 for op in ops.tolist()]
    np.testing.assert_array_equal(got.embedding[ops == 0], e2[ops == 0])
    assert got.versions[ops == 0].tolist() == versions[ops == 0].tolist()


def test_write_batches_with_a_bad_row_writes_nothing(store):
    keys, emb = rows(range(300))
    emb[250, 1] = np.nan
    mark = ProgressMark("r", 1, 1, T, 0, 300, True)
    with pytest.raises(InvalidRowError, match=r"key 250.*NaN/Inf"):
        store.write_batches(T, batches_of(keys, emb, make_version(1, 1), 100), mark)
    assert store.registry.progress("r", 1) == []
    if store.kind in ("sqlite", "postgres"):  # one transaction for the whole call
        assert not store.read(T, keys).found.any()
    with pytest.raises(ValueError, match="no batch"):
        store.write_batches(T, [], mark)


@pytest.mark.featurestore_cannot("no staging views")
def test_write_batches_into_a_staging_view(store):
    keys, emb = rows(range(100))
    write(store, T, keys, emb, make_version(1, 1))
    store.provision(SPEC, staging_generation=2)
    _, new = rows(range(100), seed=4)
    parts = batches_of(keys[::-1][:60], new[::-1][:60], make_version(2, 1), 16)
    parts += batches_of(keys[:10], new[:10], make_version(2, 1), 5, ops=[1] * 10)
    store.write_batches(T, parts, staging_generation=2)
    np.testing.assert_array_equal(store.read(T, keys).embedding, emb)
    store.merge_staging("r", 2)
    got = store.read(T, keys)
    assert got.found.tolist() == [False] * 10 + [True] * 90
    np.testing.assert_array_equal(got.embedding[40:], new[40:])
    np.testing.assert_array_equal(got.embedding[10:40], emb[10:40])


@pytest.mark.featurestore_cannot("no deletes and no key listing")
def test_write_batches_in_key_order_then_out_of_order(store):
    keys, emb = rows(range(1000))
    write(store, T, keys[:50], emb[:50], make_version(1, 1))
    _, new = rows(range(1000), seed=6)
    ops = np.zeros(1000, np.int8)
    ops[[10, 20, 730]] = 1  # deletes in an in-order batch and in a later, reordered one
    parts = batches_of(keys, new, make_version(1, 2), 100, ops=ops)
    parts[5], parts[7] = parts[7], parts[5]  # from here on not in key order
    parts.insert(2, RowBatch(keys[:0], new[:0], ops[:0], np.zeros(0, np.int64)))  # empty
    assert store.write_batches(T, parts, ProgressMark("r", 1, 2, T, 0, 1000, True)) == 1000
    got = store.read(T, keys)
    deleted = ops == 1
    assert got.found.tolist() == (~deleted).tolist()
    np.testing.assert_array_equal(got.embedding[~deleted], new[~deleted])
    assert set(got.versions[~deleted].tolist()) == {make_version(1, 2)}
    assert sum(len(k) for k in store.scan_keys(T)) == 997


@pytest.mark.featurestore_cannot("no deletes")
def test_wide_rows_in_one_large_batch(store):
    # 1500 rows of 8 KB (12 MB): SQLite cuts them into statements of 512 rows, PostgreSQL's COPY
    # into pieces of about 8 MB, both in key order
    wide = "sparse.ebc.wide"
    store.provision({wide: TableSpec(dim=2048)})
    keys, emb = rows(np.random.default_rng(1).permutation(1500).tolist(), dim=2048)
    ops = np.zeros(1500, np.int8)
    write(store, wide, keys, emb, make_version(1, 1))
    ops[:5] = 1
    _, new = rows(keys.tolist(), dim=2048, seed=8)
    write(store, wide, keys, new, make_version(1, 2), ops=ops)
    got = store.read(wide, keys)
    assert got.found.tolist() == [False] * 5 + [True] * 1495
    np.testing.assert_array_equal(got.embedding[5:], new[5:])
