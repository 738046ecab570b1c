"""The dump's encoder process: chunks are encoded and shards written outside the training process.

With ``DumperConfig.encoder = "process"`` (the default where CUDA is available) the training
process keeps only the device side of a dump: the gather, the device->host copies into the
shared ring (:class:`~deltarec.tracking.pinned.PinnedRing` with ``shared=True``, pinned by
``cudaHostRegister``) and the commit protocol. Everything that holds a Python interpreter busy
for long - the dtype and parquet encoding, the pieces' bookkeeping, sha256, the writes, the
footers, fsync - runs in one child process started when the dumper starts, with its own
interpreter and GIL. So the training thread never waits for the GIL behind the encoders, and
their garbage collections stop only the child.

The two talk over a socket pair (:class:`multiprocessing.connection.Connection`, small
pickled tuples); rows travel through the ring and never through the socket, except for
chunks that fit no slot and assembled rows (column-wise and data-parallel tables), which are
pickled. Per chunk the parent sends where its keys, rows and ops lie in the ring; the child
appends the encoded chunk to the table's shard (:class:`~deltarec.dump.encode.
ParallelShardWriter`, as the threads would) and answers ``free`` once its bytes are written and
hashed, and the parent gives the slot and the budget bytes back. At the end of a dump the
parent asks the child to close the dump's shards (footer, fsync, rename) and gets their
:class:`~deltarec.artifacts.types.ShardInfo` or the error; only then does the commit protocol
run, in the parent, as before: a dump is committed only once its shards are durable.

A child that dies (killed, out of memory) closes its end of the socket: the parent's reader
thread sees it at once, gives back every slot and byte the child held, and every later call
raises :class:`EncoderLostError`, which fails the dump in flight on every rank (nothing of it
is committed; what was committed before stays). The child ends when the parent does (its end
of the socket closes), removing the temporary shards it was writing.

The child imports numpy, pyarrow and deltarec's artifact code, not torch.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import mmap
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import numpy as np

from deltarec.errors import DeltarecError

if TYPE_CHECKING:
    from deltarec.artifacts.types import TableSpec
    from deltarec.dump.budget import HostBudgetPlan
    from deltarec.dump.config import DumperConfig
    from deltarec.tracking.pinned import PinnedRing

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0
"""How long the dumper waits for a new encoder process to report ready."""
CHILD_NICENESS = 10
"""The encoder process runs at this niceness: when its threads and the training process want
more cores than the host has, the scheduler runs the training thread first."""
STOP_TIMEOUT_S = 60.0
"""How long closing waits for the encoder process to end before killing it."""


class EncoderLostError(DeltarecError):
    """The dump's encoder process ended (or could not start); the dump in flight fails."""

    def __init__(self, pid: int | None, exit_code: int | None, doing: str) -> None:
        self.pid = pid
        self.exit_code = exit_code
        how = f"exit code {exit_code}" if exit_code is not None else "still running"
        if exit_code is not None and exit_code < 0:
            how = f"killed by signal {-exit_code}"
        super().__init__(
            f"the dump's encoder process (pid {pid}) ended ({how}) while {doing}; the dumps "
            "it had not closed are not committed"
        )


def _child_path() -> str:
    """``PYTHONPATH`` for the child: this process's import path (deltarec found as here)."""
    return os.pathsep.join(p for p in sys.path if isinstance(p, str) and p)


