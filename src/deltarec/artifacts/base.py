"""BASE.json: the commit record of a compacted base (SPEC §3a).

Layout::

    <root>/<run>/base-<G:06d>-<S:06d>/<table>/part-<P:05d>.parquet
    <root>/<run>/base-<G:06d>-<S:06d>/BASE.json                 # written last

A base folds generation ``G``'s lineage through dump ``S``: per table the newest row per key
(``op = 1`` rows kept), each part sorted by key, the parts of a table over disjoint key ranges.
A base directory without BASE.json is incomplete and ignored.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Protocol

from deltarec.artifacts.types import ShardInfo, TableSpec, _check_schema, _require, utc_now
from deltarec.errors import ArtifactError
from deltarec.ids import SCHEMA_VERSION, make_version, validate_run, validate_table_id

BASE_FILE = "BASE.json"
BASE_RE = re.compile(r"^base-(\d{6,})-(\d{6,})$")
_PART_RE = re.compile(r"^part-(\d{5})\.parquet$")


def base_name(generation: int, through_seq: int) -> str:
    """``base-<G:06d>-<S:06d>``."""
    return f"base-{generation:06d}-{through_seq:06d}"


def part_relpath(table: str, part: int) -> str:
    """A part's path relative to its base directory: ``<table>/part-<P:05d>.parquet``."""
    return f"{validate_table_id(table)}/part-{part:05d}.parquet"


@dataclass(frozen=True)
class LineageEntry:
    """One generation a base folds: its dumps through ``through_seq``, rows up to ``cutoff_step``.

    ``cutoff_step`` is the checkpoint step the next generation restored from (None for the
    base's own generation): rows of this generation read after it are not in the base.
    """

    generation: int
    through_seq: int
    cutoff_step: int | None

    def to_json(self) -> dict[str, Any]:
        """The JSON object of this entry."""
        return {
            "generation": self.generation,
            "through_seq": self.through_seq,
            "cutoff_step": self.cutoff_step,
        }


@dataclass(frozen=True)
class BasePart:
    """One parquet part of a base, as listed in BASE.json."""

    path: str
    table: str
    rows: int
    bytes: int
    sha256: str
    min_key: int | None
    max_key: int | None

    def to_json(self) -> dict[str, Any]:
        """The JSON object of this part."""
        return {
            "path": self.path,
            "table": self.table,
            "rows": self.rows,
            "bytes": self.bytes,
            "sha256": self.sha256,
            "min_key": self.min_key,
            "max_key": self.max_key,
        }


@dataclass(frozen=True)
class BaseInfo:
    """BASE.json: what a base holds and what it was built from."""

    run: str
    generation: int
    through_seq: int
    lineage: tuple[LineageEntry, ...]
    tables: dict[str, TableSpec]
    rows: dict[str, int]
    parts: tuple[BasePart, ...]
    base: tuple[int, int] | None = None  # (generation, through_seq) of the base built from
    last_step: int | None = None  # the newest folded dump's last_step (a field of our own)
    created_at: str = field(default_factory=utc_now)
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        validate_run(self.run)

    @property
    def through_version(self) -> int:
        """The version of the newest dump folded in."""
        return make_version(self.generation, self.through_seq)

    def covers(self, generation: int) -> int:
        """The newest seq of ``generation`` this base folds (``-1`` if none)."""
        for entry in self.lineage:
            if entry.generation == generation:
                return entry.through_seq
        return -1

    def parts_of(self, table: str) -> list[BasePart]:
        """The parts of one table, by key range."""
        return [p for p in self.parts if p.table == table]

    def to_json(self) -> dict[str, Any]:
        """The JSON object written as BASE.json."""
        base = (
            None if self.base is None else {"generation": self.base[0], "through_seq": self.base[1]}
        )
        return {
            "schema_version": self.schema_version,
            "run": self.run,
            "generation": self.generation,
            "through_seq": self.through_seq,
            "through_version": self.through_version,
            "created_at": self.created_at,
            "lineage": [e.to_json() for e in self.lineage],
            "base": base,
            "tables": {
                t: {**spec.to_json(), "rows": self.rows.get(t, 0)}
                for t, spec in self.tables.items()
            },
            "parts": [p.to_json() for p in self.parts],
            "last_step": self.last_step,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any], path: str) -> BaseInfo:
        """Parse BASE.json read from ``path``; part paths must be ``<table>/part-<P>.parquet``."""
        _check_schema(obj, path)
        try:
            base_obj = obj.get("base")
            info = cls(
                run=str(_require(obj, "run", path)),
                generation=int(_require(obj, "generation", path)),
                through_seq=int(_require(obj, "through_seq", path)),
                lineage=tuple(
                    LineageEntry(
                        int(e["generation"]),
                        int(e["through_seq"]),
                        None if e.get("cutoff_step") is None else int(e["cutoff_step"]),
                    )
                    for e in _require(obj, "lineage", path)
                ),
                tables={
                    validate_table_id(str(k)): TableSpec.from_json(v, f"{path}: tables.{k}")
                    for k, v in _require(obj, "tables", path).items()
                },
                rows={str(k): int(v.get("rows", 0)) for k, v in obj["tables"].items()},
                parts=tuple(_part(p) for p in _require(obj, "parts", path)),
                base=None
                if base_obj is None
                else (int(base_obj["generation"]), int(base_obj["through_seq"])),
                last_step=None if obj.get("last_step") is None else int(obj["last_step"]),
                created_at=str(obj.get("created_at", "")),
            )
        except ArtifactError:
            raise
        except (KeyError, ValueError, TypeError, AttributeError) as e:
            raise ArtifactError(path, f"malformed BASE.json: {e}") from e
        _check_parts(info, path)
        if "through_version" in obj and int(obj["through_version"]) != info.through_version:
            raise ArtifactError(path, f"through_version {obj['through_version']} does not match")
        return info


