"""A Redis view's rows, read with plain ``HSCAN`` steps parsed by hiredis on the client.

``verify --all`` reads every row of a view once (:meth:`RedisStore.scan_rows
<deltarec.stores.redis.store.RedisStore.scan_rows>`). The scan script
(:data:`~deltarec.stores.redis.lua.LUA_SCAN`) packs each ``HSCAN`` step into three strings on
the server, so the client decodes them with numpy, but the server's Lua turns every field and
value into a Lua string first: about 0.8-0.9 s of server CPU per 500k rows of dim 64, where a
plain ``HSCAN`` costs it 0.56 s. redis-py parses a plain reply of 2 objects per row in Python
(about as long again on the client); hiredis parses it in C. So with hiredis installed (the
``redis`` extra brings it) a scan with rows goes here; without it, through the script.

A step is one ``MULTI``/``EXEC``: the run's live view is found (``HGET`` of the serving names'
record, as the script's ``target()`` does) and the ``HSCAN`` step read in one atomic
transaction. The name the ``HSCAN`` used is a guess (the one found by the step before); a step
whose guess turns out wrong (a promote moved the view in between) is read again from the
same cursor under the right name: ``RENAME`` keeps a hash's table, so its cursor goes on.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import redis as redis_lib

from deltarec.errors import StoreError


def hscan_rows(
    client: redis_lib.Redis,
    target: list[str],
    table: str,
    run: str,
    count: int,
    width: int,
    where: str,
) -> Iterator[tuple[np.ndarray, bytes]]:
    """Every field of a hash as int64 keys, with its values concatenated, an ``HSCAN`` step each.

    Args:
        client: the store's client (a pool connection is taken per step).
        target: ``[hash]``, or ``["", serves, serving name, parked name]``: the live view of
            ``run`` of ``table`` wherever it is at each step (see the module doc).
        table: the table (with a four-name ``target``).
        run: the run whose live view (with a four-name ``target``).
        count: the ``COUNT`` of each step.
        width: bytes of every value.
        where: the store, for messages.

    Yields:
        ``(keys, values)``: the step's keys and its values, ``width`` bytes each, in the same
        order (steps that return nothing are skipped).

    Raises:
        StoreError: a field is not a decimal key, or a value is not ``width`` bytes.
        redis.RedisError: from the server or the connection.
    """
    live = target[0] == ""
    guess = target[2] if live else target[0]
    cursor: Any = b"0"
    while True:
        commands: list[tuple[Any, ...]] = [("HSCAN", guess, cursor, "COUNT", count)]
        if live:
            commands = [("MULTI",), ("HGET", target[1], table), *commands, ("EXEC",)]
        replies = _send(client, commands)
        if live:
            owner, step = replies[-1]
            name = target[2] if owner is not None and _text(owner) == run else target[3]
            if name != guess:
                guess = name
                continue  # moved by a promote: the same step again under its name
        else:
            step = replies[0]
        cursor, page = step
        if page:
            fields, values = page[0::2], page[1::2]
            yield _keys(fields, guess, where), _values(fields, values, width, guess, where)
        if int(cursor) == 0:
            return


def _send(client: redis_lib.Redis, commands: list[tuple[Any, ...]]) -> list[Any]:
    """Send ``commands`` at once on a pool connection; their replies (errors raised)."""
    pool = client.connection_pool
    conn = pool.get_connection()
    try:
        conn.send_packed_command(conn.pack_commands(commands))
        replies = [conn.read_response() for _ in commands]
    except BaseException:
        conn.disconnect()  # a reply may be left unread: the connection starts again
        raise
    finally:
        pool.release(conn)
    if commands[0][0] == "MULTI":  # errors inside EXEC come back as values
        for reply in replies[-1]:
            if isinstance(reply, redis_lib.ResponseError):
                raise reply
    return replies


def _keys(fields: list[bytes], name: str, where: str) -> np.ndarray:
    keys = np.fromstring(b",".join(fields), dtype=np.int64, sep=",")  # exact int64 parsing
    if len(keys) != len(fields):
        raise StoreError(f"{where}: a field of {name} is not a key")
    return keys


def _values(fields: list[bytes], values: list[bytes], width: int, name: str, where: str) -> bytes:
    if set(map(len, values)) != {width}:
        at = next(i for i, v in enumerate(values) if len(v) != width)
        raise StoreError(
            f"{where}: field {_text(fields[at])} of {name} holds {len(values[at])} bytes, "
            f"not {width}"
        )
    return b"".join(values)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
