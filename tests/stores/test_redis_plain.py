"""Plain HSET writes of the Redis store: taken only where no guard could refuse a row."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import redis

from deltarec.artifacts.types import TableSpec
from deltarec.ids import make_version
from deltarec.stores import open_store
from deltarec.stores.redis.resp import hset_bodies, hset_commands

from .test_redis_scripts import T, _write

V1, V2, V3 = make_version(1, 1), make_version(1, 2), make_version(2, 0)
_PREFIXES = itertools.count()


def _open(redis_server, unit_rows):  # type: ignore[no-untyped-def]
    s = open_store(f"{redis_server.url}?prefix=plain{next(_PREFIXES)}:", run="r")
    s.provision({T: TableSpec(dim=4)})
    s.unit_rows = unit_rows
    return s


@pytest.fixture(params=[None, 7, 200], ids=["transaction", "paced-scripts", "paced-transactions"])
def store(redis_server, request):
    """A transaction per batch, and paced (units of 7 rows, redis/paced.py): the same guards."""
    s = _open(redis_server, request.param)
    yield s
    s.close()


@pytest.fixture
def transaction_store(redis_server):
    s = _open(redis_server, None)
    yield s
    s.close()


def _scripts(redis_server) -> int:
    """Calls of the guarded scripts (EVALSHA; the plain path's low mark is an EVAL)."""
    stats = redis.Redis(port=redis_server.port).info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


def test_resp_commands_hold_every_key_and_value_including_negative_and_extreme_keys(
    redis_server,
):
    client = redis.Redis(port=redis_server.port)
    keys = np.array([0, 7, -1, 10, 99, 100, -(2**63), 2**63 - 1, 123456789012, -42], np.int64)
    values = np.random.default_rng(0).integers(0, 256, (len(keys), 13), dtype=np.uint8)
    conn = client.connection_pool.get_connection()
    try:
        pieces = hset_commands(b"resp-test", hset_bodies(keys, values, 3))
        conn.send_packed_command(pieces)
        added = [conn.read_response() for _ in range(len(pieces) // 2)]
    finally:
        client.connection_pool.release(conn)
    assert sum(added) == len(keys)
    got = client.hgetall("resp-test")
    assert {int(k): v for k, v in got.items()} == {
        k: v.tobytes() for k, v in zip(keys.tolist(), values, strict=True)
    }


def test_a_newer_row_already_there_is_kept_when_an_older_batch_comes(store, redis_server):
    newer = _write(store, np.arange(100), V3, seed=1)
    _write(store, np.arange(200), V2, seed=2)  # older for the first 100 keys
    got = store.read(T, np.arange(200))
    np.testing.assert_array_equal(got.embedding[:100], newer)
    assert got.versions.tolist() == [V3] * 100 + [V2] * 100


def test_a_tombstone_of_equal_version_keeps_an_upsert_out(store):
    keys = np.arange(10)
    _write(store, keys, V2)
    ops = np.ones(10, np.int8)
    _write(store, keys[:5], V2, ops=ops[:5])  # deletes at V2
    _write(store, keys, V2, seed=3)  # same version: the tombstones win
    got = store.read(T, keys)
    assert got.found.tolist() == [False] * 5 + [True] * 5


def test_rows_below_the_floor_are_refused_on_the_plain_path_too(store):
    _write(store, np.arange(10), V2)
    store.sweep_below(T, V3)
    _write(store, np.arange(5), V2, seed=4)
    assert not store.read(T, np.arange(10)).found.any()


def test_in_order_upserts_take_plain_hset_and_keep_the_low_mark(transaction_store, redis_server):
    store = transaction_store
    before = _scripts(redis_server)
    _write(store, np.arange(1000), V1)
    _write(store, np.arange(1000, 2000), V2)
    assert _scripts(redis_server) == before  # no guarded script: plain HSET
    _write(store, np.arange(2000, 2010), V1)  # older than the newest row: guarded, lands
    assert _scripts(redis_server) == before + 1
    store.sweep_below(T, V2)  # the low mark is V1: the sweep scans and removes the V1 rows
    got = store.read(T, np.arange(2010))
    assert got.found.tolist() == [False] * 1000 + [True] * 1000 + [False] * 10


def test_a_view_holding_rows_without_a_high_mark_is_written_with_the_guard(store, redis_server):
    _write(store, np.arange(10), V3)
    client = redis.Redis(port=redis_server.port)
    (high,) = [k for k in client.keys(f"{store.prefix}~high:*")]
    client.delete(high)  # as written before high marks were kept
    _write(store, np.arange(10), V2, seed=5)
    assert store.read(T, np.arange(10)).versions.tolist() == [V3] * 10
    assert not client.exists(high)
