"""Kept threads: a job runs on an idle kept thread or a new one, which then waits for the next."""

from __future__ import annotations

import logging
import os
import threading

import pytest

from deltarec import threads


def _run(fn, name="job"):
    job = threads.start(fn, name)
    assert job.join(30)
    return job


def test_jobs_one_after_another_run_on_the_same_thread_under_their_own_names():
    seen = []
    _run(lambda: seen.append((threading.get_ident(), threading.current_thread().name)), "one")
    _run(lambda: seen.append((threading.get_ident(), threading.current_thread().name)), "two")
    assert seen[0][0] == seen[1][0]
    assert [name for _, name in seen] == ["one", "two"]
    assert not threading.current_thread().name.startswith(threads.IDLE_NAME)


def test_jobs_at_once_run_on_threads_of_their_own():
    gate = threading.Barrier(3, timeout=30)
    idents = []

    def body():
        idents.append(threading.get_ident())
        gate.wait()  # all three run at the same time, or this breaks

    jobs = [threads.start(body, f"j{i}") for i in range(3)]
    assert all(j.join(30) for j in jobs)
    assert len(set(idents)) == 3


def test_a_job_that_raises_is_logged_and_its_thread_stays_for_the_next(caplog):
    def bad():
        raise RuntimeError("boom")

    with caplog.at_level(logging.ERROR, logger="deltarec.threads"):
        first = []
        _run(lambda: first.append(threading.get_ident()))
        job = _run(bad, "bad-job")
    assert job.done()
    assert "bad-job" in caplog.text and "boom" in caplog.text
    after = []
    _run(lambda: after.append(threading.get_ident()))
    assert after == first


def test_a_job_knows_its_own_thread_while_it_runs():
    inside = []
    job: list[threads.Job] = []
    started = threading.Event()

    def body():
        started.wait(30)
        inside.append(job[0].on_this_thread())

    job.append(threads.start(body, "self"))
    started.set()
    assert job[0].join(30)
    assert inside == [True]
    assert not job[0].on_this_thread()


def test_an_idle_thread_ends_after_the_idle_time(monkeypatch):
    monkeypatch.setattr(threads, "IDLE_S", 0.05)
    holder = []
    gate = threading.Barrier(2, timeout=30)  # jobs running at once never share a thread

    def body():
        holder.append(threading.current_thread())
        gate.wait()

    jobs = [threads.start(body, "x"), threads.start(body, "y")]
    assert all(j.join(30) for j in jobs)
    for t in holder:
        t.join(30)  # each ends once idle for IDLE_S
        assert not t.is_alive()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork")
def test_a_forked_child_starts_threads_of_its_own():
    _run(lambda: None)  # the parent has an idle kept thread
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the parent's threads are not here
        try:
            ok = threads.start(lambda: None, "child").join(30)
            os.write(w, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(w)
    got = os.read(r, 1)
    os.waitpid(pid, 0)
    assert got == b"1"
