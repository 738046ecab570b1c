"""Stores written before rows were kept per run (docs/runs.md): moved over, or refused.

Each test writes run ``one``'s rows with today's code, then turns the store back into the
runless layout (one table or hash per table id, ``deltarec_views`` without a ``run`` column)
exactly as earlier releases left it, and opens it again.
"""

from __future__ import annotations

import numpy as np
import pytest

from deltarec.artifacts.types import TableSpec
from deltarec.errors import BadInputError
from deltarec.ids import make_version
from deltarec.stores import open_store
from deltarec.stores.naming import quote

T = "sparse.ebc.user_id"
SPEC = {T: TableSpec(dim=4)}
RUNLESS_VIEWS = """CREATE TABLE deltarec_views (
    name TEXT PRIMARY KEY, table_id TEXT NOT NULL, staging_generation BIGINT NOT NULL,
    dim BIGINT NOT NULL, dtype TEXT NOT NULL, layout TEXT NOT NULL,
    floor_version BIGINT NOT NULL DEFAULT 0, has_tombstones BIGINT NOT NULL DEFAULT 0,
    created_at DOUBLE PRECISION NOT NULL, UNIQUE (table_id, staging_generation))"""


def _write_run_one(url: str) -> np.ndarray:
    rows = np.arange(40, dtype=np.float32).reshape(10, 4)
    with open_store(url, run="one") as s:
        s.provision(SPEC)
        s.registry.register_generation("one", 1)
        keys = np.arange(10, dtype=np.int64)
        s.write(T, keys, rows, np.zeros(10, np.int8), np.full(10, make_version(1, 1)))
        s.delete(T, np.array([3], np.int64), make_version(1, 2))
    rows[3] = 0
    return rows


def _to_runless(url: str, kind: str) -> None:
    """Undo the per-run layout: the run's view at the serving name, no run column."""
    with open_store(url) as s:
        if kind == "redis":
            c, reg = s._client, s._reg  # type: ignore[attr-defined]
            record = c.hget(reg("views"), f"one|{T}|0")
            c.hdel(reg("views"), f"one|{T}|0")
            c.hset(reg("views"), f"{T}|0", record)
            c.delete(reg("serves"))
            c.rename(reg("tomb", "one", T), reg("tomb", T))
            return
        with s._tx() as cur:  # type: ignore[attr-defined]
            (physical,) = s._rows(cur, "SELECT name FROM deltarec_views")[0]  # type: ignore[attr-defined]
            serving = "emb_sparse_ebc_user_id"
            cols = "name, table_id, staging_generation, dim, dtype, layout, floor_version, "
            cols += "has_tombstones, created_at"
            views = s._rows(cur, f"SELECT {cols} FROM deltarec_views")  # type: ignore[attr-defined]
            for sql in (
                f"DROP VIEW {quote(serving)}",
                "DROP TABLE deltarec_serving_views",
                "DROP TABLE deltarec_views",
                RUNLESS_VIEWS,
                f"ALTER TABLE {quote(physical)} RENAME TO {quote(serving)}",
            ):
                s._exec(cur, sql)  # type: ignore[attr-defined]
            s._exec(cur, "UPDATE deltarec_tombstones SET name = ?", (serving,))  # type: ignore[attr-defined]
            for v in views:
                s._exec(  # type: ignore[attr-defined]
                    cur,
                    f"INSERT INTO deltarec_views ({cols}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (serving, *v[1:]),
                )


def test_a_store_one_run_wrote_moves_over_and_serves_the_same_rows(backend):
    rows = _write_run_one(backend.url)
    _to_runless(backend.url, backend.kind)
    keys = np.arange(10, dtype=np.int64)
    for run in (None, "one"):
        with open_store(backend.url, run=run) as s:
            got = s.read(T, keys)
            assert got.found.tolist() == [k != 3 for k in range(10)]
            np.testing.assert_array_equal(got.embedding, rows)
            assert s.registry.serving_runs() == {T: "one"}
    with open_store(backend.url, run="one") as s:  # the tombstone moved with the rows
        s.write(T, np.array([3]), np.ones((1, 4), np.float32), np.zeros(1, np.int8),
                [make_version(1, 1)])  # fmt: skip
        assert not s.read(T, np.array([3])).found[0]
        s.write(T, np.array([11]), np.ones((1, 4), np.float32), np.zeros(1, np.int8),
                [make_version(1, 3)])  # fmt: skip
    with open_store(backend.url) as serving:
        assert serving.read(T, np.array([11])).found[0]


def test_a_store_several_runs_wrote_is_refused_naming_them_and_left_as_it_is(backend):
    rows = _write_run_one(backend.url)
    with open_store(backend.url, run="two") as s:
        s.registry.register_generation("two", 1)
    _to_runless(backend.url, backend.kind)
    for run in (None, "one", "two"):
        with open_store(backend.url, run=run) as s:
            with pytest.raises(BadInputError, match="runs 'one', 'two'") as e:
                s.read(T, np.arange(10, dtype=np.int64))
            assert "deltarec publish --artifacts ROOT --run RUN --store NEW_URL" in str(e.value)
            with pytest.raises(BadInputError, match="cannot be told apart"):
                s.provision(SPEC)
    with open_store(backend.url) as s:  # still runless: the rows are where they were
        if backend.kind == "redis":
            raw = s._client.hget(f"{s.prefix}{T}", "0")  # type: ignore[attr-defined]
            assert np.frombuffer(raw[8:], np.float32).tolist() == rows[0].tolist()
        else:
            with s._tx(write=False) as cur:  # type: ignore[attr-defined]
                n = s._rows(cur, 'SELECT count(*) FROM "emb_sparse_ebc_user_id"')  # type: ignore[attr-defined]
            assert n[0][0] == 9
