"""Reads of more keys than one read chunk holds, and scans of many pages, on every backend."""

from __future__ import annotations

import numpy as np
import pytest

from deltarec.artifacts.types import TableSpec
from deltarec.errors import StoreError
from deltarec.ids import make_version
from deltarec.stores import open_store

T = "sparse.ebc.item_id"
N = 25_000  # over two read chunks of every backend, and over Lua's unpack limit (~8000)


def test_a_read_of_many_keys_returns_every_row_in_order(backend):
    store = open_store(backend.url, run="r")
    store.provision({T: TableSpec(dim=4)})
    rng = np.random.default_rng(3)
    keys = rng.permutation(np.arange(N, dtype=np.int64) * 7)
    emb = rng.standard_normal((N, 4), dtype=np.float32)
    version = make_version(1, 1)
    store.write(T, keys, emb, np.zeros(N, np.int8), np.full(N, version, np.int64))
    asked = np.concatenate([keys[::-1], np.array([1, 2], np.int64)])  # two never written
    got = store.read(T, asked)
    assert got.found.tolist() == [True] * N + [False, False]
    np.testing.assert_array_equal(got.embedding[:N], emb[::-1])
    assert set(got.versions[:N].tolist()) == {version}
    store.close()


def test_a_postgres_scan_pages_every_row_in_key_order_and_refuses_a_short_row(postgres_server):
    url = f"{postgres_server.url}?schema=scanpages"
    store = open_store(url, run="r")
    view = store.provision({T: TableSpec(dim=4)})[T]
    rng = np.random.default_rng(4)
    keys = rng.permutation(np.arange(50, dtype=np.int64) * 3 + (1 << 40))
    emb = rng.standard_normal((50, 4), dtype=np.float32)
    versions = np.arange(1, 51, dtype=np.int64) + make_version(1, 0)
    store.write(T, keys, emb, np.zeros(50, np.int8), versions)
    pages = list(store.scan_rows(T, batch_rows=7))
    assert [len(k) for k, _ in pages] == [7] * 7 + [1]
    got_keys = np.concatenate([k for k, _ in pages])
    order = np.argsort(keys)
    np.testing.assert_array_equal(got_keys, keys[order])
    np.testing.assert_array_equal(np.concatenate([r.embedding for _, r in pages]), emb[order])
    np.testing.assert_array_equal(np.concatenate([r.versions for _, r in pages]), versions[order])
    import psycopg

    with psycopg.connect(postgres_server.url, autocommit=True) as conn:
        conn.execute(
            f'UPDATE scanpages."{view.name}" SET embedding = %s WHERE key = %s',
            (b"\0" * 12, int(keys[order][20])),
        )
    with pytest.raises(StoreError, match="not one encoded row"):
        list(store.scan_rows(T, batch_rows=7))
    store.close()
