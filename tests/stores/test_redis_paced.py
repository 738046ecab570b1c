"""Paced Redis writes (a read budget's): rows in small server-side units, the mark after them."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import redis

from deltarec.artifacts.types import TableSpec
from deltarec.errors import StoreUnavailableError
from deltarec.ids import make_version
from deltarec.stores import open_store
from deltarec.stores.redis.paced import PLAIN_UNIT_ROWS
from deltarec.stores.types import ProgressMark, RowBatch

from .test_redis_scripts import T

V1, V2 = make_version(1, 1), make_version(1, 2)
_PREFIXES = itertools.count()


@pytest.fixture(params=[64, 200], ids=["script-units", "transaction-units"])
def pair(redis_server, request):
    """A paced store (units of 64 or 200 rows, timed on the server) and one writing
    transactions."""
    url = f"{redis_server.url}?prefix=paced{next(_PREFIXES)}:"
    paced, plain = open_store(url, run="r"), open_store(url, run="r")
    paced.provision({T: TableSpec(dim=4)})
    paced.unit_rows, paced.server_timing = request.param, True
    yield paced, plain
    paced.close()
    plain.close()


def _stats(redis_server, command: str) -> int:
    stats = redis.Redis(port=redis_server.port).info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


def _batches(keys, version, ops=None, seed=0):  # type: ignore[no-untyped-def]
    keys = np.asarray(keys, np.int64)
    emb = np.random.default_rng(seed).standard_normal((len(keys), 4), dtype=np.float32)
    ops = np.zeros(len(keys), np.int8) if ops is None else np.asarray(ops, np.int8)
    versions = np.full(len(keys), version, np.int64)
    half = len(keys) // 2
    return emb, [
        RowBatch(keys[:half], emb[:half], ops[:half], versions[:half]),
        RowBatch(keys[half:], emb[half:], ops[half:], versions[half:]),
    ]


def _mark(rows: int, complete: bool = True) -> ProgressMark:
    return ProgressMark("r", 1, 1, T, 0, rows, complete)


@pytest.mark.parametrize(
    ("unit", "scripts_run", "transactions"),
    [(64, 2 * 8, 0), (250, 0, 2 * 2)],  # 500 rows a batch: script units, transaction units
)
def test_a_paced_write_lands_every_row_in_units_and_its_mark_after_them(
    pair, redis_server, unit, scripts_run, transactions
):
    paced, _ = pair
    paced.unit_rows = unit
    assert (unit < PLAIN_UNIT_ROWS) == bool(scripts_run)
    scripts, execs = _stats(redis_server, "evalsha"), _stats(redis_server, "exec")
    emb, batches = _batches(np.arange(1000), V1)
    assert paced.write_batches(T, batches, mark=_mark(1000)) == 1000
    assert _stats(redis_server, "evalsha") - scripts == scripts_run
    assert _stats(redis_server, "exec") - execs == transactions + 1  # and the mark's, alone
    got = paced.read(T, np.arange(1000))
    np.testing.assert_array_equal(got.embedding, emb)
    assert set(got.versions.tolist()) == {V1}
    (mark,) = paced.registry.progress("r", 1)
    assert (mark.rows, mark.complete) == (1000, True)
    assert paced.last_write_held_s is not None and paced.last_write_held_s > 0


def test_paced_deletes_and_older_rows_go_through_the_guard_as_a_transaction_would(pair):
    paced, plain = pair
    for store, base in ((paced, 0), (plain, 10_000)):
        keys = np.arange(base, base + 300)
        _, newer = _batches(keys, V2, seed=1)
        store.write_batches(T, newer)
        _, older = _batches(keys[::2], V1, seed=2)  # refused: a newer row is there
        store.write_batches(T, older)
        ops = np.zeros(100, np.int8)
        ops[::3] = 1
        _, mixed = _batches(keys[:100], V2, ops=ops, seed=3)  # deletes: the guarded script
        store.write_batches(T, mixed)
    a, b = paced.read(T, np.arange(300)), plain.read(T, np.arange(10_000, 10_300))
    assert a.found.tolist() == b.found.tolist() and (~a.found).sum() == 34
    np.testing.assert_array_equal(a.embedding, b.embedding)
    np.testing.assert_array_equal(a.versions, b.versions)


def test_paced_rows_into_a_staging_view_become_live_at_the_merge_in_unit_sized_steps(
    pair, redis_server
):
    paced, _ = pair
    paced.provision({T: TableSpec(dim=4)}, staging_generation=2)
    emb, batches = _batches(np.arange(1000), V2)
    paced.write_batches(T, batches, staging_generation=2)
    assert not paced.read(T, np.arange(1000)).found.any()
    scripts = _stats(redis_server, "evalsha")
    paced.merge_staging("r", 2)
    assert _stats(redis_server, "evalsha") - scripts >= 1000 // paced.unit_rows  # unit-sized steps
    np.testing.assert_array_equal(paced.read(T, np.arange(1000)).embedding, emb)


def test_a_paced_write_whose_mark_fails_is_written_again_whole_and_marked_once(pair, monkeypatch):
    paced, _ = pair
    emb, batches = _batches(np.arange(500), V1)
    record = paced.record_progress

    def down(mark):  # type: ignore[no-untyped-def]
        raise StoreUnavailableError(paced.describe(), "connection reset")

    monkeypatch.setattr(paced, "record_progress", down)
    with pytest.raises(StoreUnavailableError):
        paced.write_batches(T, batches, mark=_mark(500))
    assert paced.read(T, np.arange(500)).found.all()  # the units landed, the mark did not
    assert paced.registry.progress("r", 1) == []
    monkeypatch.setattr(paced, "record_progress", record)
    _, again = _batches(np.arange(500), V1)
    assert paced.write_batches(T, again, mark=_mark(500)) == 500
    got = paced.read(T, np.arange(500))
    np.testing.assert_array_equal(got.embedding, emb)
    assert [(m.rows, m.complete) for m in paced.registry.progress("r", 1)] == [(500, True)]


def test_paced_writers_racing_on_one_view_keep_the_newest_row_of_every_key(pair, redis_server):
    """Two writers of the same view at once (two ranks, one of them a dump ahead), each in many
    units: a unit whose decision another's write moved is decided again, and one a newer row
    may meet goes through the guard, so every key holds its newest row."""
    import threading

    paced, second = pair
    second.unit_rows, second.server_timing = paced.unit_rows, True  # paced too
    a_emb, a = _batches(np.arange(0, 4000), V1, seed=1)
    b_emb, b = _batches(np.arange(2000, 6000), V2, seed=2)
    errors: list[BaseException] = []

    def write(store, batches):  # type: ignore[no-untyped-def]
        try:
            store.write_batches(T, batches)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    second.write_batches(T, b[:1])  # keys 2000-3999 at the newer version first: A must yield
    threads = [threading.Thread(target=write, args=w) for w in ((paced, a), (second, b[1:]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    got = paced.read(T, np.arange(6000))
    assert got.found.all()
    np.testing.assert_array_equal(got.embedding[:2000], a_emb[:2000])  # only the older wrote them
    np.testing.assert_array_equal(got.embedding[2000:], b_emb)  # the newer row wins where both
    assert (got.versions[:2000] == V1).all() and (got.versions[2000:] == V2).all()


def test_a_newer_generation_registered_meanwhile_refuses_the_paced_mark(pair):
    from deltarec.errors import StaleGenerationError

    paced, plain = pair
    plain.registry.register_generation("r", 5)
    _, batches = _batches(np.arange(100), V1)
    with pytest.raises(StaleGenerationError):
        paced.write_batches(T, batches, mark=_mark(100))
    assert paced.registry.progress("r", 1) == []


def test_a_server_fsyncing_its_append_only_file_is_named_as_what_no_budget_can_hold(
    pair, redis_server
):
    paced, _ = pair
    admin = redis.Redis(port=redis_server.port)
    assert admin.config_get("appendfsync")["appendfsync"] == "everysec"  # the fixture's
    assert "appendfsync everysec" in (paced.read_stall_note() or "")
    admin.config_set("appendfsync", "no")
    try:
        assert paced.read_stall_note() is None
    finally:
        admin.config_set("appendfsync", "everysec")
    assert "appendfsync everysec" in (paced.read_stall_note() or "")
