"""Fixtures of the replica tests: generations written with the artifacts API, a SQLite store.

``Outbox`` (a :class:`tests._helpers.artifacts.Lineage`) commits dumps through
:func:`deltarec.artifacts.write_dump` and publishes them with the real publisher, so the replica
follows what a trainer's outbox holds and promote/rollback run against a real store.
"""

from __future__ import annotations

import numpy as np
import pytest
from tests._helpers.artifacts import RUN, T_EMB, T_ZCH, Lineage, sqlite_url_in, values

from deltarec.stores import open_store

__all__ = ["RUN", "T_EMB", "T_ZCH", "Outbox", "values"]


class Outbox(Lineage):
    """A :class:`~tests._helpers.artifacts.Lineage` with the replica tests' first generation."""

    def first_generation(self) -> int:
        """Generation 1: a snapshot of emb keys 0..49 and ZCH ids, then a delta."""
        return super().first_generation(np.arange(50), zch_keys=np.array([-1, 3, 7, 11]))


@pytest.fixture
def outbox(tmp_path) -> Outbox:
    return Outbox.under(tmp_path)


@pytest.fixture
def store_url(tmp_path) -> str:
    return sqlite_url_in(tmp_path)


@pytest.fixture
def store(store_url, outbox):
    with open_store(store_url, outbox.root.uri, run=RUN) as s:
        yield s
