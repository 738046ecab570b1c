"""Fixtures for verify/promote/rollback tests: generations written with the artifacts API.

``lineage`` (a :class:`tests._helpers.artifacts.Lineage`) writes generations and dumps with
:func:`deltarec.artifacts.write_dump` (shards, then the manifest last, as the dumper commits)
and publishes them with :class:`~deltarec.publish.DumpPublisher` itself, so these tests need
neither torch nor a training run, and what they verify is what the publisher writes.
"""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
from tests._helpers.artifacts import RUN, Lineage, sqlite_url_in

from deltarec.artifacts import DumpKind
from deltarec.stores import open_store
from deltarec.stores.base import Store

ZCH_KEYS = np.array([-1, 3, 7, 11, 19], np.int64)


def base_generation(
    lineage: Lineage,
    store: Store,
    keys: np.ndarray | None = None,
    updated: np.ndarray | None = None,
    publish: bool = True,
) -> int:
    """A first generation: a snapshot of emb ``keys`` (0..99) and ``ZCH_KEYS``, then a delta
    updating emb ``updated`` (0..9) and ZCH id -1 and evicting id 7; published unless told."""
    g = lineage.generation()
    snapshot = np.arange(100) if keys is None else keys
    lineage.dump(
        g,
        0,
        {lineage.T_EMB: (snapshot, 0.0), lineage.T_ZCH: (ZCH_KEYS, 0.0)},
        kind=DumpKind.SNAPSHOT,
    )
    delta = np.arange(10) if updated is None else updated
    lineage.dump(
        g,
        1,
        {
            lineage.T_EMB: (delta, 1.0),
            lineage.T_ZCH: (np.array([-1, 7]), 1.0, np.array([0, 1])),
        },
    )
    if publish:
        lineage.publish(store, g)
    return g


@pytest.fixture
def lineage(tmp_path) -> Lineage:
    return Lineage.under(tmp_path)


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return sqlite_url_in(tmp_path)


@pytest.fixture(params=["sqlite", "postgres", "redis"])
def store_url(request, sqlite_url) -> str:
    """A fresh, empty store of each backend (a schema / key prefix of its own per test)."""
    name = f"t{uuid.uuid4().hex[:10]}"
    if request.param == "sqlite":
        return sqlite_url
    if request.param == "postgres":
        return f"{request.getfixturevalue('postgres_server').url}?schema={name}"
    return f"{request.getfixturevalue('redis_server').url}?prefix={name}:"


def _opened(url: str) -> Iterator[Store]:
    """The store at ``url`` for the run, closed after the test."""
    with open_store(url, run=RUN) as s:
        yield s


@pytest.fixture
def store(store_url) -> Iterator[Store]:
    yield from _opened(store_url)


@pytest.fixture
def sqlite_store(sqlite_url) -> Iterator[Store]:
    yield from _opened(sqlite_url)


@pytest.fixture
def raw_sqlite(sqlite_url):
    """A second, raw connection to the SQLite store file (to tamper behind the store's back)."""
    conn = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"), isolation_level=None)
    try:
        yield conn
    finally:
        conn.close()
