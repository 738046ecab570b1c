"""A batch of upserts that no guard can refuse, written as plain ``HSET`` in one MULTI/EXEC.

The version guard of the Redis store's write script (:data:`~deltarec.stores.redis.lua.LUA_WRITE`)
refuses an upsert only if the view's floor, the key's row or the key's tombstone is newer. A
live view's **high mark** (``<prefix>~high:<run>:<table>``, see
:data:`~deltarec.stores.redis.lua.LUA_WRITE`'s ``raise_high``) holds the newest version of any of
its rows and of any of its tombstones. So a batch of upserts whose oldest version is

* not below the floor,
* not below the newest row (a row of equal version is replaced by the guard too),
* above the newest tombstone,

lands whole under the guard, and is written here as multi-field ``HSET`` commands
(:func:`~deltarec.stores.redis.resp.hset_bodies`), which the server applies at about half
the CPU of the
script. Without a high mark the same holds of a view that has neither rows nor tombstones yet.
The decision is made under ``WATCH`` of every key it reads (the high mark, the serving names'
record, the floors, the run's newest generation and, for a view without a mark, the view and
its tombstones), so a writer that changes one of them between the check and ``EXEC`` aborts the
transaction and the batch is decided again. The transaction also lowers the view's low mark (a
small script queued before the rows), raises the high mark and writes the progress mark.

Anything else (deletes, staging views, older or tombstoned rows, a view written before high
marks were kept) goes through the guarded script, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis as redis_lib

from deltarec.stores.redis.lua import LUA_LOWER, pack_high, pack_version, unpack_high
from deltarec.stores.redis.resp import hset_commands

_RETRIES = 20


@dataclass(frozen=True)
class PlainKeys:
    """The Redis keys a plain write reads and writes (all names of one run's live view)."""

    high: str
    serves: str
    floors: str
    lows: str
    tomb: str
    serving: str
    parked: str
    newest: str | None
    """The run's newest-generation key when the batch carries a progress mark (the fence)."""


@dataclass(frozen=True)
class PlainBatch:
    """A batch of upserts to one live view, encoded."""

    table: str
    run: str
    lowest: int
    """The oldest version of the batch."""
    highest: int
    """The newest version of the batch."""
    bodies: list[tuple[int, memoryview]]
    """The ``HSET`` commands' field-value pairs (see ``resp.hset_bodies``)."""


class Outranked(Exception):
    """The batch may meet a newer row or tombstone: it must go through the guarded script."""


def write_plain(
    client: redis_lib.Redis,
    keys: PlainKeys,
    batch: PlainBatch,
    extra: list[tuple[Any, ...]],
    generation: int | None,
) -> int | None:
    """Write ``batch`` as plain ``HSET``, if no guard could refuse it; see the module doc.

    Args:
        client: the store's client (a connection is taken from its pool).
        keys: the keys of the batch's view.
        batch: the rows.
        extra: commands queued after the rows in the same transaction (the progress mark).
        generation: the mark's generation, checked against ``keys.newest``.

    Returns:
        The newest generation registered if it is newer than ``generation`` (nothing was
        written: the caller raises), else None once written.

    Raises:
        Outranked: the batch must be written with the guard (nothing was written).
        redis.RedisError: from the server or the connection.
    """
    pool = client.connection_pool
    conn = pool.get_connection()
    try:
        for _ in range(_RETRIES):
            newest = _watch(conn, keys)
            if newest is not None and generation is not None and newest > generation:
                _command(conn, "UNWATCH")
                return newest
            live, high = _decide(conn, keys, batch)
            if _transaction(conn, keys, batch, live, high, extra):
                return None
        raise Outranked(f"{keys.high} kept moving")
    except BaseException:
        conn.disconnect()  # a reply may be left unread: the connection starts again
        raise
    finally:
        pool.release(conn)


def _command(conn: Any, *args: Any) -> Any:
    conn.send_command(*args)
    return conn.read_response()


def write_units(
    client: redis_lib.Redis,
    keys: PlainKeys,
    batch: PlainBatch,
    extra: Callable[[int], list[tuple[Any, ...]]],
) -> bool:
    """Write each of ``batch``'s bodies as a transaction of its own (a read budget's units).

    Each is decided as :func:`write_plain` decides a batch, under ``WATCH``. The next unit's
    ``WATCH`` and reads go in the same round trip as the transaction before it, and serve to
    decide it again if a ``WATCH`` fired. ``keys`` carries no progress mark (``keys.newest``
    None): the units' mark is written after them.

    Args:
        client: the store's client (a connection is taken from its pool).
        keys: the keys of the batch's view.
        batch: the rows, a unit a body.
        extra: the commands queued after a unit's rows in its transaction, given the unit's
            bytes (the slow point of :mod:`deltarec.faults`).

    Returns:
        True once every unit is written; False if a unit may meet a newer row or tombstone:
        it and the units after it were not written (the units before it were).

    Raises:
        Outranked: the view's marks kept moving under a unit.
        redis.RedisError: from the server or the connection.
    """
    pool = client.connection_pool
    conn = pool.get_connection()
    watch = ("WATCH", *_watched(keys))
    follow = [watch, *_reads(keys, batch.table)]
    try:
        conn.send_packed_command(conn.pack_commands(follow))
        conn.read_response()  # the WATCH's +OK; the reads are the first unit's decision
        done = tries = 0
        while done < len(batch.bodies):
            body = batch.bodies[done]
            unit = PlainBatch(batch.table, batch.run, batch.lowest, batch.highest, [body])
            try:
                live, high = _judged(conn, keys, unit)
            except Outranked:
                return False
            landed = _transaction(conn, keys, unit, live, high, extra(len(body[1])), follow)
            conn.read_response()  # the next WATCH's +OK
            done, tries = (done + 1, 0) if landed else (done, tries + 1)
            if tries == _RETRIES:
                raise Outranked(f"{keys.high} kept moving")
        for _ in follow[1:]:
            conn.read_response()  # the reads asked after the last unit, unused
        _command(conn, "UNWATCH")
        return True
    except BaseException:
        conn.disconnect()  # a reply may be left unread: the connection starts again
        raise
    finally:
        pool.release(conn)


def _watched(keys: PlainKeys) -> list[str]:
    """The marks a decision reads, WATCHed before it reads them."""
    return [keys.high, keys.serves, keys.floors, *([keys.newest] if keys.newest else [])]


def _reads(keys: PlainKeys, table: str) -> list[tuple[Any, ...]]:
    """The reads a decision is made of (see :func:`_judged`)."""
    return [("GET", keys.high), ("HGET", keys.serves, table), ("HGET", keys.floors, keys.parked)]


def _watch(conn: Any, keys: PlainKeys) -> int | None:
    """WATCH the marks a decision reads; the run's newest generation (None: none or no mark)."""
    _command(conn, "WATCH", *_watched(keys))
    if keys.newest is None:
        return None
    raw = _command(conn, "GET", keys.newest)
    return None if raw is None else int(raw)


def _decide(conn: Any, keys: PlainKeys, batch: PlainBatch) -> tuple[str, bytes | None]:
    """The live view's hash and its high mark, if the batch lands whole under the guard.

    Everything read is watched. Raises :class:`Outranked` (unwatched) otherwise.
    """
    conn.send_packed_command(conn.pack_commands(_reads(keys, batch.table)))
    return _judged(conn, keys, batch)


def _judged(conn: Any, keys: PlainKeys, batch: PlainBatch) -> tuple[str, bytes | None]:
    """:func:`_decide` on the replies of its reads, already asked (in order)."""
    high, serves, floor = conn.read_response(), conn.read_response(), conn.read_response()
    live = keys.serving if serves is not None and _text(serves) == batch.run else keys.parked
    if floor is not None and int.from_bytes(floor, "little", signed=True) > batch.lowest:
        raise _outranked(conn)
    if high is None:
        _command(conn, "WATCH", live, keys.tomb)
        if _command(conn, "EXISTS", live, keys.tomb):
            raise _outranked(conn)
        return live, None
    rows, tombstones = unpack_high(high)
    if rows > batch.lowest or tombstones >= batch.lowest:
        raise _outranked(conn)
    return live, high


def _outranked(conn: Any) -> Outranked:
    _command(conn, "UNWATCH")
    return Outranked()


def _transaction(
    conn: Any,
    keys: PlainKeys,
    batch: PlainBatch,
    live: str,
    high: bytes | None,
    extra: list[tuple[Any, ...]],
    then: Sequence[tuple[Any, ...]] = (),
) -> bool:
    """MULTI, the low mark, the rows, the high mark, ``extra``, EXEC. False: a WATCH fired.

    The high mark is set only where it rises: a set of an equal value would abort the watch of
    another writer of the view (another rank's part of the same dump). ``then``: commands sent
    after EXEC in the same round trip, their replies left unread.
    """
    before = [
        ("MULTI",),
        ("EVAL", LUA_LOWER, 2, keys.lows, live, keys.parked, pack_version(batch.lowest)),
    ]
    rows_high, tombstones = unpack_high(high) if high is not None else (0, 0)
    raised = pack_high(max(rows_high, batch.highest), tombstones)
    mark = [("SET", keys.high, raised)] if raised != high else []
    after = [*mark, *extra, ("EXEC",)]
    rows = hset_commands(live.encode(), batch.bodies)
    conn.send_packed_command(
        [*conn.pack_commands(before), *rows, *conn.pack_commands([*after, *then])],
        check_health=False,
    )
    queued = len(before) + len(batch.bodies) + len(after) - 1
    for _ in range(queued):
        conn.read_response()  # +OK, then +QUEUED each (a malformed command raises here)
    replies = conn.read_response()
    if replies is None:
        return False
    for reply in replies:
        if isinstance(reply, redis_lib.ResponseError):
            raise reply
    return True


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
