"""The background worker: encode gathered chunks, write shards, commit each dump across ranks.

The training thread puts, in order, for each dump: :class:`Chunk` items (one table's rows at a
time) and then one :class:`EndOfDump`. The worker waits for each chunk's device→host copy,
encodes it with the table's dtype, appends it to the table's :class:`ShardWriter` (streamed,
hashed, temp name), and at the end of the dump closes the shards (durable, renamed) and runs
the commit protocol:

1. every rank's worker sends its shard list - or the error that stopped it - to every other
   rank over the worker's own gloo group (``all_gather``);
2. if no rank failed, rank 0 writes MANIFEST.json (last, atomically) and broadcasts the
   outcome; every rank then knows whether dump ``S`` is committed.

A failure (in any rank) fails the dump on every rank: the error, naming the dump, the table and
the rank, is kept and re-raised on the training thread at its next call. After a failure the
worker writes nothing more and takes part in no further exchange (every rank stops at the same
dump, so no rank waits for another).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from deltarec.artifacts import codec
from deltarec.artifacts.root import ArtifactRoot
from deltarec.artifacts.shards import ShardRows, ShardWriter
from deltarec.artifacts.types import DumpKind, Manifest, ShardInfo, TableSpec
from deltarec.dump.assemble import Assembly, Part
from deltarec.dump.exchange import Exchange
from deltarec.dump.gather import HostRows
from deltarec.dump.queue import ByteBoundedQueue, QueueClosedError
from deltarec.errors import DumpError
from deltarec.testing.faults import failpoint

log = logging.getLogger(__name__)


@dataclass
class Chunk:
    """Rows of one table for dump ``seq``, read at training step ``step``."""

    seq: int
    table: str
    step: int
    rows: HostRows


@dataclass
class EndOfDump:
    """All chunks of dump ``seq`` were put; close its shards and commit it."""

    seq: int
    kind: DumpKind
    first_step: int
    last_step: int


@dataclass
class _Stop:
    pass


@dataclass
class _DumpState:
    seq: int
    writers: dict[str, ShardWriter] = field(default_factory=dict)
    shards: list[ShardInfo] = field(default_factory=list)
    kept: dict[str, list[ShardRows]] = field(default_factory=dict)
    kept_bytes: int = 0
    assemblies: dict[str, Assembly] = field(default_factory=dict)
    error: tuple[str | None, str] | None = None


OnCommit = Callable[[Manifest, "dict[str, ShardRows] | None"], None]
"""Called on the worker thread after a dump is committed, with this rank's rows when kept."""


