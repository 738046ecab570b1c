"""The Lua scripts of the Redis store, and the stored value format they share.

Every value of a live view or a tombstone hash starts with the row's version as 8 bytes,
little-endian (:func:`pack_version`); a live view's value goes on with the encoded row, a
staging view's with one op byte (``0``/``1``) and then the row. Versions compare as
``(high 32 bits, low 32 bits)``: Lua 5.1 numbers are doubles, so an int64 is read as two
uint32 halves.

Each script runs atomically on the server and is version-guarded, so running one again after
a failure changes nothing more: the store's batches, sweeps and merges rely on that. The
``KEYS`` and ``ARGV`` each script takes are written at its head. Keys and fields travel as
one string (decimal keys joined by ``,``) and rows as one blob each way, and a script reads
and writes a hash with one ``HMGET``/``HSET`` per 1000 fields, not one call per row: the
client encodes and decodes whole batches with numpy, and the server runs few commands. Scans
(``HSCAN``) run inside the scripts, so a sweep or a merge sends nothing back but a cursor.
Used by :mod:`deltarec.stores.redis.store`.
"""

from __future__ import annotations

import struct
from typing import Any

from deltarec.faults import slowdown

_LUA_COMMON = """
local function ver(s) local lo, hi = struct.unpack('<I4I4', s); return hi, lo end
local function ge(ah, al, bh, bl) return ah > bh or (ah == bh and al >= bl) end
local function floor_of(floors, view)
  local f = redis.call('HGET', floors, view)
  if f then return ver(f) end
  return 0, 0
end
-- Lua's unpack takes about 8000 values: hash commands go in pieces of 1000 fields
local PIECE = 1000
local function hmget(h, fields)
  local out = {}
  for s = 1, #fields, PIECE do
    local got = redis.call('HMGET', h, unpack(fields, s, math.min(#fields, s + PIECE - 1)))
    for j = 1, #got do out[s + j - 1] = got[j] end
  end
  return out
end
local function hset(h, pairs)  -- pairs: field, value, field, value, ...
  for s = 1, #pairs, 2 * PIECE do
    redis.call('HSET', h, unpack(pairs, s, math.min(#pairs, s + 2 * PIECE - 1)))
  end
end
local function hdel(h, fields)
  for s = 1, #fields, PIECE do
    redis.call('HDEL', h, unpack(fields, s, math.min(#fields, s + PIECE - 1)))
  end
end
local function split(text)
  local out = {}
  for f in string.gmatch(text, '[^,]+') do out[#out + 1] = f end
  return out
end
-- A live view's low mark (hash lows, field: the view's floor field) is a version no row of the
-- view is below: every write that lands lowers it, a completed sweep raises it. It is absent
-- for a view that held rows before it was kept; a sweep then scans the view.
local function lower_low(lows, field, existed, h, l)
  if not h then return end
  local cur = redis.call('HGET', lows, field)
  if cur then
    local ch, cl = ver(cur)
    if ge(h, l, ch, cl) then return end
  elseif existed then return end
  redis.call('HSET', lows, field, struct.pack('<I4I4', l, h))
end
-- A live view's high mark (key KEYS[9] of a write or merge, 16 bytes) is the newest version of
-- any row of the view and of any of its tombstones (0: none): a batch of upserts none older
-- than the first and newer than the second cannot be refused by any guard, and is written as
-- plain HSET by the client (deltarec.stores.redis.plain). Every write that lands raises it; it
-- is absent for a view that held rows or tombstones before it was kept (then never written).
local function raise_high(high, known, rh, rl, th, tl)
  if not rh and not th then return end
  local cur = redis.call('GET', high)
  local ah, al, bh, bl = 0, 0, 0, 0
  if cur then
    local l1, h1, l2, h2 = struct.unpack('<I4I4I4I4', cur)
    ah, al, bh, bl = h1, l1, h2, l2
  elseif not known then return end
  local nh, nl, mh, ml = ah, al, bh, bl
  if rh and not ge(ah, al, rh, rl) then nh, nl = rh, rl end
  if th and not ge(bh, bl, th, tl) then mh, ml = th, tl end
  if cur and nh == ah and nl == al and mh == bh and ml == bl then return end
  redis.call('SET', high, struct.pack('<I4I4I4I4', nl, nh, ml, mh))
end
-- Apply rows (distinct keys) to a live view: values[i] (8-byte version + row), ops[i]
-- ('0'/'1'). An upsert lands if it is not older than the row held and no tombstone is newer;
-- a delete keeps the newest tombstone and removes a row that is not newer. The view and the
-- tombstones are read once per piece (HMGET; the tombstones only if there are any) and
-- written once (HSET/HDEL of many fields); the low and high marks follow. Returns the rows
-- that changed the view.
local function apply_rows(live, tomb, lows, field, high, keys, values, ops)
  local existed = redis.call('EXISTS', live) == 1
  local cur = {}
  if existed then cur = hmget(live, keys) end
  local buried_before = redis.call('EXISTS', tomb) == 1
  local tombs = {}
  if buried_before then tombs = hmget(tomb, keys) end
  local sets, dels, buried = {}, {}, {}
  local lowh, lowl, toph, topl, tombh, tombl
  for i = 1, #keys do
    local key, value = keys[i], values[i]
    local vh, vl = ver(value)
    local c, t = cur[i], tombs[i]
    local newer = true
    if c then local ch, cl = ver(c); newer = ge(vh, vl, ch, cl) end
    if ops[i] == '1' then
      local bury = true
      if t then local th, tl = ver(t); bury = ge(vh, vl, th, tl) end
      if bury then
        buried[#buried + 1] = key; buried[#buried + 1] = string.sub(value, 1, 8)
        if not tombh or ge(vh, vl, tombh, tombl) then tombh, tombl = vh, vl end
      end
      if newer and c then dels[#dels + 1] = key end
    elseif newer then
      local dead = false
      if t then local th, tl = ver(t); dead = ge(th, tl, vh, vl) end
      if not dead then
        sets[#sets + 1] = key; sets[#sets + 1] = value
        if not lowh or ge(lowh, lowl, vh, vl) then lowh, lowl = vh, vl end
        if not toph or ge(vh, vl, toph, topl) then toph, topl = vh, vl end
      end
    end
  end
  hset(live, sets); hdel(live, dels); hset(tomb, buried)
  lower_low(lows, field, existed, lowh, lowl)
  raise_high(high, not existed and not buried_before, toph, topl, tombh, tombl)
  return #sets / 2 + #dels
end
"""

