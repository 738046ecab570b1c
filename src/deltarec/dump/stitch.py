"""One parquet shard from row groups encoded independently (in parallel) by pyarrow.

Each chunk of a shard is encoded by pyarrow into a small, complete parquet file in memory (a
:class:`Piece`: ``PAR1``, its row groups' column chunks, its footer). Encoding releases the GIL,
so pieces of one shard are encoded on several threads at once. The shard file is then the
concatenation ``PAR1 + body(piece 0) + body(piece 1) + ... + footer + length + PAR1``: the
column chunks are copied byte for byte, and the footer (thrift ``FileMetaData``, compact
protocol) is the first piece's footer with every piece's row groups, their absolute file
offsets shifted to where the piece's body lands, and the summed row count. Pages carry no
absolute offsets, so the result is the file pyarrow would have written with one
``write_table`` per chunk (SPEC §3: same schema, same encodings, same statistics).

The footer is never decoded into Python objects. :meth:`Piece.parse` scans it once, on the
encoding thread, and keeps its bytes with the positions of the few varints that hold file
offsets or row-group ordinals (:class:`PieceMeta`: bytes only, no container that the garbage
collector tracks besides the meta itself); :func:`stitched_footer` copies
the bytes between those positions and writes the shifted values. Every other byte of every
row group is copied as pyarrow wrote it.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

MAGIC = b"PAR1"

# thrift compact protocol element types
_STOP, _TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE = 0, 1, 2, 3, 4, 5, 6, 7
_BINARY, _LIST, _SET, _MAP, _STRUCT = 8, 9, 10, 11, 12

# parquet.thrift field ids that hold absolute file offsets
_FMD_NUM_ROWS, _FMD_ROW_GROUPS = 3, 4
_RG_COLUMNS, _RG_FILE_OFFSET, _RG_ORDINAL = 1, 5, 7
_CC_FILE_OFFSET, _CC_META = 2, 3
_CC_OFFSET_INDEX, _CC_COLUMN_INDEX = 4, 6
_CMD_OFFSETS = (9, 10, 11, 14)  # data page, index page, dictionary page, bloom filter

_Visit = Callable[[int, int, int], "int | None"]
"""A struct walker's field reader: ``(field id, type, position) -> position after, or None``."""

# what a cut (a varint taken out of a piece's row groups) becomes in the shard
_SHIFT, _ORDINAL = 0, 1


class StitchError(ValueError):
    """A piece is not a parquet file this module can stitch (names what is wrong)."""