class DumpWorker:
    """The per-rank background writer of one generation.

    Args:
        root: the artifact root.
        run, generation: what is written.
        tables: every table of the generation (manifests list them all, 0 rows if untouched).
        queue: the byte-bounded queue shared with the training thread.
        exchange: the worker's own exchange (gloo group) for the commit.
        fsync: make shards durable before renaming them.
        on_commit: publisher hand-off, called after each commit.
        keep_rows_bytes: keep up to this many encoded bytes of a dump in memory for
            ``on_commit``; a larger dump is handed over without rows (read from artifacts).
        fence: called on rank 0 right before MANIFEST.json is written; if it raises (a newer
            trainer owns the run), the dump fails on every rank and nothing is committed.
    """

    def __init__(
        self,
        root: ArtifactRoot,
        run: str,
        generation: int,
        tables: dict[str, TableSpec],
        queue: ByteBoundedQueue,
        exchange: Exchange,
        fsync: bool = True,
        on_commit: OnCommit | None = None,
        keep_rows_bytes: int = 0,
        fence: Callable[[], None] | None = None,
    ) -> None:
        self.root = root
        self.fence = fence
        self.run = run
        self.generation = generation
        self.tables = tables
        self.queue = queue
        self.exchange = exchange
        self.fsync = fsync
        self.on_commit = on_commit
        self.keep_rows_bytes = keep_rows_bytes
        self.committed: list[Manifest] = []
        self.failure: DumpError | None = None
        self._cond = threading.Condition()
        self._dump: _DumpState | None = None
        self._thread = threading.Thread(target=self._loop, name="deltarec-dump-worker", daemon=True)
        self._thread.start()

    # ---- training-thread side ------------------------------------------------------------
    def check(self) -> None:
        """Re-raise a failure of the worker (or of another rank's dump) on the caller's thread."""
        if self.failure is not None:
            raise self.failure

    def last_committed_seq(self) -> int | None:
        """The newest committed dump's seq (None if none yet)."""
        with self._cond:
            return self.committed[-1].seq if self.committed else None

    def wait_committed(self, seq: int, timeout: float | None = None) -> Manifest:
        """Wait until dump ``seq`` is committed; raise the dump's failure instead if it failed."""
        with self._cond:
            ok = self._cond.wait_for(
                lambda: (
                    self.failure is not None
                    or any(m.seq == seq for m in self.committed)
                    or not self._thread.is_alive()
                ),
                timeout=timeout,
            )
            self.check()
            for m in self.committed:
                if m.seq == seq:
                    return m
        problem = "timed out waiting for the commit" if not ok else "the dump worker stopped"
        raise DumpError(self.run, self.generation, seq, None, problem)

    def stop(self, timeout: float | None = None) -> bool:
        """Finish what is queued, then stop the thread. Returns False if it is still running."""
        if self._thread.is_alive():
            with contextlib.suppress(QueueClosedError):
                self.queue.put(_Stop(), 0)
            self._thread.join(timeout)
        alive = self._thread.is_alive()
        if not alive:
            self.queue.close()
        return not alive

    # ---- worker thread -------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            try:
                item, nbytes = self.queue.get()
            except QueueClosedError:
                return
            if isinstance(item, _Stop):
                self.queue.release(nbytes)
                return
            try:
                if self.failure is None:
                    self._handle(item)
            except BaseException as e:
                log.exception("dump worker failed")
                self._fail_local(item, e)
            finally:
                item = None  # drop the host rows before their bytes are released
                self.queue.release(nbytes)
                with self._cond:
                    self._cond.notify_all()

    def _handle(self, item: object) -> None:
        if isinstance(item, Chunk):
            self._write_chunk(item)
        elif isinstance(item, Part):
            self._exchange_part(item)
        elif isinstance(item, EndOfDump):
            self._end_dump(item)
        else:
            raise TypeError(f"unexpected dump queue item {item!r}")

    def _state(self, seq: int) -> _DumpState:
        if self._dump is None or self._dump.seq != seq:
            self._abort_writers()
            self._dump = _DumpState(seq)
        return self._dump

    def _write_chunk(self, chunk: Chunk) -> None:
        state = self._state(chunk.seq)
        if state.error is not None:
            return
        try:
            chunk.rows.wait()
            keys, values, ops = chunk.rows.numpy()
            self._write_rows(state, chunk.table, chunk.step, keys, values, ops)
        except Exception as e:
            state.error = (chunk.table, f"{type(e).__name__}: {e}")
            log.exception("writing dump %s table %s failed", chunk.seq, chunk.table)

    def _write_rows(
        self,
        state: _DumpState,
        table: str,
        step: int,
        keys: np.ndarray,
        values: np.ndarray,
        ops: np.ndarray | None,
    ) -> None:
        spec = self.tables[table]
        encoded = codec.encode(values, spec.dtype)
        rows = ShardRows(
            keys=keys.astype(np.int64, copy=False),
            embedding=encoded,
            ops=np.zeros(len(keys), np.int8) if ops is None else ops.astype(np.int8, copy=False),
            steps=np.full(len(keys), step, dtype=np.int64),
        )
        writer = state.writers.get(table)
        if writer is None:
            writer = ShardWriter(
                self.root,
                self.run,
                self.generation,
                state.seq,
                table,
                self.exchange.rank,
                spec.dtype,
                spec.dim,
                fsync=self.fsync,
            )
            state.writers[table] = writer
        writer.write(rows)
        failpoint("shard.write")
        self._keep(state, table, rows, encoded)

    def _exchange_part(self, part: Part) -> None:
        """One part of an assembled table: its round(s) of the exchange on the worker's group.

        Collectives run even after a local write error (the other ranks are waiting in the
        same rounds); the error then fails the dump at the commit, on every rank.
        """
        state = self._state(part.seq)
        asm = state.assemblies.get(part.table)
        if asm is None:
            counts = self.exchange.all_gather(part.count)
            asm = Assembly(part.table, part.mode, self.tables[part.table].dim, max(counts))
            state.assemblies[part.table] = asm
        payload = None
        if part.rows is not None and state.error is None:
            try:
                payload = part.payload()
            except Exception as e:
                state.error = (part.table, f"{type(e).__name__}: {e}")
        if part.count > 0:
            self._round(state, asm, part, payload)
        if part.index >= part.count - 1:  # this rank's last part: rounds the others still need
            while asm.done < asm.rounds:
                self._round(state, asm, part, None)

    def _round(self, state: _DumpState, asm: Assembly, part: Part, payload: object) -> None:
        got = self.exchange.gather((payload, part.columns), dst=part.writer_rank)
        try:
            if got is None or state.error is not None:
                return
            whole = asm.assemble([g[0] for g in got], [g[1] for g in got])
            if whole is not None and len(whole[0]):
                self._write_rows(state, part.table, part.step, whole[0], whole[1], None)
        except Exception as e:
            state.error = (part.table, f"{type(e).__name__}: {e}")
            log.exception("assembling dump %s table %s failed", part.seq, part.table)
        finally:
            asm.done += 1

    def _keep(self, state: _DumpState, table: str, rows: ShardRows, encoded: np.ndarray) -> None:
        if self.on_commit is None or state.kept_bytes < 0:
            return
        size = encoded.nbytes + rows.keys.nbytes + rows.ops.nbytes + rows.steps.nbytes
        if state.kept_bytes + size > self.keep_rows_bytes:
            state.kept.clear()
            state.kept_bytes = -1  # too large: hand over without rows
            return
        copy = ShardRows(rows.keys.copy(), encoded.copy(), rows.ops.copy(), rows.steps.copy())
        state.kept.setdefault(table, []).append(copy)
        state.kept_bytes += size

    def _end_dump(self, end: EndOfDump) -> None:
        state = self._state(end.seq)
        if state.error is None:
            for table, writer in list(state.writers.items()):
                try:
                    state.shards.append(writer.close())
                except Exception as e:
                    state.error = (table, f"{type(e).__name__}: {e}")
                    break
        if state.error is not None:
            self._abort_writers()
        manifest = self._commit(end, state)
        self._dump = None
        with self._cond:
            self.committed.append(manifest)
            self._cond.notify_all()
        if self.on_commit is not None:
            kept = None
            if state.kept_bytes >= 0:
                kept = {t: ShardRows.concat(parts) for t, parts in state.kept.items()}
            self.on_commit(manifest, kept)

    def _commit(self, end: EndOfDump, state: _DumpState) -> Manifest:
        rank = self.exchange.rank
        mine = {"shards": [s.to_json() for s in state.shards], "error": state.error}
        everyone = self.exchange.all_gather(mine)
        for r, payload in enumerate(everyone):
            if payload["error"] is not None:
                table, problem = payload["error"]
                raise DumpError(self.run, self.generation, end.seq, table, f"rank {r}: {problem}")
        shards = tuple(
            sorted(
                (ShardInfo(**s) for payload in everyone for s in payload["shards"]),
                key=lambda s: (s.table, s.rank),
            )
        )
        rows = dict.fromkeys(self.tables, 0)
        for s in shards:
            rows[s.table] = rows.get(s.table, 0) + s.rows
        manifest = Manifest(
            run=self.run,
            generation=self.generation,
            seq=end.seq,
            kind=end.kind,
            first_step=end.first_step,
            last_step=end.last_step,
            world_size=self.exchange.world_size,
            shards=shards,
            tables=rows,
        )
        outcome: str | None = None
        if rank == 0:
            try:
                failpoint("commit.manifest")
                if self.fence is not None:
                    self.fence()
            except Exception as e:
                outcome = f"not committed: {e}"
            else:
                try:
                    self.root.commit_manifest(manifest)
                except Exception as e:
                    outcome = f"rank 0 could not write MANIFEST.json: {type(e).__name__}: {e}"
        outcome = self.exchange.broadcast(outcome, src=0)
        if outcome is not None:
            raise DumpError(self.run, self.generation, end.seq, None, outcome)
        return manifest

    def _fail_local(self, item: object, e: BaseException) -> None:
        if isinstance(e, DumpError):
            err = e
        else:
            seq = getattr(item, "seq", -1)
            table = getattr(item, "table", None)
            err = DumpError(self.run, self.generation, seq, table, f"{type(e).__name__}: {e}")
            err.__cause__ = e
        self._abort_writers()
        with self._cond:
            self.failure = err
            self._cond.notify_all()

    def _abort_writers(self) -> None:
        if self._dump is None:
            return
        for writer in self._dump.writers.values():
            try:
                writer.abort()
            except Exception:
                log.warning("could not remove a temporary shard of dump %s", self._dump.seq)
        self._dump.writers.clear()
