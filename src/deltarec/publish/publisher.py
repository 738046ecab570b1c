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

Collaborators: :mod:`deltarec.publish.parts` (what is left of a part, how it is split into
transactions and read chunks) and :mod:`deltarec.publish.rows` (a part's rows, read and
checked). The other ways to publish (:mod:`~deltarec.publish.together`,
:mod:`~deltarec.publish.ahead`, :mod:`~deltarec.publish.backlog`,
:mod:`~deltarec.publish.frombase`) use only this class's public methods.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future

import numpy as np

from deltarec.artifacts import ArtifactRoot, codec
from deltarec.artifacts.shards import ShardRows
from deltarec.artifacts.types import DumpKind, GenerationInfo, Manifest, TableSpec, parse_time
from deltarec.errors import BadInputError, ConfigError
from deltarec.faults import failpoint
from deltarec.ids import validate_run
from deltarec.publish.ahead import parts_checked_ahead
from deltarec.publish.backlog import backlog_group, publish_group
from deltarec.publish.face import BatchHook
from deltarec.publish.frombase import start_from_base
from deltarec.publish.metrics import PublishMetrics
from deltarec.publish.parts import (
    default_batch_bytes,
    marks_of_part,
    tables_left,
    transaction_rows,
)
from deltarec.publish.retry import RetryPolicy
from deltarec.publish.rows import (
    PartReader,
    TablePart,
    check_part,
    checked_while_written,
    part_chunks,
)
from deltarec.publish.snapshot import finish_snapshot
from deltarec.publish.together import publish_parts_together
from deltarec.publish.types import PartResult, PublishMode
from deltarec.stores.base import Store
from deltarec.stores.types import FreshnessRecord, ProgressMark, RowBatch

