"""Connecting to PostgreSQL: the store's schema is made once, whoever connects first."""

from __future__ import annotations

import threading
import time
import uuid

import psycopg

from deltarec.artifacts.types import TableSpec
from deltarec.stores import open_store

T = "sparse.ebc.item_id"


def _waiting_on_a_lock(admin: psycopg.Connection) -> int:
    row = admin.execute(
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE application_name = 'deltarec' AND wait_event_type = 'Lock'"
    ).fetchone()
    return int(row[0]) if row else 0


def test_a_store_connecting_while_another_rank_creates_its_schema_connects_and_shares_it(
    postgres_server,
):
    # Two ranks' CREATE SCHEMA IF NOT EXISTS at once: the second waits for the first's
    # and then fails on pg_namespace's unique index (IF NOT EXISTS is not atomic).
    schema = f"created_meanwhile_{uuid.uuid4().hex[:8]}"
    failures: list[BaseException] = []
    stores = []

    def connect() -> None:
        try:
            stores.append(open_store(f"{postgres_server.url}?schema={schema}", run="r"))
            stores[0].provision({T: TableSpec(dim=2)})
        except BaseException as e:  # asserted below
            failures.append(e)

    with psycopg.connect(postgres_server.url, autocommit=True) as admin:
        with psycopg.connect(postgres_server.url) as other:  # a transaction, held open
            other.execute(f"CREATE SCHEMA {schema}")
            rank = threading.Thread(target=connect)
            rank.start()
            deadline = time.monotonic() + 30
            while _waiting_on_a_lock(admin) == 0 and rank.is_alive():
                assert time.monotonic() < deadline, "the store never waited for the schema"
                time.sleep(0.02)
            other.commit()
        rank.join(timeout=60)
    try:
        assert failures == []
        assert T in stores[0].views()
    finally:
        for store in stores:
            store.close()
