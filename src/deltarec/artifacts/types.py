"""Dataclasses and enums of the generation artifacts (SPEC §3): GENERATION.json and MANIFEST.json.

Field names are the on-disk JSON names. ``to_json()`` produces exactly the documented fields;
``from_json()`` accepts additional fields (forward compatible within a schema version) and
rejects an unknown ``schema_version`` with :class:`~deltarec.errors.SchemaVersionError`.
"""

from __future__ import annotations

import datetime as _dt
import enum
import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from deltarec.errors import ArtifactError, SchemaVersionError
from deltarec.ids import SCHEMA_VERSION, make_version, validate_run, validate_table_id


class DType(str, enum.Enum):
    """How a table's rows are encoded in shards and stores."""

    FLOAT32 = "float32"
    FLOAT16 = "float16"
    INT8_ROWWISE = "int8_rowwise"  # dim uint8 values, then fp16 scale, then fp16 bias


class TableKind(str, enum.Enum):
    """Plain tables are keyed by global row; ZCH tables by raw feature id (``-1`` = fallback)."""

    PLAIN = "plain"
    ZCH = "zch"


class DumpKind(str, enum.Enum):
    """A snapshot holds every row; a delta the rows touched since the previous dump."""

    SNAPSHOT = "snapshot"
    DELTA = "delta"
    FINAL = "final"


class Op(enum.IntEnum):
    """The ``op`` column of a shard row."""

    UPSERT = 0
    EVICTED = 1


FALLBACK_KEY = -1
"""The key under which a ZCH table's shared fallback (miss) row is published."""


def utc_now() -> str:
    """The current UTC time as ``YYYY-MM-DDTHH:MM:SS.ffffffZ`` (the artifacts' timestamp form)."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(text: str) -> float:
    """Parse an artifact timestamp into unix seconds."""
    value = _dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    if value.tzinfo is None:
        value = value.replace(tzinfo=_dt.timezone.utc)
    return value.timestamp()


def _check_schema(obj: dict[str, Any], path: str) -> None:
    found = obj.get("schema_version")
    if found != SCHEMA_VERSION:
        raise SchemaVersionError(path, found, SCHEMA_VERSION)


def _require(obj: dict[str, Any], key: str, path: str) -> Any:
    try:
        return obj[key]
    except KeyError:
        raise ArtifactError(path, f"missing field {key!r}") from None


MODULE_TYPES = ("EmbeddingBagCollection", "EmbeddingCollection")
"""The torchrec collections a table's :attr:`TableSpec.module_type` names."""


@dataclass(frozen=True)
class TableSpec:
    """One tracked table as GENERATION.json describes it."""

    dim: int
    dtype: DType = DType.FLOAT32
    kind: TableKind = TableKind.PLAIN
    num_embeddings: int = 0
    zch_size: int | None = None
    sharding: str = "table_wise"
    module_type: str | None = None
    """The torchrec collection holding the table, ``EmbeddingBagCollection`` or
    ``EmbeddingCollection`` (of a managed-collision module for a ZCH table); None where the
    writer did not record it. TorchEasyRec's table names follow it (``contract=tzrec``)."""

    def to_json(self) -> dict[str, Any]:
        """The JSON object of this table (``module_type`` only where known)."""
        out: dict[str, Any] = {
            "dim": self.dim,
            "dtype": self.dtype.value,
            "kind": self.kind.value,
            "num_embeddings": self.num_embeddings,
            "zch_size": self.zch_size,
            "sharding": self.sharding,
        }
        if self.module_type is not None:
            out["module_type"] = self.module_type
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any], path: str = "<table>") -> TableSpec:
        """Parse one table entry; raises :class:`ArtifactError` naming ``path`` if malformed."""
        try:
            spec = cls(
                dim=int(obj["dim"]),
                dtype=DType(obj.get("dtype", "float32")),
                kind=TableKind(obj.get("kind", "plain")),
                num_embeddings=int(obj.get("num_embeddings") or 0),
                zch_size=None if obj.get("zch_size") is None else int(obj["zch_size"]),
                sharding=str(obj.get("sharding", "table_wise")),
                module_type=None if obj.get("module_type") is None else str(obj["module_type"]),
            )
        except (KeyError, ValueError, TypeError) as e:
            raise ArtifactError(path, f"malformed table entry {obj!r}: {e}") from e
        if spec.dim < 1:
            raise ArtifactError(path, f"dim must be at least 1, got {spec.dim}")
        if spec.num_embeddings < 0:  # 0: not known (GENERATION.json of a ZCH table)
            raise ArtifactError(path, f"num_embeddings must be >= 0, got {spec.num_embeddings}")
        if spec.module_type not in (None, *MODULE_TYPES):
            raise ArtifactError(
                path, f"module_type must be one of {MODULE_TYPES}, got {spec.module_type!r}"
            )
        if spec.zch_size is not None and spec.zch_size < 1:
            raise ArtifactError(path, f"zch_size must be at least 1, got {spec.zch_size}")
        return spec


