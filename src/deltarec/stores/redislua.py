"""The Lua scripts of the Redis store, and the stored value format they share.

Every value of a live view or a tombstone hash starts with the row's version as 8 bytes,
little-endian (:func:`pack_version`); a live view's value goes on with the encoded row, a
staging view's with one op byte (``0``/``1``) and then the row. Versions compare as
``(high 32 bits, low 32 bits)``: Lua 5.1 numbers are doubles, so an int64 is read as two
uint32 halves.

Each script runs atomically on the server and is version-guarded, so running one again after
a failure changes nothing more: the store's batches, sweeps and merges rely on that. The
``KEYS`` and ``ARGV`` each script takes are written at its head. Used by
:mod:`deltarec.stores.redis`.
"""

from __future__ import annotations

import struct

_LUA_COMMON = """
local function ver(s) local lo, hi = struct.unpack('<I4I4', s); return hi, lo end
local function ge(ah, al, bh, bl) return ah > bh or (ah == bh and al >= bl) end
local function floor_of(floors, view)
  local f = redis.call('HGET', floors, view)
  if f then return ver(f) end
  return 0, 0
end
-- apply one row to a live view; returns 1 if it changed the view
local function apply(live, tomb, key, vbytes, op, row)
  local vh, vl = ver(vbytes)
  local cur = redis.call('HGET', live, key)
  local newer = true
  if cur then local ch, cl = ver(string.sub(cur, 1, 8)); newer = ge(vh, vl, ch, cl) end
  if op == '1' then
    local t = redis.call('HGET', tomb, key)
    if not t then redis.call('HSET', tomb, key, vbytes)
    else
      local th, tl = ver(t)
      if ge(vh, vl, th, tl) then redis.call('HSET', tomb, key, vbytes) end
    end
    if newer and cur then redis.call('HDEL', live, key); return 1 end
    return 0
  end
  if not newer then return 0 end
  local t = redis.call('HGET', tomb, key)
  if t then local th, tl = ver(t); if ge(th, tl, vh, vl) then return 0 end end
  redis.call('HSET', live, key, vbytes .. row)
  return 1
end
"""

_LUA_WHERE = """
-- a run's live view is the table's serving name while the run serves it, else its parked name
local function where(serves, tbl, run, serving, parked)
  if redis.call('HGET', serves, tbl) == run then return serving end
  return parked
end
"""

LUA_WRITE = (
    _LUA_COMMON
    + _LUA_WHERE
    + """
-- KEYS: staging view or '', tombstones, floors, floor field, serves, serving name, parked name;
-- ARGV: n, stride, blob, ops, staged ('1'/'0'), table, run, then n keys. blob holds n records
-- of 8-byte version + row. A live write goes to the run's live view wherever it is now.
local tomb, floors = KEYS[2], KEYS[3]
local n, stride = tonumber(ARGV[1]), tonumber(ARGV[2])
local blob, ops, staged = ARGV[3], ARGV[4], ARGV[5] == '1'
local view = KEYS[1]
if not staged then view = where(KEYS[5], ARGV[6], ARGV[7], KEYS[6], KEYS[7]) end
local fh, fl = floor_of(floors, KEYS[4])
local changed = 0
for i = 1, n do
  local key = ARGV[7 + i]
  local rec = string.sub(blob, (i - 1) * stride + 1, i * stride)
  local vbytes = string.sub(rec, 1, 8)
  local vh, vl = ver(vbytes)
  local op = string.sub(ops, i, i)
  if ge(vh, vl, fh, fl) then
    if staged then
      local cur = redis.call('HGET', view, key)
      local newer = true
      if cur then local ch, cl = ver(string.sub(cur, 1, 8)); newer = ge(vh, vl, ch, cl) end
      if newer then
        redis.call('HSET', view, key, vbytes .. op .. string.sub(rec, 9))
        changed = changed + 1
      end
    else
      changed = changed + apply(view, tomb, key, vbytes, op, string.sub(rec, 9))
    end
  end
end
return changed
"""
)
"""One chunk of a batch into a live view (version guard, floor, tombstones) or a staging view
(newest version wins; the op is kept in the value). Returns the rows that changed the view."""

LUA_MERGE = (
    _LUA_COMMON
    + _LUA_WHERE
    + """
-- KEYS: staging view, tombstones, floors, floor field, serves, serving name, parked name;
-- ARGV: table, run, then fields of the staging view
local stage, tomb, floors = KEYS[1], KEYS[2], KEYS[3]
local live = where(KEYS[5], ARGV[1], ARGV[2], KEYS[6], KEYS[7])
local fh, fl = floor_of(floors, KEYS[4])
local changed = 0
for i = 3, #ARGV do
  local rec = redis.call('HGET', stage, ARGV[i])
  if rec then
    local vbytes = string.sub(rec, 1, 8)
    local vh, vl = ver(vbytes)
    if ge(vh, vl, fh, fl) then
      local op, row = string.sub(rec, 9, 9), string.sub(rec, 10)
      changed = changed + apply(live, tomb, ARGV[i], vbytes, op, row)
    end
    redis.call('HDEL', stage, ARGV[i])
  end
end
return changed
"""
)
"""Given fields of a staging view into its live view (guarded as a write), each field deleted
from the staging view once applied, so running it again goes on where it stopped."""

LUA_SWEEP = (
    _LUA_WHERE
    + """
-- KEYS: a hash whose values start with an 8-byte version (or, with serves, serving name and
-- parked name given, a run's live view wherever it is now); ARGV: version, table, run, fields
local function ver(s) local lo, hi = struct.unpack('<I4I4', s); return hi, lo end
local h = KEYS[1]
if #KEYS > 1 then h = where(KEYS[2], ARGV[2], ARGV[3], KEYS[3], KEYS[4]) end
local vh, vl = ver(ARGV[1])
local removed = 0
for i = 4, #ARGV do
  local cur = redis.call('HGET', h, ARGV[i])
  if cur then
    local ch, cl = ver(string.sub(cur, 1, 8))
    if ch < vh or (ch == vh and cl < vl) then
      redis.call('HDEL', h, ARGV[i])
      removed = removed + 1
    end
  end
end
return removed
"""
)
"""Delete the given fields of a hash whose version is below ``ARGV[1]`` (rows or tombstones
below a snapshot's version). Returns how many went."""

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


LUA_READ = (
    _LUA_WHERE
    + """
-- KEYS: serves, serving name, parked name; ARGV: table, run, fields
local h = where(KEYS[1], ARGV[1], ARGV[2], KEYS[2], KEYS[3])
return redis.call('HMGET', h, unpack(ARGV, 3))
"""
)
"""Fields of a run's live view wherever it is now (a promote may move it between two calls)."""

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
