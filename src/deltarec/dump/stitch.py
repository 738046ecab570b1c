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

Only the fields that hold file offsets are rewritten; every other field is re-encoded as it
was read (the thrift reader/writer here is generic and round-trips Arrow's footers exactly).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

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


class StitchError(ValueError):
    """A piece is not a parquet file this module can stitch (names what is wrong)."""


Field = list[Any]
"""A decoded struct field: ``[field id, element type, value]``."""


class _Reader:
    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.pos = 0

    def byte(self) -> int:
        b = self.data[self.pos]
        self.pos += 1
        return int(b)

    def varint(self) -> int:
        shift = result = 0
        while True:
            b = self.byte()
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return result
            shift += 7

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def value(self, ttype: int) -> Any:
        if ttype in (_TRUE, _FALSE):  # only inside lists: one byte
            return self.byte() == _TRUE
        if ttype == _BYTE:
            return self.byte()
        if ttype in (_I16, _I32, _I64):
            return self.zigzag()
        if ttype == _DOUBLE:
            v = bytes(self.data[self.pos : self.pos + 8])
            self.pos += 8
            return v
        if ttype == _BINARY:
            n = self.varint()
            v = bytes(self.data[self.pos : self.pos + n])
            self.pos += n
            return v
        if ttype in (_LIST, _SET):
            head = self.byte()
            size, etype = head >> 4, head & 0x0F
            if size == 15:
                size = self.varint()
            return (etype, [self.value(etype) for _ in range(size)])
        if ttype == _MAP:
            size = self.varint()
            if size == 0:
                return (0, 0, [])
            kv = self.byte()
            kt, vt = kv >> 4, kv & 0x0F
            return (kt, vt, [(self.value(kt), self.value(vt)) for _ in range(size)])
        if ttype == _STRUCT:
            return self.struct()
        raise StitchError(f"unknown thrift compact type {ttype} at byte {self.pos}")

    def struct(self) -> list[Field]:
        fields: list[Field] = []
        last = 0
        while True:
            head = self.byte()
            if head == _STOP:
                return fields
            ttype, delta = head & 0x0F, head >> 4
            fid = last + delta if delta else self.zigzag()
            if ttype in (_TRUE, _FALSE):
                fields.append([fid, ttype, ttype == _TRUE])
            else:
                fields.append([fid, ttype, self.value(ttype)])
            last = fid


class _Writer:
    def __init__(self) -> None:
        self.out = bytearray()

    def varint(self, n: int) -> None:
        while True:
            if n < 0x80:
                self.out.append(n)
                return
            self.out.append((n & 0x7F) | 0x80)
            n >>= 7

    def zigzag(self, n: int) -> None:
        self.varint((n << 1) ^ (n >> 63))

    def value(self, ttype: int, v: Any) -> None:
        if ttype in (_TRUE, _FALSE):
            self.out.append(_TRUE if v else _FALSE)
        elif ttype == _BYTE:
            self.out.append(v)
        elif ttype in (_I16, _I32, _I64):
            self.zigzag(v)
        elif ttype == _DOUBLE:
            self.out += v
        elif ttype == _BINARY:
            self.varint(len(v))
            self.out += v
        elif ttype in (_LIST, _SET):
            etype, items = v
            if len(items) < 15:
                self.out.append((len(items) << 4) | etype)
            else:
                self.out.append(0xF0 | etype)
                self.varint(len(items))
            for item in items:
                self.value(etype, item)
        elif ttype == _MAP:
            kt, vt, items = v
            self.varint(len(items))
            if items:
                self.out.append((kt << 4) | vt)
                for k, x in items:
                    self.value(kt, k)
                    self.value(vt, x)
        elif ttype == _STRUCT:
            self.struct(v)
        else:
            raise StitchError(f"unknown thrift compact type {ttype}")

    def struct(self, fields: Sequence[Field]) -> None:
        last = 0
        for fid, ttype, v in fields:
            if ttype in (_TRUE, _FALSE):
                ttype = _TRUE if v else _FALSE
            if 0 < fid - last <= 15:
                self.out.append(((fid - last) << 4) | ttype)
            else:
                self.out.append(ttype)
                self.zigzag(fid)
            if ttype not in (_TRUE, _FALSE):
                self.value(ttype, v)
            last = fid
        self.out.append(_STOP)


def decode_footer(data: bytes | memoryview) -> list[Field]:
    """Parse a thrift compact ``FileMetaData`` into nested ``[id, type, value]`` fields."""
    return _Reader(memoryview(data).cast("B")).struct()


def encode_footer(fields: Sequence[Field]) -> bytes:
    """Serialize fields parsed by :func:`decode_footer` (exact inverse for Arrow's footers)."""
    w = _Writer()
    w.struct(fields)
    return bytes(w.out)


def _get(fields: Sequence[Field], fid: int) -> Field | None:
    for f in fields:
        if f[0] == fid:
            return f
    return None


@dataclass
class PieceMeta:
    """A written piece: its parsed footer, body size and rows."""

    footer: list[Field]
    body_size: int
    rows: int


@dataclass
class Piece:
    """One independently encoded parquet file in memory (one or more row groups).

    Attributes:
        buffer: the whole file as pyarrow wrote it.
        body: ``buffer[4:footer_start]``: the column chunks, copied into the shard as is.
        footer: the parsed ``FileMetaData``.
        rows: rows in the piece.
    """

    buffer: pa.Buffer
    body: memoryview
    footer: list[Field]
    rows: int
    memory: np.ndarray | None = None
    """The reusable buffer ``buffer`` lies in (see :class:`~deltarec.dump.encode.PieceArena`)."""

    @property
    def nbytes(self) -> int:
        """Bytes of memory the piece holds."""
        return int(self.buffer.size)

    def meta(self) -> PieceMeta:
        """What the footer needs of this piece once its body is written (no buffers)."""
        return PieceMeta(self.footer, len(self.body), self.rows)

    @classmethod
    def parse(cls, buffer: pa.Buffer) -> Piece:
        """Split a parquet file written by pyarrow (no encryption) into body and footer.

        Raises:
            StitchError: not a plain parquet file.
        """
        view = memoryview(buffer).cast("B")  # pyarrow exports signed bytes ("b")
        size = len(view)
        if size < 12 or bytes(view[:4]) != MAGIC or bytes(view[-4:]) != MAGIC:
            raise StitchError(f"not a parquet file ({size} bytes, no PAR1 magic at both ends)")
        (flen,) = struct.unpack("<I", view[-8:-4])
        start = size - 8 - flen
        if start < 4:
            raise StitchError(f"footer length {flen} does not fit a file of {size} bytes")
        footer = decode_footer(view[start : size - 8])
        rows = _get(footer, _FMD_NUM_ROWS)
        if rows is None or _get(footer, _FMD_ROW_GROUPS) is None:
            raise StitchError("footer without num_rows or row_groups")
        return cls(buffer, view[4:start], footer, int(rows[2]))


def _shift_row_group(rg: list[Field], delta: int, ordinal: int) -> None:
    for f in rg:
        if f[0] == _RG_FILE_OFFSET:
            f[2] += delta
        elif f[0] == _RG_ORDINAL:
            f[2] = ordinal
    columns = _get(rg, _RG_COLUMNS)
    if columns is None:
        raise StitchError("row group without columns")
    for chunk in columns[2][1]:
        for f in chunk:
            if f[0] == _CC_FILE_OFFSET and f[2] > 0:
                f[2] += delta
            elif f[0] in (_CC_OFFSET_INDEX, _CC_COLUMN_INDEX):
                raise StitchError("pieces with page indexes cannot be stitched")
            elif f[0] == _CC_META:
                for m in f[2]:
                    if m[0] in _CMD_OFFSETS:
                        m[2] += delta


def stitched_footer(pieces: Sequence[PieceMeta]) -> bytes:
    """The shard's ``FileMetaData``: the first piece's, with every piece's row groups.

    Piece ``k``'s body is placed at ``4 + sum(len(body) of pieces before k)``; its offsets
    (which count from its own ``PAR1``) are shifted by the same amount minus 4.

    Raises:
        StitchError: no pieces, or pieces with page indexes.
    """
    if not pieces:
        raise StitchError("no pieces to stitch")
    head = [list(f) for f in pieces[0].footer]
    groups: list[Any] = []
    at = 4
    for p in pieces:
        rgs = _get(p.footer, _FMD_ROW_GROUPS)
        assert rgs is not None
        for rg in rgs[2][1]:
            rg = _deep_copy(rg)
            _shift_row_group(rg, at - 4, len(groups))
            groups.append(rg)
        at += p.body_size
    rows = sum(p.rows for p in pieces)
    for f in head:
        if f[0] == _FMD_NUM_ROWS:
            f[2] = rows
        elif f[0] == _FMD_ROW_GROUPS:
            f[2] = (f[2][0], groups)
    return encode_footer(head)


def _deep_copy(v: Any) -> Any:
    if isinstance(v, list):
        return [_deep_copy(x) for x in v]
    if isinstance(v, tuple):
        return tuple(_deep_copy(x) for x in v)
    return v


def footer_tail(footer: bytes) -> bytes:
    """What follows the footer at the end of the file: its length and the magic."""
    return struct.pack("<I", len(footer)) + MAGIC
