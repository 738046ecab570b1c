"""Compaction: fold a generation's lineage through a dump into a base (SPEC §3a).

A base is what verify expects of serving at ``(G, S)``: per table the latest record of every
key (``op = 1`` records kept), with the version of the dump that wrote it. It is built by the
same replay readers use (:func:`~deltarec.artifacts.lineage.expected_state`), which starts from
the newest base that fits and reads only the dumps after it: a base is built from the previous
base plus the dumps after it, never from the whole history.

Crash safety: every part is written under a temporary name and renamed into place, and
BASE.json is written last, the same way. A base directory without BASE.json is ignored by
every reader, so a compaction killed at any point leaves the previous state valid; running it
again rewrites the parts and commits.
"""

from __future__ import annotations

import hashlib
import io
import logging
import posixpath
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from deltarec.artifacts import codec, pacing
from deltarec.artifacts.base import (
    BaseInfo,
    BasePart,
    LineageEntry,
    list_bases,
    part_relpath,
    read_base,
)
from deltarec.artifacts.expected import ExpectedRows, ExpectedTable
from deltarec.artifacts.lineage import ExpectedState, cutoffs, expected_state
from deltarec.artifacts.root import ArtifactRoot
from deltarec.errors import BadInputError
from deltarec.faults import failpoint

log = logging.getLogger(__name__)

PART_ROWS = 1 << 20
"""Rows per part unless told: parts of a table are key ranges of at most this many rows."""


@dataclass(frozen=True)
class CompactResult:
    """What :func:`compact` did: the committed base and whether this call wrote it."""

    base: BaseInfo
    written: bool
    dumps_read: int


def compact(
    root: ArtifactRoot,
    run: str,
    generation: int | None = None,
    through_seq: int | None = None,
    *,
    tables: Iterable[str] | None = None,
    part_rows: int = PART_ROWS,
) -> CompactResult:
    """Write (or find) the base of ``run``'s ``generation`` through dump ``through_seq``.

    Args:
        root: the artifact root.
        run: the run.
        generation: the generation folded (default: the newest).
        through_seq: the newest dump folded (default: the generation's newest committed one).
        tables: only these tables (default: every table); a base of some tables serves the
            readers of those only, so the default is what retention counts on.
        part_rows: the most rows of one part.

    Returns:
        The committed base; ``written`` is False if it was committed already.

    Raises:
        BadInputError: no generation, no committed dump, or a bad ``part_rows``.
        MissingDumpError: the chain after the previous base has a hole.
    """
    if part_rows < 1:
        raise BadInputError(f"part_rows must be at least 1, got {part_rows}")
    generation = generation if generation is not None else root.latest_generation(run)
    if through_seq is None:
        seqs = root.list_dumps(run, generation)
        if not seqs:
            raise BadInputError(
                f"run {run!r} generation {generation} under {root.uri} has no committed dump"
            )
        through_seq = seqs[-1]
    if (generation, through_seq) in list_bases(root, run):
        return CompactResult(read_base(root, run, generation, through_seq), False, 0)
    state = expected_state(root, run, generation, through_seq)
    wanted = sorted(state.tables if tables is None else set(tables))
    unknown = [t for t in wanted if t not in state.tables]
    if unknown:
        raise BadInputError(f"run {run!r} generation {generation} has no table {unknown}")
    base_dir = root.base_dir(run, generation, through_seq)
    parts: list[BasePart] = []
    for table in wanted:
        parts.extend(write_table_parts(root, base_dir, state.tables[table], part_rows))
    info = BaseInfo(
        run=run,
        generation=generation,
        through_seq=through_seq,
        lineage=_lineage(root, state),
        tables={t: state.tables[t].spec for t in wanted},
        rows={t: len(state.tables[t].keys) for t in wanted},
        parts=tuple(parts),
        base=None if state.base is None else (state.base.generation, state.base.through_seq),
        last_step=state.manifests[-1].last_step if state.manifests else _base_step(state),
    )
    failpoint("compact.base_json")
    root.write_bytes_atomic(root.base_file(run, generation, through_seq), _json(info))
    log.info(
        "base %s: %d rows in %d parts from %s and %d dumps",
        base_dir,
        sum(info.rows.values()),
        len(parts),
        "no base" if state.base is None else f"base {info.base}",
        len(state.manifests),
    )
    return CompactResult(info, True, len(state.manifests))


