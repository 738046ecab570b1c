"""Verification: compare what a store holds with what a generation's artifacts say it must hold.

:func:`verify` resolves the expected state of a generation through a dump from the lineage
(:func:`deltarec.artifacts.lineage.expected_state`), checks every shard of that lineage
against its manifest (:mod:`deltarec.verify.shards`), draws a seeded random sample of keys per
table (or takes every key), reads those keys from the store in batches, and classifies each key
(:class:`~deltarec.verify.types.RowClass`) by what the store can hold
(:class:`~deltarec.verify.compare.Holds`: rows without versions are checked by value; on a store
that cannot delete, an evicted id must hold its fallback row). With every key checked on a store
that can list its keys, the store's keys are scanned too to find rows the lineage never wrote
(:mod:`deltarec.verify.scan`). A generation published in ``staged`` mode and not promoted yet is
checked as serving will hold it after promote (:class:`~deltarec.verify.reader.Reader`).

Read by key, expected rows are loaded from the shards in chunks of ``load_chunk`` keys, so
memory is bounded by one chunk of rows plus the row groups holding them, whatever the table
size. In the one-pass scan they are streamed from the shards' row groups as the store's rows
arrive (:class:`~deltarec.artifacts.lineage.ExpectedRows`).
"""

from __future__ import annotations

import logging
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from deltarec.artifacts import codec
from deltarec.artifacts.lineage import ExpectedTable, expected_state
from deltarec.artifacts.newer import rollback_generations
from deltarec.artifacts.root import ArtifactRoot
from deltarec.artifacts.types import FALLBACK_KEY, utc_now
from deltarec.artifacts.wholeshard import CheckedShards
from deltarec.errors import ArtifactError, BadInputError
from deltarec.readahead import ReadAhead
from deltarec.stores.base import Store
from deltarec.verify.collect import Collector
from deltarec.verify.compare import ExpectedBatch, Holds, point_of
from deltarec.verify.count import count_keys, newer_tables
from deltarec.verify.freshness import dump_freshness
from deltarec.verify.options import VerifyOptions
from deltarec.verify.partition import PARTITION_NOTE
from deltarec.verify.reader import LaterDeletes, Reader
from deltarec.verify.records import store_id
from deltarec.verify.scan import scan_unknown, start_scan, verify_table_by_scan
from deltarec.verify.shards import check_shards, lineage_shard_refs
from deltarec.verify.types import TableResult, VerifyResult

log = logging.getLogger(__name__)


def verify(
    root: ArtifactRoot,
    run: str,
    store: Store,
    options: VerifyOptions | None = None,
    *,
    store_url: str = "",
    generation: int | None = None,
    through_seq: int | None = None,
) -> VerifyResult:
    """Verify a store against a generation of ``run`` through dump ``through_seq``.

    Args:
        root: the artifact root.
        run: the run name.
        store: an open store.
        options: how to sample, batch and report (default: :class:`VerifyOptions`).
        store_url: the store URL, for the result (pass it with credentials removed).
        generation: the generation to verify (default: the newest).
        through_seq: the last dump to include (default: the newest committed one).

    Returns:
        The result; ``result.passed`` says whether the check passed.

    Raises:
        BadInputError: no such run/generation/dump, or bad options.
    """
    opts = options or VerifyOptions()
    t0 = time.monotonic()
    if generation is None:
        generation = root.latest_generation(run)
    elif generation not in root.list_generations(run):
        raise BadInputError(
            f"run {run!r} has no generation {generation} under {root.uri} "
            f"(generations: {root.list_generations(run)})"
        )
    dumps = root.list_dumps(run, generation)
    seq = through_seq if through_seq is not None else (dumps[-1] if dumps else None)
    result = VerifyResult(
        run=run,
        generation=generation,
        through_seq=seq,
        version=point_of(generation, seq),
        store=store_url,
        store_id=store_id(store),
        mode="all" if opts.all_keys else "sample",
        sample=opts.sample,
        seed=opts.seed,
        started_at=utc_now(),
    )
    _check_lineage(root, run, generation, store, result)
    early = _early_scan(root, run, generation, store, opts)
    try:
        return _verify_state(root, run, generation, seq, store, opts, result, early, t0)
    finally:
        if early is not None:
            early[1].close()


