"""The background publisher fed during training, and the retry policy (SQLite store)."""

from __future__ import annotations

import threading
import time
import urllib.request

import numpy as np
import pytest

from deltarec.artifacts import ArtifactRoot
from deltarec.artifacts.types import DType, TableSpec
from deltarec.errors import InvalidRowError, StoreUnavailableError
from deltarec.ids import make_version
from deltarec.ports import free_port
from deltarec.publish import BackgroundPublisher, PublishMetrics, RetryPolicy
from deltarec.stores import open_store
from deltarec.testing.dumps import new_generation, random_rows, write_dump

T = "sparse.ebc.item_id"
TABLES = {T: TableSpec(dim=8, dtype=DType.FLOAT16, num_embeddings=1000)}


@pytest.fixture
def setup(tmp_path):
    root = ArtifactRoot(str(tmp_path / "art"))
    info = new_generation(root, "run", TABLES, world_size=2)
    return root, info, f"sqlite:///{tmp_path / 'store.db'}"


def test_submitted_dumps_are_published_from_memory_with_freshness(setup):
    root, info, url = setup
    metrics = PublishMetrics()
    pub = BackgroundPublisher(url, root.uri, "run", rank=1, world_size=2, metrics=metrics)
    sent = {}
    for seq in (1, 2, 3):
        rows = {T: {r: random_rows(range(r, 40, 2), TABLES[T], seed=seq) for r in range(2)}}
        manifest = write_dump(root, info, seq, rows)
        sent[seq] = rows[T][1]
        pub.submit(manifest, {T: rows[T][1]})
    pub.close(timeout=30)
    assert [(p.seq, p.rank, p.rows) for p in pub.results] == [(s, 1, 20) for s in (1, 2, 3)]
    with open_store(url) as store:
        got = store.read(T, sent[3].keys)
        np.testing.assert_array_equal(got.embedding, sent[3].embedding)
        assert set(got.versions.tolist()) == {make_version(1, 3)}
        assert not store.read(T, np.arange(0, 40, 2)).found.any()  # rank 0's rows: not ours
        fresh = store.freshness("run", 1)
        assert [(f.seq, f.rank) for f in fresh] == [(1, 1), (2, 1), (3, 1)]
        assert all(0 <= f.lag_s < 60 for f in fresh)
    assert metrics.value("deltarec_publish_rows_total", {"table": T, "mode": "direct"}) == 60
    assert metrics.value("deltarec_publish_last_version") == make_version(1, 3)


def test_rows_not_in_memory_are_read_from_the_artifacts(setup):
    root, info, url = setup
    rows = {T: {r: random_rows(range(r, 10, 2), TABLES[T], seed=7) for r in range(2)}}
    manifest = write_dump(root, info, 1, rows)
    pub = BackgroundPublisher(url, root.uri, "run", rank=0, world_size=2)
    pub.submit(manifest, {})
    pub.close(timeout=30)
    with open_store(url) as store:
        np.testing.assert_array_equal(
            store.read(T, rows[T][0].keys).embedding, rows[T][0].embedding
        )


def test_rows_wait_for_a_manifest_another_rank_commits(setup):
    root, info, url = setup
    rows = {T: {r: random_rows(range(r, 10, 2), TABLES[T], seed=8) for r in range(2)}}
    manifest = write_dump(root, info, 1, rows, commit=False)
    pub = BackgroundPublisher(url, root.uri, "run", rank=1, world_size=2)
    pub.submit_when_committed(1, 1, {T: rows[T][1]}, timeout_s=30)
    _wait_for(lambda: pub.manifest_polls >= 2)  # it looked twice and found no manifest
    assert pub.results == []
    root.commit_manifest(manifest)
    pub.close(timeout=30)
    assert [(p.seq, p.rows) for p in pub.results] == [(1, 5)]


def test_background_failure_is_raised_on_the_training_thread(setup):
    root, info, url = setup
    bad = random_rows([3, 4], TABLES[T], seed=1)
    bad.embedding[0, 0] = np.float16("inf")
    manifest = write_dump(root, info, 1, {T: {0: bad}})
    pub = BackgroundPublisher(url, root.uri, "run", rank=0, world_size=2)
    pub.submit(manifest, {T: bad})
    _wait_for(lambda: pub._error is not None)
    with pytest.raises(InvalidRowError, match=r"key 3 in run 'run' generation 1 dump 1 rank 0"):
        pub.check()
    with pytest.raises(InvalidRowError):
        pub.submit(manifest, {T: bad})
    with pytest.raises(InvalidRowError):
        pub.close(timeout=10)


def test_submit_blocks_while_the_queue_is_full(setup):
    root, info, url = setup
    rows = random_rows(range(0, 400, 2), TABLES[T], seed=2)  # 3.2 kB of rows
    manifests = [write_dump(root, info, s, {T: {0: rows}}) for s in (1, 2)]
    pub = BackgroundPublisher(url, root.uri, "run", rank=0, world_size=2, max_queue_bytes=4000)
    gate = threading.Event()
    real_open = pub._open

    def slow_open():
        gate.wait(30)
        return real_open()

    pub._open = slow_open  # type: ignore[method-assign]
    pub.submit(manifests[0], {T: rows})
    second = threading.Thread(target=pub.submit, args=(manifests[1], {T: rows}))
    second.start()
    _wait_for(lambda: pub.blocked_submits == 1)  # 3.2 kB queued + 3.2 kB > 4 kB: it waits
    assert second.is_alive() and pub.results == []
    gate.set()
    second.join(30)
    pub.close(timeout=30)
    assert [p.seq for p in pub.results] == [1, 2]


def test_metrics_are_served_over_http(setup):
    root, info, url = setup
    port = free_port()
    pub = BackgroundPublisher(url, root.uri, "run", rank=0, world_size=2, metrics_port=port)
    manifest = write_dump(root, info, 1, {T: {0: random_rows([1, 2], TABLES[T])}})
    pub.submit(manifest, None)
    pub.close(timeout=30)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'deltarec_publish_rows_total{mode="direct",table="sparse.ebc.item_id"} 2.0' in text


def test_retry_policy_backs_off_with_jitter_and_gives_up_at_the_deadline():
    policy = RetryPolicy(initial_s=1.0, max_s=8.0, jitter=0.5, deadline_s=20.0)
    waits: list[float] = []
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 4:
            raise StoreUnavailableError("connection refused")
        return "ok"

    assert policy.call(flaky, "write", sleep=waits.append) == "ok"
    assert len(waits) == 3
    for i, w in enumerate(waits):
        assert 0.5 * min(8.0, 2.0**i) <= w <= min(8.0, 2.0**i)
    never = RetryPolicy(initial_s=0.001, max_s=0.001, deadline_s=0.05)
    with pytest.raises(StoreUnavailableError, match="still unavailable"):
        never.call(lambda: (_ for _ in ()).throw(StoreUnavailableError("down")), "write")


def test_deterministic_errors_are_not_retried():
    calls = []

    def bad() -> None:
        calls.append(1)
        raise InvalidRowError("t", "dump 1", 5, "NaN")

    with pytest.raises(InvalidRowError):
        RetryPolicy().call(bad, "write", sleep=lambda s: None)
    assert calls == [1]


def _wait_for(condition, timeout_s: float = 30.0) -> None:
    """Wait until ``condition()`` holds (a generous bound: only a hang reaches it)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.005)
