"""The SQLite store syncs its WAL while a long write runs, and its file while the write commits."""

from __future__ import annotations

import os
import time

import numpy as np

from deltarec.artifacts.types import TableSpec
from deltarec.stores import open_store
from deltarec.stores.sql import writebehind
from deltarec.stores.sql.sqlite import SqliteStore
from deltarec.stores.sql.writebehind import WriteBehind
from deltarec.stores.types import RowBatch

T = "sparse.ebc.item_id"


def _synced_paths(monkeypatch) -> list[str]:
    """Record the path behind every ``os.fdatasync`` (and still sync)."""
    seen: list[str] = []
    real = os.fdatasync

    def recording(fd: int) -> None:
        seen.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(writebehind.os, "fdatasync", recording)
    return seen


def _wait_until_waiting(behind: WriteBehind) -> None:
    """Until the thread waits on its condition (not inside a sync)."""
    while True:
        with behind._changed:
            if behind._changed._waiters:  # the condition's waiting threads
                return
        time.sleep(0.001)


def test_the_wal_is_synced_while_the_transaction_runs_and_the_file_once_it_commits(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(writebehind, "FLUSH_EVERY_S", 0.01)
    seen = _synced_paths(monkeypatch)
    db = tmp_path / "s.db"
    (tmp_path / "s.db-wal").write_bytes(b"")
    db.write_bytes(b"")
    behind = WriteBehind(str(db))
    threads = set()
    for _ in range(2):  # one thread, idle between writes
        with behind.writing():
            threads.add(behind._thread)
            while not seen:
                time.sleep(0.005)
            assert set(seen) == {str(db) + "-wal"}  # the database file only once committing
            behind.committing()
            while str(db) not in seen:
                time.sleep(0.005)
        _wait_until_waiting(behind)  # a sync under way when the block ended has finished
        n = len(seen)
        time.sleep(0.05)  # five ticks of a writing thread
        assert len(seen) == n  # nothing between writes
        seen.clear()
    (thread,) = threads
    assert thread is not None and thread.is_alive()
    behind.close()
    assert not thread.is_alive()


def test_a_file_not_there_yet_is_looked_for_again(tmp_path, monkeypatch):
    monkeypatch.setattr(writebehind, "FLUSH_EVERY_S", 0.01)
    seen = _synced_paths(monkeypatch)
    db = tmp_path / "late.db"
    behind = WriteBehind(str(db))
    with behind.writing():
        time.sleep(0.05)
        assert seen == []
        (tmp_path / "late.db-wal").write_bytes(b"x")
        while not seen:
            time.sleep(0.005)
    behind.close()
    assert seen[0] == str(db) + "-wal"


def _write(store: SqliteStore, rows: int, version: int) -> None:
    keys = np.random.default_rng(version).permutation(rows).astype(np.int64)
    values = np.full((rows, 8), version, np.float32)
    half = rows // 2
    batches = [  # two batches out of key order: the spilled path
        RowBatch(k, v, np.zeros(len(k), np.int8), np.full(len(k), version, np.int64))
        for k, v in ((keys[:half], values[:half]), (keys[half:], values[half:]))
    ]
    store.write_parts(T, batches, [])


def test_a_store_write_syncs_its_wal_and_a_store_that_syncs_nothing_does_not(tmp_path, monkeypatch):
    monkeypatch.setattr(writebehind, "FLUSH_EVERY_S", 0.001)
    seen = _synced_paths(monkeypatch)
    for sync, expect in (("NORMAL", True), ("OFF", False)):
        seen.clear()
        path = tmp_path / f"{sync}.db"
        store = open_store(f"sqlite:///{path}?synchronous={sync}", run="r")
        store.provision({T: TableSpec(dim=8)})
        _write(store, 20_000, 1)
        assert bool(seen) is expect, (sync, seen)
        got = store.read(T, np.arange(20_000, dtype=np.int64))
        assert got.found.all()
        assert (got.embedding == 1).all()
        store.close()
