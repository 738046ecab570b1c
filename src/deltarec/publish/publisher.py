"""Publishing committed dumps into a store, one rank's part at a time (SPEC §6).

For one dump and one rank, :meth:`DumpPublisher.publish_dump`

1. reads the store's progress marks and skips the tables whose part is already complete;
2. checks every row of the rank's part first (NaN/Inf, width, keys, ops), so a bad row fails
   with :class:`~deltarec.errors.InvalidRowError` naming table, dump and key and nothing of the
   dump is applied;
3. writes the rows in transactions sized by bytes, each with a progress mark in the same
   transaction (``rows`` applied so far; ``complete`` on the last), streaming each one to the
   store in read chunks, and retrying transient errors with backoff; after a crash the next run
   resumes after the last committed mark;
4. completes a snapshot (removes the keys it lacks) once every rank's part is in;
5. records freshness: the manifest's commit time and the time the rows became visible.

Rows come from memory (the dumper hands them over) or from the artifacts (the durable copy),
read in bounded batches so memory does not grow with the dump.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future

import numpy as np

from deltarec.artifacts import ArtifactRoot, codec
from deltarec.artifacts.shards import ShardRows, iter_shard
from deltarec.artifacts.types import DumpKind, GenerationInfo, Manifest, TableSpec, parse_time
from deltarec.errors import BadInputError, ConfigError
from deltarec.faults import failpoint
from deltarec.ids import validate_run
from deltarec.publish.ahead import parts_checked_ahead
from deltarec.publish.backlog import backlog_group, publish_group
from deltarec.publish.frombase import start_from_base
from deltarec.publish.metrics import PublishMetrics
from deltarec.publish.retry import RetryPolicy
from deltarec.publish.snapshot import finish_snapshot
from deltarec.publish.together import publish_parts_together
from deltarec.publish.types import PartResult, PublishMode
from deltarec.readahead import ReadAhead
from deltarec.stores.base import Store
from deltarec.stores.rows import check_batch
from deltarec.stores.types import FreshnessRecord, ProgressMark, RowBatch

log = logging.getLogger(__name__)

READ_BYTES = 8 << 20
"""Rows read from the artifacts (and handed to the store) at a time."""


def default_batch_bytes(store: Store) -> int:
    """The default bytes per transaction for ``store``: its ``capabilities.batch_bytes``.

    A transaction is also the unit of the progress marks: a crash loses at most one. Rows reach
    the store in read chunks of :data:`READ_BYTES` however large a transaction is, so memory
    does not grow with it.
    """
    return store.capabilities.batch_bytes


MAX_TRANSACTION_ROWS = 2 << 20
"""Rows per store transaction at most, whatever ``batch_bytes`` says: a transaction's per-row
state (SQLite's key-order spill index, 16 bytes a row) stays within 32 MB for narrow rows too."""
_PER_ROW_OVERHEAD = 24  # key, version, op and per-row store overhead, for batch sizing


def _rows_in(nbytes: int, spec: TableSpec) -> int:
    """How many rows of ``spec`` make about ``nbytes`` (at least one)."""
    return max(1, nbytes // (codec.row_bytes(spec.dtype, spec.dim) + _PER_ROW_OVERHEAD))


BatchHook = Callable[[ProgressMark, int], None]
"""Called after each committed transaction with its mark and its row count."""


class DumpPublisher:
    """Publishes committed dumps of one run into one store.

    Args:
        store: an open store (views provisioned, or provisioned here by :meth:`prepare`).
        root: the artifact root (read for rows not in memory, and for GENERATION.json).
        run: the run name.
        mode: ``direct`` (into the live views) or ``staged`` (the generation's staging views).
        batch_bytes: target encoded bytes per store transaction and progress mark (default: by
            store kind, :func:`default_batch_bytes`); memory does not grow with it.
        retry: the retry policy for transient store errors.
        metrics: Prometheus metrics to update (default: a private registry).
        after_batch: optional hook after each committed transaction (progress output, tests).
    """

    def __init__(
        self,
        store: Store,
        root: ArtifactRoot,
        run: str,
        mode: PublishMode | str = PublishMode.DIRECT,
        batch_bytes: int | None = None,
        retry: RetryPolicy | None = None,
        metrics: PublishMetrics | None = None,
        after_batch: BatchHook | None = None,
    ) -> None:
        if batch_bytes is None:
            batch_bytes = default_batch_bytes(store)
        mode = PublishMode.parse(mode)
        if mode is PublishMode.STAGED and not store.capabilities.staging:
            raise ConfigError(f"the {store.kind} store has no staging views; use mode=direct")
        if batch_bytes <= 0:
            raise ConfigError(f"batch_bytes must be positive, got {batch_bytes}")
        if store.run != run:  # rows are kept per run (docs/runs.md)
            raise ConfigError(
                f"publishing run {run!r} through a store handle of run {store.run!r} "
                f"({store.describe()}): open the store with run={run!r}"
            )
        self.store = store
        self.registry = store.registry
        self.root = root
        self.run = validate_run(run)
        self.mode = mode
        self.batch_bytes = batch_bytes
        self.retry = retry or RetryPolicy()
        self.metrics = metrics or PublishMetrics()
        self.after_batch = after_batch
        self._generations: dict[int, GenerationInfo] = {}
        self._prepared: set[int] = set()

    # ---- setup ---------------------------------------------------------------------------
    def generation_info(self, generation: int) -> GenerationInfo:
        """GENERATION.json of ``generation`` (cached)."""
        if generation not in self._generations:
            self._generations[generation] = self.root.read_generation(self.run, generation)
        return self._generations[generation]

    def prepare(self, generation: int) -> None:
        """Provision the generation's views (and staging views) and register it; idempotent.

        Staging views are provisioned only while the generation has parts left to write: a
        staged generation that is wholly published may have been merged by promote already,
        and provisioning its staging views again (a later trainer's catch-up of older
        generations) would leave empty ones that make it look staged and unpromoted.
        """
        if generation in self._prepared:
            return
        tables = self.generation_info(generation).tables
        self._call(lambda: self.store.provision(tables), f"provision generation {generation}")
        if self.mode is PublishMode.STAGED and self.pending(generation):
            self._call(
                lambda: self.store.provision(tables, staging_generation=generation),
                f"provision staging views of generation {generation}",
            )
        self._call(
            lambda: self.registry.register_generation(self.run, generation),
            f"register generation {generation}",
        )
        self._prepared.add(generation)

    def _call(self, fn: Callable[[], object], what: str) -> object:
        return self.retry.call(fn, what, on_retry=lambda e, w: self.metrics.retries.inc())

    # ---- one dump ------------------------------------------------------------------------
    def publish_dump(
        self,
        manifest: Manifest,
        rank: int,
        rows: Mapping[str, ShardRows] | None = None,
        checked: Future[frozenset[str]] | None = None,
    ) -> PartResult:
        """Publish rank ``rank``'s part of a committed dump (see the module docstring).

        Args:
            manifest: the dump's committed manifest.
            rank: the rank whose shards to publish.
            rows: the rank's rows by table id, if in memory; missing tables are read from the
                artifacts.
            checked: :func:`~deltarec.publish.ahead.check_part` of this part from the
                artifacts, under way (``rows`` None): its tables are not read again to be
                checked; its error is raised before anything of the part is written.

        Raises:
            InvalidRowError: a row cannot be published (nothing of the part was written).
            StoreUnavailableError: the store stayed unreachable past the retry deadline.
        """
        if manifest.run != self.run:
            raise BadInputError(f"manifest of run {manifest.run!r} given to run {self.run!r}")
        start = time.monotonic()
        g, s = manifest.generation, manifest.seq
        self.prepare(g)
        self._call(  # one writer per run: never publish a superseded generation
            lambda: self.registry.check_writer(self.run, g), f"check generation {g} is the newest"
        )
        info = self.generation_info(g)
        result = PartResult(g, s, rank)
        done = self._marks(g, s, rank)
        todo = self._todo(manifest, info, rank, done, result)
        where = f"run {self.run!r} generation {g} dump {s} rank {rank}"
        inline = self._checked_while_written(manifest, rank, todo, done, rows)
        ahead = frozenset() if checked is None else checked.result()
        for table, spec in todo:
            if table == inline or table in ahead:
                continue
            self._check_rows(manifest, rank, table, spec, where, rows)
        for table, spec in todo:
            skip = done[table].rows if table in done else 0
            check = where if table == inline else None
            self._publish_table(manifest, rank, table, spec, rows, skip, result, check)
        if manifest.kind is DumpKind.SNAPSHOT:
            self._finish_snapshot(manifest)
        self._record_freshness(manifest, rank, result)
        result.seconds = time.monotonic() - start
        self.metrics.dumps.labels(self.mode.value).inc()
        self.metrics.version.set(manifest.version)
        return result

    @staticmethod
    def _check(table: str, spec: TableSpec, batch: ShardRows, version: int, where: str) -> None:
        """Raise :class:`~deltarec.errors.InvalidRowError` unless ``batch`` can be written."""
        versions = np.full(len(batch), version, np.int64)
        args = (batch.keys, batch.embedding, batch.ops, versions)
        check_batch(table, spec.dtype, spec.dim, *args, where, spec.kind)

    def _checked_while_written(
        self,
        manifest: Manifest,
        rank: int,
        todo: list[tuple[str, TableSpec]],
        done: dict[str, ProgressMark],
        memory: Mapping[str, ShardRows] | None,
    ) -> str | None:
        """The table whose rows are checked as they are written instead of read twice, if any.

        That is the first table written, when its rows come from the artifacts, what is left
        of its part goes in one transaction, and the store applies a transaction whole or not
        at all (the SQL stores): a bad row then aborts that transaction, and the other tables
        were checked before it began, so nothing of the part is applied either way.
        """
        if not todo or not self.store.capabilities.whole_writes:
            return None
        table, spec = todo[0]
        if memory is not None and table in memory:
            return None  # in memory the first pass reads nothing: keep it
        left = self._part_rows(manifest, rank, table, memory) - (
            done[table].rows if table in done else 0
        )
        return table if left <= self._batch_rows(spec) else None

    def _marks(self, generation: int, seq: int, rank: int) -> dict[str, ProgressMark]:
        marks = self._call(
            lambda: self.registry.progress(self.run, generation), f"read progress of {generation}"
        )
        assert isinstance(marks, list)
        return {m.table: m for m in marks if m.seq == seq and m.rank == rank}

    def _todo(
        self,
        manifest: Manifest,
        info: GenerationInfo,
        rank: int,
        done: dict[str, ProgressMark],
        result: PartResult,
    ) -> list[tuple[str, TableSpec]]:
        todo = []
        for table in sorted(manifest.tables):
            spec = info.tables.get(table)
            if spec is None:
                raise BadInputError(
                    f"dump {manifest.seq} of generation {manifest.generation} lists table "
                    f"{table!r}, which GENERATION.json does not declare"
                )
            mark = done.get(table)
            if mark is not None and mark.complete:
                result.skipped_rows += mark.rows
                continue
            if mark is not None:
                result.skipped_rows += mark.rows
            todo.append((table, spec))
            result.tables.append(table)
        return todo

    def _batch_rows(self, spec: TableSpec) -> int:
        """Rows per store transaction: ``batch_bytes`` of rows, at most MAX_TRANSACTION_ROWS."""
        return min(_rows_in(self.batch_bytes, spec), MAX_TRANSACTION_ROWS)

    @staticmethod
    def _read_rows(spec: TableSpec) -> int:
        """Rows per read chunk."""
        return _rows_in(READ_BYTES, spec)

    def _check_rows(
        self,
        manifest: Manifest,
        rank: int,
        table: str,
        spec: TableSpec,
        where: str,
        memory: Mapping[str, ShardRows] | None = None,
    ) -> None:
        """Check the rank's rows of ``table`` (shard checksums, then every chunk), keep none.

        Rows in memory are checked in read chunks too, so the temporaries stay bounded.
        """
        chunk = self._read_rows(spec)
        for _ in self._rows(manifest, rank, table, spec, memory, 0, True, chunk, where):
            pass  # each chunk is checked as it is read

    def _rows(
        self,
        manifest: Manifest,
        rank: int,
        table: str,
        spec: TableSpec,
        memory: Mapping[str, ShardRows] | None,
        skip: int,
        verify: bool = False,
        memory_rows: int | None = None,
        check: str | None = None,
    ) -> Iterator[ShardRows]:
        """The rank's rows of ``table`` in chunks, without the first ``skip`` rows.

        Rows in memory come as views (no copies) of ``memory_rows`` rows each (default: one
        transaction for a SQL store, which sorts a transaction's rows at once; a read chunk for
        any other, which encodes and sends each batch whole, as it does the artifacts' read
        chunks); rows from the artifacts in read chunks. ``verify`` checks each shard's sha256
        before reading it (the first pass does). ``check`` (where the rows come from, for the
        message): every chunk is checked (:meth:`_check`) before it comes, those from the
        artifacts on the reading thread.
        """
        if memory is not None and table in memory:
            data = memory[table]
            size = memory_rows or self._batch_rows(spec)
            if not self.store.capabilities.whole_writes:
                size = min(size, self._read_rows(spec))
            chunks = (data.slice(start, start + size) for start in range(skip, len(data), size))
            yield from _checked(chunks, table, spec, manifest.version, check)
            return
        reader = self._reader(manifest, rank, table, spec, skip, verify, check=check)
        try:
            yield from reader
        finally:
            reader.close()

    def _reader(
        self,
        manifest: Manifest,
        rank: int,
        table: str,
        spec: TableSpec,
        skip: int,
        verify: bool,
        later: list[Callable[[], None]] | None = None,
        check: str | None = None,
    ) -> ReadAhead[ShardRows]:
        """The rank's rows of ``table`` from the artifacts, read ahead from now on (a thread).

        As :meth:`_rows` without rows in memory; the caller closes it. ``later`` (with
        ``verify``): each shard's sha256 is checked after its rows are read, and its wait is
        appended to ``later`` (see :func:`~deltarec.artifacts.shards.iter_shard`): only for rows
        that all go into one transaction, committed after the waits. ``check``: every chunk
        is checked on the reading thread too (a bad row is raised where its chunk would have
        come).
        """
        size = min(self._read_rows(spec), self._batch_rows(spec))
        dump_dir = self.root.dump_dir(self.run, manifest.generation, manifest.seq)
        rows = self._shard_rows(manifest, rank, spec, table, dump_dir, size, skip, verify, later)
        return ReadAhead(_checked(rows, table, spec, manifest.version, check), name="publish-read")

    def _shard_rows(
        self,
        manifest: Manifest,
        rank: int,
        spec: TableSpec,
        table: str,
        dump_dir: str,
        size: int,
        skip: int,
        verify: bool,
        later: list[Callable[[], None]] | None = None,
    ) -> Iterator[ShardRows]:
        """The rank's rows of ``table`` from its shards, after the first ``skip``.

        In chunks of about ``size`` rows; runs on :func:`read_ahead`'s thread (see :meth:`_rows`).
        """
        for shard in manifest.shards_of(table):
            if shard.rank != rank:
                continue
            seen = 0
            for batch in iter_shard(
                self.root,
                dump_dir,
                shard,
                spec.dtype,
                batch_rows=size,
                verify=verify,
                bounded_memory=True,
                verify_later=later,
            ):
                n = len(batch)
                if seen + n <= skip:
                    seen += n
                    continue
                cut = max(0, skip - seen)
                seen += n
                yield batch.slice(cut, n) if cut else batch

    def _part_rows(
        self, manifest: Manifest, rank: int, table: str, memory: Mapping[str, ShardRows] | None
    ) -> int:
        if memory is not None and table in memory:
            return len(memory[table])
        return sum(s.rows for s in manifest.shards_of(table) if s.rank == rank)

    def _publish_table(
        self,
        manifest: Manifest,
        rank: int,
        table: str,
        spec: TableSpec,
        memory: Mapping[str, ShardRows] | None,
        skip: int,
        result: PartResult,
        check: str | None = None,
    ) -> None:
        """Write the rank's rows of ``table`` after the first ``skip``, a transaction at a time.

        With ``check`` (where the rows come from, for the message), each shard's sha256 and
        every row are checked as they are read (see :meth:`_checked_while_written`).
        """
        stage = manifest.generation if self.mode is PublishMode.STAGED else None
        if memory is not None and table in memory:
            skip = 0  # rows in memory are replayed whole: their order need not match the shard
        total = self._part_rows(manifest, rank, table, memory)

        def rows_from(start: int) -> Iterator[ShardRows]:
            verify = check is not None
            return self._rows(manifest, rank, table, spec, memory, start, verify, check=check)

        reader = _PartReader(rows_from, ShardRows.empty(spec.dtype, spec.dim))
        done = min(skip, total)
        while True:  # batch_bytes may change between transactions (a read budget's throttle)
            end = min(total, done + self._batch_rows(spec))
            mark = ProgressMark(
                self.run,
                manifest.generation,
                manifest.seq,
                table,
                rank,
                end,
                end == total,
                stage or 0,
            )
            self._write(manifest, reader, mark, done, stage)
            failpoint("publish.batch")
            n = end - done
            nbytes = n * codec.row_bytes(spec.dtype, spec.dim)
            result.rows += n
            result.bytes += nbytes
            self.metrics.rows.labels(table, self.mode.value).inc(n)
            self.metrics.bytes.labels(table, self.mode.value).inc(nbytes)
            if self.after_batch is not None:
                self.after_batch(mark, n)
            done = end
            if done >= total:
                return

    def _write(
        self,
        manifest: Manifest,
        reader: _PartReader,
        mark: ProgressMark,
        start: int,
        stage: int | None,
    ) -> None:
        """One transaction: rows ``start .. mark.rows`` of the part, and ``mark``."""

        def batches() -> Iterator[RowBatch]:
            for rows in reader.take(start, mark.rows - start):
                versions = np.full(len(rows), manifest.version, np.int64)
                yield RowBatch(rows.keys, rows.embedding, rows.ops, versions)

        self._call(
            lambda: self.store.write_batches(
                mark.table, batches(), mark=mark, staging_generation=stage
            ),
            f"write rows {start}..{mark.rows} of {mark.table!r} (generation "
            f"{manifest.generation} dump {manifest.seq} rank {mark.rank})",
        )

    def _finish_snapshot(self, manifest: Manifest) -> None:
        stage = manifest.generation if self.mode is PublishMode.STAGED else None
        for table in sorted(manifest.tables):
            complete = self._call(
                functools.partial(
                    finish_snapshot,
                    self.store,
                    self.run,
                    manifest.generation,
                    manifest.seq,
                    table,
                    manifest.world_size,
                    stage,
                ),
                f"complete snapshot of {table!r}",
            )
            log.debug("snapshot %s of %s complete: %s", manifest.seq, table, complete)

    def _record_freshness(self, manifest: Manifest, rank: int, result: PartResult) -> None:
        """Record when the part became readable, counted from the dump's training step.

        The registry's record starts at MANIFEST.json's ``taken_at`` (the moment the dump was
        taken) when the manifest has it, else at its commit (dumps written before it existed).
        """
        if self.mode is not PublishMode.DIRECT or not manifest.created_at:
            return
        committed = parse_time(manifest.created_at)
        taken = manifest.extra.get("taken_at")
        start = parse_time(str(taken)) if taken else committed
        visible = time.time()
        record = FreshnessRecord(self.run, manifest.generation, manifest.seq, rank, start, visible)
        self._call(lambda: self.registry.record_freshness(record), "record freshness")
        result.lag_s = visible - committed
        result.freshness_s = record.lag_s
        self.metrics.observe_visible(record.lag_s, visible - committed)

    # ---- after the fact ------------------------------------------------------------------
    def pending(self, generation: int, ranks: list[int] | None = None) -> list[tuple[int, int]]:
        """``(seq, rank)`` parts of committed dumps the store does not hold completely yet."""
        marks = self._call(
            lambda: self.registry.progress(self.run, generation), f"read progress of {generation}"
        )
        assert isinstance(marks, list)
        complete = {(m.seq, m.table, m.rank) for m in marks if m.complete}
        out = []
        # the chain is checked (SPEC §3a) before anything of it is written
        for seq in self.root.list_dumps(self.run, generation):
            manifest = self.root.read_manifest(self.run, generation, seq)
            for rank in ranks if ranks is not None else range(manifest.world_size):
                if any((seq, t, rank) not in complete for t in manifest.tables):
                    out.append((seq, rank))
        return out

    def _untouched(self, generation: int, seqs: list[int]) -> set[int]:
        """The dumps of ``seqs`` the store holds no mark of (no part begun)."""
        marks = self._call(
            lambda: self.registry.progress(self.run, generation), f"read progress of {generation}"
        )
        assert isinstance(marks, list)
        return set(seqs) - {m.seq for m in marks}

    def _one_by_one(self, manifest: Manifest, ranks: list[int]) -> Iterator[PartResult]:
        """:meth:`publish_dump` of each of ``ranks``' parts, as each is done.

        Into a store that checks no table's rows while writing them (not a SQL store), the next
        part is checked on a thread meanwhile (:mod:`deltarec.publish.ahead`).
        """
        if self.store.capabilities.whole_writes or len(ranks) < 2:
            for rank in ranks:
                yield self.publish_dump(manifest, rank)
            return
        yield from parts_checked_ahead(self, manifest, ranks)

    def publish_generation(
        self,
        generation: int,
        ranks: list[int] | None = None,
        on_part: Callable[[PartResult], None] | None = None,
    ) -> list[PartResult]:
        """Publish every committed dump of ``generation`` the store does not hold yet.

        Dumps go in ``seq`` order, each rank's part from the artifacts; parts already complete
        per the progress marks are skipped, partial ones resume after their mark. A store that
        holds nothing of the generation, or lacks dumps retention removed, starts from the
        generation's newest base (:mod:`deltarec.publish.frombase`). Into SQLite,
        the parts of a dump go together where they can (:mod:`deltarec.publish.together`). Snapshots
        whose parts are all in are completed even if nothing was left to write.
        """
        self.prepare(generation)
        results = []
        todo = set(self.pending(generation, ranks))
        based = start_from_base(self, generation, ranks)  # an empty or lagging store
        seqs = [s for s in self.root.list_dumps(self.run, generation) if s > based]
        untouched = self._untouched(generation, seqs) if ranks is None else set()
        i = 0
        while i < len(seqs):
            group = backlog_group(self, generation, seqs[i:], todo, untouched)
            if group:  # a backlog of small dumps: several in one transaction
                results.extend(publish_group(self, group, on_part))
                i += len(group)
                continue
            seq = seqs[i]
            i += 1
            manifest = self.root.read_manifest(self.run, generation, seq)
            mine = [
                rank
                for rank in (ranks if ranks is not None else range(manifest.world_size))
                if (seq, rank) in todo
            ]
            together = publish_parts_together(self, manifest, mine)
            for part in together if together is not None else self._one_by_one(manifest, mine):
                results.append(part)
                if on_part is not None:
                    on_part(part)
            if manifest.kind is DumpKind.SNAPSHOT:
                self._finish_snapshot(manifest)
        return results


def _checked(
    chunks: Iterator[ShardRows], table: str, spec: TableSpec, version: int, where: str | None
) -> Iterator[ShardRows]:
    """``chunks``, each checked by :meth:`DumpPublisher._check` before it comes.

    ``where`` names the rows' origin in the message; None: the chunks come unchecked.
    """
    for batch in chunks:
        if where is not None:
            DumpPublisher._check(table, spec, batch, version, where)
        yield batch


class _PartReader:
    """One rank's rows of one table, read forward once across its transactions.

    :meth:`take` continues where the previous one stopped; after a write that failed part-way
    (its rows were read but not committed) it reopens the rows at the transaction's start.
    """

    def __init__(self, open_at: Callable[[int], Iterator[ShardRows]], empty: ShardRows) -> None:
        self._open_at = open_at
        self._empty = empty
        self._rows: Iterator[ShardRows] = iter(())
        self._position = -1
        self._carry: ShardRows | None = None

    def take(self, start: int, count: int) -> Iterator[ShardRows]:
        """Rows ``start .. start + count`` in chunks (one empty chunk when ``count`` is 0)."""
        if self._position != start:
            self._rows, self._position, self._carry = self._open_at(start), start, None
        left, sent = count, False
        while left > 0:
            chunk = self._carry if self._carry is not None else next(self._rows, None)
            self._carry = None
            if chunk is None:
                break
            if len(chunk) > left:
                chunk, self._carry = chunk.slice(0, left), chunk.slice(left, len(chunk))
            self._position += len(chunk)
            left -= len(chunk)
            sent = True
            yield chunk
        if not sent:
            yield self._empty
