"""Row encoding shared by shards (parquet ``embedding`` column) and stores (packed bytes).

A row of a table with dtype

* ``float32`` is ``dim`` little-endian float32 values (``4 * dim`` bytes);
* ``float16`` is ``dim`` little-endian float16 values (``2 * dim`` bytes);
* ``int8_rowwise`` is ``dim`` uint8 codes, then an fp16 scale, then an fp16 bias
  (``dim + 4`` bytes); value ``i`` decodes as ``code[i] * scale + bias``.

The encoded form is identical in parquet and in every store, so publishing never re-encodes.
All functions work on whole batches (numpy arrays), never per row.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from deltarec.artifacts.types import DType

KEY, EMBEDDING, OP, STEP = "key", "embedding", "op", "step"
VERSION = "version"
"""A base part's fifth column (SPEC §3a): the version of the dump that wrote the row."""
COLUMNS = (KEY, EMBEDDING, OP, STEP)

ROW_GROUP_VALUES = 1 << 21
"""Embedding values per parquet row group (at least :data:`MIN_ROW_GROUP_ROWS` rows).

While pyarrow writes a row group it holds the repetition and definition levels of every
embedding value of the group in its own memory pool: 4 bytes per value, about 6.4 with its
page buffers (measured with pyarrow 26: a 65536 x 128 fp32 chunk written as one row group
took 51 MiB of pool memory, as 4 groups of 16384 rows 15 MiB, and was written 2.4x faster).
Groups of 2M values bound that scratch to about 13 MiB per writer, whatever the chunk size."""
MIN_ROW_GROUP_ROWS = 1024
"""Row groups never hold fewer rows than this (very wide rows keep groups readable)."""


def element_type(dtype: DType) -> np.dtype:
    """The numpy element type of an encoded row."""
    table: dict[DType, np.dtype] = {
        DType.FLOAT32: np.dtype("<f4"),
        DType.FLOAT16: np.dtype("<f2"),
        DType.INT8_ROWWISE: np.dtype("u1"),
    }
    return table[DType(dtype)]


def encoded_width(dtype: DType, dim: int) -> int:
    """Elements per encoded row (``dim``, or ``dim + 4`` for int8_rowwise)."""
    return dim + 4 if DType(dtype) is DType.INT8_ROWWISE else dim


def row_bytes(dtype: DType, dim: int) -> int:
    """Bytes per encoded row."""
    return encoded_width(dtype, dim) * element_type(dtype).itemsize


