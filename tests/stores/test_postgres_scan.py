"""PostgreSQL's one-pass scan (``scan_rows``): pages of heap blocks in one snapshot (keyset pages
on servers without TID range scans), each read as one binary value."""

from __future__ import annotations

import itertools

import numpy as np
import psycopg
import pytest

from deltarec.artifacts import codec
from deltarec.artifacts.types import DType, TableSpec
from deltarec.errors import StoreError
from deltarec.ids import make_version
from deltarec.stores import open_store
from deltarec.stores.sql import postgres as pgmod

T = "sparse.ebc.item_id"
_SCHEMAS = itertools.count()


def _open(server, layout: str = "bytea", dtype: DType = DType.FLOAT32):
    schema = f"scan{next(_SCHEMAS)}"
    store = open_store(f"{server.url}?schema={schema}&layout={layout}", run="r")
    store.provision({T: TableSpec(dim=3, dtype=dtype)})
    return store, schema


def _scan(store, batch_rows):
    pages = list(store.scan_rows(T, batch_rows))
    keys = np.concatenate([k for k, _ in pages])
    emb = np.concatenate([r.embedding for _, r in pages])
    versions = np.concatenate([r.versions for _, r in pages])
    assert all(r.found.all() for _, r in pages)
    return pages, keys, emb, versions


@pytest.mark.parametrize(
    ("layout", "dtype"),
    [
        ("bytea", DType.FLOAT32),
        ("bytea", DType.INT8_ROWWISE),
        ("float4[]", DType.FLOAT32),
        ("float4[]", DType.FLOAT16),
    ],
)
@pytest.mark.parametrize("by", ["blocks", "keys"])
def test_scan_rows_pages_every_row_once_with_its_version(
    postgres_server, layout, dtype, by, monkeypatch
):
    if by == "keys":  # as on a server without TID range scans
        monkeypatch.setattr(pgmod, "_BLOCK_SCANS", 1 << 40)
    store, _ = _open(postgres_server, layout, dtype)
    rng = np.random.default_rng(11)
    keys = np.unique(rng.integers(0, 2**62, 1000, dtype=np.int64))
    keys[0] = -1  # a ZCH table's fallback row, and the largest keys sort right
    keys[-1] = np.iinfo(np.int64).max
    emb = codec.encode(rng.standard_normal((len(keys), 3), dtype=np.float32), dtype)
    versions = make_version(1, 1) + rng.integers(0, 5, len(keys))
    store.write(T, keys, emb, np.zeros(len(keys), np.int8), versions)
    pages, got_keys, got_emb, got_versions = _scan(store, batch_rows=97)
    if by == "keys":
        assert [len(k) for k, _ in pages] == [97] * (len(keys) // 97) + [len(keys) % 97]
    else:
        assert len(pages) > 3 and max(len(k) for k, _ in pages) <= 2 * 97
    order = np.argsort(got_keys)
    got_keys, got_emb, got_versions = got_keys[order], got_emb[order], got_versions[order]
    np.testing.assert_array_equal(got_keys, keys)  # each once
    np.testing.assert_array_equal(got_emb, emb)
    assert got_emb.dtype == emb.dtype and got_emb.flags.c_contiguous
    np.testing.assert_array_equal(got_versions, versions)
    store.close()


def test_an_empty_view_scans_to_nothing(postgres_server):
    store, _ = _open(postgres_server)
    assert list(store.scan_rows(T)) == []
    store.close()


@pytest.mark.parametrize(
    ("layout", "bad"),
    [
        ("bytea", "'\\x0102'::bytea"),
        ("float4[]", "ARRAY[1.0, 2.0]::real[]"),  # 2 values where the view's dim is 3
        ("float4[]", "ARRAY[1.0, NULL, 2.0]::real[]"),
        ("float4[]", "ARRAY[[1.0, 2.0, 3.0]]::real[]"),  # two-dimensional
    ],
)
def test_a_stored_row_not_of_the_views_shape_fails_the_scan_naming_the_view(
    postgres_server, layout, bad
):
    store, schema = _open(postgres_server, layout)
    keys = np.array([1, 2, 3], np.int64)
    emb = np.ones((3, 3), np.float32)
    store.write(T, keys, emb, np.zeros(3, np.int8), np.full(3, make_version(1, 1)))
    name = store.views()[T].name
    with psycopg.connect(postgres_server.url, autocommit=True) as conn:
        conn.execute(f'UPDATE {schema}."{name}" SET embedding = {bad} WHERE key = 2')
    with pytest.raises(StoreError, match=name):
        list(store.scan_rows(T))
    store.close()


def test_rows_updated_and_added_while_a_scan_runs_come_once_as_they_were_at_its_start(
    postgres_server,
):
    store, schema = _open(postgres_server)
    keys = np.arange(2000, dtype=np.int64)
    v = make_version(1, 1)
    store.write(T, keys, np.ones((2000, 3), np.float32), np.zeros(2000, np.int8), np.full(2000, v))
    name = store.views()[T].name
    scan = store.scan_rows(T, 100)
    pages = [next(scan)]
    with psycopg.connect(postgres_server.url, autocommit=True) as conn:  # rows move to new blocks
        conn.execute(f'UPDATE {schema}."{name}" SET version = version + 1, embedding = embedding')
        conn.execute(f'UPDATE {schema}."{name}" SET version = version + 1, embedding = embedding')
        conn.execute(
            f'INSERT INTO {schema}."{name}" (key, embedding, version) '
            f"SELECT k, '\\x000000000000000000000000'::bytea, {v} "
            "FROM generate_series(5000, 5999) k"
        )
    got = store.read(T, keys[:3])  # the store's own connection is free while the scan is open
    assert got.found.all() and (got.versions == v + 2).all()
    pages += list(scan)
    seen = np.concatenate([k for k, _ in pages])
    np.testing.assert_array_equal(np.sort(seen), keys)
    assert all((r.versions == v).all() for _, r in pages)
    store.close()