def _varint(d: bytes, p: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        b = d[p]
        p += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, p
        shift += 7


def _skip(d: bytes, p: int, t: int) -> int:
    """Position after one compact-protocol value of type ``t`` at ``p``."""
    if t in (_I16, _I32, _I64):
        while d[p] & 0x80:
            p += 1
        return p + 1
    if t in (_TRUE, _FALSE, _BYTE):  # a bool is one byte only inside containers
        return p + 1
    if t == _BINARY:
        n, p = _varint(d, p)
        return p + n
    if t == _STRUCT:
        return _walk_struct(d, p)
    if t in (_LIST, _SET):
        et = d[p] & 0x0F
        size, p = _list_size(d, p)
        if et in (_TRUE, _FALSE, _BYTE):
            return p + size
        if et == _DOUBLE:
            return p + 8 * size
        for _ in range(size):
            p = _skip(d, p, et)
        return p
    if t == _DOUBLE:
        return p + 8
    if t == _MAP:
        size, p = _varint(d, p)
        if size == 0:
            return p
        kv = d[p]
        p += 1
        for _ in range(size):
            p = _skip(d, _skip(d, p, kv >> 4), kv & 0x0F)
        return p
    raise StitchError(f"unknown thrift compact type {t} at byte {p}")


def _field(d: bytes, p: int, last: int) -> tuple[int, int, int]:
    """``(field id, type, position of the value)`` of the field header at ``p`` (id 0: stop)."""
    head = d[p]
    p += 1
    if head == _STOP:
        return 0, _STOP, p
    t, delta = head & 0x0F, head >> 4
    if delta:
        return last + delta, t, p
    n, p = _varint(d, p)
    return (n >> 1) ^ -(n & 1), t, p


def _walk_struct(d: bytes, p: int, visit: _Visit | None = None) -> int:
    """Walk the struct whose first field header is at ``p``; the position after its stop.

    ``visit(fid, type, at)`` reads a field's value at ``at`` and returns the position after it,
    or None to have the value skipped (as every value is when ``visit`` is None).
    """
    last = 0
    while True:
        fid, t, p = _field(d, p, last)
        if t == _STOP:
            return p
        end = visit(fid, t, p) if visit is not None else None
        if end is not None:
            p = end
        elif t not in (_TRUE, _FALSE):
            p = _skip(d, p, t)
        last = fid


def _list_size(d: bytes, p: int) -> tuple[int, int]:
    """``(element count, position of the first element)`` of the list header at ``p``."""
    size = d[p] >> 4
    if size == 15:
        return _varint(d, p + 1)
    return size, p + 1


class _Cuts:
    """Varints taken out of a piece's row groups: ``(start, end, kind, value)`` quadruples."""

    def __init__(self) -> None:
        self.flat = array("q")

    def take(self, d: bytes, p: int, kind: int) -> int:
        n, end = _varint(d, p)
        self.flat.extend((p, end, kind, (n >> 1) ^ -(n & 1)))
        return end


def _scan_row_groups(d: bytes, p: int, count: int, cuts: _Cuts) -> int:
    """Take the cuts of the ``count`` row groups from ``p``; the position after the last."""
    ordinal = 0

    def row_group(fid: int, t: int, p: int) -> int | None:
        if fid == _RG_FILE_OFFSET:
            return cuts.take(d, p, _SHIFT)
        if fid == _RG_ORDINAL:
            _, end = _varint(d, p)
            cuts.flat.extend((p, end, _ORDINAL, ordinal))
            return end
        if fid == _RG_COLUMNS and t == _LIST:
            size, p = _list_size(d, p)
            for _ in range(size):
                p = _walk_struct(d, p, column_chunk)
            return p
        return None

    def column_chunk(fid: int, t: int, p: int) -> int | None:
        if fid == _CC_FILE_OFFSET:
            n, end = _varint(d, p)
            if (n >> 1) ^ -(n & 1) > 0:
                cuts.take(d, p, _SHIFT)
            return end
        if fid in (_CC_OFFSET_INDEX, _CC_COLUMN_INDEX):
            raise StitchError("pieces with page indexes cannot be stitched")
        if fid == _CC_META and t == _STRUCT:
            return _walk_struct(d, p, column_meta)
        return None

    def column_meta(fid: int, t: int, p: int) -> int | None:
        return cuts.take(d, p, _SHIFT) if fid in _CMD_OFFSETS else None

    for ordinal in range(count):  # noqa: B007 (row_group reads it)
        p = _walk_struct(d, p, row_group)
    return p


def _zigzag_varint(n: int) -> bytes:
    n = (n << 1) ^ (n >> 63)
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _list_head(size: int, etype: int) -> bytes:
    if size < 15:
        return bytes(((size << 4) | etype,))
    n, out = size, bytearray((0xF0 | etype,))
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


@dataclass
class PieceMeta:
    """What the shard's footer needs of a written piece (its footer's bytes, no buffers).

    Attributes:
        before_rows: the footer's bytes up to the ``num_rows`` value.
        before_groups: from after ``num_rows`` to the ``row_groups`` list's header.
        groups: the row groups' bytes (the list's elements).
        after_groups: the rest of the footer (key-value metadata, created_by, ...).
        cuts: ``(start, end, kind, value)`` per varint of ``groups`` to rewrite (a file
            offset, shifted by where the body lands, or a row group's ordinal), as native
            int64 bytes: no container for the garbage collector to track.
        group_count: row groups in the piece.
        body_size: bytes of the piece's body.
        rows: rows in the piece.
    """

    before_rows: bytes
    before_groups: bytes
    groups: bytes
    after_groups: bytes
    cuts: bytes
    group_count: int
    body_size: int
    rows: int


@dataclass
class Piece:
    """One independently encoded parquet file in memory (one or more row groups).

    Attributes:
        buffer: the whole file as pyarrow wrote it.
        body: ``buffer[4:footer_start]``: the column chunks, copied into the shard as is.
        rows: rows in the piece.
        footer_meta: what the shard's footer needs of it (:meth:`meta`).
    """

    buffer: pa.Buffer
    body: memoryview
    rows: int
    footer_meta: PieceMeta
    memory: np.ndarray | None = None
    """The reusable buffer ``buffer`` lies in (see :class:`~deltarec.dump.encode.PieceArena`)."""

    @property
    def nbytes(self) -> int:
        """Bytes of memory the piece holds."""
        return int(self.buffer.size)

    def meta(self) -> PieceMeta:
        """What the footer needs of this piece once its body is written (no buffers)."""
        return self.footer_meta

    @classmethod
    def parse(cls, buffer: pa.Buffer) -> Piece:
        """Split a parquet file written by pyarrow (no encryption) into body and footer.

        Raises:
            StitchError: not a plain parquet file, or one with page indexes.
        """
        view = memoryview(buffer).cast("B")  # pyarrow exports signed bytes ("b")
        size = len(view)
        if size < 12 or bytes(view[:4]) != MAGIC or bytes(view[-4:]) != MAGIC:
            raise StitchError(f"not a parquet file ({size} bytes, no PAR1 magic at both ends)")
        (flen,) = struct.unpack("<I", view[-8:-4])
        start = size - 8 - flen
        if start < 4:
            raise StitchError(f"footer length {flen} does not fit a file of {size} bytes")
        meta = _scan_footer(bytes(view[start : size - 8]), start - 4)
        return cls(buffer, view[4:start], meta.rows, meta)


def _scan_footer(d: bytes, body_size: int) -> PieceMeta:
    """Scan a ``FileMetaData``: where ``num_rows`` and the row groups are, and their cuts."""
    try:
        last, p = 0, 0
        rows_at = rows_end = groups_at = groups_end = -1
        rows, count, groups_start = 0, 0, -1
        cuts = _Cuts()
        while True:
            fid, t, at = _field(d, p, last)
            if t == _STOP:
                break
            if fid == _FMD_NUM_ROWS:
                n, p = _varint(d, at)
                rows, rows_at, rows_end = (n >> 1) ^ -(n & 1), at, p
            elif fid == _FMD_ROW_GROUPS and t == _LIST:
                groups_at = at
                count, p = _list_size(d, at)
                groups_start = p
                p = _scan_row_groups(d, p, count, cuts)
                groups_end = p
            elif t in (_TRUE, _FALSE):
                p = at
            else:
                p = _skip(d, at, t)
            last = fid
    except IndexError:
        raise StitchError(f"footer of {len(d)} bytes ends inside a value") from None
    if rows_at < 0 or groups_at < 0 or not rows_end <= groups_at:
        raise StitchError("footer without num_rows before row_groups")
    # cut positions relative to the row groups' bytes
    flat = cuts.flat
    for i in range(0, len(flat), 4):
        flat[i] -= groups_start
        flat[i + 1] -= groups_start
    return PieceMeta(
        before_rows=d[:rows_at],
        before_groups=d[rows_end:groups_at],
        groups=d[groups_start:groups_end],
        after_groups=d[groups_end:],
        cuts=flat.tobytes(),
        group_count=count,
        body_size=body_size,
        rows=rows,
    )


def stitched_footer(pieces: Sequence[PieceMeta]) -> bytes:
    """The shard's ``FileMetaData``: the first piece's, with every piece's row groups.

    Piece ``k``'s body is placed at ``4 + sum(len(body) of pieces before k)``; its offsets
    (which count from its own ``PAR1``) are shifted by the same amount minus 4.

    Raises:
        StitchError: no pieces.
    """
    if not pieces:
        raise StitchError("no pieces to stitch")
    first = pieces[0]
    out = [first.before_rows, _zigzag_varint(sum(p.rows for p in pieces)), first.before_groups]
    out.append(_list_head(sum(p.group_count for p in pieces), _STRUCT))
    delta = ordinal = 0
    for p in pieces:
        groups, flat, prev = p.groups, array("q", p.cuts), 0
        for i in range(0, len(flat), 4):
            start, end, kind, value = flat[i], flat[i + 1], flat[i + 2], flat[i + 3]
            out.append(groups[prev:start])
            out.append(_zigzag_varint(value + delta if kind == _SHIFT else value + ordinal))
            prev = end
        out.append(groups[prev:])
        delta += p.body_size
        ordinal += p.group_count
    out.append(first.after_groups)
    return b"".join(out)


def footer_tail(footer: bytes) -> bytes:
    """What follows the footer at the end of the file: its length and the magic."""
    return struct.pack("<I", len(footer)) + MAGIC