_LUA_WHERE = """
-- a run's live view is the table's serving name while the run serves it, else its parked name
local function where(serves, tbl, run, serving, parked)
  if redis.call('HGET', serves, tbl) == run then return serving end
  return parked
end
-- KEYS[1] a hash; or '' and KEYS[2..4] = serves, serving name, parked name: the live view of
-- run ARGV[2] of table ARGV[1] wherever it is now (a promote may move it between two calls)
local function target()
  if KEYS[1] == '' then return where(KEYS[2], ARGV[1], ARGV[2], KEYS[3], KEYS[4]) end
  return KEYS[1]
end
-- one HSCAN step of hash h: the next cursor, the fields and their values
local function scan(h, cursor, count)
  local r = redis.call('HSCAN', h, cursor, 'COUNT', count)
  local fields, values, page = {}, {}, r[2]
  for i = 1, #page, 2 do fields[#fields + 1] = page[i]; values[#values + 1] = page[i + 1] end
  return r[1], fields, values
end
"""

LUA_WRITE = (
    _LUA_COMMON
    + _LUA_WHERE
    + """
-- KEYS: staging view or '', tombstones, floors, floor field, serves, serving name, parked name,
-- low marks, high mark; ARGV: n, stride, blob, ops, staged ('1'/'0'), table, run, the n keys
-- joined by ','. blob holds n records of 8-byte version + row. A live write goes to the run's
-- live view wherever it is now. The keys of one call are distinct (the store's batches are).
local tomb, floors = KEYS[2], KEYS[3]
local n, stride = tonumber(ARGV[1]), tonumber(ARGV[2])
local blob, ops, staged = ARGV[3], ARGV[4], ARGV[5] == '1'
local keys = split(ARGV[8])
if #keys ~= n then
  return redis.error_reply('deltarec: ' .. #keys .. ' keys for ' .. n .. ' rows')
end
local fh, fl = floor_of(floors, KEYS[4])
local ks, vs, opv = {}, {}, {}
for i = 1, n do
  local at = (i - 1) * stride
  local lo, hi = struct.unpack('<I4I4', blob, at + 1)
  if ge(hi, lo, fh, fl) then
    local j = #ks + 1
    ks[j], opv[j] = keys[i], string.sub(ops, i, i)
    vs[j] = string.sub(blob, at + 1, at + stride)
  end
end
if not staged then
  local view = where(KEYS[5], ARGV[6], ARGV[7], KEYS[6], KEYS[7])
  return apply_rows(view, tomb, KEYS[8], KEYS[4], KEYS[9], ks, vs, opv)
end
local view = KEYS[1]
local cur = hmget(view, ks)
local sets = {}
for i = 1, #ks do
  local newer = true
  if cur[i] then
    local ch, cl = ver(cur[i]); local vh, vl = ver(vs[i])
    newer = ge(vh, vl, ch, cl)
  end
  if newer then
    sets[#sets + 1] = ks[i]
    sets[#sets + 1] = string.sub(vs[i], 1, 8) .. opv[i] .. string.sub(vs[i], 9)
  end
end
hset(view, sets)
return #sets / 2
"""
)
"""One chunk of a batch into a live view (version guard, floor, tombstones) or a staging view
(newest version wins; the op is kept in the value). Returns the rows that changed the view."""

