"""Read the next chunks of an iterator on a thread while the caller works on the current one.

The publisher reads shard rows (parquet decoding, mostly outside the GIL) while the store
applies the previous chunk (SQLite steps and PostgreSQL COPY, outside the GIL too): on two
cores the two overlap instead of taking turns. At most ``depth`` chunks wait, so memory grows
by ``depth`` read chunks (the publisher's are 8 MB), never with the part.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import TypeVar

T = TypeVar("T")

_END = object()


def read_ahead(source: Iterator[T], depth: int = 2, name: str = "publish-read") -> Iterator[T]:
    """Yield ``source``'s items, produced on a daemon thread at most ``depth`` items ahead.

    An exception raised by ``source`` is re-raised here, where its item would have come.
    Closing the returned generator (or dropping it) stops the thread at its next item; the
    rest of ``source`` is not read.

    Args:
        source: the items, in order; it runs on the thread (it must not need this one's state).
        depth: items produced and not yet taken, at most (>= 1).
        name: the thread's name.
    """
    if depth < 1:
        raise ValueError(f"read-ahead depth must be >= 1, got {depth}")
    items: queue.Queue[object] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: object) -> bool:
        while not stop.is_set():
            try:
                items.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def run() -> None:
        try:
            for item in source:
                if not put(item):
                    return
            put(_END)
        except BaseException as e:  # handed to the consumer
            put(e)
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    try:
        while True:
            item = items.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item  # type: ignore[misc]
    finally:
        stop.set()
        thread.join(timeout=30)
