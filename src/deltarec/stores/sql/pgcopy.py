"""PostgreSQL binary COPY payloads built with numpy (no per-row Python work).

A binary COPY stream is a header, then per tuple an int16 field count and per field an int32
length and the big-endian value, then an int16 ``-1`` trailer. Every field of a batch here has
a fixed width, so a whole batch is one structured numpy array.
"""

from __future__ import annotations

import numpy as np

HEADER = b"PGCOPY\n\xff\r\n\x00" + b"\x00\x00\x00\x00" + b"\x00\x00\x00\x00"
TRAILER = b"\xff\xff"
FLOAT4_OID = 700
_ARRAY_HEADER = 20  # ndim, has_null, element oid, dim length, lower bound (5 x int32)


def float4_array_width(dim: int) -> int:
    """Bytes of one ``float4[]`` value of ``dim`` elements in binary form."""
    return _ARRAY_HEADER + 8 * dim


def embedding_field(embedding: np.ndarray, layout: str) -> tuple[np.ndarray, int]:
    """The embedding column as ``[n]`` opaque values of fixed width, and that width.

    ``bytea``: the encoded row as is (little-endian). ``float4[]``: a one-dimensional array of
    the row's values (float32 or float16 tables) in PostgreSQL's binary array format.
    """
    n = embedding.shape[0]
    if layout == "bytea":
        rows = np.ascontiguousarray(embedding)
        width = rows.shape[1] * rows.itemsize
        return rows.view(np.dtype((np.void, width))).reshape(n), width
    dim = embedding.shape[1]
    arr = np.empty(n, np.dtype([("h", ">i4", (5,)), ("e", [("l", ">i4"), ("v", ">f4")], (dim,))]))
    arr["h"] = (1, 0, FLOAT4_OID, dim, 1)
    arr["e"]["l"] = 4
    arr["e"]["v"] = embedding.astype(np.float32)
    width = float4_array_width(dim)
    return arr.view(np.dtype((np.void, width))).reshape(n), width


def batch_records(
    keys: np.ndarray,
    embedding: np.ndarray,
    versions: np.ndarray,
    ops: np.ndarray | None,
    layout: str,
) -> np.ndarray:
    """The COPY tuples of ``(key bigint, embedding, version bigint[, op smallint])`` rows.

    One structured array; its buffer goes to the COPY stream between :data:`HEADER` and
    :data:`TRAILER`. Without ``ops`` the tuples have three fields (a view's own columns).
    """
    emb, width = embedding_field(embedding, layout)
    fields = [
        ("nf", ">i2"),
        ("kl", ">i4"),
        ("k", ">i8"),
        ("el", ">i4"),
        ("e", np.void, width),
        ("vl", ">i4"),
        ("v", ">i8"),
    ]
    if ops is not None:
        fields += [("ol", ">i4"), ("o", ">i2")]
    arr = np.empty(keys.shape[0], np.dtype(fields))
    arr["nf"], arr["kl"], arr["el"], arr["vl"] = (3 if ops is None else 4), 8, width, 8
    arr["k"] = keys
    arr["e"] = emb
    arr["v"] = versions
    if ops is not None:
        arr["ol"] = 2
        arr["o"] = ops
    return arr


def batch_payload(
    keys: np.ndarray, embedding: np.ndarray, versions: np.ndarray, ops: np.ndarray, layout: str
) -> bytes:
    """The whole COPY payload of one batch (:func:`batch_records` framed)."""
    return HEADER + batch_records(keys, embedding, versions, ops, layout).tobytes() + TRAILER


def decode_float4_array(values: list[float] | None, dim: int) -> np.ndarray:
    """A ``float4[]`` read back (a list) as a float32 row; checks its length."""
    row = np.asarray(values if values is not None else [], dtype=np.float32)
    if row.shape != (dim,):
        raise ValueError(f"float4[] holds {row.shape[0]} values, the view's dim is {dim}")
    return row