def _part(p: dict[str, Any]) -> BasePart:
    return BasePart(
        path=str(p["path"]),
        table=validate_table_id(str(p["table"])),
        rows=int(p["rows"]),
        bytes=int(p["bytes"]),
        sha256=str(p["sha256"]),
        min_key=None if p.get("min_key") is None else int(p["min_key"]),
        max_key=None if p.get("max_key") is None else int(p["max_key"]),
    )


def _check_parts(info: BaseInfo, path: str) -> None:
    """Part paths confined to ``<table>/part-<P:05d>.parquet``; a table's key ranges disjoint."""
    last: dict[str, int] = {}
    if len({p.path for p in info.parts}) != len(info.parts):
        raise ArtifactError(path, "a part is listed twice")
    for p in info.parts:
        head, _, tail = p.path.partition("/")
        if head != p.table or not _PART_RE.match(tail) or p.table not in info.tables:
            raise ArtifactError(
                path, f"part path {p.path!r} is not <table>/part-<P:05d>.parquet of a base table"
            )
        if p.rows and (p.min_key is None or p.max_key is None or p.min_key > p.max_key):
            raise ArtifactError(path, f"part {p.path!r} has no valid key range")
        if p.rows and p.table in last and p.min_key <= last[p.table]:  # type: ignore[operator]
            raise ArtifactError(path, f"part {p.path!r} overlaps the key range of the one before")
        if p.rows:
            last[p.table] = p.max_key  # type: ignore[assignment]
    if not info.lineage or info.lineage[-1].generation != info.generation:
        raise ArtifactError(path, "lineage does not end at the base's own generation")


class BaseRoot(Protocol):
    """What the base readers need of an artifact root.

    :class:`~deltarec.artifacts.ArtifactRoot` is one: it lists the base directories and names
    and reads their BASE.json. A Protocol, so this module stays below ``root.py``.
    """

    def base_dirs(self, run: str) -> list[tuple[int, int]]:
        """Every ``base-<G>-<S>`` directory of ``run`` (committed or not), ascending."""
        ...

    def base_file(self, run: str, generation: int, through_seq: int) -> str:
        """Path of BASE.json."""
        ...

    def exists(self, path: str) -> bool:
        """Whether ``path`` exists."""
        ...

    def read_json(self, path: str) -> dict[str, Any]:
        """Read and parse a JSON file; raises :class:`ArtifactError` naming the file."""
        ...

    def url(self, path: str) -> str:
        """A path as a URI (for messages)."""
        ...


def list_bases(root: BaseRoot, run: str) -> list[tuple[int, int]]:
    """``(generation, through_seq)`` of every committed base (with BASE.json), ascending."""
    return [b for b in root.base_dirs(run) if root.exists(root.base_file(run, *b))]


def read_base(root: BaseRoot, run: str, generation: int, through_seq: int) -> BaseInfo:
    """Parse BASE.json of one base; it must describe the base its directory names."""
    path = root.base_file(run, generation, through_seq)
    info = BaseInfo.from_json(root.read_json(path), root.url(path))
    if (info.run, info.generation, info.through_seq) != (run, generation, through_seq):
        raise ArtifactError(
            root.url(path),
            f"describes run {info.run!r} generation {info.generation} "
            f"through dump {info.through_seq}",
        )
    return info


def covered_seq(root: BaseRoot, run: str, generation: int) -> int:
    """The newest seq of ``generation`` that a committed base folds (``-1`` if none).

    A base of the generation itself is known by its name; a base of a later generation covers
    it through its lineage (its BASE.json is read).
    """
    covered = -1
    for g, s in list_bases(root, run):
        if g == generation:
            covered = max(covered, s)
        elif g > generation:
            covered = max(covered, read_base(root, run, g, s).covers(generation))
    return covered


def seq_ranges(seqs: list[int]) -> str:
    """``0-2, 4-6`` for ``[0, 1, 2, 4, 5, 6]`` (ascending seqs)."""
    out: list[list[int]] = []
    for s in seqs:
        if out and out[-1][1] == s - 1:
            out[-1][1] = s
        else:
            out.append([s, s])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


def part_shard(part: BasePart) -> ShardInfo:
    """A base part as a shard entry (rank 0), for the readers and checks of shards."""
    return ShardInfo(part.path, part.table, 0, part.rows, part.bytes, part.sha256)


def usable_base(
    root: BaseRoot,
    run: str,
    chain: list[tuple[int, int | None]],
    through_seq: int | None,
) -> BaseInfo | None:
    """The newest committed base a replay of ``chain`` through ``through_seq`` may start from.

    ``chain`` is the lineage as ``(generation, cutoff step or None)``, oldest first, ending at
    the generation replayed. A base fits when its lineage is a prefix of ``chain`` with the
    same cutoffs, and its own generation is either the one replayed (folded no further than
    ``through_seq``) or an ancestor whose folded rows were all read at or before the step its
    child restored from.
    """
    target = chain[-1][0]
    order = [g for g, _ in chain]
    cut = dict(chain)
    for g, s in sorted(list_bases(root, run), reverse=True):
        if g not in cut or (g == target and through_seq is not None and s > through_seq):
            continue
        info = read_base(root, run, g, s)
        gens = [e.generation for e in info.lineage]
        if gens != order[: len(gens)]:
            continue
        if any(cut[e.generation] != e.cutoff_step for e in info.lineage[:-1]):
            continue
        if g == target:
            return info
        limit = cut[g]
        if limit is not None and info.last_step is not None and info.last_step <= limit:
            return info
    return None