def _base_step(state: ExpectedState) -> int | None:
    return state.base.last_step if state.base is not None else None


def _json(info: BaseInfo) -> bytes:
    import json

    return json.dumps(info.to_json(), indent=2).encode()


def _lineage(root: ArtifactRoot, state: ExpectedState) -> tuple[LineageEntry, ...]:
    """Each generation of the lineage with the newest seq folded and its cutoff step."""
    newest: dict[int, int] = {}
    if state.base is not None:
        newest.update({e.generation: e.through_seq for e in state.base.lineage})
    for m in state.manifests:
        newest[m.generation] = max(newest.get(m.generation, -1), m.seq)
    return tuple(
        LineageEntry(g, newest.get(g, -1), cutoff)
        for g, cutoff in cutoffs(root, state.run, state.generation)
    )


def write_table_parts(
    root: ArtifactRoot,
    base_dir: str,
    table: ExpectedTable,
    part_rows: int,
    span: range | None = None,
) -> list[BasePart]:
    """Parts of one table: its records in key order, ``part_rows`` a part.

    Args:
        root: the artifact root written to.
        base_dir: the base's directory (the parts go under ``<table>/``).
        table: the table's records, in key order.
        part_rows: rows per part.
        span: which parts (by their place in the table); None: every part.
    """
    n = len(table.keys)
    parts = []
    with ExpectedRows(table) as rows:
        for p in span if span is not None else range(-(-n // part_rows)):
            lo, hi = p * part_rows, min(n, (p + 1) * part_rows)
            data = _part_bytes(table, rows, lo, hi)
            relpath = part_relpath(table.table, p)
            failpoint("compact.part")
            digest = _sha256(data)
            root.write_bytes_atomic(posixpath.join(base_dir, relpath), data)
            pacing.checkpoint()
            parts.append(
                BasePart(
                    path=relpath,
                    table=table.table,
                    rows=hi - lo,
                    bytes=len(data),
                    sha256=digest,
                    min_key=int(table.keys[lo]),
                    max_key=int(table.keys[hi - 1]),
                )
            )
    return parts


def _part_bytes(table: ExpectedTable, rows: ExpectedRows, lo: int, hi: int) -> bytes:
    """Records ``[lo, hi)`` as one parquet part: key, embedding, op, step, version (SPEC §3a).

    Gathered, encoded and written a row group at a time (the bytes are those of one
    ``pq.write_table`` of the whole part with the same row group size): a bounded chunk of
    work between two pacing checkpoints, and only one row group's rows gathered at once.
    """
    spec = table.spec
    group = codec.row_group_rows(spec.dtype, spec.dim)
    buf = io.BytesIO()
    writer: pq.ParquetWriter | None = None
    try:
        for a in range(lo, hi, group):
            pos = np.arange(a, min(hi, a + group), dtype=np.int64)
            chunk = _arrow(table, pos, rows.take(pos))
            if writer is None:
                writer = pq.ParquetWriter(buf, chunk.schema)
            writer.write_table(chunk, row_group_size=group)
            pacing.checkpoint()
    finally:
        if writer is not None:
            writer.close()
    return buf.getvalue()


def _arrow(table: ExpectedTable, pos: np.ndarray, embedding: np.ndarray) -> pa.Table:
    spec = table.spec
    shard = codec.to_arrow(table.keys[pos], embedding, table.ops[pos], table.steps[pos], spec.dtype)
    return shard.append_column(
        pa.field(codec.VERSION, pa.int64(), nullable=False),
        pa.array(np.asarray(table.versions[pos], np.int64)),
    )


_HASH_SLICE = 16 << 20
"""Bytes hashed between two pacing checkpoints."""


def _sha256(data: bytes) -> str:
    digest = hashlib.sha256()
    view = memoryview(data)
    for at in range(0, len(view), _HASH_SLICE):
        digest.update(view[at : at + _HASH_SLICE])
        pacing.checkpoint()
    return digest.hexdigest()