LUA_MERGE = (
    _LUA_COMMON
    + _LUA_WHERE
    + """
-- KEYS: staging view, tombstones, floors, floor field, serves, serving name, parked name, low
-- marks, high mark; ARGV: table, run, cursor, count. Returns {the next cursor, rows that changed
-- the live view}.
local stage, tomb, floors = KEYS[1], KEYS[2], KEYS[3]
local live = where(KEYS[5], ARGV[1], ARGV[2], KEYS[6], KEYS[7])
local fh, fl = floor_of(floors, KEYS[4])
local cursor, fields, recs = scan(stage, ARGV[3], ARGV[4])
local ks, vs, opv = {}, {}, {}
for i = 1, #fields do
  local rec = recs[i]
  local vh, vl = ver(rec)
  if ge(vh, vl, fh, fl) then
    local j = #ks + 1
    ks[j], opv[j] = fields[i], string.sub(rec, 9, 9)
    vs[j] = string.sub(rec, 1, 8) .. string.sub(rec, 10)
  end
end
local changed = apply_rows(live, tomb, KEYS[8], KEYS[4], KEYS[9], ks, vs, opv)
hdel(stage, fields)
return {cursor, changed}
"""
)
"""One ``HSCAN`` step of a staging view into its live view (guarded as a write), each field
deleted from the staging view once applied, so running it again goes on where it stopped."""

LUA_SWEEP = (
    _LUA_COMMON
    + _LUA_WHERE
    + """
-- KEYS: see target(), then for a live view the low marks (field: its parked name, KEYS[4]);
-- ARGV: table, run, version, cursor, count. The hash's values start with an 8-byte version.
-- A live view whose low mark is not below the version holds nothing to remove: not scanned.
-- The step that ends the scan raises the low mark to the version. Returns {the next cursor,
-- fields removed}.
local h = target()
local vh, vl = ver(ARGV[3])
local lows = KEYS[5]
if lows and ARGV[4] == '0' then
  local low = redis.call('HGET', lows, KEYS[4])
  if low then local ch, cl = ver(low); if ge(ch, cl, vh, vl) then return {'0', 0} end end
end
local cursor, fields, values = scan(h, ARGV[4], ARGV[5])
local gone = {}
for i = 1, #fields do
  local ch, cl = ver(values[i])
  if not ge(ch, cl, vh, vl) then gone[#gone + 1] = fields[i] end
end
hdel(h, gone)
if lows and cursor == '0' then
  local low = redis.call('HGET', lows, KEYS[4])
  local raise = true
  if low then local ch, cl = ver(low); raise = not ge(ch, cl, vh, vl) end
  if raise then redis.call('HSET', lows, KEYS[4], ARGV[3]) end
end
return {cursor, #gone}
"""
)
"""One ``HSCAN`` step of a hash, on the server, deleting the fields whose version is below
``ARGV[3]`` (rows or tombstones below a snapshot's version); only the cursor and a count come
back to the client. The caller raises the view's floor to the version first, so no write
below it lands while the steps run."""

LUA_SCAN = (
    _LUA_WHERE
    + """
-- KEYS: see target(); ARGV: table, run, cursor, count, width (bytes of every value; 0: fields
-- only). Returns {the next cursor, n, the n fields joined by ',', their values concatenated}.
local h = target()
local cursor, fields, values = scan(h, ARGV[3], ARGV[4])
local width = tonumber(ARGV[5])
if width == 0 then return {cursor, #fields, table.concat(fields, ','), ''} end
for i = 1, #values do
  if #values[i] ~= width then
    return redis.error_reply('deltarec: field ' .. fields[i] .. ' of ' .. h .. ' holds ' ..
      #values[i] .. ' bytes, not ' .. width)
  end
end
return {cursor, #fields, table.concat(fields, ','), table.concat(values)}
"""
)
"""One ``HSCAN`` step of a hash (a run's live view wherever it is now), packed into three
strings on the server so the client decodes them with numpy, not one object per field."""

LUA_LOWER = (
    _LUA_COMMON
    + """
-- KEYS: low marks, the live view; ARGV: the view's floor field, the lowest version of rows
-- about to be written to it (queued before their HSET in one MULTI/EXEC). Returns 0.
local h, l = ver(ARGV[2])
lower_low(KEYS[1], ARGV[1], redis.call('EXISTS', KEYS[2]) == 1, h, l)
return 0
"""
)
"""The low mark's part of a write of plain ``HSET`` commands (see :mod:`.plain`)."""

