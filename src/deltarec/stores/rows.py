"""Checks every store applies to a batch before writing anything (deterministic errors).

A batch is rejected as a whole with :class:`~deltarec.errors.InvalidRowError` naming the table,
where the rows came from and the first offending key: wrong width or element type, NaN/Inf
values (for ``int8_rowwise`` in the fp16 scale and bias), keys below ``-1``, duplicate keys,
ops other than 0/1, versions that are not positive. None of these are retried.
"""

from __future__ import annotations

import numpy as np

from deltarec.artifacts import codec
from deltarec.artifacts.types import DType, TableKind
from deltarec.errors import InvalidRowError
from deltarec.stores.types import ViewInfo

_MIN_KEY = -1


def checked_arrays(
    table: str,
    view: ViewInfo,
    keys: np.ndarray,
    embedding: np.ndarray,
    ops: np.ndarray,
    versions: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``keys, ops, versions`` as arrays, after :func:`check_batch` against ``view``.

    The first step of every backend's ``write``: nothing is written unless this passes.
    """
    keys, ops, versions = (np.asarray(a) for a in (keys, ops, versions))
    check_batch(table, view.dtype, view.dim, keys, embedding, ops, versions)
    return keys, ops, versions


def check_batch(
    table: str,
    dtype: DType,
    dim: int,
    keys: np.ndarray,
    embedding: np.ndarray,
    ops: np.ndarray,
    versions: np.ndarray,
    where: str = "batch",
    kind: TableKind | None = None,
) -> None:
    """Raise :class:`InvalidRowError` unless the batch can be written as is.

    Args:
        table: table id (for the message).
        dtype: the view's dtype.
        dim: the view's dim.
        keys: int64 ``[n]``.
        embedding: ``[n, encoded_width]`` encoded rows.
        ops: int8 ``[n]``.
        versions: int64 ``[n]``.
        where: where the rows come from (``dump 3 rank 0`` ...), for the message.
        kind: the table kind, if known: key ``-1`` is only allowed in ZCH tables.
    """
    n = _check_shapes(table, dtype, dim, keys, embedding, ops, versions, where)
    if n == 0:
        return
    bad = (
        np.empty(0, np.int64)
        if _all_finite(embedding, dtype, dim)
        else (np.flatnonzero(~_finite_rows(embedding, dtype, dim)))
    )
    if bad.size:
        raise InvalidRowError(table, where, int(keys[bad[0]]), f"{bad.size} row(s) hold NaN/Inf")
    low = _MIN_KEY if kind in (None, TableKind.ZCH) else 0
    bad = np.flatnonzero(keys < low)
    if bad.size:
        raise InvalidRowError(table, where, int(keys[bad[0]]), f"key below {low}")
    bad = np.flatnonzero((ops != 0) & (ops != 1))
    if bad.size:
        raise InvalidRowError(table, where, int(keys[bad[0]]), f"op {int(ops[bad[0]])} not 0/1")
    bad = np.flatnonzero(versions <= 0)
    if bad.size:
        raise InvalidRowError(table, where, int(keys[bad[0]]), "version is not positive")
    sorted_keys = np.sort(keys)
    dup = np.flatnonzero(sorted_keys[1:] == sorted_keys[:-1])
    if dup.size:
        raise InvalidRowError(table, where, int(sorted_keys[dup[0]]), "key appears twice")


def _check_shapes(
    table: str,
    dtype: DType,
    dim: int,
    keys: np.ndarray,
    embedding: np.ndarray,
    ops: np.ndarray,
    versions: np.ndarray,
    where: str,
) -> int:
    n = int(keys.shape[0]) if keys.ndim == 1 else -1
    if n < 0 or keys.dtype != np.int64:
        raise InvalidRowError(table, where, None, f"keys must be int64 [n], got {keys.dtype}")
    width = codec.encoded_width(dtype, dim)
    element = codec.element_type(dtype)
    if embedding.ndim != 2 or embedding.shape != (n, width):
        raise InvalidRowError(
            table,
            where,
            None,
            f"embedding shape {embedding.shape} != ({n}, {width}) for dim={dim} "
            f"dtype={DType(dtype).value}",
        )
    if embedding.dtype != element:
        raise InvalidRowError(
            table, where, None, f"embedding elements are {embedding.dtype}, expected {element}"
        )
    if ops.shape != (n,) or versions.shape != (n,):
        raise InvalidRowError(table, where, None, f"ops/versions must have shape ({n},)")
    return n


def _all_finite(embedding: np.ndarray, dtype: DType, dim: int) -> bool:
    """Fast path without a temporary per element: min/max propagate NaN and show Inf."""
    if DType(dtype) is DType.INT8_ROWWISE:
        return bool(_finite_rows(embedding, dtype, dim).all())
    return bool(np.isfinite(embedding.min()) and np.isfinite(embedding.max()))


def _finite_rows(embedding: np.ndarray, dtype: DType, dim: int) -> np.ndarray:
    if DType(dtype) is DType.INT8_ROWWISE:
        tail = np.ascontiguousarray(embedding[:, dim : dim + 4]).view("<f2")
        return np.isfinite(tail).all(axis=1)  # type: ignore[no-any-return]
    return np.isfinite(embedding).all(axis=1)  # type: ignore[no-any-return]


def ascending(keys: np.ndarray) -> bool:
    """Whether ``keys`` are strictly ascending (the order a B-tree takes fastest)."""
    return len(keys) < 2 or bool((keys[1:] > keys[:-1]).all())