def _check_lineage(
    root: ArtifactRoot, run: str, generation: int, store: Store, result: VerifyResult
) -> None:
    """Fail ``result`` where the store's generation was published from other artifacts."""
    held = store.registry.generation_origin(run, generation)
    ours = root.read_generation(run, generation).created_at
    if held and ours and held != ours:
        result.errors.append(
            f"run {run!r} generation {generation} was published to this store from artifacts "
            f"created at {held}, not from these (created at {ours}): the store holds another "
            "lineage under this run name (docs/runs.md, rule 5)"
        )


def _early_scan(
    root: ArtifactRoot, run: str, generation: int, store: Store, opts: VerifyOptions
) -> tuple[str, ReadAhead[Any]] | None:
    """The one-pass store scan of the generation's first table, started now, if it may be used.

    With every key checked on a store that can scan, the scan (a server's work, on a thread)
    starts before the expected state is read from the shards instead of after it. Used when
    that table's turn comes and it goes by the scan (:func:`_verify_one`); otherwise closed.
    """
    part = opts.partition
    if not (opts.all_keys and store.capabilities.scan) or (part is not None and part.count > 1):
        return None
    try:
        tables = root.read_generation(run, generation).tables
    except ArtifactError:
        return None  # said by the expected state's error
    if not tables:
        return None
    table = min(tables)
    return table, start_scan(store, table, tables[table], opts.batch_size)


def _verify_state(
    root: ArtifactRoot,
    run: str,
    generation: int,
    seq: int | None,
    store: Store,
    opts: VerifyOptions,
    result: VerifyResult,
    early: tuple[str, ReadAhead[Any]] | None,
    t0: float,
) -> VerifyResult:
    """:func:`verify` from the expected state on (``early``: a scan already started)."""
    try:
        checked = CheckedShards(root)  # each small shard read once: checked, keys, rows
        state = expected_state(root, run, generation, seq, checked=checked)
    except ArtifactError as e:
        # A corrupted or missing shard: name it by checking every shard the lineage lists.
        result.errors.append(f"expected state could not be computed: {e}")
        refs = lineage_shard_refs(root, run, generation, seq)
        result.shards_checked, result.shard_failures = check_shards(root, refs)
        result.duration_s = time.monotonic() - t0
        return result
    result.version = state.version
    result.notes.extend(_store_notes(store, opts))
    part = opts.partition
    if part is not None:
        result.notes.append(PARTITION_NOTE.format(index=part.index, count=part.count))
    holds = Holds.of(store.capabilities)
    # Checksums (hashlib runs outside the GIL) overlap with reading the store.
    with ThreadPoolExecutor(1, thread_name_prefix="verify-sha256") as pool:
        refs = state.shard_refs()
        checks = pool.submit(check_shards, root, part.share(refs) if part else refs, checked)
        rollbacks = rollback_generations(root, run, generation, seq)
        result.rollback_generations = sorted(rollbacks)
        reader = Reader(store, run, generation, state.manifests)
        later = LaterDeletes(root, run, result.version)
        newer = None if opts.all_keys else newer_tables(store, run, result.version, rollbacks)
        for table in sorted(state.tables):
            et = state.tables[table]
            acc = Collector(_table_result(et), opts.max_mismatches, later, holds)
            started = early[1] if early is not None and early[0] == table else None
            result.tables[table] = _verify_one(
                et, reader, acc, result.version, rollbacks, opts, started
            )
            if not opts.all_keys:
                partitioned = part is not None and part.count > 1
                staged = reader.staged(table)
                count_keys(result, et, store, staged=staged, partitioned=partitioned, newer=newer)
        result.shards_checked, result.shard_failures = checks.result()
    result.staged_tables = sorted(t for t in state.tables if reader.staged(t))
    result.dumps = dump_freshness(state, result, store.registry)
    result.duration_s = time.monotonic() - t0
    return result


