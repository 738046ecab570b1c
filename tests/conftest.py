"""Suite-wide test configuration and the one set of server fixtures.

Area fixtures live in each tests/<area>/conftest.py. The PostgreSQL and Redis servers are
session-wide and defined here only, so a full run starts one of each (on 127.0.0.1 and free
ports, from the binaries :mod:`deltarec.testing.servers` finds).
"""

import os
from collections.abc import Iterator

import pytest

from deltarec.testing.servers import PostgresServer, RedisServer

# Keep torch from oversubscribing the CI machine's two cores in multi-rank tests.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    with PostgresServer() as server:
        yield server


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server
