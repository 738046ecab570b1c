"""The publisher's transactions: streamed in read chunks, reopened after a failed write."""

from __future__ import annotations

from typing import Any

import numpy as np

import deltarec.publish.parts as parts_module
from deltarec.artifacts import ArtifactRoot
from deltarec.artifacts.types import TableSpec
from deltarec.errors import StoreUnavailableError
from deltarec.ids import make_version
from deltarec.publish import DumpPublisher, RetryPolicy
from deltarec.stores import open_store
from deltarec.testing.dumps import new_generation, random_rows, write_dump

T = "sparse.ebc.item_id"
TABLES = {T: TableSpec(dim=8, num_embeddings=100_000)}


class FlakyWrites:
    """A store whose ``write_batches`` fails once after reading ``after`` chunks of a write."""

    def __init__(self, store: Any, fail_on_call: int, after: int) -> None:
        self._store = store
        self.fail_on_call = fail_on_call
        self.after = after
        self.calls = 0
        self.chunks: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def write_batches(self, table, batches, mark=None, staging_generation=None):
        self.calls += 1
        batches = list(batches) if self.calls != self.fail_on_call else batches
        if self.calls == self.fail_on_call:
            for i, _ in enumerate(batches, 1):
                if i == self.after:
                    raise StoreUnavailableError("connection reset while writing")
        self.chunks.append(len(batches))
        return self._store.write_batches(table, batches, mark, staging_generation)


def test_transactions_cover_every_row_once_across_chunks_and_a_failed_write(tmp_path, monkeypatch):
    monkeypatch.setattr(parts_module, "READ_BYTES", 37 * 56)  # chunks of 37 rows
    root = ArtifactRoot(str(tmp_path / "art"))
    info = new_generation(root, "r", TABLES, world_size=1)
    keys = np.random.default_rng(0).permutation(50_000)[:1000]
    rows = random_rows(keys, TABLES[T], seed=4)
    manifest = write_dump(root, info, 1, {T: {0: rows}})
    store = FlakyWrites(open_store(f"sqlite:///{tmp_path}/s.db", run="r"), fail_on_call=2, after=3)
    marks: list[tuple[int, bool]] = []
    pub = DumpPublisher(
        store,  # type: ignore[arg-type]
        root,
        "r",
        batch_bytes=300 * 56,  # transactions of 300 rows: chunk and transaction edges differ
        retry=RetryPolicy(initial_s=0.01, max_s=0.02, deadline_s=10),
        after_batch=lambda m, n: marks.append((m.rows, m.complete)),
    )
    part = pub.publish_dump(manifest, 0)
    assert part.rows == 1000
    assert marks == [(300, False), (600, False), (900, False), (1000, True)]
    assert store.calls == 5  # the second transaction was written twice
    assert store.chunks[:2] == [9, 9]  # 300 rows in chunks of 37 (the last of each cut short)
    got = store.read(T, rows.keys)
    assert got.found.all()
    np.testing.assert_array_equal(got.embedding, rows.embedding)
    assert set(got.versions.tolist()) == {make_version(1, 1)}
    assert sum(len(k) for k in store.scan_keys(T)) == 1000


def test_rows_in_memory_go_to_the_store_as_views_of_one_transaction_each(tmp_path):
    root = ArtifactRoot(str(tmp_path / "art"))
    info = new_generation(root, "r", TABLES, world_size=1)
    rows = random_rows(np.arange(500)[::-1], TABLES[T], seed=2)
    manifest = write_dump(root, info, 1, {T: {0: rows}})
    store = FlakyWrites(open_store(f"sqlite:///{tmp_path}/s.db", run="r"), fail_on_call=0, after=0)
    DumpPublisher(store, root, "r", batch_bytes=200 * 56).publish_dump(  # type: ignore[arg-type]
        manifest, 0, rows={T: rows}
    )
    assert store.chunks == [1, 1, 1]  # 200 + 200 + 100 rows, each one batch
    np.testing.assert_array_equal(store.read(T, rows.keys).embedding, rows.embedding)
