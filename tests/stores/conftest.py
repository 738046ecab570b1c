"""Real PostgreSQL and Redis servers (one each per session) and a per-test store of each kind.

The ``backend`` fixture is parametrized over sqlite, postgres and redis (``any_backend`` also
over PAI FeatureStore through the strict test SDK in ``sdk/``); every test gets an
empty namespace (a new SQLite file, a new PostgreSQL schema, a new Redis key prefix) and a way
to take the store down and bring it back (``backend.down()`` / ``backend.up()``).
"""

from __future__ import annotations

import itertools
import sqlite3
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
from tests._helpers import featurestore as fs_state

from deltarec.testing.servers import PostgresServer, RedisServer

_COUNTER = itertools.count()


@dataclass
class Backend:
    kind: str
    url: str
    down: Callable[[], None]
    up: Callable[[], None]
    _held: list[sqlite3.Connection] = field(default_factory=list)


def _sqlite_backend(tmp_path) -> Backend:
    path = tmp_path / "store.db"
    held: list[sqlite3.Connection] = []

    def down() -> None:  # another writer holds the database lock: writers time out
        conn = sqlite3.connect(path, isolation_level=None)
        conn.execute("BEGIN EXCLUSIVE")
        held.append(conn)

    def up() -> None:
        while held:
            conn = held.pop()
            conn.execute("ROLLBACK")
            conn.close()

    return Backend("sqlite", f"sqlite:///{path}?timeout_s=0.2", down, up, held)


def _featurestore_backend(tmp_path, monkeypatch) -> Backend:
    """FeatureStore through the test SDK: network down = every SDK call fails with a reset."""
    state = str(tmp_path / "featurestore.db")
    fs_state.use_test_sdk(monkeypatch, state)
    ops = ("write_features", "get_online_features", "get_dynamic_embedding_feature_view")

    def down() -> None:
        for op in ops:
            fs_state.inject_fault(state, op, 10**6, "network: connection reset by peer")

    def up() -> None:
        for op in ops:
            fs_state.inject_fault(state, op, 0)

    url = (
        f"featurestore://{fs_state.PROJECT}/{fs_state.VIEW}?region=cn-hangzhou&create_wait_s=5"
        f"&registry=sqlite:///{tmp_path}/registry.db"
    )
    return Backend("featurestore", url, down, up)


def _make(kind: str, request, tmp_path) -> Backend:
    n = next(_COUNTER)
    if kind == "sqlite":
        return _sqlite_backend(tmp_path)
    if kind == "featurestore":
        reason = request.node.get_closest_marker("featurestore_cannot")
        if reason is not None:
            pytest.skip(f"FeatureStore cannot: {reason.args[0]}")
        return _featurestore_backend(tmp_path, request.getfixturevalue("monkeypatch"))
    if kind == "postgres":
        pg: PostgresServer = request.getfixturevalue("postgres_server")
        return Backend("postgres", f"{pg.url}?schema=t{n}&connect_timeout=2", pg.stop, pg.start)
    rd: RedisServer = request.getfixturevalue("redis_server")
    return Backend("redis", f"{rd.url}?prefix=t{n}:&socket_timeout_s=2", rd.stop, rd.start)


def _restore(b: Backend, request) -> None:
    """A failed test must not leave the shared server down for the next one."""
    if b.kind in ("sqlite", "featurestore"):
        b.up()
    elif b.kind == "postgres":
        pg: PostgresServer = request.getfixturevalue("postgres_server")
        if not pg.running:
            pg.start()
    elif b.kind == "redis":
        rd: RedisServer = request.getfixturevalue("redis_server")
        if rd.proc is None:
            rd.start()


@pytest.fixture(params=["sqlite", "postgres", "redis"])
def backend(request, tmp_path) -> Iterator[Backend]:
    b = _make(request.param, request, tmp_path)
    try:
        yield b
    finally:
        _restore(b, request)


@pytest.fixture(params=["sqlite", "postgres", "redis", "featurestore"])
def any_backend(request, tmp_path) -> Iterator[Backend]:
    """Every backend, PAI FeatureStore through the test SDK included (tests it cannot meet
    carry ``@pytest.mark.featurestore_cannot("reason")``)."""
    b = _make(request.param, request, tmp_path)
    try:
        yield b
    finally:
        _restore(b, request)


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "featurestore_cannot(reason): a contract PAI FeatureStore cannot meet"
    )
