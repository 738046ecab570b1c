"""Many small shards read on two processes: this one and a forked child, taking turns.

A dump of hundreds of ranks has thousands of small shards, and each costs about 0.1 ms of
one core to open, read, hash and decode (most of it Arrow's reader set-up and decoding of a
small file), whatever its rows. Threads do not help: each of those steps is a short call that
gives up the interpreter lock and waits to take it back. Here, from :data:`POOL_SHARDS`
shards on, a forked child and this process take chunks of shards (runs of a group's shards)
from one queue (a pipe holding their numbers, so that whichever is less busy takes more), and
each reads, checks and decodes its chunks with the same ``read`` function; the child hands its
tables back in Arrow's IPC format through an anonymous in-memory file, mapped here without a
copy.

Nothing is weakened and no verdict changes: the child runs the same ``read`` (the
trust-boundary open, the size and sha256 before any decoding, the row count), and anything it
did not finish (a bad shard, a crash, shards of one group in two schemas) is read again here,
in order, so that errors are raised as the serial read raises them, for the first bad shard.
Used only where forking is safe and pays: a local artifact root (an object store's client
keeps an event loop on a thread that a child must not use), Linux (``memfd_create``), and at
least two CPUs for this process. The child does nothing but read, hash, decode and write its
tables (no store, no thread, no lock of the parent's), and leaves with ``os._exit``.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import select
import signal
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pyarrow as pa

from deltarec.artifacts.types import ShardInfo

POOL_SHARDS = 512
"""Calls with at least this many shards use the child; fewer are read on this process alone
(a fork, its wait and its hand-back cost a few milliseconds)."""
CHUNK_SHARDS = 64
"""Shards a chunk (a run of one group's shards, the unit the two processes take in turn)."""
MAX_CHUNKS = 1024
"""At most this many chunks (their numbers fill one page of the queue's pipe); larger calls
take larger chunks."""
HUNG_CHILD_S = 60.0
"""A child not done this long (plus 10 times this process's own share's time) after this
process ran out of chunks is killed and its chunks are read here."""
_ID = struct.Struct("<I")
_TRAILER = struct.Struct("<Q")

Read = Callable[[ShardInfo], pa.Table]


@dataclass(frozen=True)
class _Chunk:
    """A run of one group's shards (in order, the group's next after the chunk before)."""

    group: int
    shards: Sequence[ShardInfo]


def can_pool(shards: int, local: bool) -> bool:
    """Whether :func:`read_groups` would use a child for ``shards`` shards (``local``: root)."""
    return (
        local
        and shards >= POOL_SHARDS
        and hasattr(os, "fork")
        and hasattr(os, "memfd_create")
        and _cpus() >= 2
    )


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call on this platform
        return os.cpu_count() or 1


def read_groups(
    groups: Sequence[Sequence[ShardInfo]], read: Read, local: bool
) -> list[list[pa.Table]]:
    """Each group's shards read by ``read``: tables whose rows, in order, are the group's.

    Serially (a table a shard) unless :func:`can_pool`; then this process and the child take
    chunks (:data:`CHUNK_SHARDS` of a group's shards) from a queue in turn, and a group's
    tables are its chunks' (the child's chunk as one table).

    Raises:
        What ``read`` raises, for the first shard (groups in order, shards in order) it
        raises for.
    """
    count = sum(len(g) for g in groups)
    out: list[list[pa.Table]] = [[] for _ in groups]
    if not can_pool(count, local):
        for g, group in enumerate(groups):
            out[g].extend(read(s) for s in group)
        return out
    chunks = _chunks(groups, max(CHUNK_SHARDS, -(-count // MAX_CHUNKS)))
    got: dict[int, list[pa.Table]] = {}
    child = _Child.start(chunks, read)
    try:
        t0 = time.monotonic()
        _take(child.queue, chunks, read, got)
        got.update(child.result(HUNG_CHILD_S + 10 * (time.monotonic() - t0)))
    finally:
        child.close()
    for c, chunk in enumerate(chunks):  # in order; one not read (a bad shard) is read here
        out[chunk.group].extend(got[c] if c in got else [read(s) for s in chunk.shards])
    return out


def _chunks(groups: Sequence[Sequence[ShardInfo]], size: int) -> list[_Chunk]:
    """Each group's shards in runs of at most ``size``, groups in order."""
    return [
        _Chunk(g, group[i : i + size])
        for g, group in enumerate(groups)
        for i in range(0, len(group), size)
    ]


def _next(queue: int) -> int | None:
    """The next chunk's number from the queue's pipe, or None once it is empty."""
    data = os.read(queue, _ID.size)  # atomic: every number was written before the fork
    return _ID.unpack(data)[0] if len(data) == _ID.size else None


def _take(queue: int, chunks: list[_Chunk], read: Read, got: dict[int, list[pa.Table]]) -> None:
    """Read chunks from the queue here until it is empty or a shard fails (read again later)."""
    while (c := _next(queue)) is not None:
        try:
            tables = [read(s) for s in chunks[c].shards]
        except Exception:  # read again in order by read_groups, which raises it there
            return
        try:  # one table a chunk: the group's block is then made of a few (cheaper to join)
            got[c] = [_joined(tables)]
        except (pa.ArrowInvalid, pa.ArrowTypeError):  # shards of other schemas
            got[c] = tables


def _joined(tables: list[pa.Table]) -> pa.Table:
    """``tables`` (of one schema) as one table of one chunk a column."""
    return pa.concat_tables(tables).combine_chunks() if len(tables) > 1 else tables[0]


class _Child:
    """A forked child taking chunks from the queue; :meth:`result` maps the tables it read."""

    def __init__(self, pid: int, queue: int, memfd: int, done_r: int) -> None:
        self.pid = pid
        self.queue = queue  # the read end of the pipe holding the chunks' numbers
        self.memfd = memfd
        self.done_r = done_r  # readable (EOF) once the child has exited

    @classmethod
    def start(cls, chunks: list[_Chunk], read: Read) -> _Child:
        """Fill the queue and fork a child that takes chunks from it (it never returns)."""
        fds: list[int] = []
        try:
            queue, q_w = os.pipe()
            fds += [queue, q_w]
            os.write(q_w, b"".join(_ID.pack(c) for c in range(len(chunks))))  # one page at most
            os.close(fds.pop())
            fds.append(os.memfd_create("deltarec-shards", getattr(os, "MFD_CLOEXEC", 0)))
            done_r, done_w = os.pipe()
            fds += [done_r, done_w]
            pid = os.fork()
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        if pid == 0:  # the child
            code = 1
            try:
                os.close(done_r)
                _child_main(queue, chunks, read, fds[1])
                code = 0
            finally:
                os._exit(code)
        os.close(done_w)
        return cls(pid, queue, fds[1], done_r)

    def result(self, timeout: float) -> dict[int, list[pa.Table]]:
        """The chunks the child read, by number (a table each).

        Empty if the child crashed, or was not done within ``timeout`` seconds after this
        call (it is then killed).
        """
        ready, _, _ = select.select([self.done_r], [], [], timeout)
        if not ready:
            return {}
        try:
            _, status = os.waitpid(self.pid, 0)
        except ChildProcessError:  # reaped elsewhere (SIGCHLD ignored): its status is lost
            return {}
        finally:
            self.pid = 0
        if not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0:
            return {}
        return _mapped(self.memfd)

    def close(self) -> None:
        """Kill the child if it still runs, reap it, close the descriptors (idempotent)."""
        if self.pid:
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            self.pid = 0
        for fd in (self.queue, self.memfd, self.done_r):
            if fd >= 0:
                os.close(fd)
        self.queue = self.memfd = self.done_r = -1


def _child_main(queue: int, chunks: list[_Chunk], read: Read, memfd: int) -> None:
    """In the child: read chunks from the queue, write each as one table, then the index.

    The anonymous file holds one IPC stream a chunk, then the index (JSON: chunk number,
    offset and length of each stream) and the index's length. The child stops at the first
    failure (a bad shard, a chunk's shards in two schemas); the chunks it did not write are
    read by the parent.
    """
    index: list[tuple[int, int, int]] = []
    with pa.OSFile(f"/proc/self/fd/{memfd}", "wb") as sink:
        try:
            while (c := _next(queue)) is not None:
                table = _joined([read(s) for s in chunks[c].shards])
                offset = sink.tell()
                with pa.ipc.new_stream(sink, table.schema) as writer:
                    writer.write_table(table)
                index.append((c, offset, sink.tell() - offset))
        except Exception:  # the parent reads the rest again and raises the real error
            pass
        data = json.dumps(index).encode()
        sink.write(data)
        sink.write(_TRAILER.pack(len(data)))


def _mapped(memfd: int) -> dict[int, list[pa.Table]]:
    """The child's chunks, as tables over a read-only map of its anonymous file (no copy)."""
    size = os.fstat(memfd).st_size
    if size < _TRAILER.size:
        return {}
    buf = pa.py_buffer(mmap.mmap(memfd, size, prot=mmap.PROT_READ))
    (n,) = _TRAILER.unpack(buf.slice(size - _TRAILER.size).to_pybytes())
    index = json.loads(buf.slice(size - _TRAILER.size - n, n).to_pybytes())
    return {
        c: [pa.ipc.open_stream(buf.slice(offset, length)).read_all()] for c, offset, length in index
    }


__all__ = ["POOL_SHARDS", "can_pool", "read_groups"]
