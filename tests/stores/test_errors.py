"""The one error-mapping helper every backend uses (``deltarec.stores.errors``)."""

from __future__ import annotations

import sqlite3

import psycopg
import pytest
import redis

from deltarec.errors import BadInputError, StoreError, StoreUnavailableError
from deltarec.stores import postgres, sqlite
from deltarec.stores import redis as redis_store
from deltarec.stores.errors import DriverErrors

ERRORS = DriverErrors((ConnectionError, ValueError), lambda e: isinstance(e, ConnectionError))


def test_a_transient_driver_error_becomes_store_unavailable_naming_place_and_cause():
    cause = ConnectionError("reset by peer")
    with pytest.raises(StoreUnavailableError) as info, ERRORS.map_errors("redis://h:1/0"):
        raise cause
    assert str(info.value) == "redis://h:1/0: ConnectionError: reset by peer"
    assert info.value.__cause__ is cause


def test_any_other_driver_error_becomes_a_store_error_that_is_not_retried():
    with pytest.raises(StoreError) as info, ERRORS.map_errors("sqlite:///x.db"):
        raise ValueError("no such table: t")
    assert not isinstance(info.value, StoreUnavailableError)
    assert str(info.value) == "sqlite:///x.db: ValueError: no such table: t"


def test_errors_that_are_not_the_drivers_pass_through_unchanged():
    own = BadInputError("table 't' is not provisioned")
    with pytest.raises(BadInputError) as info, ERRORS.map_errors("somewhere"):
        raise own
    assert info.value is own
    with pytest.raises(KeyError), ERRORS.map_errors("somewhere"):
        raise KeyError("k")


@pytest.mark.parametrize(
    ("errors", "transient", "permanent"),
    [
        (
            sqlite._ERRORS,
            sqlite3.OperationalError("database is locked"),
            sqlite3.OperationalError("no such table: emb_t"),
        ),
        (
            postgres._ERRORS,
            psycopg.errors.DeadlockDetected("deadlock detected"),
            psycopg.errors.UndefinedTable('relation "emb_t" does not exist'),
        ),
        (
            redis_store._ERRORS,
            redis.ConnectionError("Connection refused"),
            redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind"),
        ),
    ],
    ids=["sqlite", "postgres", "redis"],
)
def test_each_backend_says_which_of_its_drivers_errors_a_retry_can_fix(
    errors, transient, permanent
):
    assert isinstance(errors.store_error("here", transient), StoreUnavailableError)
    mapped = errors.store_error("here", permanent)
    assert type(mapped) is StoreError
    assert str(mapped).startswith(f"here: {type(permanent).__name__}: ")
