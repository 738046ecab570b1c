"""PostgreSQL's one-pass scan (``scan_rows``): keyset pages read as one binary value each."""

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
def test_scan_rows_pages_every_row_in_key_order_with_its_version(postgres_server, layout, dtype):
    store, _ = _open(postgres_server, layout, dtype)
    rng = np.random.default_rng(11)
    keys = np.unique(rng.integers(0, 2**62, 1000, dtype=np.int64))
    keys[0] = -1  # a ZCH table's fallback row, and the largest keys sort right
    keys[-1] = np.iinfo(np.int64).max
    emb = codec.encode(rng.standard_normal((len(keys), 3), dtype=np.float32), dtype)
    versions = make_version(1, 1) + rng.integers(0, 5, len(keys))
    store.write(T, keys, emb, np.zeros(len(keys), np.int8), versions)
    pages, got_keys, got_emb, got_versions = _scan(store, batch_rows=97)
    assert [len(k) for k, _ in pages] == [97] * (len(keys) // 97) + [len(keys) % 97]
    np.testing.assert_array_equal(got_keys, keys)  # ascending, each once
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