class EncoderProcess:
    """The training process's handle on its encoder process (one per dump worker).

    Args:
        setup: what the child needs: ``artifacts``, ``storage_options``, ``run``,
            ``generation``, ``rank``, ``tables`` (``{table: (dtype, dim)}``), ``fsync``,
            ``encode_workers``, ``arena_bytes``.
        ring: the shared ring the chunks lie in (None: every chunk is pickled).

    Raises:
        EncoderLostError: the child did not start or report ready within
            :data:`START_TIMEOUT_S`.
    """

    def __init__(self, setup: dict[str, Any], ring: Any = None) -> None:
        self.ring = ring if ring is not None and ring.shared and ring.fd >= 0 else None
        ours, theirs = socket.socketpair()
        fds = [theirs.fileno()] + ([self.ring.fd] if self.ring is not None else [])
        env = dict(os.environ, PYTHONPATH=_child_path())
        code = "from deltarec.dump.encoder_process import child_main; child_main()"
        ring_fd = str(self.ring.fd) if self.ring is not None else "-1"
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", code, str(theirs.fileno()), ring_fd],
                pass_fds=fds,
                env=env,
                close_fds=True,
            )
        finally:
            theirs.close()
        self.pid = self.proc.pid
        self._conn = Connection(ours.detach())
        self._send_lock = threading.Lock()
        self._cond = threading.Condition()
        self._pending: dict[int, Callable[[], None] | None] = {}
        self._replies: dict[tuple[str, int], tuple[Any, ...]] = {}
        self._tokens = itertools.count()
        self._lost: EncoderLostError | None = None
        self._stopping = False
        self.send(("init", setup), "starting")
        if not self._conn.poll(START_TIMEOUT_S):
            self.proc.kill()
            raise EncoderLostError(self.pid, self.proc.poll(), "starting")
        try:
            ready = self._conn.recv()
        except (EOFError, OSError):
            raise EncoderLostError(self.pid, self.proc.wait(), "starting") from None
        if ready[0] != "ready":
            self.proc.kill()
            raise EncoderLostError(self.pid, self.proc.wait(), f"starting: {ready[1]}")
        self._reader = threading.Thread(
            target=self._read_loop, name="deltarec-encoder-reader", daemon=True
        )
        self._reader.start()

    # ---- the dump worker's side ------------------------------------------------------------
    def check(self, doing: str = "encoding") -> None:
        """Raise :class:`EncoderLostError` if the child has ended."""
        if self._lost is not None:
            raise EncoderLostError(self.pid, self._lost.exit_code, doing)

    def send(self, message: tuple[Any, ...], doing: str) -> None:
        """Send one message (raises :class:`EncoderLostError` if the child is gone)."""
        self.check(doing)
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, EOFError):
            self._on_lost()
            self.check(doing)

    def send_chunk(
        self, seq: int, table: str, step: int, host: Any, release: Callable[[], None]
    ) -> None:
        """Hand one host chunk (:class:`~deltarec.tracking.gather.HostRows`) to the child.

        Waits for the chunk's device->host copy first. ``release`` is called once the child
        has written and hashed it (or has ended): it gives the chunk's slot and bytes back.
        """
        host.wait()
        tensors = (host.keys, host.rows, host.ops)
        in_ring = self.ring is not None and host.slot is not None and host.slot.ring is self.ring
        if self.ring is not None and not in_ring:
            # rows gathered into host memory of their own (a CPU table): into a slot
            copied = self.ring.copy_in(*(t.contiguous() for t in tensors))
            if copied is not None:
                slot, tensors = copied[0], tuple(copied[1])
                release = _then(slot.give_back, release)
                in_ring = True
        token = self._register(release)
        keys, rows, ops = (t.numpy() for t in tensors)
        doing = f"encoding dump {seq} table {table!r}"
        if in_ring:
            assert self.ring is not None
            # each tensor's ring offset; one outside the ring (a staged chunk's ops) inline
            where = tuple(
                self.ring.offset_of(t) if self.ring.holds(t) else a
                for t, a in zip(tensors, (keys, rows, ops), strict=True)
            )
            shape = (len(keys), int(rows.shape[1]) if rows.ndim > 1 else 1, rows.dtype.str)
            self.send(("chunk", seq, table, step, token, where, shape), doing)
        else:
            self.send(("rows", seq, table, step, token, keys, rows, ops), doing)

    def send_rows(
        self,
        seq: int,
        table: str,
        step: int,
        keys: np.ndarray,
        values: np.ndarray,
        ops: np.ndarray | None,
    ) -> None:
        """Hand rows already in host memory (assembled rows) to the child, pickled."""
        if ops is None:
            ops = np.zeros(len(keys), np.int8)
        token = self._register(None)
        self.send(("rows", seq, table, step, token, keys, values, ops), f"encoding dump {seq}")

    def close_dump(self, seq: int) -> tuple[list[dict[str, Any]], tuple[str | None, str] | None]:
        """Close dump ``seq``'s shards in the child: ``(shard infos as JSON, error or None)``.

        Waits until they are durable and renamed into place (or failed).

        Raises:
            EncoderLostError: the child ended first.
        """
        doing = f"closing the shards of dump {seq}"
        self.send(("close", seq), doing)
        with self._cond:
            self._cond.wait_for(lambda: ("closed", seq) in self._replies or self._lost is not None)
            reply = self._replies.pop(("closed", seq), None)
        if reply is None:
            self.check(doing)
            raise AssertionError("no reply and no loss")
        return reply[2], reply[3]

    def abort_dump(self, seq: int) -> None:
        """Drop dump ``seq``'s shards in the child (their slots come back as ``free``)."""
        with contextlib.suppress(EncoderLostError):
            self.send(("abort", seq), f"aborting dump {seq}")

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """End the child: it finishes what it holds, then exits (killed after ``timeout``)."""
        self._stopping = True
        with contextlib.suppress(EncoderLostError):
            self.send(("stop",), "stopping")
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("the dump's encoder process (pid %d) did not stop; killing it", self.pid)
            self.proc.kill()
            self.proc.wait()
        self._reader.join(5.0)
        self._conn.close()

    @property
    def alive(self) -> bool:
        """Whether the child is running (and has not been seen to end)."""
        return self._lost is None and self.proc.poll() is None

    # ---- internals -------------------------------------------------------------------------
    def _register(self, release: Callable[[], None] | None) -> int:
        token = next(self._tokens)
        with self._cond:
            if self._lost is not None:
                lost = self._lost
            else:
                self._pending[token] = release
                return token
        if release is not None:
            release()
        raise EncoderLostError(self.pid, lost.exit_code, "encoding")

    def _read_loop(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                self._on_lost()
                return
            if msg[0] == "free":
                with self._cond:
                    release = self._pending.pop(msg[1], None)
                if release is not None:
                    release()
            elif msg[0] == "stopped":
                continue
            else:
                with self._cond:
                    self._replies[(msg[0], msg[1])] = msg
                    self._cond.notify_all()

    def _on_lost(self) -> None:
        """The child is gone: give back everything it held, wake every waiter."""
        try:
            code = self.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        with self._cond:
            if self._lost is not None:
                return
            self._lost = EncoderLostError(self.pid, code, "encoding")
            pending, self._pending = self._pending, {}
            self._cond.notify_all()
        for release in pending.values():
            if release is not None:
                release()
        if not self._stopping or code != 0:
            log.error("%s", self._lost)


def start_encoder(
    config: DumperConfig,
    generation: int,
    rank: int,
    tables: dict[str, TableSpec],
    plan: HostBudgetPlan,
    pinned: PinnedRing | None,
) -> EncoderProcess:
    """Start a rank's encoder process for ``generation`` (it reports ready once it can encode)."""
    setup = {
        "artifacts": config.artifacts,
        "storage_options": dict(config.storage_options),
        "run": config.run,
        "generation": generation,
        "rank": rank,
        "tables": {t: (spec.dtype.value, spec.dim) for t, spec in tables.items()},
        "fsync": config.fsync,
        "encode_workers": plan.encode_threads,
        "arena_bytes": plan.arena_bytes,
    }
    encoder = EncoderProcess(setup, pinned)
    log.info("dump encoder process started (pid %d)", encoder.pid)
    return encoder


def _then(first: Callable[[], None], then: Callable[[], None]) -> Callable[[], None]:
    def both() -> None:
        try:
            first()
        finally:
            then()

    return both


# ---- the child ---------------------------------------------------------------------------------
class _Child:
    """The encoder process's state: the open dump's shard writers, the encode pool."""

    def __init__(self, conn: Connection, ring: mmap.mmap | None, setup: dict[str, Any]) -> None:
        from deltarec.artifacts.root import ArtifactRoot
        from deltarec.artifacts.types import DType
        from deltarec.dump.encode import EncodePool

        self.conn = conn
        self.ring = ring
        self.setup = setup
        self.root = ArtifactRoot(setup["artifacts"], setup["storage_options"])
        self.tables = {t: (DType(d), int(dim)) for t, (d, dim) in setup["tables"].items()}
        self.pool = EncodePool(int(setup["encode_workers"]), int(setup["arena_bytes"]))
        self.writers: dict[str, Any] = {}
        self.seq: int | None = None
        self.error: tuple[str | None, str] | None = None
        self._send_lock = threading.Lock()

    def send(self, message: tuple[Any, ...]) -> None:
        with self._send_lock:
            self.conn.send(message)

    def warm_up(self) -> None:
        """Encode one empty piece per encoding (imports parquet's modules before a dump)."""
        from deltarec.artifacts.shards import ShardRows
        from deltarec.dump.encode import encode_piece

        for dtype in {d for d, _ in self.tables.values()}:
            encode_piece(ShardRows.empty(dtype, 1), dtype, 1)
        gc.collect()

    def serve(self) -> None:
        """Handle messages until ``stop`` or the parent's end of the socket closes."""
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                self.abort()  # the parent is gone: leave no temporary shard behind
                return
            kind = msg[0]
            if kind in ("chunk", "rows"):
                self.encode(msg)
            elif kind == "close":
                self.close(int(msg[1]))
            elif kind == "abort":
                if self.seq == int(msg[1]):
                    self.abort()
            elif kind == "stop":
                self.abort()
                self.pool.close()
                self.send(("stopped", 0))
                return

    def _open(self, seq: int) -> None:
        if self.seq != seq:
            self.abort()
            self.seq = seq

    def encode(self, msg: tuple[Any, ...]) -> None:
        from deltarec.artifacts.shards import ShardPlace
        from deltarec.dump.encode import ParallelShardWriter, encode_rows

        kind, seq, table, step, token = msg[:5]
        self._open(seq)

        def free() -> None:
            self.send(("free", token))

        if self.error is not None:
            free()
            return
        try:
            dtype, dim = self.tables[table]
            if kind == "chunk":
                keys, values, ops = self._views(*msg[5:])
            else:
                keys, values, ops = msg[5:]
            arena = self.pool.arena

            def job() -> Any:
                return encode_rows(keys, values, ops, step, dtype, dim, arena)

            writer = self.writers.get(table)
            if writer is None:
                setup = self.setup
                place = ShardPlace(setup["run"], setup["generation"], seq, table, setup["rank"])
                writer = self.writers[table] = ParallelShardWriter(
                    self.root,
                    place,
                    dtype,
                    dim,
                    self.pool,
                    fsync=self.setup["fsync"],
                )
        except Exception as e:
            self.error = (table, f"{type(e).__name__}: {e}")
            log.exception("encoding dump %s table %s failed", seq, table)
            free()
            return
        writer.write(job, free)  # calls free exactly once, when written and hashed (or dropped)

    def _views(
        self, where: tuple[int | np.ndarray, ...], shape: tuple[int, int, str]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The chunk's keys, rows and ops: views of the ring at their offsets (or inline)."""
        n, dim, vdtype = shape
        kinds: tuple[tuple[np.dtype[Any], int], ...] = (
            (np.dtype(np.int64), n),
            (np.dtype(vdtype), n * dim),
            (np.dtype(np.int8), n),
        )
        out = []
        for at, (dtype, count) in zip(where, kinds, strict=True):
            if isinstance(at, np.ndarray):
                out.append(at.reshape(-1))
            else:
                assert self.ring is not None
                out.append(np.frombuffer(self.ring, dtype, count, at))
        return out[0], out[1].reshape(n, dim), out[2]

    def close(self, seq: int) -> None:
        from deltarec.dump.encode import close_writers

        shards: list[dict[str, Any]] = []
        error = self.error if self.seq == seq else None
        if self.seq == seq and error is None:
            for table, result in close_writers(self.writers):
                if isinstance(result, BaseException):
                    error = error or (table, f"{type(result).__name__}: {result}")
                else:
                    shards.append(result.to_json())
            self.writers.clear()
        self.abort()
        self.seq, self.error = None, None
        self.send(("closed", seq, shards, error))

    def abort(self) -> None:
        for writer in self.writers.values():
            try:
                writer.abort()
            except Exception:
                log.warning("could not remove a temporary shard of dump %s", self.seq)
        self.writers.clear()


def child_main() -> None:
    """The encoder process's entry point: ``python -c ... CONN_FD RING_FD`` (see module)."""
    logging.basicConfig(level=logging.WARNING, format="deltarec-encoder: %(message)s")
    with contextlib.suppress(OSError):
        os.nice(CHILD_NICENESS)
    conn = Connection(int(sys.argv[1]))
    ring_fd = int(sys.argv[2])
    try:
        kind, setup = conn.recv()
        assert kind == "init"
        ring = mmap.mmap(ring_fd, 0) if ring_fd >= 0 else None
        child = _Child(conn, ring, setup)
        child.warm_up()
    except Exception as e:
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        raise
    conn.send(("ready", os.getpid()))
    child.serve()
