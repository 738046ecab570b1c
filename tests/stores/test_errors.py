"""The one error-mapping helper every backend uses (``deltarec.stores.errors``)."""

from __future__ import annotations

import sqlite3

import psycopg
import pytest
import redis

from deltarec.errors import BadInputError, StoreError, StoreUnavailableError
from deltarec.stores.errors import DriverErrors
from deltarec.stores.redis import store as redis_store
from deltarec.stores.sql import postgres, sqlite

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


@pytest.mark.parametrize(
    ("raised", "transient", "advice"),
    [
        (RuntimeError("Throttling.User: Request was denied due to user flow control"), True, ""),
        (RuntimeError("HTTP 503 ServiceUnavailable"), True, ""),
        (ConnectionResetError("connection reset by peer"), True, ""),
        (RuntimeError("SecurityTokenExpired: the token has expired"), True, ""),
        (RuntimeError("HTTP 403 Forbidden: InvalidAccessKeyId"), False, "authentication failed"),
        (ValueError("field embedding: expected ARRAY<FLOAT>"), False, "does not fit the view"),
        (RuntimeError("something else"), False, None),
    ],
)
def test_featurestore_sdk_errors_are_retried_or_say_what_to_fix(raised, transient, advice):
    from deltarec.errors import ViewMismatchError
    from deltarec.stores.featurestore.sdk import sdk_error

    mapped = sdk_error(raised, "featurestore view p/v table t")
    assert isinstance(mapped, StoreUnavailableError) is transient
    assert str(mapped).startswith(f"featurestore view p/v table t: {type(raised).__name__}: ")
    if advice is None:
        assert type(mapped) is StoreError and str(mapped).endswith("something else")
    elif advice:
        assert type(mapped) is StoreError and advice in str(mapped)
    own = ViewMismatchError("p/v", "ARRAY<FLOAT>", "ARRAY<UINT8>")
    assert sdk_error(own, "anywhere") is own  # deltarec's own errors pass unchanged
