"""The Redis store's reads: point reads, key counts and scans of a run's views.

A mixin of :class:`~deltarec.stores.redis.store.RedisStore`, which registers the scripts
(:data:`~deltarec.stores.redis.lua.LUA_READ`, ``LUA_COUNT``, ``LUA_SCAN``) and finds views.
Each script finds the handle's run's live view wherever it is when it runs (a promote may
move it between two calls) and answers with one string of keys and one blob of fixed-width
values, decoded here with numpy; with hiredis installed, a scan with rows reads plain
``HSCAN`` steps instead (:mod:`deltarec.stores.redis.scan`).
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from typing import Any

import numpy as np

from deltarec.artifacts import codec
from deltarec.errors import StoreError
from deltarec.stores.redis.registry import ERRORS as _ERRORS
from deltarec.stores.redis.scan import hscan_rows
from deltarec.stores.types import ReadResult, ViewInfo

_SCAN_STEP = 16384
"""Fields per ``HSCAN`` step of a scan script (about 4 MB of rows of dim 64 per reply)."""
_READ_CHUNK = 8192
"""Keys per read script."""


class RedisReads(abc.ABC):
    """``read``, ``count_keys``, ``scan_keys`` and ``scan_rows`` of the Redis store."""

    run: str | None
    scan_on_client: bool
    _client: Any
    _read_script: Any
    _count_script: Any
    _scan_script: Any

    @abc.abstractmethod
    def describe(self) -> str:
        """The store, for messages."""

    @abc.abstractmethod
    def _view(self, table: str, staging_generation: int | None = None) -> ViewInfo:
        """The handle's view of ``table`` (:class:`~deltarec.stores.runviews.RunViews`)."""

    @abc.abstractmethod
    def _live_keys(self, run: str, table: str) -> list[str]:
        """Where ``run``'s live view of ``table`` may be (the serving name, parked)."""

    def read(
        self, table: str, keys: np.ndarray, staging_generation: int | None = None
    ) -> ReadResult:
        """See :meth:`Store.read` (a script per chunk of keys; a staged delete is not found)."""
        view = self._view(table, staging_generation)
        keys = np.asarray(keys, dtype=np.int64)
        out = ReadResult.none_found(view, len(keys))
        records = _value_type(view)
        staged = "1" if view.staging_generation else "0"
        for s in range(0, len(keys), _READ_CHUNK):
            part = keys[s : s + _READ_CHUNK]
            with _ERRORS.map_errors(self.describe()):
                flags, values = self._read_script(
                    keys=self._target(view),
                    args=[
                        view.table,
                        self.run or "",
                        ",".join(map(str, part.tolist())),
                        records.itemsize,
                        staged,
                    ],
                )
            found = np.frombuffer(flags, np.uint8) == ord("1")
            rows = np.frombuffer(values, records)
            at = np.flatnonzero(found) + s
            out.found[at] = True
            out.versions[at] = rows["v"]
            out.embedding[at] = rows["e"]
        return out

    def _target(self, view: ViewInfo) -> list[str]:
        """The ``KEYS`` of a script's ``target()``.

        The view's hash, or the handle's run's live view of its table wherever it is when the
        script runs (a promote may move it between two calls).
        """
        if view.staging_generation or self.run is None:
            return [view.name]
        return ["", *self._live_keys(self.run, view.table)]

    def count_keys(self, table: str) -> int:
        """See :meth:`Store.count_keys` (``HLEN`` of the run's live view, wherever it is)."""
        view = self._view(table)
        with _ERRORS.map_errors(self.describe()):
            return int(
                self._count_script(keys=self._target(view), args=[view.table, self.run or ""])
            )

    def scan_keys(self, table: str, batch_rows: int = 65536) -> Iterator[np.ndarray]:
        """See :meth:`Store.scan_keys` (hash order, not sorted)."""
        for keys, _ in self._scan(self._view(table), batch_rows, with_rows=False):
            yield keys

    def scan_rows(
        self, table: str, batch_rows: int = 65536
    ) -> Iterator[tuple[np.ndarray, ReadResult]]:
        """See :meth:`Store.scan_rows`: one pass of ``HSCAN`` steps (hash order, not sorted)."""
        view = self._view(table)
        for keys, rows in self._scan(view, batch_rows, with_rows=True):
            n = len(keys)
            emb = np.ascontiguousarray(rows["e"])
            yield keys, ReadResult(np.ones(n, bool), rows["v"].copy(), emb)

    def _scan(
        self, view: ViewInfo, batch_rows: int, with_rows: bool
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Keys (and, ``with_rows``, the values as :func:`_value_type`) of ``view``, a step each.

        A field or value the script sent back that does not parse as the view's raises
        :class:`~deltarec.errors.StoreError` naming the view.
        """
        records = _value_type(view)
        width = records.itemsize if with_rows else 0
        if with_rows and self.scan_on_client:
            steps = hscan_rows(
                self._client,
                self._target(view),
                view.table,
                self.run or "",
                min(batch_rows, _SCAN_STEP),
                width,
                self.describe(),
            )
            while True:
                with _ERRORS.map_errors(self.describe()):
                    step = next(steps, None)
                if step is None:
                    return
                yield step[0], np.frombuffer(step[1], records)
        cursor = b"0"
        while True:
            with _ERRORS.map_errors(self.describe()):
                cursor, n, fields, values = self._scan_script(
                    keys=self._target(view),
                    args=[view.table, self.run or "", cursor, min(batch_rows, _SCAN_STEP), width],
                )
            if n:
                keys = np.fromstring(fields, dtype=np.int64, sep=",")
                if len(keys) != n:
                    raise StoreError(f"{self.describe()}: a field of {view.name} is not a key")
                yield keys, np.frombuffer(values, records)  # empty without rows
            if int(cursor) == 0:
                return


def _value_type(view: ViewInfo) -> np.dtype:
    """One stored value of ``view`` as a numpy record.

    Fields: version ``v``, a staged value's op byte ``o``, the encoded row ``e``.
    """
    row = (codec.element_type(view.dtype), (codec.encoded_width(view.dtype, view.dim),))
    op = [("o", np.uint8)] if view.staging_generation else []
    return np.dtype([("v", "<i8"), *op, ("e", *row)])