@dataclass(frozen=True)
class Parent:
    """The generation and checkpoint step a restored generation started from."""

    generation: int
    checkpoint_step: int


ROLLBACK_FIELD = "rollback"
"""GENERATION.json field of a rollback generation: ``{"to_generation": G, "through_seq": S}``.

Its rows restore the values G had at dump S under a newer version (``deltarec rollback``)."""


@dataclass(frozen=True)
class GenerationInfo:
    """GENERATION.json: one training process lifetime of a run."""

    run: str
    generation: int
    world_size: int
    tables: dict[str, TableSpec]
    parent: Parent | None = None
    created_at: str = field(default_factory=utc_now)
    schema_version: int = SCHEMA_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate_run(self.run)
        for t in self.tables:
            validate_table_id(t)

    def to_json(self) -> dict[str, Any]:
        """The JSON object written as GENERATION.json."""
        parent = None
        if self.parent is not None:
            parent = {
                "generation": self.parent.generation,
                "checkpoint_step": self.parent.checkpoint_step,
            }
        return {
            **self.extra,
            "schema_version": self.schema_version,
            "run": self.run,
            "generation": self.generation,
            "created_at": self.created_at,
            "parent": parent,
            "world_size": self.world_size,
            "tables": {name: spec.to_json() for name, spec in self.tables.items()},
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any], path: str) -> GenerationInfo:
        """Parse GENERATION.json read from ``path``."""
        _check_schema(obj, path)
        parent_obj = obj.get("parent")
        try:
            parent = (
                None
                if parent_obj is None
                else Parent(int(parent_obj["generation"]), int(parent_obj["checkpoint_step"]))
            )
            known = {"schema_version", "run", "generation", "created_at", "parent"}
            known |= {"world_size", "tables"}
            return cls(
                run=str(_require(obj, "run", path)),
                generation=int(_require(obj, "generation", path)),
                world_size=int(_require(obj, "world_size", path)),
                tables={
                    str(k): TableSpec.from_json(v, f"{path}: tables.{k}")
                    for k, v in _require(obj, "tables", path).items()
                },
                parent=parent,
                created_at=str(obj.get("created_at", "")),
                extra={k: v for k, v in obj.items() if k not in known},
            )
        except (KeyError, ValueError, TypeError, AttributeError) as e:
            raise ArtifactError(path, f"malformed GENERATION.json: {e}") from e


def shard_relpath(table: str, rank: int) -> str:
    """A shard's path relative to its dump directory: ``<table>/rank-<R:05d>.parquet``."""
    return f"{validate_table_id(table)}/rank-{rank:05d}.parquet"


def _shard_from_json(s: Any, path: str) -> ShardInfo:
    """One entry of a manifest's ``shards``; its path must be the one SPEC §3 derives.

    The artifact root is a trust boundary: a reader may hold wider rights than the writer, so
    a manifest cannot name a file outside its own dump, another table's or another rank's.
    """
    table = validate_table_id(str(s["table"]))
    rank = int(s["rank"])
    if rank < 0:
        raise ArtifactError(path, f"shard of table {table!r} has a negative rank {rank}")
    expected = shard_relpath(table, rank)
    if s["path"] != expected:
        raise ArtifactError(
            path,
            f"shard path {str(s['path'])[:200]!r} of table {table!r} rank {rank} is not "
            f"{expected!r}; a manifest may name only its own shards",
        )
    return ShardInfo(
        path=expected,
        table=table,
        rank=rank,
        rows=int(s["rows"]),
        bytes=int(s["bytes"]),
        sha256=str(s["sha256"]),
    )


@dataclass(frozen=True)
class ShardInfo:
    """One parquet shard of a dump, as listed in MANIFEST.json."""

    path: str
    table: str
    rank: int
    rows: int
    bytes: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        """The JSON object of this shard."""
        return {
            "path": self.path,
            "table": self.table,
            "rank": self.rank,
            "rows": self.rows,
            "bytes": self.bytes,
            "sha256": self.sha256,
        }