def row_group_rows(dtype: DType, dim: int) -> int:
    """Rows per parquet row group of a shard of this dtype and dim (see ROW_GROUP_VALUES)."""
    return max(MIN_ROW_GROUP_ROWS, ROW_GROUP_VALUES // encoded_width(dtype, dim))


def embedding_type(dtype: DType, dim: int) -> pa.FixedSizeListType:
    """The ``embedding`` column's type: a fixed-size list of required (non-null) values.

    Required values spare parquet a definition level per value, which halves the time to
    write (and read) a shard; readers accept shards with nullable values just the same.
    """
    value_type = pa.from_numpy_dtype(element_type(dtype))
    item = pa.field("element", value_type, nullable=False)
    return pa.list_(item, encoded_width(dtype, dim))


def shard_schema(dtype: DType, dim: int) -> pa.Schema:
    """The parquet schema of a shard: key, embedding, op, step (in this order)."""
    return pa.schema(
        [
            pa.field(KEY, pa.int64(), nullable=False),
            pa.field(EMBEDDING, embedding_type(dtype, dim), nullable=False),
            pa.field(OP, pa.int8(), nullable=False),
            pa.field(STEP, pa.int64(), nullable=False),
        ]
    )


def encode(values: np.ndarray, dtype: DType) -> np.ndarray:
    """Encode float rows ``[n, dim]`` into ``[n, encoded_width]`` elements of ``element_type``."""
    dtype = DType(dtype)
    if values.ndim != 2:
        raise ValueError(f"rows must be 2-D [n, dim], got shape {values.shape}")
    if dtype is DType.FLOAT32:
        return np.ascontiguousarray(values, dtype="<f4")
    if dtype is DType.FLOAT16:
        return np.ascontiguousarray(values, dtype="<f2")
    return quantize_int8_rowwise(values)


def decode(encoded: np.ndarray, dtype: DType, dim: int) -> np.ndarray:
    """Decode ``[n, encoded_width]`` elements back into float32 rows ``[n, dim]``."""
    dtype = DType(dtype)
    if dtype is DType.INT8_ROWWISE:
        return dequantize_int8_rowwise(encoded, dim)
    return np.asarray(encoded, dtype="<f4").reshape(-1, dim)


def quantize_int8_rowwise(values: np.ndarray) -> np.ndarray:
    """Per-row asymmetric 8-bit quantization with fp16 scale and bias appended."""
    x = np.asarray(values, dtype=np.float32)
    n, dim = x.shape
    lo = x.min(axis=1, initial=np.inf) if dim else np.zeros(n, np.float32)
    hi = x.max(axis=1, initial=-np.inf) if dim else np.zeros(n, np.float32)
    bias = lo.astype(np.float16)
    scale = ((hi - bias.astype(np.float32)) / 255.0).astype(np.float16)
    s32 = scale.astype(np.float32)
    safe = np.where(s32 > 0, s32, 1.0)
    codes = np.rint((x - bias.astype(np.float32)[:, None]) / safe[:, None])
    out = np.empty((n, dim + 4), dtype=np.uint8)
    out[:, :dim] = np.clip(codes, 0, 255).astype(np.uint8)
    out[:, dim : dim + 2] = scale.view(np.uint8).reshape(n, 2)
    out[:, dim + 2 :] = bias.view(np.uint8).reshape(n, 2)
    return out


def dequantize_int8_rowwise(encoded: np.ndarray, dim: int) -> np.ndarray:
    """Inverse of :func:`quantize_int8_rowwise` (up to quantization error)."""
    e = np.ascontiguousarray(encoded, dtype=np.uint8).reshape(-1, dim + 4)
    scale = e[:, dim : dim + 2].copy().view("<f2").astype(np.float32)
    bias = e[:, dim + 2 :].copy().view("<f2").astype(np.float32)
    return e[:, :dim].astype(np.float32) * scale + bias


def tolerance(dtype: DType, values: np.ndarray) -> np.ndarray:
    """Per-row absolute tolerance for comparing decoded rows with expected float rows.

    Exact (0) for float32; float16 rounding for float16; one quantization step plus fp16
    rounding of scale and bias for int8_rowwise.
    """
    dtype = DType(dtype)
    v = np.asarray(values, dtype=np.float32)
    if dtype is DType.FLOAT32 or v.size == 0:
        return np.zeros(v.shape[0], dtype=np.float32)
    amax = np.abs(v).max(axis=1)
    if dtype is DType.FLOAT16:
        return amax * np.float32(2.0**-10) + np.float32(1e-7)
    span = v.max(axis=1) - v.min(axis=1)
    return span / 255.0 + amax * np.float32(2.0**-8) + np.float32(1e-6)


def to_arrow(
    keys: np.ndarray, encoded: np.ndarray, ops: np.ndarray, steps: np.ndarray, dtype: DType
) -> pa.Table:
    """Build a shard table (zero-copy where numpy allows) from encoded rows."""
    width = encoded.shape[1]
    dim = width - 4 if DType(dtype) is DType.INT8_ROWWISE else width
    flat = pa.array(np.ascontiguousarray(encoded, dtype=element_type(dtype)).reshape(-1))
    emb = pa.FixedSizeListArray.from_arrays(flat, type=embedding_type(dtype, dim))
    return pa.Table.from_arrays(
        [
            pa.array(np.asarray(keys, dtype=np.int64)),
            emb,
            pa.array(np.asarray(ops, dtype=np.int8)),
            pa.array(np.asarray(steps, dtype=np.int64)),
        ],
        schema=shard_schema(dtype, dim),
    )


def embedding_matrix(column: pa.ChunkedArray | pa.Array, dtype: DType) -> np.ndarray:
    """The ``embedding`` column of a shard as an ``[n, encoded_width]`` numpy array."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    assert isinstance(column, pa.FixedSizeListArray)
    width = column.type.list_size
    if column.null_count:
        values = column.flatten().to_numpy(zero_copy_only=False)
    else:  # the child values of the rows: flatten() would import pyarrow.compute (~0.1 s)
        values = column.values.slice(column.offset * width, len(column) * width)
        values = values.to_numpy(zero_copy_only=False)
    return values.astype(element_type(dtype), copy=False).reshape(-1, width)
