"""Compaction fanned out: a base built by partitions, then committed once all are done (SPEC §3a).

A base of ``(G, S)`` holds, per table, the table's records in key order cut into parts of
``part_rows`` rows: part ``p`` holds positions ``[p * part_rows, (p + 1) * part_rows)``, so a
table of ``R`` rows has ``P = ceil(R / part_rows)`` parts whatever builds them. A partition
``I/N`` of a table writes the parts ``[I * P // N, (I + 1) * P // N)`` (a key range) and then its
record, ``<table>/partition-<I:05d>-of-<N:05d>.json`` in the base directory: what it wrote
(each part's rows, bytes, sha256 and key range) and what every partition of the base must
agree on (the table's rows, ``part_rows``, the lineage folded, the tables of the base).

:func:`commit_base` writes BASE.json only when, for every table of the base, the records of
one ``part_rows`` cover its parts ``0 .. P-1``; otherwise it refuses, naming the missing
parts. The partitions of one base may be any mix of ``N`` (a re-run with another fan-out
reuses what is done): parts are named by their place in the table, not by the partition.

Crash safety: parts and records are written under a temporary name and renamed; BASE.json is
written last. A base directory without BASE.json is ignored by every reader, so a fan-out
killed at any point leaves the previous state valid; running the partitions again skips
those whose record (and parts) are in place, and the commit completes the base.
"""

from __future__ import annotations

import json
import logging
import math
import posixpath
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from deltarec.artifacts.base import BaseInfo, BasePart, LineageEntry, list_bases
from deltarec.artifacts.compact import (
    PART_ROWS,
    CompactResult,
    _json,
    _lineage,
    write_table_parts,
)
from deltarec.artifacts.lineage import ExpectedState, expected_state
from deltarec.artifacts.root import ArtifactRoot
from deltarec.artifacts.types import TableKind, TableSpec
from deltarec.errors import ArtifactError, BadInputError
from deltarec.faults import failpoint
from deltarec.ids import SCHEMA_VERSION, validate_table_id

log = logging.getLogger(__name__)

_RECORD_RE = re.compile(r"^partition-(\d{5})-of-(\d{5})\.json$")
MAX_PARTITIONS = 1024
"""The most key ranges one table is cut into."""


def parse_key_range(text: str) -> tuple[int, int]:
    """``"I/N"`` as ``(I, N)`` with ``0 <= I < N <= MAX_PARTITIONS``.

    Raises:
        BadInputError: anything else (names the text).
    """
    i, sep, n = text.partition("/")
    try:
        index, count = int(i), int(n)
    except ValueError:
        index, count = -1, 0
    if not sep or not 0 <= index < count <= MAX_PARTITIONS:
        raise BadInputError(
            f"key range {text!r}: expected I/N with 0 <= I < N <= {MAX_PARTITIONS}, e.g. 0/4"
        )
    return index, count


def record_relpath(table: str, index: int, count: int) -> str:
    """A partition record's path relative to its base directory."""
    return f"{validate_table_id(table)}/partition-{index:05d}-of-{count:05d}.json"


