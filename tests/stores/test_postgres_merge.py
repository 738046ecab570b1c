"""PostgreSQL's MERGE path: a concurrent insert of the same new key falls back to ON CONFLICT."""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np
import psycopg

from deltarec.artifacts import codec
from deltarec.artifacts.types import TableSpec
from deltarec.ids import make_version
from deltarec.stores import ProgressMark, open_store

T = "sparse.ebc.user_id"
_SCHEMAS = itertools.count()


def test_concurrent_insert_of_a_new_key_is_merged_not_lost(postgres_server):  # type: ignore[no-untyped-def]
    schema = f"merge{next(_SCHEMAS)}"
    store = open_store(f"{postgres_server.url}?schema={schema}")
    view = store.provision({T: TableSpec(dim=4)})[T]
    keys = np.arange(10, dtype=np.int64)
    emb = codec.encode(np.ones((10, 4), np.float32), codec.DType.FLOAT32)
    other = psycopg.connect(postgres_server.url)  # another writer, mid-transaction
    other.execute(f"SET search_path TO {schema}")
    other.execute(
        f'INSERT INTO "{view.name}" (key, embedding, version) VALUES (3, %s, %s)',
        (b"\0" * 16, make_version(1, 1)),
    )
    commit = threading.Timer(0.5, other.commit)  # while MERGE waits on key 3
    commit.start()
    try:
        started = time.monotonic()
        mark = ProgressMark("r", 1, 2, T, 0, 10, True)
        store.write(T, keys, emb, np.zeros(10, np.int8), np.full(10, make_version(1, 2)), mark=mark)
        assert time.monotonic() - started >= 0.4  # it did wait for the other writer
    finally:
        commit.join()
        other.close()
    got = store.read(T, keys)
    assert got.found.all()
    assert set(got.versions.tolist()) == {make_version(1, 2)}  # key 3 too: newer version won
    np.testing.assert_array_equal(got.embedding, emb)
    assert [m.rows for m in store.progress("r", 1)] == [10]
    store.close()
