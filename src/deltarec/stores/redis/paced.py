"""Redis writes that serving reads interleave with: a write's rows in small server-side units.

Redis runs one command at a time, and a ``MULTI``/``EXEC`` as one: every read of the serving
name waits for the whole transaction in flight. Under a read-latency budget
(:mod:`deltarec.publish.budget`) the store writes instead (``RedisStore.unit_rows`` set):

* each batch in **units** of ``unit_rows`` rows, each a transaction of its own: the server
  serves the other clients between two units, so a read waits for one unit at most, not for
  the write;
* upserts that no guard can refuse (no newer row, tombstone or floor: the conditions of
  :mod:`deltarec.stores.redis.plain`) go without the guard's script. Units of
  :data:`PLAIN_UNIT_ROWS` rows or more are written as that module writes a whole batch without
  a budget: decided under ``WATCH`` of every key the decision reads, then one
  ``MULTI``/``EXEC`` of plain ``HSET`` with the low and high marks (a writer that changes one
  of those keys between the decision and ``EXEC`` aborts the unit, and it is decided again),
  the next unit's decision asked in the same round trip. Smaller units are one script call each
  (:data:`LUA_PUT`: the same conditions checked by the script on the server, then ``HSET``),
  all of a batch's in one pipeline. A script unit costs the server about twice the CPU a row
  of the unthrottled write at every size (2.0-2.8x); a transaction unit about the same as it
  from 256 rows (1.1x) but a round trip each, which small units pay more for than the
  server's time: ``bench/bench_redis_units.py``, BENCHMARKS.md. Anything else, or a unit
  turned down, goes through the store's guarded write script
  (:data:`~deltarec.stores.redis.lua.LUA_WRITE`) in units of the same size;
* the progress mark last, alone, in the store's fenced ``MULTI``/``EXEC`` (a newer generation
  registered meanwhile refuses it), once every unit before it has been applied.

So a write that fails midway may leave some of its rows applied without its mark; the
publisher then writes them again from the last mark, and the guard makes that idempotent
(the same as a failure between two transactions). Marks, versions and what a reader can see
of a row are those of any write. The server's time for the units (``EXEC`` and ``EVALSHA``
microseconds in ``INFO commandstats``, all clients', so never less than the write's; two more
round trips a write) is what ``last_write_held_s`` reports while ``server_timing`` is set: the
budget sizes the units by it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import redis as redis_lib

from deltarec.faults import slowdown
from deltarec.stores.redis.lua import _LUA_COMMON, _LUA_WHERE, LUA_SPIN, pack_version, slow_commands
from deltarec.stores.redis.plain import Outranked, PlainBatch, PlainKeys, write_units
from deltarec.stores.redis.registry import ERRORS
from deltarec.stores.types import RowBatch, Write

MAX_UNIT_ROWS = 1000
"""Rows per unit at most (a script's ``HSET``: Lua's ``unpack`` takes about 8000 values)."""

PLAIN_UNIT_ROWS = 128
"""Units of at least this many rows are transactions decided under ``WATCH``; smaller ones are
script calls (see the module doc)."""

LUA_PUT = (
    _LUA_COMMON
    + _LUA_WHERE
    + """
-- KEYS: high mark, serves, floors, low marks, tombstones, serving name, parked name;
-- ARGV: table, run, the oldest and the newest version of the rows (8 bytes each), then field,
-- value, field, value ... (values: 8-byte version + row). The pairs are written as HSET if no
-- guard could refuse one of them (floor, newest row, newest tombstone: see redis/plain.py);
-- else nothing is written and -1 returned. Returns the rows written.
local high, lows, tomb, parked = KEYS[1], KEYS[4], KEYS[5], KEYS[7]
local live = where(KEYS[2], ARGV[1], ARGV[2], KEYS[6], parked)
local lh, ll = ver(ARGV[3])
local fh, fl = floor_of(KEYS[3], parked)
if not ge(lh, ll, fh, fl) then return -1 end
local existed = redis.call('EXISTS', live) == 1
local cur = redis.call('GET', high)
if cur then
  local l1, h1, l2, h2 = struct.unpack('<I4I4I4I4', cur)
  if not ge(lh, ll, h1, l1) or ge(h2, l2, lh, ll) then return -1 end
elseif existed or redis.call('EXISTS', tomb) == 1 then
  return -1
