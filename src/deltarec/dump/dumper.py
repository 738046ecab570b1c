"""The dumper: turns tracked rows into committed generation artifacts without stalling training.

Shaped like a checkpointer. The training loop calls :meth:`Dumper.maybe_dump` after every step
and the dumper decides; public methods own the guards, private ones do the work::

    dumper = Dumper(config, sources)
    dumper.start(step=0)                       # allocate generation, clean, snapshot (dump 0)
    for step in range(1, n + 1):
        train_step()
        dumper.maybe_dump(step)                # cheap unless a dump is due
    dumper.final_dump(n)                       # kind "final"; waits until committed
    dumper.close()

A dump, on the training thread of every rank at the same step: every source's touched rows are
deduplicated and gathered on the device and copied to host memory (asynchronously, pinned, on
CUDA) chunk by chunk into a queue bounded in bytes; when the queue is full the training thread
waits. The background :class:`~deltarec.dump.worker.DumpWorker` encodes, writes and commits.
A failure there is raised on the training thread at the next call, naming dump and table.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from deltarec.artifacts.lease import LeaseHeldError, LeaseLostError, RunLease
from deltarec.artifacts.lineage import keys_published_after
from deltarec.artifacts.root import ArtifactRoot
from deltarec.artifacts.types import DumpKind, GenerationInfo, Manifest, Parent, TableSpec
from deltarec.dump.cadence import Cadence
from deltarec.dump.claim import GenerationClaim
from deltarec.dump.compactor import BackgroundCompactor, compactor_for
from deltarec.dump.config import DumperConfig
from deltarec.dump.encode import warm_up_encoding
from deltarec.dump.encoder_process import start_encoder
from deltarec.dump.exchange import Exchange
from deltarec.dump.holds import DumpHolds
from deltarec.dump.plan import agreed_table_specs, plan_dump, snapshot_fits
from deltarec.dump.queue import ByteBoundedQueue
from deltarec.dump.spread import SpreadDumps
from deltarec.dump.worker import Chunk, DumpWorker, EndOfDump, OnCommit, queue_parts
from deltarec.errors import ConfigError, DumpError
from deltarec.tracking.assemble import LocalParts
from deltarec.tracking.device_budget import DeviceBudget, device_staging
from deltarec.tracking.gather import DeviceRows
from deltarec.tracking.pinned import PinnedRing
from deltarec.tracking.types import (
    ABSORB_STEPS,
    Gathered,
    SourceOptions,
    TableSource,
    absorb_recorded,
    prepare_collects,
)

log = logging.getLogger(__name__)

TIMINGS_KEPT = 1000
"""Dumps whose training-thread timings a :class:`Dumper` keeps (the latest; a job that runs
for days dumps thousands of times)."""

STATE_VERSION = 1


class DataMismatchError(DumpError):
    """Ranks reached the final dump at different steps (uneven data exhaustion)."""


class Dumper:
    """Delta dumps of one training process lifetime (one generation).

    Args:
        config: where and when to dump.
        sources: this rank's table sources, in the same table order on every rank.
        on_commit: called on the worker thread after each committed dump (publisher hand-off).
        keep_rows: keep each dump's rows in memory for ``on_commit`` (the publisher hand-off),
            within the host budget's share for it (:attr:`plan`); a larger dump is handed
            over without rows.
        on_generation: called on rank 0 once the lease is held and the generation allocated,
            before anything of it is dumped (the other ranks wait); a failure fails the start.
    """

    def __init__(
        self,
        config: DumperConfig,
        sources: Sequence[TableSource],
        on_commit: OnCommit | None = None,
        keep_rows: bool = False,
        on_generation: Callable[[GenerationInfo], None] | None = None,
    ) -> None:
        self.config = config
        self.on_generation = on_generation
        self.sources = list(sources)
        ids = [s.table_id for s in self.sources]
        if len(set(ids)) != len(ids):
            dup = sorted({t for t in ids if ids.count(t) > 1})
            raise ConfigError(f"several table sources claim the same table id(s): {dup}")
        self.root = ArtifactRoot(config.artifacts, config.storage_options)
        self.on_commit = on_commit
        self._compactor: BackgroundCompactor | None = None
        self.generation: GenerationInfo | None = None
        dump_plan = plan_dump(config, self.sources, keep_rows)
        self.host_budget = dump_plan.host_budget
        self.encoder_process = dump_plan.encoder_process
        """Whether a child process encodes and writes the shards
        (:mod:`deltarec.dump.encoder_process`)."""
        slot = dump_plan.slot_bytes
        self.plan = dump_plan.host
        """How the host budget is shared out (:func:`~deltarec.dump.budget.plan_host_budget`)."""
        self.queue = ByteBoundedQueue(self.plan.queue_bytes, abort_check=self._check_worker)
        self.spread = SpreadDumps(self.queue)
        """The open spread dump (``DumperConfig.spread_steps``; :mod:`deltarec.dump.spread`)."""
        self.device_budget = DeviceBudget(config.device_staging_share)
        self.pinned: PinnedRing | None = (
            PinnedRing(slot, self.plan.pinned_slots, shared=self.encoder_process)
            if self.plan.pinned_slots
            else None
        )
        """Pinned host memory for every device→host copy of the dumps (CUDA), allocated
        once, in :meth:`start`; in shared memory with an encoder process (also on CPU)."""
        self._worker: DumpWorker | None = None
        self.lease: RunLease | None = None
        """The run's lease (rank 0 only): acquired in :meth:`start`, checked at every commit."""
        self._train_x: Exchange | None = None
        self._worker_x: Exchange | None = None
        self._cadence: Cadence | None = None
        self._restored: dict[str, Any] | None = None
        self._seq = -1
        self._step = 0
        self._last_dump_step = 0
        self._paused = False
        self._since_absorb = 0
        self._closed = False
        self.dumps_taken = 0
        """Dumps taken since :meth:`start` (this process)."""
        self.holds = DumpHolds(TIMINGS_KEPT)
        """What the latest dumps cost the training thread (:mod:`deltarec.dump.holds`)."""
        self._dump_over = threading.Event()
        self._dump_over.set()
        self.dump_host_seconds = self.holds.host_seconds
        """Wall seconds the training thread spent in the latest dumps, waits for the
        device included (see :attr:`dump_seconds`)."""
        self.dump_cpu_seconds = self.holds.cpu_seconds
        """Training-thread CPU seconds of the latest dumps (``time.thread_time``)."""
        self.dump_timings = self.holds.timings
        """Training-thread seconds per table of the latest dumps."""
        self.last_dump_timing: dict[str, float] = {}
        """Training-thread seconds per table of the latest dump."""

    # ---- lifecycle -----------------------------------------------------------------------
    @property
    def dump_seconds(self) -> deque[float]:
        """The hold of the latest dumps: what each cost the training thread, in seconds.

        With CUDA, the time between two events on the training stream, recorded as the dump
        began and as its last device work was queued: the dump's own device work and the waits
        of its host synchronizations (docs/dump.md), not the work that the steps before it had
        queued. Without CUDA, the thread's wall time in the dump (gather and enqueue; writing
        is background). A dump's figure appears once its device work has run (the next call
        reads it).
        """
        return self.holds.seconds

    @property
    def rank(self) -> int:
        """This rank within the dumper's groups (0 when not distributed)."""
        return self._train_x.rank if self._train_x is not None else 0

    @property
    def started(self) -> bool:
        """True between :meth:`start` and :meth:`close`."""
        return self.generation is not None and not self._closed

    def start(self, step: int = 0, restored_from: int | None = None) -> GenerationInfo:
        """Open the next generation at training step ``step`` (collective: every rank at once).

        Rank 0 removes incomplete dumps of the run and allocates the generation atomically;
        a fresh generation then gets a snapshot (dump 0) unless disabled, and a generation
        restored by :meth:`load_state_dict` republishes (dump 1) every key that dumps after
        the checkpoint had published, with the restored values.

        Args:
            step: the training step the model is at (0 for a fresh start).
            restored_from: the checkpoint step when resuming (defaults to the step saved in
                the dumper's state).
        """
        if self.generation is not None:
            raise RuntimeError("dumper already started")
        # deltarec's own gloo side groups, beside any training backend (NCCL included)
        self._train_x = Exchange.create(self.config.commit_timeout_s, "training-thread")
        self._worker_x = Exchange.create(self.config.commit_timeout_s, "worker")
        options = SourceOptions(
            zch_misses=self.config.zch_misses,
            device_graph_bytes=self.config.device_graph_bytes,
            spread_steps=self.config.spread_steps,
        )
        for s in self.sources:
            s.configure(options)
            s.bind(self._train_x)
        tables = self._table_specs()
        parent = None
        if self._restored is not None:
            ckpt = restored_from if restored_from is not None else int(self._restored["step"])
            parent = Parent(int(self._restored["generation"]), int(ckpt))
        self.generation = self._allocate(tables, parent)
        self._step = self._last_dump_step = step
        if self.pinned is not None and (torch.cuda.is_initialized() or self.pinned.shared):
            self.pinned.allocate()  # now, before training runs: never during a dump
        if self.lease is not None:
            # the commits' fence, once before training: its first use imports fsspec (about
            # 60 ms holding the GIL), which on the worker stalled the training thread
            self._fence()
        encoder = None
        if self.encoder_process:
            assert self._worker_x is not None
            encoder = start_encoder(
                self.config, self.generation.generation, self._worker_x.rank, tables,
                self.plan, self.pinned,
            )  # fmt: skip
            gc.collect()
        else:
            warm_up_encoding({spec.dtype for spec in tables.values()})
            gc.collect()  # the start-up's objects are old ones too
        self._worker = DumpWorker(
            self.root,
            self.config.run,
            self.generation.generation,
            tables,
            self.queue,
            self._worker_x,
            fsync=self.config.fsync,
            on_commit=self.on_commit,
            keep_rows_bytes=self.plan.keep_rows_bytes,
            fence=self._fence if self.lease is not None else None,
            encode_workers=self.plan.encode_threads,
            chunk_rows=self.config.chunk_rows,
            arena_bytes=self.plan.arena_bytes,
            pinned=self.pinned,
            encoder=encoder,
            dump_over=self._dump_over,
        )
        rank = self._worker_x.rank if self._worker_x is not None else 0
        self._compactor = compactor_for(self.config, self.generation.generation, rank)
        if self._compactor is not None:  # rank 0 compacts every N dumps, in a child process
            self._worker.after_commit = self._compactor.committed
        self._cadence = Cadence(
            self.config.every_steps,
            self.config.every_minutes,
            clock_sync=self._agreed_clock,
            max_gap=self.config.time_sync_max_steps,
        )
        if torch.cuda.is_initialized():
            # sources allocate their dump buffers and load their kernels now, not in the first
            # dump; whatever this takes of the ids recorded so far is discarded just below
            prepare_collects(self.sources)
        self._discard_pending()
        if parent is not None:
            self._republish(step, parent)
        elif self.config.snapshot and self._snapshot_fits():
            self._dump(step, DumpKind.SNAPSHOT, seq=0)
        self._seq = max(self._seq, 0)
        self._cadence.start(step)
        return self.generation

    def _snapshot_fits(self) -> bool:
        """Collective: whether every rank's rows fit ``snapshot_max_bytes`` (logs if not)."""
        assert self._train_x is not None and self.generation is not None
        return snapshot_fits(
            self.config, self.sources, self._train_x, self.host_budget, self.generation.generation
        )

    def _table_specs(self) -> dict[str, TableSpec]:
        assert self._train_x is not None
        return agreed_table_specs(self.config, self.sources, self._train_x)

    def _allocate(self, tables: dict[str, TableSpec], parent: Parent | None) -> GenerationInfo:
        assert self._train_x is not None
        outcome: tuple[str, Any]
        if self._train_x.rank == 0:
            world, on_generation = self._train_x.world_size, self.on_generation
            claim = GenerationClaim(self.root, self.config, world, tables, parent, on_generation)
            outcome = claim.run(lambda lease: setattr(self, "lease", lease))
        else:
            outcome = ("ok", None)
        outcome = self._train_x.broadcast(outcome, src=0)
        if outcome[0] == "held":
            raise LeaseHeldError(outcome[1])
        if outcome[0] != "ok":
            raise DumpError(self.config.run, 0, 0, None, f"allocating a generation: {outcome[1]}")
        path = self.root.generation_file(self.config.run, int(outcome[1]["generation"]))
        return GenerationInfo.from_json(outcome[1], self.root.url(path))

    def close(self, timeout: float | None = 60.0) -> None:
        """Finish queued dumps (up to ``timeout`` seconds), stop the worker, release sources."""
        if self._closed:
            return
        self._closed = True
        stuck = False
        try:
            self.spread.close()
            if self._worker is not None:
                stuck = not self._worker.stop(timeout)
        finally:
            if self._compactor is not None:
                self._compactor.close()
            if self.lease is not None:
                if stuck:
                    self.lease.stop()  # the worker may still commit: let the lease expire
                else:
                    self.lease.release()
            for s in self.sources:
                try:
                    s.close()
                except Exception:
                    log.exception("closing table source %s failed", s.table_id)
            if self._train_x is not None:
                self._train_x.close()
            if self._worker_x is not None and not stuck:
                self._worker_x.close()
            if self.pinned is not None and not stuck:
                self.pinned.close()
            if stuck:
                log.warning(
                    "the dump worker did not stop within %s s (waiting for another rank at a "
                    "commit?); it is left to end with the process",
                    timeout,
                )

    # ---- per step ------------------------------------------------------------------------
    def maybe_dump(self, step: int) -> int | None:
        """Dump if the cadence says so after training step ``step``; returns the dump's seq.

        Raises the failure of an earlier dump (:class:`~deltarec.errors.DumpError`).
        No collective runs here except at the cadence's agreed steps.
        """
        self._require_started()
        self._check_worker()
        self._step = step
        assert self._cadence is not None
        if not self._cadence.due(step):
            self.spread.advance()
            self._since_absorb += 1
            if self._since_absorb >= ABSORB_STEPS and not self._paused:
                # a dump of many steps then marks only the last few steps' lookups itself
                self._since_absorb = 0
                absorb_recorded(self.sources)
            return None
        self._since_absorb = 0
        return self._dump(step, DumpKind.DELTA)

    def dump_now(self, step: int) -> int:
        """Dump the rows touched so far at ``step`` (collective: every rank at the same step)."""
        self._require_started()
        self._check_worker()
        self._step = step
        return self._dump(step, DumpKind.DELTA)

    def final_dump(self, step: int, timeout: float | None = None) -> Manifest:
        """Write the last delta (kind ``final``) and wait until it is committed.

        Every rank's last step is compared first (one all_gather); if they differ the call
        fails on every rank naming the ranks and steps, so a lagging rank's rows are never
        silently skipped.
        """
        self._require_started()
        self._check_worker()
        assert self._train_x is not None and self._worker is not None
        steps = self._train_x.all_gather(int(step), what=f"the final dump's step check ({step})")
        if len(set(steps)) != 1:
            raise DataMismatchError(
                self.config.run,
                self.generation.generation if self.generation else 0,
                self._seq + 1,
                None,
                "ranks ended at different steps ("
                + ", ".join(f"rank {r}: step {s}" for r, s in enumerate(steps))
                + "); the ranks ran out of data unevenly, no final dump was written",
            )
        self._step = step
        seq = self._dump(step, DumpKind.FINAL)
        return self._worker.wait_committed(seq, timeout)

    def wait_idle(self, timeout: float | None = None) -> None:
        """Wait until every queued dump is written and committed (raises a dump failure)."""
        self._require_started()
        assert self._worker is not None
        self.spread.advance(finish=True)
        queued = self.dumps_taken > 0 or self._restored is not None  # else no dump 0 to wait for
        if queued and self._worker.last_committed_seq() != self._seq:
            self._worker.wait_committed(self._seq, timeout)
        self._check_worker()

    def check_owner(self) -> None:
        """Collective: raise on every rank unless this trainer still owns the run.

        Called before a training checkpoint, so that a superseded trainer never writes one.

        Raises:
            LeaseLostError: a newer trainer holds the run's lease.
        """
        self._require_started()
        assert self._train_x is not None
        problem = None
        if self.lease is not None:
            try:
                self._fence()
            except LeaseLostError as e:
                problem = str(e)
        problem = self._train_x.broadcast(problem, src=0)
        if problem is not None:
            raise LeaseLostError(problem)

    def _fence(self) -> None:
        """Rank 0: the lease is still ours and no newer generation exists (raises otherwise)."""
        assert self.lease is not None and self.generation is not None
        self.lease.check()
        newest = self.root.newest_generation_number(self.config.run)
        if newest > self.generation.generation:
            raise LeaseLostError(
                f"generation {newest} of run {self.config.run!r} was opened by another writer;"
                f" this trainer (generation {self.generation.generation}) stops without "
                "committing"
            )

    # ---- evaluation ----------------------------------------------------------------------
    def before_eval(self) -> None:
        """Lookups from now until :meth:`after_eval` are not training updates."""
        if self._paused:
            return
        self._paused = True
        for s in self.sources:
            s.before_eval()

    def after_eval(self) -> None:
        """Evaluation ended: forget the ids recorded during it."""
        if not self._paused:
            return
        self._paused = False
        for s in self.sources:
            s.after_eval()

    # ---- checkpoint ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What a training checkpoint keeps: run, generation, last seq and step."""
        gen = self.generation.generation if self.generation is not None else None
        return {
            "version": STATE_VERSION,
            "run": self.config.run,
            "generation": gen,
            "seq": self._seq,
            "step": self._step,
            "last_dump_step": self._last_dump_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from a checkpoint, before :meth:`start`: the next generation's parent."""
        if self.generation is not None:
            raise RuntimeError("load_state_dict must be called before start()")
        if not state:
            return  # saved before the dumper started: a fresh lineage
        if state.get("version") != STATE_VERSION:
            raise ConfigError(f"dumper state version {state.get('version')!r} is not supported")
        if state.get("run") != self.config.run:
            raise ConfigError(
                f"checkpoint belongs to run {state.get('run')!r}, not {self.config.run!r}"
            )
        if state.get("generation") is None:
            return  # checkpoint taken before the dumper started: a fresh lineage
        self._restored = dict(state)

    @property
    def compactor(self) -> BackgroundCompactor | None:
        """Rank 0's background compactor (``compact_every_dumps``), else None."""
        return self._compactor

    # ---- internals -----------------------------------------------------------------------
    def _require_started(self) -> None:
        if self.generation is None or self._closed:
            raise RuntimeError("the dumper is not started (call start() first) or is closed")

    def _check_worker(self) -> None:
        if self._worker is not None:
            self._worker.check()

    def _agreed_clock(self) -> float:
        assert self._train_x is not None
        what = f"the time cadence's clock agreement at step {self._step}"
        return float(self._train_x.broadcast(time.time(), src=0, what=what))

    def _discard_pending(self) -> None:
        self.spread.drop()
        for s in self.sources:
            s.discard()

    def _dump(self, step: int, kind: DumpKind, seq: int | None = None) -> int:
        seq = self._seq + 1 if seq is None else seq
        first = self._last_dump_step + 1 if kind is not DumpKind.SNAPSHOT else step
        first = min(first, step)
        taken_at = time.time()  # the freshness of this dump's rows counts from here
        started = self.holds.begin()
        timing = {}
        staged: list[Chunk] = []
        self._dump_over.clear()
        try:
            self.spread.advance(finish=True)  # the previous dump's rows first
            if kind is not DumpKind.SNAPSHOT:
                # every table's dedup queued (one sync for all), gathered by a CUDA graph, or
                # spread over the next steps
                with device_staging(self.device_budget, self.pinned):
                    prepare_collects(self.sources)
            for source in self.sources:
                t0 = time.perf_counter()
                gathered = (
                    source.dump_snapshot(self.config.chunk_rows)
                    if kind is DumpKind.SNAPSHOT
                    else source.dump_collect(self.config.chunk_rows)
                )
                self._enqueue_gathered(seq, source.table_id, step, gathered, staged)
                timing[source.table_id] = time.perf_counter() - t0
        except BaseException:
            for chunk in staged:  # never queued: give their device bytes back
                if isinstance(chunk.rows, DeviceRows):
                    chunk.rows.release()
            raise
        finally:
            self._dump_over.set()
        for chunk in staged:  # the worker would only wait for the dump's end to copy them
            self.queue.put(chunk, 0)
        end = EndOfDump(seq, kind, first, step, taken_at)
        if not self.spread.start(self.sources, end):
            self.queue.put(end, 0)
        elif kind is DumpKind.FINAL:  # no step follows it
            self.spread.advance(finish=True, early=False)
        self.dumps_taken += 1
        self.holds.end(started, timing)
        self.last_dump_timing = timing
        self._seq = seq
        self._last_dump_step = step
        if self._cadence is not None and kind is not DumpKind.SNAPSHOT:
            self._cadence.start(step)
        return seq

    def _enqueue_gathered(
        self,
        seq: int,
        table: str,
        step: int,
        gathered: Gathered,
        staged: list[Chunk] | None = None,
    ) -> None:
        """Queue what a source answered: its local part of an assembled table, or chunks.

        Chunks are gathered within the device staging scope: a CUDA table's rows may stay on
        the device, in one staging buffer. With ``staged``, such buffers are appended to it
        instead, for the caller to queue once the dump is over: queued now, each would wake
        the worker, whose Python then takes the GIL from the training thread's next calls.
        """
        if isinstance(gathered, LocalParts):
            queue_parts(self.queue, seq, table, step, gathered)
            return
        with device_staging(self.device_budget, self.pinned):
            for host in gathered:
                if len(host) == 0:
                    continue
                if staged is not None and isinstance(host, DeviceRows):
                    staged.append(Chunk(seq, table, step, host))
                else:
                    self.queue.put(Chunk(seq, table, step, host), host.nbytes)

    def _republish(self, step: int, parent: Parent) -> None:
        assert self.generation is not None
        taken_at = time.time()
        published = keys_published_after(self.root, self.config.run, parent)
        seq = 1
        for source in self.sources:
            keys = published.get(source.table_id, np.empty(0, np.int64))
            tkeys = torch.from_numpy(np.ascontiguousarray(keys, dtype=np.int64))
            gathered = source.dump_read_keys(tkeys, self.config.chunk_rows)
            self._enqueue_gathered(seq, source.table_id, step, gathered)
        self.queue.put(EndOfDump(seq, DumpKind.DELTA, step, step, taken_at), 0)
        self._seq = seq
        self._last_dump_step = step
        log.info(
            "generation %d republished %d keys published after step %d of generation %d",
            self.generation.generation,
            sum(len(k) for k in published.values()),
            parent.checkpoint_step,
            parent.generation,
        )
