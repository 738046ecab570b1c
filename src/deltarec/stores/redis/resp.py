r"""Plain ``HSET`` commands of many rows, encoded as RESP with numpy (no object per row).

The Redis store writes a batch that no stored row or tombstone can outrank (see
:mod:`deltarec.stores.redis.plain`) as plain multi-field ``HSET`` commands instead of its
version-guarded script: the server parses them in C, about half the CPU of the script. redis-py
would build them one argument at a time (a Python call per field and per value); here a whole
batch becomes one byte buffer: the rows are grouped by the length of their decimal key, so
within a group every ``$<len>\\r\\n<key>\\r\\n$<width>\\r\\n<value>\\r\\n`` pair has one width
and is filled column by column.
"""

from __future__ import annotations

import itertools

import numpy as np

_POWERS = [np.uint64(10**p) for p in range(1, 20)]


def decimal_lengths(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The decimal form's length of every int64 key, its sign and its magnitude (uint64)."""
    keys = np.asarray(keys, np.int64)
    negative = keys < 0
    magnitude = np.where(negative, -keys, keys).view(np.uint64)  # -(-2**63) wraps to 2**63
    digits = np.ones(len(keys), np.int64)
    for p in _POWERS:
        digits += magnitude >= p
    return digits + negative, negative, magnitude


def hset_bodies(
    keys: np.ndarray, values: np.ndarray, fields_per_command: int
) -> list[tuple[int, memoryview]]:
    """The field-value pairs of ``HSET`` commands of every row, in RESP (see :func:`hset_commands`).

    Args:
        keys: int64 ``[n]``, distinct; each becomes its decimal field name.
        values: uint8 ``[n, width]``; row ``i`` is the value of ``keys[i]``.
        fields_per_command: at most this many fields per ``HSET``.

    Returns:
        ``(fields, pairs)`` of ``ceil(n / fields_per_command)`` commands (rows in an order of
        their own: by key length).
    """
    n, width = values.shape
    if n == 0:
        return []
    lengths, negative, magnitude = decimal_lengths(keys)
    group = lengths * 2 + negative
    order = np.argsort(group, kind="stable")
    group = group[order]
    middle = b"\r\n$%d\r\n" % width
    widths = np.empty(n, np.int64)
    starts = np.flatnonzero(np.diff(group, prepend=-1))
    bounds = [*starts.tolist(), n]
    heads = []
    for a, b in itertools.pairwise(bounds):
        length = int(lengths[order[a]])
        head = b"$%d\r\n" % length
        heads.append((a, b, length, head))
        widths[a:b] = len(head) + length + len(middle) + width + 2
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(widths, out=offsets[1:])
    buf = np.empty(int(offsets[-1]), np.uint8)
    for a, b, length, head in heads:
        rows = order[a:b]
        w = int(widths[a])
        region = buf[int(offsets[a]) : int(offsets[b])].reshape(b - a, w)
        region[:, : len(head)] = np.frombuffer(head, np.uint8)
        at = len(head)
        if negative[rows[0]]:
            region[:, at] = ord("-")
            at += 1
            length -= 1
        mag = magnitude[rows]
        for j in range(length):
            place = np.uint64(10 ** (length - 1 - j))
            region[:, at + j] = (mag // place % np.uint64(10)).astype(np.uint8) + ord("0")
        at += length
        region[:, at : at + len(middle)] = np.frombuffer(middle, np.uint8)
        at += len(middle)
        region[:, at : at + width] = values[rows]
        region[:, at + width :] = np.frombuffer(b"\r\n", np.uint8)
    view = memoryview(buf.data)
    bodies = []
    for s in range(0, n, fields_per_command):
        e = min(n, s + fields_per_command)
        bodies.append((e - s, view[int(offsets[s]) : int(offsets[e])]))
    return bodies


def hset_commands(name: bytes, bodies: list[tuple[int, memoryview]]) -> list[bytes | memoryview]:
    """``HSET name key value ...`` commands of :func:`hset_bodies`, as RESP pieces in order."""
    prefix = b"$4\r\nHSET\r\n$%d\r\n%s\r\n" % (len(name), name)
    pieces: list[bytes | memoryview] = []
    for fields, pairs in bodies:
        pieces.append(b"*%d\r\n" % (2 + 2 * fields) + prefix)
        pieces.append(pairs)
    return pieces
