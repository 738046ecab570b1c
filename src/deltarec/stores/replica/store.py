"""``replica://host:port``: a running replica read as a store, read-only (no torch here).

``deltarec verify --store replica://host:port`` reads rows back from a replica exactly as it
reads them from a store: :meth:`ReplicaStore.read` returns each key's encoded row as the
replica holds it and the version of the dump that wrote it, :meth:`ReplicaStore.scan_keys`
lists the keys it holds (``--all`` finds rows the lineage never wrote). Its registry side
answers what a replica knows (the generation it serves, when dumps became visible in it) and
refuses every write: a replica changes only by following its run's outbox.

A handle belongs to the replica's own run: opened for another run (``open_store(url,
run=...)``), every read is refused naming both.

When the replica requires a bearer token, the handle sends the one in the environment
(``DELTAREC_REPLICA_TOKEN``, or the file ``DELTAREC_REPLICA_TOKEN_FILE`` names): never in the
URL. A read of more keys than the replica answers at once (413 with ``X-Deltarec-Max-Keys``)
is split into requests it answers; a busy replica (503 with ``Retry-After``) is asked again.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from deltarec.artifacts import codec
from deltarec.artifacts.types import DType, TableSpec
from deltarec.errors import BadInputError, StoreError, StoreUnavailableError, UnsupportedError
from deltarec.stores.base import Registry, Store
from deltarec.stores.config import ReplicaConfig
from deltarec.stores.replica.status import TOKEN_ENV, TOKEN_FILE_ENV, ReplicaStatus, token_from_env
from deltarec.stores.types import (
    Capabilities,
    FreshnessRecord,
    ProgressMark,
    ReadResult,
    ServingPointer,
    SnapshotRecord,
    ViewInfo,
    Write,
)

_CAPABILITIES = Capabilities(deletes=True, scan=True)
_BUSY_RETRIES = 5
"""Times a request a busy replica refused (503 with Retry-After) is sent again."""


class _TooMany(BadInputError):
    """413 with ``X-Deltarec-Max-Keys``: the most keys of the table one request may name."""

    def __init__(self, message: str, most: int) -> None:
        super().__init__(message)
        self.most = most


class ReplicaStore(Store, Registry):
    """A serving replica over HTTP, read as a store (read-only).

    Args:
        config: the replica's host and port.
    """

    kind = "replica"
    capabilities = _CAPABILITIES

    def __init__(self, config: ReplicaConfig) -> None:
        self.config = config
        self.base = f"http://{config.host}:{config.port}"
        self._run_checked = False
        self._token = token_from_env()
        self._most_keys: dict[str, int] = {}  # per table, learnt from a 413

    def describe(self) -> str:
        """``replica://host:port``."""
        return f"replica://{self.config.host}:{self.config.port}"

    # ---- HTTP ------------------------------------------------------------------------------
    def _request(
        self, path: str, body: bytes | None = None, query: Mapping[str, Any] | None = None
    ) -> tuple[bytes, Any]:
        for attempt in range(_BUSY_RETRIES + 1):
            try:
                return self._send(path, body, query)
            except urllib.error.HTTPError as e:
                retry_after = e.headers.get("Retry-After") if e.headers else None
                if e.code == 503 and retry_after and attempt < _BUSY_RETRIES:
                    e.close()
                    time.sleep(min(5.0, float(retry_after)) if retry_after.isdigit() else 1.0)
                    continue
                raise self._error(path, e) from e
            except (urllib.error.URLError, OSError) as e:
                raise StoreUnavailableError(f"{self.describe()} cannot be reached: {e}") from e
        raise AssertionError("unreachable")

    def _send(
        self, path: str, body: bytes | None, query: Mapping[str, Any] | None
    ) -> tuple[bytes, Any]:
        url = self.base + path + ("?" + urllib.parse.urlencode(query) if query else "")
        req = urllib.request.Request(url, data=body, method="POST" if body is not None else "GET")
        if self._token is not None:
            req.add_header("Authorization", f"Bearer {self._token}")
        with urllib.request.urlopen(req, timeout=self.config.timeout_s) as resp:
            return resp.read(), resp.headers

    def _error(self, path: str, e: urllib.error.HTTPError) -> Exception:
        try:
            message = json.loads(e.read()).get("error", str(e))
        except (ValueError, AttributeError, OSError):
            message = str(e)
        where = f"{self.describe()}{path}"
        most = e.headers.get("X-Deltarec-Max-Keys") if e.headers else None
        if e.code == 413 and most and most.isdigit():
            return _TooMany(f"{where}: {message}", int(most))
        if e.code == 401:
            return BadInputError(
                f"{where}: {message}; set {TOKEN_ENV} (or {TOKEN_FILE_ENV}) to the replica's token"
            )
        if e.code == 503:
            return StoreUnavailableError(f"{where}: {message}")
        if e.code in (400, 404, 408, 413):
            return BadInputError(f"{where}: {message}")
        return StoreError(f"{where}: HTTP {e.code}: {message}")

    def status(self) -> ReplicaStatus:
        """The replica's position, lag and tables (``GET /v1/status``)."""
        data, _ = self._request("/v1/status")
        return ReplicaStatus.from_json(json.loads(data))

    def _check_served(self, run: str, what: str) -> None:
        served = self.status().run
        if run != served:
            raise BadInputError(
                f"{what} of run {run!r} from {self.describe()}, a replica of run {served!r}"
            )

    # ---- rows (read-only) ------------------------------------------------------------------
    def views(self, staging_generation: int | None = None) -> dict[str, ViewInfo]:
        """The replica's tables as live views (a replica has no staging views)."""
        if staging_generation is not None:
            return {}
        status = self.status()
        if self.run is not None and self.run != status.run:
            self._check_served(self.run, "reading the views")
        return {
            t: ViewInfo(t, t, int(v["dim"]), DType(v["dtype"]), run=status.run)
            for t, v in status.tables.items()
        }

    def read(
        self, table: str, keys: np.ndarray, staging_generation: int | None = None
    ) -> ReadResult:
        """Rows of ``keys`` as the replica serves them now (one snapshot per call)."""
        if staging_generation is not None:
            raise self._unsupported("staging views")
        if self.run is not None and not self._run_checked:  # once per handle
            self._check_served(self.run, "reading rows")
            self._run_checked = True
        keys = np.ascontiguousarray(keys, dtype="<i8")
        most = self._most_keys.get(table)
        if most is None or len(keys) <= most:
            try:
                return self._read_rows(table, keys)
            except _TooMany as e:
                most = self._most_keys[table] = e.most
        parts = [self._read_rows(table, keys[i : i + most]) for i in range(0, len(keys), most)]
        return ReadResult(
            np.concatenate([p.found for p in parts]),
            np.concatenate([p.versions for p in parts]),
            np.concatenate([p.embedding for p in parts]),
        )

    def _read_rows(self, table: str, keys: np.ndarray) -> ReadResult:
        data, headers = self._request("/v1/rows", keys.tobytes(), {"table": table})
        n, width = int(headers["X-Deltarec-Rows"]), int(headers["X-Deltarec-Width"])
        element = codec.element_type(DType(headers["X-Deltarec-Dtype"]))
        found = np.frombuffer(data, np.uint8, n).astype(bool)
        versions = np.frombuffer(data, "<i8", n, offset=n).astype(np.int64)
        rows = np.frombuffer(data, element, n * width, offset=9 * n).reshape(n, width)
        return ReadResult(found, versions, rows.copy())

    def scan_keys(self, table: str, batch_rows: int = 65536) -> Iterator[np.ndarray]:
        """Every key the replica holds in ``table``, ascending (paged)."""
        after: int | None = None
        while True:
            query: dict[str, Any] = {"table": table, "limit": batch_rows}
            if after is not None:
                query["after"] = after
            data, _ = self._request("/v1/keys", query=query)
            keys = np.frombuffer(data, "<i8").astype(np.int64)
            if len(keys) == 0:
                return
            yield keys
            after = int(keys[-1])

    def provision(
        self, tables: Mapping[str, TableSpec], staging_generation: int | None = None
    ) -> dict[str, ViewInfo]:
        """Refused: a replica's tables come from its run's outbox."""
        raise self._read_only("provisioning views")

    def apply(self, write: Write) -> int:
        """Refused: a replica changes only by following its run's outbox."""
        raise self._read_only("writing rows")

    def close(self) -> None:
        """Nothing to release (every request is its own connection)."""

    def _read_only(self, what: str) -> UnsupportedError:
        return UnsupportedError(
            f"{self.describe()} is a serving replica, read-only: {what} is not possible "
            "(it follows its run's committed dumps and serving pointer)"
        )

    # ---- registry: what a replica knows ------------------------------------------------------
    def generations(self, run: str) -> list[int]:
        """The generation the replica serves, if it serves ``run``."""
        status = self.status()
        return [status.generation] if status.ready and status.run == run else []

    def progress(self, run: str, generation: int) -> list[ProgressMark]:
        """None: a replica keeps no progress marks (it applies whole dumps)."""
        return []

    def freshness(self, run: str, generation: int | None = None) -> list[FreshnessRecord]:
        """When the latest dumps were taken and when they became visible in the replica."""
        if self.status().run != run:
            return []
        data, _ = self._request("/v1/freshness")
        return [
            FreshnessRecord(run, v["generation"], v["seq"], 0, v["taken_at"], v["visible_at"])
            for v in json.loads(data)
            if v.get("taken_at") is not None and generation in (None, v["generation"])
        ]

    def serving_history(self, run: str) -> list[ServingPointer]:
        """The pointer the replica follows (it keeps no history of its own)."""
        status = self.status()
        ptr = status.pointer
        if status.run != run or not ptr:
            return []
        return [ServingPointer(run, ptr["generation"], ptr["seq"], ptr["promoted_at"])]

    def snapshot(self, run: str, generation: int, seq: int, table: str) -> SnapshotRecord | None:
        """None: a replica keeps no snapshot records."""
        return None

    def register_generation(self, run: str, generation: int, origin: str | None = None) -> None:
        """Refused (read-only)."""
        raise self._read_only("registering a generation")

    def record_progress(self, mark: ProgressMark) -> None:
        """Refused (read-only)."""
        raise self._read_only("recording progress")

    def record_freshness(self, record: FreshnessRecord) -> None:
        """Refused (read-only)."""
        raise self._read_only("recording freshness")

    def set_serving(self, run: str, generation: int, seq: int, note: str = "") -> ServingPointer:
        """Refused: promote and roll back through the store the replica follows."""
        raise self._read_only("moving the serving pointer")

    def record_snapshot(self, record: SnapshotRecord) -> None:
        """Refused (read-only)."""
        raise self._read_only("recording a snapshot")


__all__ = ["ReplicaStore"]