log = logging.getLogger(__name__)


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
        info = self.generation_info(generation)
        tables = info.tables
        self.call(lambda: self.store.provision(tables), f"provision generation {generation}")
        if self.mode is PublishMode.STAGED and self.pending(generation):
            self.call(
                lambda: self.store.provision(tables, staging_generation=generation),
                f"provision staging views of generation {generation}",
            )
        self.call(
            lambda: self.registry.register_generation(
                self.run, generation, info.created_at or None
            ),
            f"register generation {generation}",
        )
        self._prepared.add(generation)

    def call(self, fn: Callable[[], object], what: str) -> object:
        """``fn()`` under the retry policy (transient store errors retried, each counted)."""
        return self.retry.call(fn, what, on_retry=lambda e, w: self.metrics.retries.inc())

    def fence(self, generation: int) -> None:
        """Refuse unless ``generation`` is the run's newest (one writer per run, SPEC §5).

        Raises:
            StaleGenerationError: a newer generation of the run is registered.
        """
        self.call(
            lambda: self.registry.check_writer(self.run, generation),
            f"check generation {generation} is the newest",
        )

    def marks(self, generation: int, seq: int, rank: int) -> dict[str, ProgressMark]:
        """Table id -> the store's progress mark of dump ``seq``'s part of rank ``rank``."""
        marks = self.call(
            lambda: self.registry.progress(self.run, generation), f"read progress of {generation}"
        )
        assert isinstance(marks, list)
        return marks_of_part(marks, seq, rank)

    def transaction_rows(self, spec: TableSpec) -> int:
        """Rows of ``spec`` per store transaction now (``batch_bytes`` may change meanwhile)."""
        return transaction_rows(self.batch_bytes, spec)

    def check_part(self, part: TablePart, where: str) -> None:
        """Check every row of ``part`` (shard checksums first), as a write would; keep none.

        Raises:
            InvalidRowError: a row cannot be published.
            ChecksumError: a shard does not match its manifest entry.
        """
        whole = self.store.capabilities.whole_writes
        check_part(part, self.transaction_rows(part.spec), whole, where)

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
        self.fence(g)  # one writer per run: never publish a superseded generation
        info = self.generation_info(g)
        result = PartResult(g, s, rank)
        done = self.marks(g, s, rank)
        todo = tables_left(manifest, info, done, result)
        where = f"run {self.run!r} generation {g} dump {s} rank {rank}"
        parts = [TablePart(self.root, manifest, rank, table, spec, rows) for table, spec in todo]
        whole = self.store.capabilities.whole_writes
        inline = checked_while_written(parts, done, whole, self.transaction_rows)
        ahead = frozenset() if checked is None else checked.result()
        for part in parts:
            if part.table != inline and part.table not in ahead:
                self.check_part(part, where)
        for part in parts:
            skip = done[part.table].rows if part.table in done else 0
            self._publish_table(part, skip, result, where if part.table == inline else None)
        if manifest.kind is DumpKind.SNAPSHOT:
            self.complete_snapshot(manifest)
        self.record_freshness(manifest, rank, result)
        result.seconds = time.monotonic() - start
        self.metrics.dumps.labels(self.mode.value).inc()
        self.metrics.version.set(manifest.version)
        return result

    def _publish_table(
        self, part: TablePart, skip: int, result: PartResult, check: str | None = None
    ) -> None:
        """Write the part's rows after the first ``skip``, a transaction at a time.

        With ``check`` (where the rows come from, for the message), each shard's sha256 and
        every row are checked as they are read (see :func:`~.rows.checked_while_written`).
        """
        manifest, table, spec = part.manifest, part.table, part.spec
        stage = manifest.generation if self.mode is PublishMode.STAGED else None
        if part.in_memory:
            skip = 0  # rows in memory are replayed whole: their order need not match the shard
        total = part.rows
        whole = self.store.capabilities.whole_writes

        def rows_from(start: int) -> Iterator[ShardRows]:
            size = self.transaction_rows(spec)
            return part_chunks(part, start, size, whole, check is not None, check=check)

        reader = PartReader(rows_from, ShardRows.empty(spec.dtype, spec.dim))
        done = min(skip, total)
        while True:  # batch_bytes may change between transactions (a read budget's throttle)
            end = min(total, done + self.transaction_rows(spec))
            mark = ProgressMark(
                self.run,
                manifest.generation,
                manifest.seq,
                table,
                part.rank,
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
        reader: PartReader,
        mark: ProgressMark,
        start: int,
        stage: int | None,
    ) -> None:
        """One transaction: rows ``start .. mark.rows`` of the part, and ``mark``."""

        def batches() -> Iterator[RowBatch]:
            for rows in reader.take(start, mark.rows - start):
                versions = np.full(len(rows), manifest.version, np.int64)
                yield RowBatch(rows.keys, rows.embedding, rows.ops, versions)

        self.call(
            lambda: self.store.write_batches(
                mark.table, batches(), mark=mark, staging_generation=stage
            ),
            f"write rows {start}..{mark.rows} of {mark.table!r} (generation "
            f"{manifest.generation} dump {manifest.seq} rank {mark.rank})",
        )

    def complete_snapshot(self, manifest: Manifest) -> None:
        """Complete a snapshot dump's tables whose parts are all in (:func:`finish_snapshot`)."""
        stage = manifest.generation if self.mode is PublishMode.STAGED else None
        read: list[list[ProgressMark]] = []  # the marks, read at most once for every table

        def progress() -> list[ProgressMark]:
            if not read:
                read.append(self.registry.progress(self.run, manifest.generation))
            return read[0]

        for table in sorted(manifest.tables):
            complete = self.call(
                functools.partial(
                    finish_snapshot,
                    self.store,
                    self.run,
                    manifest.generation,
                    manifest.seq,
                    table,
                    manifest.world_size,
                    stage,
                    progress,
                ),
                f"complete snapshot of {table!r}",
            )
            log.debug("snapshot %s of %s complete: %s", manifest.seq, table, complete)

    def record_freshness(self, manifest: Manifest, rank: int, result: PartResult) -> None:
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
        self.call(lambda: self.registry.record_freshness(record), "record freshness")
        result.lag_s = visible - committed
        result.freshness_s = record.lag_s
        self.metrics.observe_visible(record.lag_s, visible - committed)

    # ---- after the fact ------------------------------------------------------------------
    def pending(self, generation: int, ranks: list[int] | None = None) -> list[tuple[int, int]]:
        """``(seq, rank)`` parts of committed dumps the store does not hold completely yet."""
        marks = self.call(
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
        marks = self.call(
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
                self.complete_snapshot(manifest)
        return results