def part_span(rows: int, part_rows: int, index: int, count: int) -> range:
    """The parts (by their place in the table) partition ``index`` of ``count`` writes."""
    total = math.ceil(rows / part_rows)
    return range(index * total // count, (index + 1) * total // count)


@dataclass(frozen=True)
class PartitionResult:
    """What :func:`compact_partition` did, per table: ``"written"`` or ``"done before"``."""

    generation: int
    through_seq: int
    key_range: tuple[int, int]
    tables: dict[str, str]
    committed: bool  # the base was committed already: nothing to do


def compact_partition(
    root: ArtifactRoot,
    run: str,
    generation: int,
    through_seq: int,
    *,
    tables: Iterable[str] | None = None,
    key_range: tuple[int, int] = (0, 1),
    part_rows: int = PART_ROWS,
) -> PartitionResult:
    """Write one partition of the base of ``(generation, through_seq)``; BASE.json is not written.

    Args:
        root: the artifact root.
        run: the run.
        generation: the generation folded.
        through_seq: the newest dump folded (every partition of a base names the same one).
        tables: the tables of this partition (default: every table of the base).
        key_range: ``(I, N)``: the I-th of N key ranges of each of those tables.
        part_rows: the most rows of one part (every partition of a base uses the same).

    Raises:
        BadInputError: a bad ``part_rows`` or key range, an unknown table, no such dump.
        MissingDumpError: the chain after the previous base has a hole.
    """
    index, count = key_range
    parse_key_range(f"{index}/{count}")
    if part_rows < 1:
        raise BadInputError(f"part_rows must be at least 1, got {part_rows}")
    if (generation, through_seq) in list_bases(root, run):
        return PartitionResult(generation, through_seq, key_range, {}, True)
    only = None if tables is None else set(tables)
    state = expected_state(root, run, generation, through_seq, only=only)
    wanted = sorted(state.tables if only is None else only)
    unknown = [t for t in wanted if t not in state.tables]
    if unknown:
        raise BadInputError(f"run {run!r} generation {generation} has no table {unknown}")
    base_dir = root.base_dir(run, generation, through_seq)
    done = {}
    for table in wanted:
        t = state.tables[table]
        rel = record_relpath(table, index, count)
        if _record_in_place(root, base_dir, rel, len(t.keys), part_rows):
            done[table] = "done before"
            continue
        span = part_span(len(t.keys), part_rows, index, count)
        parts = write_table_parts(root, base_dir, t, part_rows, span)
        record = _record(root, state, table, key_range, part_rows, parts)
        failpoint("compact.partition")
        root.write_bytes_atomic(posixpath.join(base_dir, rel), json.dumps(record).encode())
        done[table] = "written"
    return PartitionResult(generation, through_seq, key_range, done, False)


def _record(
    root: ArtifactRoot,
    state: ExpectedState,
    table: str,
    key_range: tuple[int, int],
    part_rows: int,
    parts: list[BasePart],
) -> dict[str, Any]:
    base = state.base
    return {
        "schema_version": SCHEMA_VERSION,
        "run": state.run,
        "generation": state.generation,
        "through_seq": state.through_seq,
        "table": table,
        "key_range": list(key_range),
        "part_rows": part_rows,
        "rows": len(state.tables[table].keys),
        "parts": [p.to_json() for p in parts],
        "tables": {t: s.spec.to_json() for t, s in sorted(state.tables.items())},
        "lineage": [e.to_json() for e in _lineage(root, state)],
        "base": None if base is None else [base.generation, base.through_seq],
        "last_step": state.manifests[-1].last_step
        if state.manifests
        else (base.last_step if base is not None else None),
    }


def _record_in_place(
    root: ArtifactRoot, base_dir: str, rel: str, rows: int, part_rows: int
) -> bool:
    """Whether a record of this partition (same rows and ``part_rows``) and its parts exist."""
    path = posixpath.join(base_dir, rel)
    if not root.exists(path):
        return False
    try:
        rec = root.read_json(path)
    except (ArtifactError, OSError, ValueError):
        return False
    if rec.get("rows") != rows or rec.get("part_rows") != part_rows:
        return False
    return all(_part_in_place(root, base_dir, p) for p in rec.get("parts", []))


def _part_in_place(root: ArtifactRoot, base_dir: str, part: dict[str, Any]) -> bool:
    path = posixpath.join(base_dir, str(part["path"]))
    try:
        return bool(root.fs.size(path) == part["bytes"])
    except (FileNotFoundError, OSError):
        return False


def commit_base(
    root: ArtifactRoot,
    run: str,
    generation: int,
    through_seq: int,
    *,
    part_rows: int = PART_ROWS,
) -> CompactResult:
    """Write BASE.json of ``(generation, through_seq)`` once every partition is in place.

    Args:
        root: the artifact root.
        run: the run.
        generation: the generation folded.
        through_seq: the newest dump folded.
        part_rows: the ``part_rows`` the partitions were written with.

    Returns:
        The committed base; ``written`` is False if it was committed already.

    Raises:
        BadInputError: no partition was written, or some parts of a table are missing (names
            the table and the parts), or the partitions disagree on what they fold.
    """
    from deltarec.artifacts.base import read_base

    if (generation, through_seq) in list_bases(root, run):
        return CompactResult(read_base(root, run, generation, through_seq), False, 0)
    base_dir = root.base_dir(run, generation, through_seq)
    records = _records(root, base_dir, part_rows)
    where = f"base {root.url(base_dir)}"
    if not records:
        raise BadInputError(f"{where}: no partition written with part_rows {part_rows}")
    first = records[0]
    for rec in records:
        for key in ("run", "generation", "through_seq", "tables", "lineage", "base", "last_step"):
            if rec[key] != first[key]:
                raise BadInputError(f"{where}: partitions disagree on {key!r}; run them again")
    specs = {str(t): TableSpec.from_json(s, where) for t, s in first["tables"].items()}
    parts, rows = _covered(root, base_dir, records, specs, where)
    base = first["base"]
    info = BaseInfo(
        run=run,
        generation=generation,
        through_seq=through_seq,
        lineage=tuple(
            LineageEntry(int(e["generation"]), int(e["through_seq"]), e["cutoff_step"])
            for e in first["lineage"]
        ),
        tables=specs,
        rows=rows,
        parts=tuple(parts),
        base=None if base is None else (int(base[0]), int(base[1])),
        last_step=first["last_step"],
    )
    failpoint("compact.base_json")
    root.write_bytes_atomic(root.base_file(run, generation, through_seq), _json(info))
    _drop_records(root, base_dir, records)
    log.info("base %s committed: %d parts from %d partitions", base_dir, len(parts), len(records))
    return CompactResult(info, True, 0)


def _records(root: ArtifactRoot, base_dir: str, part_rows: int) -> list[dict[str, Any]]:
    """Every partition record of the base written with ``part_rows`` (others are stale)."""
    out = []
    try:
        found = root.fs.glob(posixpath.join(base_dir, "*", "partition-*-of-*.json"))
    except FileNotFoundError:
        found = []
    for path in sorted(str(p) for p in found):
        if not _RECORD_RE.match(posixpath.basename(path)):
            continue
        rec = root.read_json(path)
        if rec.get("schema_version") != SCHEMA_VERSION:
            raise ArtifactError(root.url(path), "unknown partition record schema_version")
        if rec.get("part_rows") == part_rows:
            rec["_path"] = path
            out.append(rec)
    return out


def _covered(
    root: ArtifactRoot,
    base_dir: str,
    records: list[dict[str, Any]],
    specs: dict[str, TableSpec],
    where: str,
) -> tuple[list[BasePart], dict[str, int]]:
    """Each table's parts ``0 .. P-1`` from the records, or an error naming what is missing."""
    parts: list[BasePart] = []
    rows: dict[str, int] = {}
    missing = []
    for table in sorted(specs):
        mine = [r for r in records if r["table"] == table]
        if not mine:
            missing.append(f"{table} (no partition)")
            continue
        counts = {int(r["rows"]) for r in mine}
        if len(counts) != 1:
            raise BadInputError(f"{where}: partitions of {table} disagree on its rows {counts}")
        rows[table] = counts.pop()
        part_rows = int(mine[0]["part_rows"])
        by_place: dict[int, BasePart] = {}
        for r in mine:
            for p in r["parts"]:
                by_place[int(p["path"].rsplit("-", 1)[1].split(".")[0])] = BasePart(**p)
        want = range(math.ceil(rows[table] / part_rows))
        gone = [p for p in want if p not in by_place]
        if gone:
            missing.append(f"{table} parts {gone[0]}-{gone[-1]} of {len(want)}")
            continue
        for p in want:
            if not _part_in_place(root, base_dir, by_place[p].to_json()):
                raise BadInputError(
                    f"{where}: part {by_place[p].path} is not the one its partition wrote; "
                    "run that partition again"
                )
            parts.append(by_place[p])
    if missing:
        raise BadInputError(
            f"{where} is not complete: missing {'; '.join(missing)}; run the missing partitions "
            "(deltarec compact --key-range I/N) and commit again"
        )
    return parts, rows


def estimate_rows(
    root: ArtifactRoot, run: str, generation: int, through_seq: int
) -> dict[str, int]:
    """An upper bound of each table's rows in the base of ``(generation, through_seq)``.

    Read from BASE.json of the newest base that fits and the manifests of the dumps after it
    (their rows summed, so a key written by two dumps counts twice), capped by the table's
    capacity (``num_embeddings``) for a plain table (a ZCH table's base also keeps the evicted
    ids: no cap). No parquet is read: the pipeline decides its fan-out with it.
    """
    from deltarec.artifacts.base import usable_base
    from deltarec.artifacts.lineage import cutoffs

    chain = cutoffs(root, run, generation)
    base = usable_base(root, run, chain, through_seq)
    est: dict[str, int] = dict(base.rows) if base is not None else {}
    specs: dict[str, TableSpec] = dict(base.tables) if base is not None else {}
    folded = {e.generation: e.through_seq for e in base.lineage} if base is not None else {}
    for gen, cutoff in chain:
        if gen in folded and base is not None and gen != base.generation:
            continue
        specs.update(root.read_generation(run, gen).tables)
        for seq in root.list_dumps(run, gen):
            if seq <= folded.get(gen, -1) or (gen == generation and seq > through_seq):
                continue
            m = root.read_manifest(run, gen, seq)
            if cutoff is not None and m.first_step > cutoff:
                break
            for table, n in m.tables.items():
                est[table] = est.get(table, 0) + int(n)
    out = {}
    for table, spec in specs.items():
        cap = spec.num_embeddings if spec.kind is TableKind.PLAIN else 0
        out[table] = min(est.get(table, 0), cap) if cap else est.get(table, 0)
    return out


def _drop_records(root: ArtifactRoot, base_dir: str, records: list[dict[str, Any]]) -> None:
    """The records are of no use once BASE.json lists the parts; a crash here leaves them."""
    for rec in records:
        try:
            root.fs.rm(str(rec["_path"]))
        except (FileNotFoundError, OSError) as e:  # harmless: a committed base ignores them
            log.debug("partition record %s stays: %s", rec["_path"], e)


__all__ = [
    "MAX_PARTITIONS",
    "PartitionResult",
    "commit_base",
    "compact_partition",
    "estimate_rows",
    "parse_key_range",
    "part_span",
    "record_relpath",
]
