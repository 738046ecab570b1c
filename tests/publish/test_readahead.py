"""The publisher's read-ahead: items in order, errors where they happened, bounded, stoppable."""

from __future__ import annotations

import threading
import time

import pytest

from deltarec import threads
from deltarec.readahead import read_ahead


def test_items_come_in_order_and_the_thread_is_free_again_after_them():
    before = {t.ident for t in threading.enumerate()}
    assert list(read_ahead(iter(range(100)), depth=3, name="reader-a")) == list(range(100))
    new = [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert all(t.name == threads.IDLE_NAME for t in new)  # kept for the next reader, idle
    assert list(read_ahead(iter(range(10)), name="reader-b")) == list(range(10))
    again = [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert len(again) == len(new) <= 1  # the second reader ran on the kept thread


def test_an_error_of_the_source_is_raised_after_the_items_before_it():
    def source():
        yield 1
        yield 2
        raise OSError("shard unreadable")

    got = []
    with pytest.raises(OSError, match="shard unreadable"):
        for item in read_ahead(source()):
            got.append(item)
    assert got == [1, 2]


def test_the_source_runs_at_most_depth_items_ahead_and_stops_when_closed():
    produced = []
    closed = threading.Event()

    def source():
        try:
            for i in range(1000):
                produced.append(i)
                yield i
        finally:
            closed.set()

    it = read_ahead(source(), depth=2)
    assert [next(it), next(it)] == [0, 1]
    deadline = time.monotonic() + 30
    while len(produced) < 5 and time.monotonic() < deadline:  # 2 taken, 2 queued, 1 waiting
        time.sleep(0.005)
    it.close()
    assert closed.wait(30)  # the source was closed on its thread
    assert produced == [0, 1, 2, 3, 4]  # never more than depth ahead of the taker


def test_a_depth_below_one_is_refused():
    with pytest.raises(ValueError, match="depth"):
        next(read_ahead(iter([1]), depth=0))
