"""Suite-wide test configuration and the one set of server fixtures.

Area fixtures live in each tests/<area>/conftest.py. The PostgreSQL and Redis servers are
session-wide and defined here only, so a full run starts one of each (on 127.0.0.1 and free
ports, from the binaries :mod:`deltarec.testing.servers` finds).

Every test that starts a server (it uses one of :data:`SERVER_FIXTURES`, or a backend
parameter named in :data:`SERVER_PARAMS`) is marked ``integration`` at collection, so
``make test-fast`` (``-m "not multiprocess and not integration"``) starts none.
"""

import os
from collections.abc import Iterator

import pytest

from deltarec.testing.servers import PostgresServer, RedisServer, SeaweedServer

SERVER_FIXTURES = frozenset({"postgres_server", "redis_server", "s3_server", "s3_uri", "s3_root"})
"""Fixtures that start a real server (PostgreSQL, Redis, an S3-compatible SeaweedFS server)."""
SERVER_PARAMS = frozenset({"postgres", "redis"})
"""Backend parameters (``backend``, ``any_backend``, ``store_url``, ...) served by a real server."""


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        callspec = getattr(item, "callspec", None)
        params = callspec.params.values() if callspec is not None else ()
        if fixtures & SERVER_FIXTURES or {p for p in params if isinstance(p, str)} & SERVER_PARAMS:
            item.add_marker(pytest.mark.integration)


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


@pytest.fixture(scope="session")
def s3_server() -> Iterator[SeaweedServer]:
    """A real S3-compatible object store (SeaweedFS); each test makes its own bucket."""
    with SeaweedServer() as server:
        yield server


_RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _no_rendezvous_left_behind(request) -> Iterator[None]:
    """A test that trains in this process (``deltarec train`` without torchrun) sets the rank
    variables and opens a process group; both stay for the tests after it, whose ``deltarec
    train`` children would then take themselves for ranks of a rendezvous on that port. Fail
    the test that leaves them, and put the process back as it was."""
    before = {k: os.environ.get(k) for k in _RANK_ENV}
    yield
    import sys

    left = [k for k in _RANK_ENV if os.environ.get(k) != before[k]]
    for k in left:
        if before[k] is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = before[k]  # type: ignore[assignment]
    dist = sys.modules.get("torch.distributed")
    group = dist is not None and dist.is_available() and dist.is_initialized()
    if group:
        dist.destroy_process_group()
    if left or group:
        pytest.fail(
            f"{request.node.nodeid} left rank variables {left} or a process group behind",
            pytrace=False,
        )
