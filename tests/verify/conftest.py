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

from deltarec.ids import make_version
from deltarec.stores import open_store
from deltarec.stores.base import Store


def base_generation(
    lineage: Lineage,
    store: Store,
    keys: np.ndarray | None = None,
    updated: np.ndarray | None = None,
    publish: bool = True,
) -> int:
    """:meth:`Lineage.first_generation` of ``keys`` and ``updated``, published unless told."""
    g = lineage.first_generation(keys, updated)
    if publish:
        lineage.publish(store, g)
    return g


def tamper(
    lineage: Lineage, store: Store, g: int, *, changed: int, deleted: int, stray: int | None = None
) -> None:
    """Break generation ``g`` in the store behind the publisher's back: emb key ``changed``
    gets another value, ``deleted`` is deleted, and ``stray`` (if given) is a row the lineage
    never wrote."""
    v1 = make_version(g, 1)
    bad = lineage.expected_row(lineage.T_EMB, np.array([changed]), 9.0)
    store.write(lineage.T_EMB, np.array([changed]), bad, np.zeros(1, np.int8), np.array([v1]))
    store.delete(lineage.T_EMB, np.array([deleted]), make_version(g, 0))
    if stray is not None:
        row = lineage.expected_row(lineage.T_EMB, np.array([stray]), 0.0)
        store.write(lineage.T_EMB, np.array([stray]), row, np.zeros(1, np.int8), np.array([v1]))


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
