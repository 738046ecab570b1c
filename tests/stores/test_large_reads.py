"""Reading and verifying more keys than one read chunk holds, on every backend with a server."""

from __future__ import annotations

import numpy as np

from deltarec.artifacts.types import TableSpec
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