@dataclass(frozen=True)
class Manifest:
    """MANIFEST.json: the commit record of one dump. Written last."""

    run: str
    generation: int
    seq: int
    kind: DumpKind
    first_step: int
    last_step: int
    world_size: int
    shards: tuple[ShardInfo, ...]
    tables: dict[str, int]  # table id -> rows across all ranks
    created_at: str = field(default_factory=utc_now)
    schema_version: int = SCHEMA_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_shards(
        cls,
        run: str,
        generation: int,
        seq: int,
        kind: DumpKind,
        first_step: int,
        last_step: int,
        world_size: int,
        shards: Iterable[ShardInfo],
        tables: Iterable[str] = (),
        extra: dict[str, Any] | None = None,
    ) -> Manifest:
        """The manifest of a dump whose shards are written: the one place a manifest is built.

        Shards are listed by (table, rank); ``tables`` holds the rows of each table summed over
        its shards, in the order of ``tables`` (listed with 0 rows if no shard has it) and then
        of any other shard's table.

        Args:
            run: the run name.
            generation: the generation number.
            seq: the dump's sequence number.
            kind: snapshot, delta or final.
            first_step: the first training step the dump covers.
            last_step: the last training step the dump covers.
            world_size: the generation's number of ranks.
            shards: every rank's closed (durable, renamed) shards.
            tables: tables the dump covers, with or without shards.
            extra: additional top-level fields (``taken_at``, ``rollback``).
        """
        ordered = tuple(sorted(shards, key=lambda s: (s.table, s.rank)))
        rows = dict.fromkeys(tables, 0)
        for s in ordered:
            rows[s.table] = rows.get(s.table, 0) + s.rows
        return cls(
            run=run,
            generation=generation,
            seq=seq,
            kind=DumpKind(kind),
            first_step=first_step,
            last_step=last_step,
            world_size=world_size,
            shards=ordered,
            tables=rows,
            extra=dict(extra or {}),
        )

    @property
    def version(self) -> int:
        """``generation << 32 | seq``."""
        return make_version(self.generation, self.seq)

    def shards_of(self, table: str) -> list[ShardInfo]:
        """The shards of one table, by rank."""
        return [s for shards in self._by_table.get(table, {}).values() for s in shards]

    def shards_of_rank(self, table: str, rank: int) -> list[ShardInfo]:
        """The shards of one table written by one rank."""
        return list(self._by_table.get(table, {}).get(rank, ()))

    def part_rows(self, table: str, rank: int) -> int:
        """Rows of one table's shards written by one rank (0 if it wrote none)."""
        return self._part_rows.get((table, rank), 0)

    @functools.cached_property
    def _part_rows(self) -> dict[tuple[str, int], int]:
        """Rows by table and rank, summed once (a publish asks for each part several times)."""
        rows: dict[tuple[str, int], int] = {}
        for s in self.shards:
            rows[s.table, s.rank] = rows.get((s.table, s.rank), 0) + s.rows
        return rows

    @functools.cached_property
    def _by_table(self) -> dict[str, dict[int, list[ShardInfo]]]:
        """The shards by table and rank (ranks ascending), built once.

        A dump of hundreds of ranks has thousands of shards, and its readers ask per table
        and rank.
        """
        index: dict[str, dict[int, list[ShardInfo]]] = {}
        for s in sorted(self.shards, key=lambda s: (s.table, s.rank)):
            index.setdefault(s.table, {}).setdefault(s.rank, []).append(s)
        return index

    def to_json(self) -> dict[str, Any]:
        """The JSON object written as MANIFEST.json."""
        return {
            **self.extra,
            "schema_version": self.schema_version,
            "run": self.run,
            "generation": self.generation,
            "seq": self.seq,
            "version": self.version,
            "kind": self.kind.value,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "created_at": self.created_at,
            "world_size": self.world_size,
            "shards": [s.to_json() for s in self.shards],
            "tables": {name: {"rows": rows} for name, rows in self.tables.items()},
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any], path: str) -> Manifest:
        """Parse MANIFEST.json read from ``path``; the stored version must match G and seq."""
        _check_schema(obj, path)
        known = {"schema_version", "run", "generation", "seq", "version", "kind", "first_step"}
        known |= {"last_step", "created_at", "world_size", "shards", "tables"}
        try:
            m = cls(
                run=str(_require(obj, "run", path)),
                generation=int(_require(obj, "generation", path)),
                seq=int(_require(obj, "seq", path)),
                kind=DumpKind(_require(obj, "kind", path)),
                first_step=int(_require(obj, "first_step", path)),
                last_step=int(_require(obj, "last_step", path)),
                world_size=int(_require(obj, "world_size", path)),
                shards=tuple(_shard_from_json(s, path) for s in _require(obj, "shards", path)),
                tables={
                    validate_table_id(str(k)): int(v["rows"])
                    for k, v in _require(obj, "tables", path).items()
                },
                created_at=str(obj.get("created_at", "")),
                extra={k: v for k, v in obj.items() if k not in known},
            )
        except ArtifactError:
            raise
        except (KeyError, ValueError, TypeError, AttributeError) as e:
            raise ArtifactError(path, f"malformed MANIFEST.json: {e}") from e
        if "version" in obj and int(obj["version"]) != m.version:
            raise ArtifactError(
                path, f"version {obj['version']} != generation {m.generation} << 32 | seq {m.seq}"
            )
        seen: set[tuple[str, int]] = set()
        for shard in m.shards:
            if shard.rank >= m.world_size:
                raise ArtifactError(
                    path, f"shard {shard.path!r} has rank {shard.rank} of world size {m.world_size}"
                )
            if (shard.table, shard.rank) in seen:
                raise ArtifactError(path, f"shard {shard.path!r} is listed twice")
            seen.add((shard.table, shard.rank))
        return m