end
lower_low(lows, parked, existed, lh, ll)
for s = 5, #ARGV, 2 * PIECE do
  redis.call('HSET', live, unpack(ARGV, s, math.min(#ARGV, s + 2 * PIECE - 1)))
end
local hh, hl = ver(ARGV[4])
raise_high(high, not cur, hh, hl, nil, nil)
return (#ARGV - 4) / 2
"""
)
"""One unit of upserts no guard can refuse (see the module doc)."""


def apply_paced(store: Any, write: Write, unit_rows: int) -> int:
    """``store.apply(write)`` as units of ``unit_rows`` rows (see the module doc); rows applied.

    Args:
        store: the :class:`~deltarec.stores.redis.store.RedisStore`.
        write: the write.
        unit_rows: rows per server-side unit (at most :data:`MAX_UNIT_ROWS`).
    """
    table, batches, mark, stage = write
    unit = max(1, min(MAX_UNIT_ROWS, int(unit_rows)))
    timing = store.server_timing
    before = server_usec(store._client) if timing else None
    total = 0
    for batch in _nonempty(batches):
        queue, n, plain = store._prepared(table, batch, None, stage, unit)
        with ERRORS.map_errors(store.describe()):
            if plain is None or not _put(store, plain, unit):
                pipe = store._client.pipeline(transaction=False)
                queue(pipe)  # the guarded script, a unit at a time; idempotent after a put
                pipe.execute()
        total += n
    if mark is not None:
        store.record_progress(mark)  # alone, fenced, after every unit
    after = server_usec(store._client) if timing else None
    held = None if before is None or after is None else max(0, after - before) / 1e6
    store.last_write_held_s = held
    return total


def _nonempty(batches: Iterable[RowBatch]) -> Iterable[RowBatch]:
    return (b for b in batches if len(b.keys))


def _put(store: Any, plain: PlainBatch, unit: int) -> bool:
    """Write ``plain`` a unit at a time without the guard's script; False: a unit turned down.

    A unit turned down wrote nothing; the caller writes the whole batch guarded, and the units
    that landed land again, unchanged. See the module doc.
    """
    if unit < PLAIN_UNIT_ROWS:
        return _put_scripts(store, plain)
    keys: PlainKeys = store._plain_keys(plain.run, plain.table, None)
    try:  # the slow point (a fault): the server waits inside each unit's transaction
        return write_units(store._client, keys, plain, slow_commands)
    except Outranked:
        return False


def _put_scripts(store: Any, plain: PlainBatch) -> bool:
    """Send ``plain``'s units as :data:`LUA_PUT` calls in one pipeline; False: one was refused.

    A unit refused by its guard wrote nothing; the caller writes the whole batch guarded (the
    units that landed land again, unchanged).
    """
    keys: PlainKeys = store._plain_keys(plain.run, plain.table, None)
    head = [
        keys.high, keys.serves, keys.floors, keys.lows, keys.tomb, keys.serving, keys.parked,
        plain.table, plain.run, pack_version(plain.lowest), pack_version(plain.highest),
    ]  # fmt: skip
    for attempt in range(2):
        sha = getattr(store, "_put_sha", None)
        if sha is None:
            sha = store._put_sha = store._client.script_load(LUA_PUT)
        try:
            return _send_units(store._client, sha, head, plain)
        except redis_lib.exceptions.NoScriptError:  # the server's scripts were flushed
            store._put_sha = None
            if attempt:
                raise
    return False


def _send_units(client: Any, sha: str, head: list[Any], plain: PlainBatch) -> bool:
    pool = client.connection_pool
    conn = pool.get_connection()
    try:
        prefix = b"".join(conn.pack_command("EVALSHA", sha, 7, *head))
        first_line = prefix.index(b"\r\n") + 2  # '*<count>\r\n': the count grows with the rows
        rest = prefix[first_line:]
        pieces: list[Any] = []
        spin = slowdown("redis.exec")
        spin_sha = client.script_load(LUA_SPIN) if spin > 0 else None  # timed as EVALSHA
        for fields, pairs in plain.bodies:
            pieces += [b"*%d\r\n" % (3 + len(head) + 2 * fields), rest, pairs]
            if spin > 0:  # the slow point: the server waits inside the write, per unit
                usec = int(spin * len(pairs))  # seconds per MB times bytes, in microseconds
                pieces += conn.pack_command("EVALSHA", spin_sha, 0, usec)
        conn.send_packed_command(pieces, check_health=False)
        landed = True
        for _ in plain.bodies:
            if int(conn.read_response()) < 0:
                landed = False
            if spin > 0:
                conn.read_response()
        return landed
    except BaseException:
        conn.disconnect()  # replies may be left unread: the connection starts again
        raise
    finally:
        pool.release(conn)


def server_usec(client: Any) -> int | None:
    """The server's microseconds in ``EXEC`` (what ran inside too) and ``EVALSHA``, or None."""
    try:
        stats: Any = client.info("commandstats")
        return sum(int(stats.get(f"cmdstat_{c}", {}).get("usec", 0)) for c in ("exec", "evalsha"))
    except (redis_lib.RedisError, TypeError, ValueError):
        return None


def fsync_stall(client: Any) -> str | None:
    """Why this server's reads can stall whatever a read budget does, or None.

    A server that fsyncs its append-only file (``appendfsync everysec``, Redis's default, or
    ``always``) makes the writes of the file, which its one command thread does, wait for the
    file system now and then: every client waits with them (tens of ms measured; see
    docs/publish.md). None where the file is off or never fsynced, or where ``CONFIG`` is
    refused (a managed server may rename it).
    """
    try:
        conf: Any = client.config_get("append*")
    except redis_lib.RedisError:
        return None
    got = {_text(k): _text(v) for k, v in conf.items()}
    fsync = got.get("appendfsync", "no")
    if got.get("appendonly") != "yes" or fsync == "no":
        return None
    return (
        f"the server fsyncs its append-only file (appendfsync {fsync}): its writes of the file "
        "can hold every reader for tens of ms whatever the budget (appendfsync no avoids it; "
        "docs/publish.md)"
    )


def _text(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)
