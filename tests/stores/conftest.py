"""Real PostgreSQL and Redis servers (one each per session) and a per-test store of each kind.

The ``backend`` fixture is parametrized over sqlite, postgres and redis; every test gets an
empty namespace (a new SQLite file, a new PostgreSQL schema, a new Redis key prefix) and a way
to take the store down and bring it back (``backend.down()`` / ``backend.up()``).
"""

from __future__ import annotations

import itertools
import sqlite3
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from deltarec.testing.servers import PostgresServer, RedisServer

_COUNTER = itertools.count()


@dataclass
class Backend:
    kind: str
    url: str
    down: Callable[[], None]
    up: Callable[[], None]
    _held: list[sqlite3.Connection] = field(default_factory=list)


def _sqlite_backend(tmp_path) -> Backend:  # type: ignore[no-untyped-def]
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


@pytest.fixture(params=["sqlite", "postgres", "redis"])
def backend(request, tmp_path) -> Iterator[Backend]:  # type: ignore[no-untyped-def]
    n = next(_COUNTER)
    if request.param == "sqlite":
        b = _sqlite_backend(tmp_path)
    elif request.param == "postgres":
        pg: PostgresServer = request.getfixturevalue("postgres_server")
        b = Backend("postgres", f"{pg.url}?schema=t{n}&connect_timeout=2", pg.stop, pg.start)
    else:
        rd: RedisServer = request.getfixturevalue("redis_server")
        b = Backend("redis", f"{rd.url}?prefix=t{n}:&socket_timeout_s=2", rd.stop, rd.start)
    try:
        yield b
    finally:  # a failed test must not leave the shared server down for the next one
        if b.kind == "sqlite":
            b.up()
        elif b.kind == "postgres" and not pg.running:
            pg.start()
        elif b.kind == "redis" and rd.proc is None:
            rd.start()
