"""SQLite's one-pass scan (``scan_rows``, what ``verify --all`` reads): every row, paired right.

A page is fetched as one aggregate row; these tests cover the page shapes it distinguishes:
one dense run of keys at one version, sparse keys, mixed versions, extreme keys, and a
corrupted blob.
"""

from __future__ import annotations

import sqlite3

import numpy as np
import pytest

from deltarec.artifacts import DType, TableSpec, codec
from deltarec.errors import StoreError
from deltarec.stores import open_store

TABLE = "sparse.ebc.item_id"


def _scan(store, batch_rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
    keys, versions, rows, sizes = [], [], [], []
    for k, r in store.scan_rows(TABLE, batch_rows):
        assert r.found.all() and len(k) == len(r.versions) == len(r.embedding)
        keys.append(k)
        versions.append(r.versions)
        rows.append(r.embedding)
        sizes.append(len(k))
    return np.concatenate(keys), np.concatenate(versions), np.concatenate(rows), sizes


@pytest.mark.parametrize("dtype", [DType.FLOAT32, DType.INT8_ROWWISE])
def test_scan_pairs_every_key_with_its_row_and_version_in_key_order(sqlite_url, dtype):
    rng = np.random.default_rng(3)
    dense = np.arange(100, 160, dtype=np.int64)  # whole pages of one run, one version
    sparse = rng.choice(np.arange(1000, 100_000), 70, replace=False).astype(np.int64)
    extreme = np.array([-1, (1 << 63) - 1], np.int64)
    keys = np.concatenate([dense, sparse, extreme])
    values = codec.encode(rng.standard_normal((len(keys), 6), dtype=np.float32), dtype)
    # pages of 16 rows: a run, a run at mixed versions, a run again (after a listed page), ...
    versions = np.where((keys >= 118) & (keys < 124) | (keys > 1000), (8 << 32) + keys % 3, 7 << 32)
    order = rng.permutation(len(keys))  # written in random order
    with open_store(sqlite_url, run="r") as store:
        store.provision({TABLE: TableSpec(dim=6, dtype=dtype)})
        store.write(
            TABLE, keys[order], values[order], np.zeros(len(keys), np.int8), versions[order]
        )
        for batch_rows in (1, 16, 30, 1000):
            got_keys, got_versions, got_rows, sizes = _scan(store, batch_rows)
            expect = np.argsort(keys)
            assert got_keys.tolist() == keys[expect].tolist()
            assert got_versions.tolist() == versions[expect].tolist()
            assert (got_rows == values[expect]).all()
            assert all(n == batch_rows for n in sizes[:-1]) and 0 < sizes[-1] <= batch_rows


def test_scan_of_an_empty_view_yields_nothing(sqlite_url):
    with open_store(sqlite_url, run="r") as store:
        store.provision({TABLE: TableSpec(dim=4, dtype=DType.FLOAT32)})
        assert list(store.scan_rows(TABLE, 8)) == []


@pytest.mark.parametrize(
    ("lengths", "message"),
    [
        ({4: 12}, "10 rows of 156 bytes in all, the longest 16"),
        ({4: 12, 7: 20}, "10 rows of 160 bytes in all, the longest 20"),  # sum still right
    ],
)
def test_scan_names_the_view_and_keys_of_blobs_of_the_wrong_length(
    sqlite_url, tmp_path, lengths, message
):
    keys = np.arange(10, dtype=np.int64)
    rows = np.ones((10, 4), np.float32)
    with open_store(sqlite_url, run="r") as store:
        store.provision({TABLE: TableSpec(dim=4, dtype=DType.FLOAT32)})
        store.write(TABLE, keys, rows, np.zeros(10, np.int8), np.full(10, 5, np.int64))
        view = store.views()[TABLE].name
    conn = sqlite3.connect(str(tmp_path / "store.db"))
    for key, size in lengths.items():
        conn.execute(f'UPDATE "{view}" SET embedding = zeroblob(?) WHERE key = ?', (size, key))
    conn.commit()
    conn.close()
    match = rf"{view}.*not 16 bytes .* between keys 0 and 9: {message}"
    for batch_rows in (100, 3):  # the page holding key 4 fails, whatever the page size
        with open_store(sqlite_url, run="r") as store, pytest.raises(StoreError, match=view):
            list(store.scan_rows(TABLE, batch_rows))
    with open_store(sqlite_url, run="r") as store, pytest.raises(StoreError, match=match):
        list(store.scan_rows(TABLE, 100))