def _store_notes(store: Store, opts: VerifyOptions) -> list[str]:
    """What this store cannot show, said once in the result."""
    caps, kind = store.capabilities, store.kind
    notes = []
    if opts.all_keys and not caps.scan:
        notes.append(
            f"the {kind} store cannot list its keys: every key the artifacts expect was read "
            "back, but keys the lineage never wrote (unexpected extra rows) cannot be seen"
        )
    if not caps.versions:
        notes.append(
            f"the {kind} store keeps no row versions: rows were compared by value within the "
            "dtype's tolerance"
        )
    if not caps.fallback_key:
        notes.append(
            f"the {kind} store does not hold key {FALLBACK_KEY} (the fallback row) by its "
            "contract: it was not checked"
        )
    if not caps.deletes:
        notes.append(
            f"the {kind} store cannot delete: a key the model holds no row for (op 1: an "
            "evicted ZCH id, or one looked up but never admitted) is expected to hold its "
            "fallback row"
        )
    return notes


def _table_result(et: ExpectedTable) -> TableResult:
    res = TableResult(et.table, et.spec.dtype.value, et.spec.dim)
    res.expected_keys = len(et.keys)
    res.expected_present = int(et.present.sum())
    return res


def _verify_one(
    et: ExpectedTable,
    reader: Reader,
    acc: Collector,
    point_version: int,
    rollbacks: frozenset[int],
    opts: VerifyOptions,
    started: ReadAhead[Any] | None = None,
) -> TableResult:
    """One table: one pass over the store with ``--all`` when it fits, else lookups by key.

    ``started``: the table's store scan, already under way (used by the one pass, else left
    for the caller to close).
    """
    can_scan = reader.store.capabilities.scan
    part = opts.partition if opts.partition and opts.partition.count > 1 else None
    if (
        opts.all_keys
        and can_scan
        and part is None
        and _fits(et, opts.full_scan_bytes)
        and not reader.staged(et.table)
    ):
        return verify_table_by_scan(et, reader.store, acc, point_version, rollbacks, opts, started)
    keys = _sample_keys(et, opts.sample, opts.seed)
    keep = None if part is None else (lambda k: part.mask(et.keys, k))
    if keep is not None:
        keys = keys[keep(keys)]
    if not reader.store.capabilities.fallback_key:
        keys = keys[keys != FALLBACK_KEY]
    _verify_table(et, reader, keys, acc, point_version, rollbacks, opts)
    if opts.all_keys and can_scan:
        acc.res.store_keys_scanned = scan_unknown(
            et, reader, acc, point_version, rollbacks, opts.batch_size, keep
        )
    return acc.res


def _sample_keys(table: ExpectedTable, sample: int | None, seed: int) -> np.ndarray:
    """Sorted keys to check: all with ``sample=None``, else a seeded sample without replacement.

    The generator is seeded with ``(seed, crc32(table id))`` so each table gets its own
    reproducible sample, independent of which other tables exist.
    """
    n = len(table.keys)
    if sample is None or sample >= n:
        return table.keys
    rng = np.random.default_rng([seed, zlib.crc32(table.table.encode())])
    return np.sort(table.keys[rng.choice(n, size=sample, replace=False)])


def _verify_table(
    table: ExpectedTable,
    store: Reader,
    keys: np.ndarray,
    acc: Collector,
    point_version: int,
    rollbacks: frozenset[int],
    opts: VerifyOptions,
) -> None:
    """Read ``keys`` from the store in batches and classify them against their records."""
    present = table.present  # computed once, not per batch
    batch_size, step = opts.batch_size, max(opts.load_chunk, opts.batch_size)
    total = len(keys)
    for start in range(0, total, step):
        chunk = keys[start : start + step]
        pos = table.index_of(chunk)
        rows = table.load(chunk)
        for b in range(0, len(chunk), batch_size):
            sl = slice(b, b + batch_size)
            exp = ExpectedBatch(chunk[sl], table.versions[pos[sl]], present[pos[sl]], rows[sl])
            got = store.read(table.table, exp.keys)
            store.drop_staged_deletes(table.table, exp, got)
            acc.add(exp, got, point_version, rollbacks)
            if opts.progress is not None:
                opts.progress(table.table, start + min(b + batch_size, len(chunk)), total)


def _fits(table: ExpectedTable, budget: int) -> bool:
    row = codec.row_bytes(table.spec.dtype, table.spec.dim)
    return len(table.keys) * row <= budget


__all__ = ["verify"]