LUA_FLOOR = """
local function ver(s) local lo, hi = struct.unpack('<I4I4', s); return hi, lo end
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if cur then
  local ch, cl = ver(cur); local vh, vl = ver(ARGV[2])
  if ch > vh or (ch == vh and cl >= vl) then return 0 end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""
"""Raise a view's floor to ``ARGV[2]`` (never lower it). Returns 1 if it rose."""

LUA_REGISTER = """
-- KEYS: generations hash, newest-generation key; ARGV: generation, record
local newest = redis.call('GET', KEYS[2])
if not newest then
  newest = 0
  for _, g in ipairs(redis.call('HKEYS', KEYS[1])) do
    if tonumber(g) > newest then newest = tonumber(g) end
  end
else
  newest = tonumber(newest)
end
local gen = tonumber(ARGV[1])
if gen > newest then newest = gen end
redis.call('SET', KEYS[2], newest)
redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2])
return newest
"""
"""Record a generation of a run (the first record is kept) and keep the run's newest-generation
key at the highest generation seen (the write fence reads it). Returns the newest."""


LUA_COUNT = (
    _LUA_WHERE
    + """
-- KEYS: see target(); ARGV: table, run. Returns the number of fields of the hash.
return redis.call('HLEN', target())
"""
)
"""The number of keys of a run's live view, wherever it is now."""

LUA_READ = (
    _LUA_COMMON
    + _LUA_WHERE
    + """
-- KEYS: see target(); ARGV: table, run, fields joined by ',', width (bytes of every value),
-- staged ('1': a value whose op byte, the 9th, is '1' is a staged delete: not found).
-- Returns {one '1'/'0' per field (found or not), the found values concatenated}.
local h = target()
local fields = split(ARGV[3])
local got = hmget(h, fields)
local width, staged = tonumber(ARGV[4]), ARGV[5] == '1'
local found, values = {}, {}
for i = 1, #fields do
  local v = got[i]
  if v and not (staged and string.sub(v, 9, 9) == '1') then
    if #v ~= width then
      return redis.error_reply('deltarec: field ' .. fields[i] .. ' of ' .. h .. ' holds ' ..
        #v .. ' bytes, not ' .. width)
    end
    found[i] = '1'; values[#values + 1] = v
  else
    found[i] = '0'
  end
end
return {table.concat(found), table.concat(values)}
"""
)
"""Fields of a hash (a run's live view wherever it is now), the found values packed into one
string on the server."""

LUA_SWITCH = """
-- KEYS: serves, serving name, the new run's parked name, the serving run's parked name;
-- ARGV: table, new run, the run the caller saw serving ('' for none)
local cur = redis.call('HGET', KEYS[1], ARGV[1]) or ''
if cur ~= ARGV[3] then return redis.error_reply('deltarec: serving moved; read it again') end
if cur == ARGV[2] then return 0 end
if cur == '' and redis.call('EXISTS', KEYS[2]) == 1 then
  return redis.error_reply('deltarec: the serving name holds rows of no known run')
end
if cur ~= '' and redis.call('EXISTS', KEYS[2]) == 1 then redis.call('RENAME', KEYS[2], KEYS[4]) end
if redis.call('EXISTS', KEYS[3]) == 1 then redis.call('RENAME', KEYS[3], KEYS[2])
else redis.call('DEL', KEYS[2]) end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""
"""Make a table's serving name the new run's live view (the run serving it so far is parked),
atomically: a reader of the serving name sees one run's rows or the other's, never a mix."""


def pack_version(version: int) -> bytes:
    """The 8-byte little-endian form of a version (the head of every stored value)."""
    return struct.pack("<q", version)


def pack_high(rows: int, tombstones: int) -> bytes:
    """A high mark: the newest version of a view's rows and of its tombstones (0: none)."""
    return struct.pack("<qq", rows, tombstones)


def unpack_high(value: bytes) -> tuple[int, int]:
    """The two versions of a high mark (see :func:`pack_high`)."""
    rows, tombstones = struct.unpack("<qq", value)
    return int(rows), int(tombstones)


LUA_SPIN = """
local t = redis.call('TIME')
local start = tonumber(t[1]) * 1000000 + tonumber(t[2])
repeat
  t = redis.call('TIME')
until tonumber(t[1]) * 1000000 + tonumber(t[2]) - start >= tonumber(ARGV[1])
return 0
"""


def slow_commands(nbytes: int) -> list[tuple[Any, ...]]:
    """The ``redis.exec`` slow point (:mod:`deltarec.faults`): a wait on the server, in the write.

    Its milliseconds per megabyte of ``nbytes`` are spent by a script queued in the write's
    ``MULTI``/``EXEC``, so every reader waits for them as for a slow server; none unless set.
    """
    delay = slowdown("redis.exec") * nbytes / 1e6
    return [("EVAL", LUA_SPIN, 0, int(delay * 1e6))] if delay > 0 else []
