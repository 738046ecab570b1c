"""The relational stores' low marks: a snapshot's sweep skips the scan of a view holding
nothing older, and never skips one that does (SQLite and PostgreSQL)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from deltarec.artifacts.types import TableSpec
from deltarec.ids import make_version
from deltarec.stores import open_store

T = "sparse.ebc.user_id"
DIM = 4
RELATIONAL = pytest.mark.parametrize("backend", ["sqlite", "postgres"], indirect=True)


def _open(backend: Any) -> Any:
    store = open_store(backend.url, run="r")
    store.provision({T: TableSpec(dim=DIM)})
    return store


def _write(store: Any, keys: list[int], version: int, staging: int | None = None) -> None:
    k = np.array(keys, np.int64)
    emb = np.full((len(k), DIM), float(version % 97), np.float32)
    store.write(
        T, k, emb, np.zeros(len(k), np.int8), np.full(len(k), version), staging_generation=staging
    )


def _held(store: Any, keys: list[int]) -> dict[int, int]:
    got = store.read(T, np.array(keys, np.int64))
    return {k: int(v) for k, f, v in zip(keys, got.found, got.versions, strict=True) if f}


def _mark(store: Any) -> int | None:
    name = store._view(T).name
    with store._tx(write=False) as cur:
        rows = store._rows(cur, "SELECT version FROM deltarec_low_marks WHERE name = ?", (name,))
    return int(rows[0][0]) if rows else None


@RELATIONAL
def test_rows_written_into_a_fresh_view_are_swept_by_a_later_snapshot(backend):
    store = _open(backend)
    v = [make_version(1, s) for s in range(6)]
    _write(store, [1, 2], v[5])
    _write(store, [3, 4], v[3])  # older than the first write: lowers the mark
    assert _mark(store) == v[3]
    store.sweep_below(T, v[4])
    assert _held(store, [1, 2, 3, 4]) == {1: v[5], 2: v[5]}
    assert _mark(store) == v[4]


@RELATIONAL
def test_a_sweep_of_a_view_holding_nothing_older_keeps_every_row(backend):
    store = _open(backend)
    v = make_version(1, 0)
    _write(store, [1, 2, 3], v)
    store.sweep_below(T, v)
    assert _held(store, [1, 2, 3]) == {1: v, 2: v, 3: v}
    store.sweep_below(T, make_version(1, 1))  # now the rows are older: removed
    assert _held(store, [1, 2, 3]) == {}


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_a_sweep_of_a_view_holding_nothing_older_does_not_scan_it(backend):
    store = _open(backend)
    v = make_version(1, 0)
    _write(store, [1, 2, 3], v)
    statements: list[str] = []
    store._conn.set_trace_callback(statements.append)
    name = store._view(T).name
    store.sweep_below(T, v)
    assert not [s for s in statements if s.startswith(f'DELETE FROM "{name}"')]
    store.sweep_below(T, make_version(1, 1))
    assert [s for s in statements if s.startswith(f'DELETE FROM "{name}"')]


@RELATIONAL
def test_merged_staging_rows_are_swept_by_a_later_snapshot(backend):
    store = _open(backend)
    store.provision({T: TableSpec(dim=DIM)}, staging_generation=1)
    v = [make_version(1, s) for s in range(3)]
    store.sweep_below(T, v[0])  # the mark is at v[0] now
    _write(store, [1, 2], v[0], staging=1)
    store.register_generation("r", 1)
    store.merge_staging("r", 1)
    assert _held(store, [1, 2]) == {1: v[0], 2: v[0]}
    store.sweep_below(T, v[1])
    assert _held(store, [1, 2]) == {}


@RELATIONAL
def test_a_view_without_a_low_mark_is_scanned_by_a_sweep(backend):
    store = _open(backend)
    v = [make_version(1, s) for s in range(2)]
    _write(store, [1, 2], v[0])
    with store._tx() as cur:  # a view provisioned before low marks were kept
        store._exec(cur, "DELETE FROM deltarec_low_marks")
    store.sweep_below(T, v[1])
    assert _held(store, [1, 2]) == {}
    assert _mark(store) == v[1]


@RELATIONAL
def test_a_view_provisioned_over_a_table_holding_rows_gets_no_low_mark(backend):
    store = _open(backend)
    v = [make_version(1, s) for s in range(2)]
    _write(store, [1, 2], v[0])
    name = store._view(T).name
    with store._tx() as cur:  # the registry's record lost, the table kept
        store._exec(cur, "DELETE FROM deltarec_views WHERE name = ?", (name,))
    store._views_cache.clear()
    store.provision({T: TableSpec(dim=DIM)})
    assert _mark(store) is None
    store.sweep_below(T, v[1])
    assert _held(store, [1, 2]) == {}
