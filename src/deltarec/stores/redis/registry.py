"""The Redis store's control plane: generations, progress, freshness, snapshots, serving.

The registry keys are listed in :mod:`deltarec.stores.redis.store`; :class:`RedisRegistry` is the
:class:`~deltarec.stores.base.Registry` half of :class:`~deltarec.stores.redis.store.RedisStore`
(the rows half stays there). Records are JSON values of hash fields, read with one
``HGETALL`` each; promote's switch of serving names is one script per table
(:data:`~deltarec.stores.redis.lua.LUA_SWITCH`).
"""

from __future__ import annotations

import json
import time
from typing import Any

import redis as redis_lib

from deltarec.errors import StoreError
from deltarec.ids import make_version, validate_run
from deltarec.stores.base import Registry, origin_error
from deltarec.stores.errors import DriverErrors
from deltarec.stores.types import FreshnessRecord, ProgressMark, ServingPointer, SnapshotRecord

ERRORS = DriverErrors(
    redis_lib.RedisError,
    lambda e: isinstance(e, (redis_lib.ConnectionError, redis_lib.TimeoutError)),
)
"""redis-py's errors as the store contract's (see :mod:`deltarec.stores.errors`)."""
_ERRORS = ERRORS


class RedisRegistry(Registry):
    """The registry methods of the Redis store (a mixin of :class:`RedisStore`)."""

    _client: redis_lib.Redis
    _layout_problem: str | None
    _views_cache: dict[Any, Any]
    _register_script: Any
    _switch_script: Any

    def describe(self) -> str:  # pragma: no cover - given by RedisStore
        """The store's URL."""
        raise NotImplementedError

    def _reg(self, name: str, *parts: object) -> str:  # pragma: no cover - given by RedisStore
        raise NotImplementedError

    def _parked(self, run: str, table: str) -> str:  # pragma: no cover - given by RedisStore
        raise NotImplementedError

    def _live_keys(self, run: str, table: str) -> list[str]:  # pragma: no cover - ditto
        raise NotImplementedError

    def store_uuid(self) -> str | None:
        """See :meth:`Registry.store_uuid` (``<prefix>~store``)."""
        with _ERRORS.map_errors(self.describe()):
            value = self._client.get(self._reg("store"))
        return None if value is None else _text(value)

    def _records(self, key: str) -> list[tuple[str, Any]]:
        """Every field of the registry hash ``key`` with its JSON record, decoded."""
        with _ERRORS.map_errors(self.describe()):
            raw = self._client.hgetall(key)
        return [(_text(field), json.loads(value)) for field, value in raw.items()]

    def serving_runs(self) -> dict[str, str]:
        """See :meth:`Registry.serving_runs`."""
        with _ERRORS.map_errors(self.describe()):
            raw = self._client.hgetall(self._reg("serves"))
        return {_text(t): _text(r) for t, r in raw.items()}

    def snapshot(self, run: str, generation: int, seq: int, table: str) -> SnapshotRecord | None:
        """See :meth:`Registry.snapshot`."""
        with _ERRORS.map_errors(self.describe()):
            raw = self._client.hget(self._reg("snapshots", run), f"{generation}|{seq}|{table}")
        if raw is None:
            return None
        r = json.loads(raw)
        swept = r["swept_at"]
        return SnapshotRecord(
            run,
            generation,
            seq,
            table,
            int(r["staging_generation"]),
            int(r["version"]),
            None if swept is None else float(swept),
        )

    def record_snapshot(self, record: SnapshotRecord) -> None:
        """See :meth:`Registry.record_snapshot`."""
        validate_run(record.run)
        value = {
            "version": record.version,
            "staging_generation": record.staging_generation,
            "swept_at": record.swept_at,
        }
        field = f"{record.generation}|{record.seq}|{record.table}"
        with _ERRORS.map_errors(self.describe()):
            self._client.hset(self._reg("snapshots", record.run), field, json.dumps(value))

    # ---- registry ------------------------------------------------------------------------
    def _set_gen_field(self, run: str, generation: int, field: str, value: float) -> None:
        key = self._reg("gens", run)
        with _ERRORS.map_errors(self.describe()):
            raw = self._client.hget(key, str(generation))
            record = json.loads(raw) if raw else {"registered_at": value}
            record[field] = value
            self._client.hset(key, str(generation), json.dumps(record))

    def register_generation(self, run: str, generation: int, origin: str | None = None) -> None:
        """See :meth:`Registry.register_generation` (hash ``<prefix>~origins:<run>``)."""
        validate_run(run)
        record = json.dumps({"registered_at": time.time()})
        with _ERRORS.map_errors(self.describe()):
            if origin is not None:  # the first origin is kept (HSETNX), any other refused
                key, field = self._reg("origins", run), str(int(generation))
                pipe = self._client.pipeline(transaction=True)
                pipe.hsetnx(key, field, origin)
                pipe.hget(key, field)
                held = pipe.execute()[1]
                held = held.decode() if isinstance(held, bytes) else str(held)
                if held != origin:
                    raise origin_error(self.describe(), run, generation, held, origin)
            self._register_script(
                keys=[self._reg("gens", run), self._reg("newest", run)],
                args=[str(int(generation)), record],
            )

    def generation_origin(self, run: str, generation: int) -> str | None:
        """See :meth:`Registry.generation_origin`."""
        with _ERRORS.map_errors(self.describe()):
            held = self._client.hget(self._reg("origins", run), str(int(generation)))
        return None if held is None else held.decode() if isinstance(held, bytes) else str(held)

    def generations(self, run: str) -> list[int]:
        """See :meth:`Registry.generations`."""
        with _ERRORS.map_errors(self.describe()):
            return sorted(int(g) for g in self._client.hkeys(self._reg("gens", run)))

    def progress(self, run: str, generation: int) -> list[ProgressMark]:
        """See :meth:`Registry.progress`."""
        marks = []
        for field, r in self._records(self._reg("progress", run, generation)):
            seq, table, rank = field.split("|")
            marks.append(
                ProgressMark(
                    run,
                    generation,
                    int(seq),
                    table,
                    int(rank),
                    int(r["rows"]),
                    bool(r["complete"]),
                    int(r["staging_generation"]),
                    float(r["written_at"]),
                )
            )
        return sorted(marks, key=lambda m: (m.seq, m.table, m.rank))

    def record_freshness(self, record: FreshnessRecord) -> None:
        """See :meth:`Registry.record_freshness` (the first record is kept)."""
        value = json.dumps({"committed_at": record.committed_at, "visible_at": record.visible_at})
        with _ERRORS.map_errors(self.describe()):
            self._client.hsetnx(
                self._reg("fresh", record.run),
                f"{record.generation}|{record.seq}|{record.rank}",
                value,
            )

    def freshness(self, run: str, generation: int | None = None) -> list[FreshnessRecord]:
        """See :meth:`Registry.freshness`."""
        out = []
        for field, obj in self._records(self._reg("fresh", run)):
            g, s, r = (int(p) for p in field.split("|"))
            if generation is None or g == generation:
                out.append(FreshnessRecord(run, g, s, r, obj["committed_at"], obj["visible_at"]))
        return sorted(out, key=lambda f: (f.generation, f.seq, f.rank))

    def set_serving(self, run: str, generation: int, seq: int, note: str = "") -> ServingPointer:
        """See :meth:`Registry.set_serving`."""
        validate_run(run)
        make_version(generation, seq)
        last = self.get_serving(run)
        now = max(time.time(), (last.promoted_at + 1e-6) if last else 0.0)
        pointer = ServingPointer(run, generation, seq, now, note)
        record = {"generation": generation, "seq": seq, "promoted_at": now, "note": note}
        with _ERRORS.map_errors(self.describe()):
            self._client.rpush(self._reg("serving", run), json.dumps(record))
            if not self._layout_problem:
                for table in sorted(self._run_tables(run)):
                    self._switch(run, table)
        self._views_cache.clear()
        return pointer

    def _run_tables(self, run: str) -> set[str]:
        """The tables ``run`` has a live view of."""
        fields = (_text(f) for f in self._client.hkeys(self._reg("views")))
        return {f.split("|")[1] for f in fields if f.startswith(f"{run}|") and f.endswith("|0")}

    def _switch(self, run: str, table: str) -> None:
        """Make ``table``'s serving name ``run``'s live view (see ``LUA_SWITCH``)."""
        for _ in range(20):
            raw = self._client.hget(self._reg("serves"), table)
            current = _text(raw) if raw is not None else ""
            parked_current = self._parked(current, table) if current else self._parked(run, table)
            try:
                self._switch_script(
                    keys=[*self._live_keys(run, table), parked_current], args=[table, run, current]
                )
                return
            except redis_lib.ResponseError as e:
                if "serving moved" not in str(e):
                    raise StoreError(
                        f"{self.describe()}: serving {table!r} from run {run!r}: {e}"
                    ) from e
        raise StoreError(f"{self.describe()}: serving {table!r} kept moving under promote")

    def serving_history(self, run: str) -> list[ServingPointer]:
        """See :meth:`Registry.serving_history`."""
        with _ERRORS.map_errors(self.describe()):
            raw = self._client.lrange(self._reg("serving", run), 0, -1)
        out = []
        for value in raw:
            o = json.loads(value)
            out.append(ServingPointer(run, o["generation"], o["seq"], o["promoted_at"], o["note"]))
        return out


def text(value: bytes | str) -> str:
    """A reply as ``str``."""
    return value.decode() if isinstance(value, bytes) else value


_text = text
