"""The Redis store's scripts: batched guards, server-side sweeps and scans, packed replies."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import redis

from deltarec.artifacts.types import TableSpec
from deltarec.errors import StoreError
from deltarec.ids import make_version
from deltarec.stores import open_store
from deltarec.stores.types import RowBatch

T = "sparse.ebc.item_id"
V1, V2, V3 = make_version(1, 1), make_version(1, 2), make_version(2, 0)
_PREFIXES = itertools.count()


@pytest.fixture
def store(redis_server):
    prefix = f"scripts{next(_PREFIXES)}:"
    # more rows per script than the scripts' 1000-field pieces of HMGET/HSET/HDEL
    s = open_store(f"{redis_server.url}?prefix={prefix}&rows_per_script=2500", run="r")
    s.provision({T: TableSpec(dim=4)})
    yield s
    s.close()


def _client(redis_server) -> redis.Redis:
    return redis.Redis(port=redis_server.port)


def _write(store, keys, version, ops=None, seed=0):
    keys = np.asarray(keys, np.int64)
    emb = np.random.default_rng(seed).standard_normal((len(keys), 4), dtype=np.float32)
    ops = np.zeros(len(keys), np.int8) if ops is None else np.asarray(ops, np.int8)
    store.write(T, keys, emb, ops, np.full(len(keys), version, np.int64))
    return emb


def _hscans(redis_server) -> int:
    stats = _client(redis_server).info("commandstats")
    return int(stats.get("cmdstat_hscan", {}).get("calls", 0))


def test_one_script_of_many_rows_applies_guards_deletes_and_tombstones_per_row(store):
    keys = np.arange(6000, dtype=np.int64)
    first = _write(store, keys, V2)
    _write(store, keys[:3000], V1, seed=1)  # older: refused
    newer = _write(store, keys[3000:], V3, seed=2)
    got = store.read(T, keys)
    np.testing.assert_array_equal(got.embedding, np.concatenate([first[:3000], newer]))
    assert got.versions.tolist() == [V2] * 3000 + [V3] * 3000
    ops = np.zeros(6000, np.int8)
    ops[::2] = 1
    last = _write(store, keys, V3 + 1, ops=ops, seed=3)  # deletes bury the even keys
    _write(store, keys[::2], V3, seed=4)  # below their tombstones: refused
    got = store.read(T, keys)
    assert got.found.tolist() == [False, True] * 3000
    np.testing.assert_array_equal(got.embedding[1::2], last[1::2])
    assert set(got.versions[1::2].tolist()) == {V3 + 1}
    _write(store, keys[::2], V3 + 2, seed=5)  # newer than the tombstones: back
    assert store.read(T, keys).found.all()


def test_write_batches_applies_every_batch(store):
    keys = np.arange(10_000, dtype=np.int64)
    emb = np.random.default_rng(5).standard_normal((10_000, 4), dtype=np.float32)
    ops, versions = np.zeros(10_000, np.int8), np.full(10_000, V1, np.int64)
    parts = [slice(s, s + 3000) for s in range(0, 10_000, 3000)]
    batches = [RowBatch(keys[p], emb[p], ops[p], versions[p]) for p in parts]
    assert store.write_batches(T, iter(batches)) == 10_000
    got = store.read(T, keys)
    assert got.found.all()
    np.testing.assert_array_equal(got.embedding, emb)


def test_a_failing_batch_stops_write_batches_before_the_rest(store, monkeypatch):
    keys = np.arange(9, dtype=np.int64)
    emb = np.zeros((9, 4), np.float32)
    zeros, versions = np.zeros(3, np.int8), np.full(3, V1, np.int64)
    bad = emb[3:6].copy()
    bad[0, 0] = np.nan
    batches = [
        RowBatch(keys[:3], emb[:3], zeros, versions),
        RowBatch(keys[3:6], bad, zeros, versions),
        RowBatch(keys[6:], emb[6:], zeros, versions),
    ]
    with pytest.raises(Exception, match="NaN"):
        store.write_batches(T, iter(batches))
    assert store.read(T, keys).found.tolist() == [True] * 3 + [False] * 6


def test_a_sweep_of_a_view_holding_nothing_older_does_not_scan_it(store, redis_server):
    _write(store, np.arange(20_000), V2)
    before = _hscans(redis_server)
    store.sweep_below(T, V2)
    assert _hscans(redis_server) - before == 1  # the tombstones' (empty) hash only
    assert store.read(T, np.arange(20_000)).found.all()


def test_a_sweep_removes_older_rows_and_tombstones_in_server_side_steps(store, redis_server):
    _write(store, np.arange(10_000), V1)
    _write(store, np.arange(5_000), V2, ops=np.r_[np.ones(100, np.int8), np.zeros(4_900, np.int8)])
    _write(store, np.arange(30_000, 30_050), V1, ops=np.ones(50, np.int8))  # older: removed
    _write(store, [20_000], V3, ops=[1])  # a tombstone newer than the sweep: kept
    before = _hscans(redis_server)
    store.sweep_below(T, V2)
    assert _hscans(redis_server) - before > 2  # 10,000 fields take several steps
    got = store.read(T, np.arange(10_000))
    assert got.found.tolist() == [False] * 100 + [True] * 4_900 + [False] * 5_000
    tombs = _client(redis_server).hkeys(f"{store.prefix}~tomb:r:{T}")
    assert sorted(int(t) for t in tombs) == [*range(100), 20_000]
    # the sweep raised the view's low mark: sweeping again does not scan the view
    before = _hscans(redis_server)
    store.sweep_below(T, V2)
    assert _hscans(redis_server) - before == 1


def test_a_view_without_a_low_mark_is_scanned_by_a_sweep(store, redis_server):
    """A view written before low marks were kept (none recorded) still loses its old rows."""
    _write(store, np.arange(3_000), V1)
    _client(redis_server).delete(f"{store.prefix}~lows")
    _write(store, np.arange(1_000), V2)  # does not make up a mark for a view that held rows
    assert not _client(redis_server).exists(f"{store.prefix}~lows")
    store.sweep_below(T, V2)
    assert store.read(T, np.arange(3_000)).found.tolist() == [True] * 1_000 + [False] * 2_000


@pytest.fixture(params=["hscan on the client", "scan script"])
def scanning(request, store, monkeypatch):
    """The store, scanning rows with plain HSCAN steps (hiredis) or with the scan script."""
    on_client = request.param == "hscan on the client"
    if on_client and not redis.utils.HIREDIS_AVAILABLE:
        pytest.skip("hiredis is not installed")
    monkeypatch.setattr(store, "scan_on_client", on_client)
    return store


def test_scan_rows_and_scan_keys_return_every_live_row_once(scanning):
    store = scanning
    keys = np.random.default_rng(7).choice(2**62, 40_000, replace=False).astype(np.int64)
    keys[0] = -1
    emb = _write(store, keys, V2)
    seen_keys, seen_rows, seen_versions = [], [], []
    for k, got in store.scan_rows(T, batch_rows=5000):
        assert got.found.all() and got.embedding.flags.c_contiguous
        seen_keys.append(k)
        seen_rows.append(got.embedding)
        seen_versions.append(got.versions)
    k = np.concatenate(seen_keys)
    order, want = np.argsort(k), np.argsort(keys)
    np.testing.assert_array_equal(k[order], keys[want])
    np.testing.assert_array_equal(np.concatenate(seen_rows)[order], emb[want])
    assert set(np.concatenate(seen_versions).tolist()) == {V2}
    scanned = np.concatenate(list(store.scan_keys(T, batch_rows=3000)))
    np.testing.assert_array_equal(np.sort(scanned), np.sort(keys))


def test_a_scan_follows_its_run_s_view_when_a_promote_moves_it_between_steps(
    scanning, redis_server
):
    """Run r serves the table; run s is promoted after the scan's first step, which moves r's
    hash to its parked name: the scan goes on there and returns each of r's rows once."""
    store = scanning
    keys = np.arange(20_000, dtype=np.int64)
    emb = _write(store, keys, V2)
    other = open_store(f"{redis_server.url}?prefix={store.prefix}", run="s")
    try:
        other.provision({T: TableSpec(dim=4)})
        other.write(
            T,
            keys[:10],
            np.zeros((10, 4), np.float32),
            np.zeros(10, np.int8),
            np.full(10, V3, np.int64),
        )
        seen, rows = [], []
        for k, got in store.scan_rows(T, batch_rows=2000):
            if not seen:
                assert store.serving_runs()[T] == "r"
                other.set_serving("s", 2, 0)
            seen.append(k)
            rows.append(got.embedding)
        assert store.serving_runs()[T] == "s"
    finally:
        other.close()
    k = np.concatenate(seen)
    assert len(k) == len(keys) and len(np.unique(k)) == len(keys)
    np.testing.assert_array_equal(np.concatenate(rows)[np.argsort(k)], emb)


