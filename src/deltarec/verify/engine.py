"""Verification: compare what a store holds with what a generation's artifacts say it must hold.

:func:`verify` resolves the expected state of a generation through a dump from the lineage
(:func:`deltarec.artifacts.lineage.expected_state`), checks every shard of that lineage
against its manifest (sha256, size, row count), draws a seeded random sample of keys per table
(or takes every key), reads those keys from the store in batches, and classifies each key
(:class:`~deltarec.verify.types.RowClass`). With ``all_keys`` it also scans the store's keys
to find rows the lineage never wrote. A generation published in ``staged`` mode and not
promoted yet is checked as serving will hold it after promote (its staging views merged over
the live views).

Read by key, expected rows are loaded from the shards in chunks of ``load_chunk`` keys, so
memory is bounded by one chunk of rows plus the row groups holding them, whatever the table
size. In the one-pass scan they are streamed from the shards' row groups as the store's rows
arrive (:class:`~deltarec.artifacts.lineage.ExpectedRows`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from deltarec.artifacts import codec
from deltarec.artifacts.lineage import (
    ExpectedRows,
    ExpectedState,
    ExpectedTable,
    ShardRef,
    expected_state,
)
from deltarec.artifacts.root import ArtifactRoot
from deltarec.artifacts.shards import check_shard
from deltarec.artifacts.types import Manifest, parse_time, utc_now
from deltarec.errors import ArtifactError, BadInputError
from deltarec.stores.base import Store
from deltarec.verify.compare import (
    CODE,
    NO_RECORD,
    BatchOutcome,
    ExpectedBatch,
    StoreBatch,
    classify,
    point_of,
)
from deltarec.verify.newer import NewerRecords, newer_records
from deltarec.verify.types import (
    CLASS_ORDER,
    DumpFreshness,
    Mismatch,
    RowClass,
    ShardFailure,
    TableResult,
    VerifyResult,
)

log = logging.getLogger(__name__)

DEFAULT_SAMPLE = 10_000
DEFAULT_BATCH = 8192
DEFAULT_MAX_MISMATCHES = 20
DEFAULT_FULL_SCAN_BYTES = 1 << 30
PREFETCH_BYTES = 32 << 20
"""Store rows the one-pass scan may read ahead of the comparison."""
ROLLBACK_FIELD = "rollback"
"""GENERATION.json field of a rollback generation: ``{"to_generation": G, "through_seq": S}``."""


ProgressFn = Callable[[str, int, int], None]
"""``progress(table, done, total)``, called after each store batch."""


def verify(
    root: ArtifactRoot,
    run: str,
    store: Store,
    *,
    store_url: str = "",
    generation: int | None = None,
    through_seq: int | None = None,
    sample: int | None = DEFAULT_SAMPLE,
    seed: int = 0,
    batch_size: int = DEFAULT_BATCH,
    load_chunk: int = 1 << 20,
    max_mismatches: int = DEFAULT_MAX_MISMATCHES,
    full_scan_bytes: int = DEFAULT_FULL_SCAN_BYTES,
    progress: ProgressFn | None = None,
) -> VerifyResult:
    """Verify a store against a generation of ``run`` through dump ``through_seq``.

    Args:
        root: the artifact root.
        run: the run name.
        store: an open store (anything with ``read`` and ``scan_keys``).
        store_url: the store URL, for the result (pass it with credentials removed).
        generation: the generation to verify (default: the newest).
        through_seq: the last dump to include (default: the newest committed one).
        sample: keys per table to sample; None checks every expected key and also scans the
            store for keys the lineage never wrote (``--all``).
        seed: the sampling seed (the same seed samples the same keys).
        batch_size: keys per store read.
        load_chunk: keys whose expected rows are loaded from the shards at once.
        max_mismatches: the worst non-MATCH keys kept per table.
        full_scan_bytes: with every key checked, a table whose expected rows fit in this many
            bytes is verified in one pass over the store (:meth:`Store.scan_rows`: each store
            row read once, no lookups by key) against its expected rows, streamed from the
            shards in key order (loaded at once if the store's scan is not in key order);
            larger tables, and tables read through a staging view, are read by key in chunks.
        progress: optional callback, see :data:`ProgressFn`.

    Returns:
        The result; ``result.passed`` says whether the check passed.

    Raises:
        BadInputError: no such run/generation/dump, or bad arguments.
    """
    if sample is not None and sample < 0:
        raise BadInputError(f"sample size must be >= 0, got {sample}")
    if batch_size < 1:
        raise BadInputError(f"batch size must be >= 1, got {batch_size}")
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
        mode="all" if sample is None else "sample",
        sample=sample,
        seed=seed,
        started_at=utc_now(),
    )
    try:
        state = expected_state(root, run, generation, seq)
    except ArtifactError as e:
        # A corrupted or missing shard: name it by checking every shard the lineage lists.
        result.errors.append(f"expected state could not be computed: {e}")
        refs = lineage_shard_refs(root, run, generation, seq)
        result.shards_checked, result.shard_failures = check_shards(root, refs)
        result.duration_s = time.monotonic() - t0
        return result
    result.version = state.version
    # Checksums (hashlib runs outside the GIL) overlap with reading the store.
    with ThreadPoolExecutor(1, thread_name_prefix="verify-sha256") as pool:
        checks = pool.submit(check_shards, root, state.shard_refs())
        rollbacks = rollback_generations(root, run, generation, seq)
        result.rollback_generations = sorted(rollbacks)
        reader = _Reader(store, run, generation, state.manifests)
        later = _LaterDeletes(root, run, result.version)
        for table in sorted(state.tables):
            result.tables[table] = _verify_one(
                state.tables[table],
                reader,
                later,
                rollbacks,
                point_version=result.version,
                sample=sample,
                seed=seed,
                batch_size=batch_size,
                load_chunk=load_chunk,
                full_scan_bytes=full_scan_bytes,
                max_mismatches=max_mismatches,
                progress=progress,
            )
        result.shards_checked, result.shard_failures = checks.result()
    result.staged_tables = sorted(t for t in state.tables if reader.staged(t))
    result.dumps = _freshness(state, result, store)
    result.duration_s = time.monotonic() - t0
    return result


def _verify_one(
    et: ExpectedTable,
    reader: _Reader,
    later: _LaterDeletes,
    rollbacks: frozenset[int],
    *,
    point_version: int,
    sample: int | None,
    seed: int,
    batch_size: int,
    load_chunk: int,
    full_scan_bytes: int,
    max_mismatches: int,
    progress: ProgressFn | None,
) -> TableResult:
    """One table: one pass over the store with ``--all`` when it fits, else lookups by key."""
    if sample is None and _fits(et, full_scan_bytes) and not reader.staged(et.table):
        return _verify_table_by_scan(
            et,
            reader.store,
            later=later,
            point_version=point_version,
            rollbacks=rollbacks,
            batch_size=batch_size,
            max_mismatches=max_mismatches,
            progress=progress,
        )
    return _verify_table(
        et,
        reader,
        _sample_keys(et, sample, seed),
        later=later,
        scan_store=sample is None,
        point_version=point_version,
        rollbacks=rollbacks,
        batch_size=batch_size,
        load_chunk=load_chunk,
        max_mismatches=max_mismatches,
        progress=progress,
    )


# ---- artifacts --------------------------------------------------------------------------------
def check_shards(root: ArtifactRoot, refs: list[ShardRef]) -> tuple[int, list[ShardFailure]]:
    """Check sha256, size and row count of each shard against its manifest entry.

    Returns:
        ``(shards checked, failures)``; a failure names the shard's full path.
    """
    failures: list[ShardFailure] = []
    for ref in refs:
        problem = _shard_problem(root, ref)
        if problem is not None:
            gen, seq = ref.version >> 32, ref.version & 0xFFFFFFFF
            path = root.url(f"{ref.dump_dir}/{ref.shard.path}")
            failures.append(ShardFailure(path, ref.shard.table, ref.shard.rank, gen, seq, problem))
    return len(refs), failures


def _shard_problem(root: ArtifactRoot, ref: ShardRef) -> str | None:
    try:
        check_shard(root, ref.dump_dir, ref.shard)
    except ArtifactError as e:
        return e.problem
    path = f"{ref.dump_dir}/{ref.shard.path}"
    try:
        with root.fs.open(path, "rb") as f:
            rows = pq.ParquetFile(f).metadata.num_rows
    except Exception as e:  # any parquet failure is this shard's problem
        return f"unreadable parquet: {e}"
    if rows != ref.shard.rows:
        return f"holds {rows} rows, the manifest says {ref.shard.rows}"
    return None


def lineage_shard_refs(
    root: ArtifactRoot, run: str, generation: int, through_seq: int | None
) -> list[ShardRef]:
    """Every shard of every committed dump of the lineage (ancestors in full), for checksums."""
    refs: list[ShardRef] = []
    for info in root.lineage(run, generation):
        for seq in root.list_dumps(run, info.generation):
            if info.generation == generation and through_seq is not None and seq > through_seq:
                break
            try:
                m = root.read_manifest(run, info.generation, seq)
            except ArtifactError:
                continue  # reported through the expected-state error
            d = root.dump_dir(run, info.generation, seq)
            refs.extend(ShardRef(d, s, m.version) for s in m.shards)
    return refs


def rollback_generations(
    root: ArtifactRoot, run: str, generation: int, through_seq: int | None
) -> frozenset[int]:
    """Generations of ``run`` that are rollbacks to exactly ``generation`` through ``through_seq``.

    A rollback generation's GENERATION.json carries ``"rollback": {"to_generation": G,
    "through_seq": S}``; its rows restore the values G had at S under a newer version.
    """
    found: set[int] = set()
    for g in root.list_generations(run):
        if g == generation:
            continue
        target = root.read_generation(run, g).extra.get(ROLLBACK_FIELD)
        if not isinstance(target, dict):
            continue
        if target.get("to_generation") == generation and target.get("through_seq") == through_seq:
            found.add(g)
    return frozenset(found)


# ---- sampling and comparison ------------------------------------------------------------------
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
    store: _Reader,
    keys: np.ndarray,
    *,
    later: _LaterDeletes,
    scan_store: bool,
    point_version: int,
    rollbacks: frozenset[int],
    batch_size: int,
    load_chunk: int,
    max_mismatches: int,
    progress: ProgressFn | None,
) -> TableResult:
    spec = table.spec
    res = TableResult(table.table, spec.dtype.value, spec.dim)
    res.expected_keys = len(table.keys)
    present = table.present  # computed once, not per batch
    res.expected_present = int(present.sum())
    acc = _Collector(res, max_mismatches, later)
    total = len(keys)
    for start in range(0, total, max(load_chunk, batch_size)):
        chunk = keys[start : start + max(load_chunk, batch_size)]
        pos = table.index_of(chunk)
        rows = table.load(chunk)
        for b in range(0, len(chunk), batch_size):
            sl = slice(b, b + batch_size)
            exp = ExpectedBatch(chunk[sl], table.versions[pos[sl]], present[pos[sl]], rows[sl])
            got = store.read(table.table, exp.keys)
            store.drop_staged_deletes(table.table, exp, got)
            acc.add(exp, got, point_version, rollbacks)
            if progress is not None:
                progress(table.table, start + min(b + batch_size, len(chunk)), total)
    if scan_store:
        res.store_keys_scanned = _scan_unknown(
            table, store, acc, point_version, rollbacks, batch_size
        )
    return res


def _fits(table: ExpectedTable, budget: int) -> bool:
    row = codec.row_bytes(table.spec.dtype, table.spec.dim)
    return len(table.keys) * row <= budget


def _verify_table_by_scan(
    table: ExpectedTable,
    store: Store,
    *,
    later: _LaterDeletes,
    point_version: int,
    rollbacks: frozenset[int],
    batch_size: int,
    max_mismatches: int,
    progress: ProgressFn | None,
) -> TableResult:
    """Every expected key and every store row of one table, in one pass over the store.

    Store rows come from ``store.scan_rows`` in any order and are matched to the expected
    records by key; expected keys the scan never produced are then classified as absent.
    """
    spec = table.spec
    res = TableResult(table.table, spec.dtype.value, spec.dim)
    res.expected_keys = len(table.keys)
    res.expected_present = int(table.present.sum())
    acc = _Collector(res, max_mismatches, later)
    # The store scan runs ahead on a thread while the expected rows load from the shards (both
    # spend most of their time outside the GIL: SQLite steps, parquet decoding).
    depth = max(2, PREFETCH_BYTES // max(1, batch_size * codec.row_bytes(spec.dtype, spec.dim)))
    scan = _Prefetch(store.scan_rows(table.table, batch_size), depth)
    try:
        with ExpectedRows(table) as rows:
            res.store_keys_scanned = _consume_scan(
                table, scan, rows.take, acc, point_version, rollbacks, batch_size, progress
            )
    finally:
        scan.close()
    return res


def _consume_scan(
    table: ExpectedTable,
    scan: Iterable[tuple[np.ndarray, Any]],
    rows: Callable[[np.ndarray], np.ndarray],
    acc: _Collector,
    point_version: int,
    rollbacks: frozenset[int],
    batch_size: int,
    progress: ProgressFn | None,
) -> int:
    """Classify every scanned store row and then every expected key the scan never produced.

    ``rows(pos)`` gives the expected encoded rows of the records at positions ``pos``.
    """
    width = codec.encoded_width(table.spec.dtype, table.spec.dim)
    element = codec.element_type(table.spec.dtype)
    seen = np.zeros(len(table.keys), bool)
    present = table.present  # computed once, not per batch
    scanned = 0
    for keys, got in scan:
        keys = np.asarray(keys, np.int64)
        scanned += len(keys)
        batch = StoreBatch(
            np.asarray(got.found, bool), np.asarray(got.versions, np.int64), got.embedding
        )
        idx = table.index_of(keys)
        known = idx >= 0
        every = bool(known.all())
        pos = idx if every else idx[known]
        seen[pos] = True
        exp = ExpectedBatch(
            keys if every else keys[known],
            table.versions[pos],
            present[pos],
            rows(pos),
        )
        acc.add(exp, batch if every else _take(batch, known), point_version, rollbacks)
        if not every:
            k = keys[~known]
            none = ExpectedBatch(
                k,
                np.full(len(k), NO_RECORD, np.int64),
                np.zeros(len(k), bool),
                np.zeros((len(k), width), element),
            )
            acc.add(none, _take(batch, ~known), point_version, rollbacks)
        if progress is not None:
            progress(table.table, int(seen.sum()), len(table.keys))
    unseen = np.nonzero(~seen)[0]
    for b in range(0, len(unseen), batch_size):
        pos = unseen[b : b + batch_size]
        n = len(pos)
        exp = ExpectedBatch(table.keys[pos], table.versions[pos], present[pos], rows(pos))
        absent = StoreBatch(np.zeros(n, bool), np.zeros(n, np.int64), np.zeros((n, width), element))
        acc.add(exp, absent, point_version, rollbacks)
    return scanned


class _Prefetch:
    """Iterate ``source`` on a daemon thread, at most ``depth`` items ahead; errors re-raised."""

    _END = object()

    def __init__(self, source: Iterator[Any], depth: int) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._source = source
        self._thread = threading.Thread(target=self._run, name="verify-scan", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for item in self._source:
                if not self._put(item):
                    return
            self._put(self._END)
        except BaseException as e:  # handed to the consumer
            self._put(e)

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator[Any]:
        while True:
            item = self._queue.get()
            if item is self._END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def _take(batch: StoreBatch, mask: np.ndarray) -> StoreBatch:
    return StoreBatch(batch.found[mask], batch.versions[mask], batch.rows[mask])


def _scan_unknown(
    table: ExpectedTable,
    store: _Reader,
    acc: _Collector,
    point_version: int,
    rollbacks: frozenset[int],
    batch_size: int,
) -> int:
    """Classify store keys the lineage never wrote; returns the number of store keys scanned."""
    width = codec.encoded_width(table.spec.dtype, table.spec.dim)
    scanned = 0
    for batch in store.store.scan_keys(table.table):
        batch = np.asarray(batch, np.int64)
        scanned += len(batch)
        unknown = batch[table.index_of(batch) < 0]
        for b in range(0, len(unknown), batch_size):
            k = unknown[b : b + batch_size]
            exp = ExpectedBatch(
                k,
                np.full(len(k), NO_RECORD, np.int64),
                np.zeros(len(k), bool),
                np.zeros((len(k), width), codec.element_type(table.spec.dtype)),
            )
            acc.add(exp, store.read(table.table, k), point_version, rollbacks)
    return scanned


class _Reader:
    """Reads a batch of keys from the live view, merged with the generation's staging view.

    A generation published in ``staged`` mode is not live until promote merges it; before that,
    what serving *will* hold is, per key, the newer of the staging row and the live row (the
    versioned merge). A table has a staging view only until promote drops it, so the view is
    probed once per table; a store without staging is read live only.
    """

    def __init__(self, store: Store, run: str, generation: int, manifests: list[Manifest]) -> None:
        self.store = store
        self.run = run
        self.generation = generation
        self._shards = {
            (m.seq, t): len(m.shards_of(t))
            for m in manifests
            if m.generation == generation
            for t in m.tables
        }
        self._staging: set[str] | None = None
        self._complete: set[tuple[int, str]] | None = None

    def staged(self, table: str) -> bool:
        """Whether ``table`` has a staging view of the generation (looked up once)."""
        if self._staging is None:
            self._staging = (
                set(self.store.views(staging_generation=self.generation))
                if self.store.capabilities.staging
                else set()
            )
        return table in self._staging

    def read(self, table: str, keys: np.ndarray) -> StoreBatch:
        live = self._read(table, keys, None)
        if not self.staged(table):
            return live
        staged = self._read(table, keys, self.generation)
        take = staged.found & (~live.found | (staged.versions >= live.versions))
        return StoreBatch(
            live.found | staged.found,
            np.where(take, staged.versions, live.versions),
            np.where(take[:, None], staged.rows, live.rows),
        )

    def drop_staged_deletes(self, table: str, exp: ExpectedBatch, got: StoreBatch) -> None:
        """Hide live rows that the staging view deletes when merged (in place).

        A staged delete (``op = 1``) is not readable through :meth:`Store.read`; the expected
        record says the generation deleted the key, and the store's progress marks say the
        dump's staging writes are complete, so after the merge the live row is gone.
        """
        if not self.staged(table):
            return
        ev = exp.versions
        pending = ~exp.present & got.found & (got.versions < ev) & (ev >> 32 == self.generation)
        for i in np.nonzero(pending)[0]:
            if (int(ev[i]) & 0xFFFFFFFF, table) in self._staged_complete():
                got.found[i] = False

    def _staged_complete(self) -> set[tuple[int, str]]:
        if self._complete is None:
            done: dict[tuple[int, str], int] = {}
            for m in self.store.registry.progress(self.run, self.generation):
                if m.complete and m.staging_generation == self.generation:
                    done[(m.seq, m.table)] = done.get((m.seq, m.table), 0) + 1
            self._complete = {k for k, n in done.items() if n >= self._shards.get(k, 1)}
        return self._complete

    def _read(self, table: str, keys: np.ndarray, staging: int | None) -> StoreBatch:
        if staging is None:
            r = self.store.read(table, keys)
        else:
            r = self.store.read(table, keys, staging_generation=staging)
        return StoreBatch(
            np.asarray(r.found, bool), np.asarray(r.versions, np.int64), np.asarray(r.embedding)
        )


class _LaterDeletes:
    """Which keys a dump newer than the point deleted (read lazily, only if a key is missing).

    The store keeps no readable trace of a delete, so a key that a later dump evicted reads as
    absent; against an older point it is SUPERSEDED (deleted by a newer version), not MISSING.
    """

    def __init__(self, root: ArtifactRoot, run: str, point: int) -> None:
        self.root, self.run, self.point = root, run, point
        self._records: dict[str, NewerRecords] | None = None

    def mask(self, table: str, keys: np.ndarray) -> np.ndarray:
        if self._records is None:
            self._records = newer_records(self.root, self.run, self.point)
        records = self._records.get(table)
        return records.deleted(keys) if records is not None else np.zeros(len(keys), bool)


class _Collector:
    """Accumulates counts, the worst mismatches and live versions of one table."""

    def __init__(self, res: TableResult, limit: int, later: _LaterDeletes) -> None:
        self.res = res
        self.limit = limit
        self.later = later

    def add(
        self,
        exp: ExpectedBatch,
        got: StoreBatch,
        point_version: int,
        rollbacks: frozenset[int],
    ) -> None:
        spec_dtype, dim = self.res.dtype, self.res.dim
        out = classify(exp, got, spec_dtype, dim, point_version, rollbacks)  # type: ignore[arg-type]
        missing = np.nonzero(out.classes == CODE[RowClass.MISSING])[0]
        if len(missing):
            for i in missing[self.later.mask(self.res.table, exp.keys[missing])]:
                out.classes[i] = CODE[RowClass.SUPERSEDED]
                out.reasons[i] = "deleted by a newer version"
        res = self.res
        res.checked += len(exp.keys)
        counts = np.bincount(out.classes, minlength=len(CLASS_ORDER))
        for i, c in enumerate(CLASS_ORDER):
            res.counts[c] += int(counts[i])
        compared = out.diffs[~np.isnan(out.diffs)]
        if len(compared):
            res.max_abs_diff = max(res.max_abs_diff, float(compared.max()))
        if (np.isnan(out.diffs) & ~np.isnan(out.tolerance)).any():
            res.max_abs_diff = float("nan")
        for v, live in _version_counts(got.versions[got.found]):
            res.live_by_version[v] = res.live_by_version.get(v, 0) + live
        self._keep_worst(exp, got, out)

    def _keep_worst(self, exp: ExpectedBatch, got: StoreBatch, out: BatchOutcome) -> None:
        bad = np.nonzero(out.classes != CODE[RowClass.MATCH])[0]
        if len(bad) == 0 or self.limit == 0:
            return
        failing = np.isin(
            out.classes[bad],
            [CODE[RowClass.DIFFERENT], CODE[RowClass.MISSING], CODE[RowClass.UNEXPECTED]],
        )
        diff = np.where(np.isnan(out.diffs[bad]), np.inf, out.diffs[bad])
        top = bad[np.lexsort((-diff, ~failing))[: self.limit]]
        for i in top.tolist():
            ev = int(exp.versions[i])
            self.res.mismatches.append(
                Mismatch(
                    table=self.res.table,
                    key=int(exp.keys[i]),
                    row_class=CLASS_ORDER[int(out.classes[i])],
                    reason=out.reasons[i],
                    expected_version=None if ev == NO_RECORD else ev,
                    expected_present=bool(exp.present[i]),
                    store_version=int(got.versions[i]) if got.found[i] else None,
                    max_abs_diff=None if np.isnan(out.diffs[i]) else float(out.diffs[i]),
                    tolerance=None if np.isnan(out.tolerance[i]) else float(out.tolerance[i]),
                )
            )
        self.res.mismatches.sort(key=Mismatch.severity, reverse=True)
        del self.res.mismatches[self.limit :]


def _version_counts(versions: np.ndarray) -> list[tuple[int, int]]:
    """``(version, rows)`` pairs; a batch of one version (the usual case) needs no sort."""
    if len(versions) and (versions == versions[0]).all():
        return [(int(versions[0]), len(versions))]
    vers, n = np.unique(versions, return_counts=True)
    return list(zip(vers.tolist(), n.tolist(), strict=True))


# ---- freshness --------------------------------------------------------------------------------
def _freshness(state: ExpectedState, result: VerifyResult, store: Store) -> list[DumpFreshness]:
    now = time.time()
    live: dict[int, int] = {}
    for t in result.tables.values():
        for v, n in t.live_by_version.items():
            live[v] = live.get(v, 0) + n
    lags = _publish_lags(store, state.run, sorted({m.generation for m in state.manifests}))
    return [
        _dump_freshness(m, now, live.get(m.version, 0), lags.get(m.version))
        for m in state.manifests
    ]


def _publish_lags(store: Store, run: str, generations: list[int]) -> dict[int, float]:
    """Version -> publish lag of the slowest rank, from the store's freshness records."""
    lags: dict[int, float] = {}
    for g in generations:
        for r in store.registry.freshness(run, g):
            v = (int(r.generation) << 32) | int(r.seq)
            lag = float(r.visible_at) - float(r.committed_at)
            lags[v] = max(lags.get(v, lag), lag)
    return lags


def _dump_freshness(m: Manifest, now: float, live_rows: int, lag_s: float | None) -> DumpFreshness:
    try:
        age: float | None = max(0.0, now - parse_time(m.created_at))
    except ValueError:
        age = None
    return DumpFreshness(
        generation=m.generation,
        seq=m.seq,
        version=m.version,
        kind=m.kind.value,
        created_at=m.created_at,
        first_step=m.first_step,
        last_step=m.last_step,
        rows=sum(m.tables.values()),
        age_s=age,
        live_rows=live_rows,
        lag_s=lag_s,
    )
