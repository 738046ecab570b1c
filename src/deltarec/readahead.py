"""Read the next items of an iterator on a thread while the caller works on the current one.

The publisher reads shard rows (parquet decoding, mostly outside the GIL) while the store
applies the previous chunk (SQLite steps and PostgreSQL COPY, outside the GIL too); SQLite reads
a spilled write's rows back while it applies the chunk before; verify scans the store while it
compares the batch before. On two cores the two sides overlap instead of taking turns. At most
``depth`` items wait, so memory grows by ``depth`` items (the publisher's read chunks are 8 MB),
never with the whole.

The standard library only: every layer may use it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import TypeVar

from deltarec import threads

T = TypeVar("T")

_END = object()


class ReadAhead(Iterator[T]):
    """``source``'s items, produced on a daemon thread at once, at most ``depth`` ahead.

    An exception raised by ``source`` is re-raised by ``next``, where its item would have come.
    :meth:`close` (or dropping the reader) stops the thread at its next item; the rest of
    ``source`` is not read. Started before its items are wanted (the next rank's part while
    the store applies this one's), its first chunks (and the shard's sha256) are ready when
    they are.

    Args:
        source: the items, in order; it runs on the thread (it must not need this one's state).
        depth: items produced and not yet taken, at most (>= 1).
        name: the thread's name.
    """

    def __init__(self, source: Iterator[T], depth: int = 2, name: str = "read-ahead") -> None:
        if depth < 1:
            raise ValueError(f"read-ahead depth must be >= 1, got {depth}")
        self._items: queue.Queue[object] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        self._source = source
        self._job = threads.start(self._run, name)  # a kept thread (deltarec.threads)

    def _put(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self._items.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        source = self._source
        try:
            for item in source:
                if not self._put(item):
                    return
            self._put(_END)
        except BaseException as e:  # handed to the consumer
            self._put(e)
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        item = self._items.get()
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, BaseException):
            self.close()
            raise item
        return item  # type: ignore[return-value]

    def __enter__(self) -> ReadAhead[T]:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the thread (idempotent); waits for it to notice, at most 30 s."""
        self._done = True
        self._stop.set()
        if not self._job.on_this_thread():
            self._job.join(timeout=30)

    def __del__(self) -> None:
        self._stop.set()


def read_ahead(source: Iterator[T], depth: int = 2, name: str = "read-ahead") -> Iterator[T]:
    """Yield ``source``'s items, produced on a daemon thread at most ``depth`` items ahead.

    The thread starts with the first item asked for (see :class:`ReadAhead` for one that starts
    at once). An exception raised by ``source`` is re-raised here, where its item would have
    come. Closing the returned generator (or dropping it) stops the thread at its next item;
    the rest of ``source`` is not read.

    Args:
        source: the items, in order; it runs on the thread (it must not need this one's state).
        depth: items produced and not yet taken, at most (>= 1).
        name: the thread's name.
    """
    if depth < 1:
        raise ValueError(f"read-ahead depth must be >= 1, got {depth}")
    reader = ReadAhead(source, depth, name)
    try:
        yield from reader
    finally:
        reader.close()