def test_a_stored_value_of_the_wrong_width_fails_reads_and_scans_naming_it(scanning, redis_server):
    store = scanning
    _write(store, [1, 2], V1)
    _client(redis_server).hset(f"{store.prefix}{T}", "2", b"\x01" * 11)
    with pytest.raises(StoreError, match=r"field 2 .* holds 11 bytes, not 24"):
        store.read(T, np.array([1, 2], np.int64))
    with pytest.raises(StoreError, match="holds 11 bytes"):
        list(store.scan_rows(T))
    assert store.read(T, np.array([1], np.int64)).found.all()


def test_staged_rows_read_back_and_merge_in_server_side_steps(store):
    store.provision({T: TableSpec(dim=4)}, staging_generation=2)
    live = _write(store, np.arange(6_000), V1)
    keys = np.arange(3_000, 9_000, dtype=np.int64)
    emb = np.random.default_rng(9).standard_normal((6_000, 4), dtype=np.float32)
    ops = np.zeros(6_000, np.int8)
    ops[:10] = 1  # keys 3000..3009 deleted by the staged generation
    store.write(T, keys, emb, ops, np.full(6_000, V3, np.int64), staging_generation=2)
    staged = store.read(T, keys, staging_generation=2)
    assert staged.found.tolist() == [False] * 10 + [True] * 5_990
    np.testing.assert_array_equal(staged.embedding[10:], emb[10:])
    assert store.merge_staging("r", 2) == 6_000
    got = store.read(T, np.arange(9_000))
    assert got.found.tolist() == [True] * 3_000 + [False] * 10 + [True] * 5_990
    np.testing.assert_array_equal(got.embedding[:3_000], live[:3_000])
    np.testing.assert_array_equal(got.embedding[3_010:], emb[10:])
