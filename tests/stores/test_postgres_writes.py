"""PostgreSQL's write paths: new keys copied straight into a view, the rest merged.

Which path a write took is seen through ``pgload.copy_direct`` (wrapped to record
whether each group went in) and ``PostgresStore._merge_batch`` (whether the merge walked both
indexes by a merge join); what the view holds afterwards is checked in full.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

import numpy as np
import psycopg
import pytest

from deltarec.artifacts import codec
from deltarec.artifacts.types import TableSpec
from deltarec.errors import StoreUnavailableError
from deltarec.ids import make_version
from deltarec.publish.snapshot import finish_snapshot
from deltarec.stores import ProgressMark, RowBatch, open_store
from deltarec.stores.sql import pgload
from deltarec.stores.sql import postgres as pgstore

T = "sparse.ebc.user_id"
DIM = 4
_SCHEMAS = itertools.count()


@pytest.fixture
def store(postgres_server):
    s = open_store(f"{postgres_server.url}?schema=writes{next(_SCHEMAS)}", run="r")
    s.provision({T: TableSpec(dim=DIM)})
    yield s
    s.close()


@pytest.fixture
def direct(monkeypatch):
    """Each batch its own COPY group; records ``went in`` per group."""
    calls: list[bool] = []
    real = pgload.copy_direct

    def spy(*args: Any) -> Any:
        result = real(*args)
        calls.append(result[0])
        return result

    monkeypatch.setattr(pgload, "_DIRECT_BYTES", 1)
    monkeypatch.setattr(pgload, "copy_direct", spy)
    return calls


@pytest.fixture
def walks(monkeypatch):
    """Merge joins for merges of any size; records ``walk`` per merge."""
    calls: list[bool] = []
    real = pgstore.PostgresStore._merge_batch

    def spy(self, *args: Any, **kwargs: Any) -> Any:
        calls.append(bool(kwargs.get("walk", args[6] if len(args) > 6 else False)))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(pgstore, "_WALK_MIN_BYTES", 0)
    monkeypatch.setattr(pgstore.PostgresStore, "_merge_batch", spy)
    return calls


def _batch_index(store: Any) -> Any:
    """The batch table's key index in the store's own session, or None."""
    with store._tx() as cur:
        cur.execute("SELECT to_regclass('pg_temp.deltarec_batch_bytea_key')")
        return cur.fetchone()[0]


def rows(keys: Any, seed: int) -> tuple[np.ndarray, np.ndarray]:
    values = np.random.default_rng(seed).normal(size=(len(keys), DIM)).astype(np.float32)
    return np.asarray(keys, np.int64), codec.encode(values, codec.DType.FLOAT32)


def batch(keys: np.ndarray, emb: np.ndarray, version: int, ops: Any = 0) -> RowBatch:
    n = len(keys)
    return RowBatch(keys, emb, np.full(n, ops, np.int8), np.full(n, version, np.int64))


def test_new_keys_go_straight_in_until_a_group_holds_a_key_the_view_has(store, direct):
    held, held_emb = rows(range(500, 600), seed=1)
    store.write_batches(T, [batch(held, held_emb, make_version(1, 5))])
    assert direct == [True]  # an empty view: straight in
    direct.clear()
    keys, emb = rows(range(800), seed=2)  # row i is key i
    shuffle = np.random.default_rng(0).permutation
    parts = [shuffle(np.arange(a, b)) for a, b in ((0, 150), (150, 300), (300, 800), (800, 800))]
    old = make_version(1, 3)  # older than the held rows, which must not change
    mark = ProgressMark("r", 1, 3, T, 0, 800, True)
    assert store.write_batches(T, [batch(keys[p], emb[p], old) for p in parts], mark) == 800
    # the first two groups went straight in; the third holds keys 500-599 and was merged
    assert direct == [True, True, False]
    got = store.read(T, keys)
    assert got.found.all()
    is_held = (keys >= 500) & (keys < 600)
    np.testing.assert_array_equal(got.embedding[is_held], held_emb)
    np.testing.assert_array_equal(got.embedding[~is_held], emb[~is_held])
    assert set(got.versions[is_held].tolist()) == {make_version(1, 5)}
    assert set(got.versions[~is_held].tolist()) == {old}
    assert [m.rows for m in store.progress("r", 1)] == [800]


def test_a_failed_group_is_undone_and_the_write_goes_on(store, direct):
    """A group that fails on its last row is undone whole, and merged."""
    keys, emb = rows(range(300), seed=3)
    store.write(T, keys[299:], emb[299:], np.zeros(1, np.int8), np.full(1, make_version(1, 1)))
    direct.clear()
    new = make_version(1, 2)
    store.write_batches(T, [batch(keys[:100], emb[:100], new), batch(keys[100:], emb[100:], new)])
    assert direct == [True, False]  # keys 100-298 went in first, then 299 failed the group
    got = store.read(T, keys)
    assert got.found.all() and set(got.versions.tolist()) == {new}
    np.testing.assert_array_equal(got.embedding, emb)


def test_deletes_go_to_the_merge_and_tombstones_stop_copies_straight_in(store, direct):
    keys, emb = rows(range(40), seed=4)
    v1, v2 = make_version(1, 1), make_version(1, 2)
    ops = np.array([0, 1] * 20, np.int8)  # deletes of keys the view never held
    store.write_batches(T, [RowBatch(keys, emb, ops, np.full(40, v1, np.int64))])
    assert direct == [True]  # the upserts; the deletes were merged (tombstones)
    got = store.read(T, keys)
    assert got.found.tolist() == (ops == 0).tolist()
    np.testing.assert_array_equal(got.embedding[ops == 0], emb[ops == 0])
    direct.clear()
    # the view has tombstones now: no write copies straight in (the guard needs the merge)
    store.write_batches(T, [batch(keys[1:2], emb[1:2], make_version(1, 0))])  # older: refused
    store.write_batches(T, [batch(np.array([100]), emb[:1], v2)])
    assert direct == []
    assert store.read(T, keys[1:2]).found.tolist() == [False]
    assert store.read(T, np.array([100])).found.tolist() == [True]


def test_rows_below_the_floor_are_not_copied_in(store, direct):
    keys, emb = rows(range(10), seed=5)
    snap = make_version(2, 0)
    mark = ProgressMark("r", 2, 0, T, 0, 5, True)
    store.write(T, keys[:5], emb[:5], np.zeros(5, np.int8), np.full(5, snap), mark=mark)
    assert finish_snapshot(store, "r", 2, 0, T, world_size=1)
    direct.clear()
    late = np.array([make_version(1, 9)] * 3 + [make_version(2, 1)] * 2, np.int64)
    store.write_batches(T, [RowBatch(keys[5:], emb[5:], np.zeros(5, np.int8), late)])
    assert direct == [True]
    assert store.read(T, keys[5:]).found.tolist() == [False] * 3 + [True] * 2


def test_groups_copied_straight_in_per_write_are_bounded(store, direct, monkeypatch):
    monkeypatch.setattr(pgload, "_DIRECT_SAVEPOINTS", 2)
    keys, emb = rows(range(500), seed=6)
    v = make_version(1, 1)
    store.write_batches(
        T, [batch(keys[s : s + 100], emb[s : s + 100], v) for s in range(0, 500, 100)]
    )
    assert direct == [True, True]  # the other three batches went through the batch table
    got = store.read(T, keys)
    assert got.found.all()
    np.testing.assert_array_equal(got.embedding, emb)


def test_a_staging_view_takes_new_rows_and_tombstones_straight_in(store, direct):
    keys, emb = rows(range(20), seed=7)
    store.write(T, keys, emb, np.zeros(20, np.int8), np.full(20, make_version(1, 1)))
    store.provision({T: TableSpec(dim=DIM)}, staging_generation=2)
    direct.clear()
    ops = np.array([1] * 5 + [0] * 15, np.int8)
    _, new = rows(range(20), seed=8)
    store.write_batches(
        T, [RowBatch(keys, new, ops, np.full(20, make_version(2, 1)))], staging_generation=2
    )
    assert direct == [True]
    store.merge_staging("r", 2)
    got = store.read(T, keys)
    assert got.found.tolist() == [False] * 5 + [True] * 15
    np.testing.assert_array_equal(got.embedding[5:], new[5:])


def _other_writer(url: str, schema: str) -> psycopg.Connection[Any]:
    other = psycopg.connect(url)  # another writer, mid-transaction
    other.execute(f"SET search_path TO {schema}")
    return other


@pytest.mark.parametrize(
    ("view_holds_a_key", "walk"),
    [(False, False), (True, False), (True, True)],
    ids=["copy", "merge", "merge-join"],
)
def test_concurrent_insert_of_a_new_key_is_applied_not_lost(
    postgres_server, monkeypatch, view_holds_a_key, walk
):
    """Another session inserts key 3 and commits while this write waits on it.

    ``copy``: the view is empty, the COPY straight in waits on key 3 and fails on it; the rows
    are merged. ``merge``: the view holds key 0, so the COPY fails at once and the MERGE waits
    on key 3 and fails on it; the rows are applied by ``INSERT ... ON CONFLICT``.
    ``merge-join``: the same, with the MERGE by a merge join.
    """
    monkeypatch.setattr(pgstore, "_WALK_MIN_BYTES", 0 if walk else 1 << 60)
    schema = f"concurrent{next(_SCHEMAS)}"
    store = open_store(f"{postgres_server.url}?schema={schema}", run="r")
    view = store.provision({T: TableSpec(dim=DIM)})[T]
    keys, emb = rows(range(10), seed=9)
    new = make_version(1, 2)
    if view_holds_a_key:
        store.write(T, keys[:1], emb[:1], np.zeros(1, np.int8), np.full(1, make_version(1, 1)))
    other = _other_writer(postgres_server.url, schema)
    other.execute(
        f'INSERT INTO "{view.name}" (key, embedding, version) VALUES (3, %s, %s)',
        (b"\0" * 16, make_version(1, 1)),
    )
    committing = threading.Event()

    def commit_other() -> None:
        committing.set()  # before the commit: this write cannot have ended before it was set
        other.commit()

    commit = threading.Timer(0.5, commit_other)  # while this write waits on key 3
    commit.start()
    try:
        mark = ProgressMark("r", 1, 2, T, 0, 10, True)
        store.write(T, keys, emb, np.zeros(10, np.int8), np.full(10, new), mark=mark)
        assert committing.is_set()  # it did wait for the other writer's commit
    finally:
        commit.join()
        other.close()
    got = store.read(T, keys)
    assert got.found.all()
    assert set(got.versions.tolist()) == {new}  # key 3 too: the newer version won
    np.testing.assert_array_equal(got.embedding, emb)
    assert [m.rows for m in store.progress("r", 1)] == [10]
    store.close()


def test_two_writers_tombstoning_a_view_first_at_once_retry_as_transient(postgres_server):
    """Both hold the registry row's share lock, then both set ``has_tombstones``: PostgreSQL
    aborts one as a deadlock, which is transient (the publisher retries); the other commits."""
    schema = f"tombstones{next(_SCHEMAS)}"
    url = f"{postgres_server.url}?schema={schema}"
    stores = [open_store(url, run="r"), open_store(url, run="r")]
    stores[0].provision({T: TableSpec(dim=DIM)})
    keys, emb = rows(range(20), seed=10)
    v = make_version(1, 1)
    stores[0].write(T, keys, emb, np.zeros(20, np.int8), np.full(20, v))
    both_locked = threading.Barrier(2, timeout=10)

    def deletes(part: slice) -> Any:
        # write_batches takes the first batch before its transaction and the rest inside it,
        # after the share lock: both writers wait there for each other, both holding it.
        half = slice(part.start, part.start + 5)
        yield batch(keys[half], emb[half], make_version(1, 2), ops=1)
        both_locked.wait()
        rest = slice(part.start + 5, part.stop)
        yield batch(keys[rest], emb[rest], make_version(1, 2), ops=1)

    outcome: list[Any] = [None, None]

    def run(i: int) -> None:
        try:
            outcome[i] = stores[i].write_batches(T, deletes(slice(10 * i, 10 * i + 10)))
        except Exception as e:  # the outcome is checked below
            outcome[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    failed = [o for o in outcome if isinstance(o, Exception)]
    assert len(failed) == 1 and outcome.count(10) == 1, outcome
    assert isinstance(failed[0], StoreUnavailableError) and "Deadlock" in str(failed[0])
    loser = outcome.index(failed[0])
    both_locked = threading.Barrier(1)
    part = slice(10 * loser, 10 * loser + 10)
    assert stores[loser].write_batches(T, deletes(part)) == 10  # the retry
    assert not stores[1].read(T, keys).found.any()
    for s in stores:
        s.close()


def test_servers_before_15_take_the_plain_path(store, direct, monkeypatch):
    """Wire-compatible stores that report older versions: no savepoints, no MERGE."""
    monkeypatch.setattr(pgstore.PostgresStore, "_has_merge", staticmethod(lambda cur: False))
    keys, emb = rows(range(200), seed=11)
    _, new = rows(range(200), seed=12)
    shuffle = np.random.default_rng(1).permutation(200)
    v1, v2 = make_version(1, 1), make_version(1, 2)
    store.write_batches(
        T,
        [batch(keys[shuffle[s : s + 50]], emb[shuffle[s : s + 50]], v1) for s in range(0, 200, 50)],
    )
    parts = [
        batch(keys[:100], new[:100], v2),
        batch(keys[100:150], new[100:150], make_version(1, 0)),
    ]
    parts.append(batch(keys[150:160], new[150:160], v2, ops=1))
    store.write_batches(T, parts, ProgressMark("r", 1, 2, T, 0, 160, True))
    assert direct == []
    got = store.read(T, keys)
    np.testing.assert_array_equal(got.embedding[:100], new[:100])
    np.testing.assert_array_equal(got.embedding[100:150], emb[100:150])  # older: ignored
    assert got.found.tolist() == [True] * 150 + [False] * 10 + [True] * 40
    np.testing.assert_array_equal(got.embedding[160:], emb[160:])
    assert [m.rows for m in store.progress("r", 1)] == [160]


def test_a_merge_of_a_large_share_of_the_view_walks_both_indexes(store, direct, walks, monkeypatch):
    keys, emb = rows(range(3000), seed=13)
    v1, v2, v3 = make_version(1, 1), make_version(1, 2), make_version(1, 3)
    store.write(T, keys[:2000], emb[:2000], np.zeros(2000, np.int8), np.full(2000, v2))
    assert walks == []  # new keys: straight in
    _, new = rows(range(3000), seed=14)
    # keys 0-999 newer, 1000-1499 older (refused), 1500-1699 deleted, 2000-2999 new keys
    pick = np.concatenate([np.arange(0, 1700), np.arange(2000, 3000)])
    versions = np.where((pick >= 1000) & (pick < 1500), v1, v3)
    ops = ((pick >= 1500) & (pick < 1700)).astype(np.int8)
    order = np.random.default_rng(2).permutation(len(pick))
    parts = [order[s : s + 500] for s in range(0, len(order), 500)]
    store.write_batches(
        T,
        [RowBatch(keys[pick[p]], new[pick[p]], ops[p], versions[p]) for p in parts],
        ProgressMark("r", 1, 3, T, 0, len(pick), True),
    )
    assert walks == [True]
    assert _batch_index(store) is None  # dropped: later COPYs do not maintain it
    got = store.read(T, keys)
    expect_found = np.ones(3000, bool)
    expect_found[1500:1700] = False
    expect_found[1700:2000] = True  # not written: as before
    assert got.found.tolist() == expect_found.tolist()
    fresh = np.r_[0:1000, 2000:3000]
    np.testing.assert_array_equal(got.embedding[fresh], new[fresh])
    assert set(got.versions[fresh].tolist()) == {v3}
    kept = np.r_[1000:1500, 1700:2000]
    np.testing.assert_array_equal(got.embedding[kept], emb[kept])
    assert set(got.versions[kept].tolist()) == {v2}
    assert [m.rows for m in store.progress("r", 1)] == [len(pick)]
    # the view has tombstones now: the guard holds on this path too
    monkeypatch.setattr(pgstore, "_WALK", 1000)  # 200 rows: a merge join all the same
    walks.clear()
    back = np.r_[1500:1600]  # older than their tombstones: refused
    again = np.r_[1600:1700]  # newer: back in
    both = np.concatenate([back, again])
    store.write_batches(
        T,
        [
            RowBatch(
                keys[both],
                emb[both],
                np.zeros(200, np.int8),
                np.where(both < 1600, v1, make_version(1, 4)),
            )
        ],
    )
    assert walks == [True]
    got = store.read(T, keys[both])
    assert got.found.tolist() == [False] * 100 + [True] * 100


def test_small_merges_into_a_large_view_keep_the_nested_loop(store, walks):
    keys, emb = rows(range(4000), seed=15)
    store.write(T, keys, emb, np.zeros(4000, np.int8), np.full(4000, make_version(1, 1)))
    _, new = rows(range(20), seed=16)
    store.write(T, keys[:20], new, np.zeros(20, np.int8), np.full(20, make_version(1, 2)))
    assert walks == [False]
    np.testing.assert_array_equal(store.read(T, keys[:20]).embedding, new)


def test_a_failed_merge_join_write_leaves_nothing_behind(store, walks, monkeypatch):
    keys, emb = rows(range(100), seed=17)
    v1, v2 = make_version(1, 1), make_version(1, 2)
    store.write(T, keys, emb, np.zeros(100, np.int8), np.full(100, v1))
    _, new = rows(range(100), seed=18)
    ops = np.zeros(100, np.int8)
    ops[:10] = 1

    def broken(*args: Any) -> int:
        raise RuntimeError("lost between the merge and the deletes")

    with monkeypatch.context() as m:
        m.setattr(pgstore.PostgresStore, "_apply_deletes", staticmethod(broken))
        with pytest.raises(RuntimeError, match="lost between"):
            store.write(
                T, keys, new, ops, np.full(100, v2), mark=ProgressMark("r", 1, 2, T, 0, 100, True)
            )
    assert walks == [True]
    assert _batch_index(store) is None  # rolled back with the rest
    got = store.read(T, keys)
    assert got.found.all() and set(got.versions.tolist()) == {v1}  # nothing half-applied
    np.testing.assert_array_equal(got.embedding, emb)
    assert store.progress("r", 1) == []
    store.write(T, keys, new, ops, np.full(100, v2))  # the retry: the index is made anew
    got = store.read(T, keys)
    assert got.found.tolist() == [False] * 10 + [True] * 90
    np.testing.assert_array_equal(got.embedding[10:], new[10:])


def test_promote_merges_a_large_staging_view_by_a_merge_join(store, walks):
    keys, emb = rows(range(200), seed=19)
    store.write(T, keys, emb, np.zeros(200, np.int8), np.full(200, make_version(2, 5)))
    store.provision({T: TableSpec(dim=DIM)}, staging_generation=2)
    _, new = rows(range(200), seed=20)
    ops = np.array([1] * 20 + [0] * 180, np.int8)
    versions = np.array([make_version(2, 6)] * 100 + [make_version(2, 4)] * 100, np.int64)
    store.write_batches(T, [RowBatch(keys, new, ops, versions)], staging_generation=2)
    walks.clear()
    store.merge_staging("r", 2)
    assert walks == [True]
    got = store.read(T, keys)
    assert got.found.tolist() == [False] * 20 + [True] * 180
    np.testing.assert_array_equal(got.embedding[20:100], new[20:100])  # newer
    np.testing.assert_array_equal(got.embedding[100:], emb[100:])  # older: refused
