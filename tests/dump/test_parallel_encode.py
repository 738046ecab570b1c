"""Shards encoded in parallel: byte-identical to pyarrow's own file, verified, in chunk order."""

from __future__ import annotations

import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from deltarec.artifacts import ArtifactRoot, DType, codec, read_shard
from deltarec.artifacts.shards import ShardPlace, ShardRows
from deltarec.dump.budget import (
    MIN_HOST_BUDGET,
    default_encode_workers,
    default_host_budget,
)
from deltarec.dump.encode import EncodePool, ParallelShardWriter, encode_piece, encode_rows
from deltarec.dump.queue import ByteBoundedQueue
from deltarec.dump.stitch import MAGIC, Piece, StitchError, footer_tail, stitched_footer


def _rows(rng: np.random.Generator, n: int, start: int, dim: int, dtype: DType) -> ShardRows:
    values = rng.standard_normal((n, dim), dtype=np.float32)
    return ShardRows(
        np.arange(start, start + n, dtype=np.int64),
        codec.encode(values, dtype),
        (rng.random(n) < 0.1).astype(np.int8),
        np.full(n, 7 + start, np.int64),
    )


def _one_writer(chunks: list[ShardRows], dtype: DType, dim: int) -> bytes:
    """The shard one pyarrow writer makes of ``chunks``, a row group each (the reference)."""
    sink = pa.BufferOutputStream()
    with pq.ParquetWriter(
        sink,
        codec.shard_schema(dtype, dim),
        compression="none",
        use_dictionary=False,
        write_statistics=[codec.KEY, codec.STEP],
    ) as w:
        for c in chunks:
            w.write_table(codec.to_arrow(c.keys, c.embedding, c.ops, c.steps, dtype))
    return sink.getvalue().to_pybytes()


@pytest.mark.parametrize("dtype", list(DType))
def test_a_stitched_shard_is_byte_identical_to_one_pyarrow_writer_of_the_same_chunks(dtype):
    rng = np.random.default_rng(0)
    chunks = [_rows(rng, n, s, 12, dtype) for n, s in ((100, 0), (3000, 500), (1, 9000))]
    pieces = [encode_piece(c, dtype, 12) for c in chunks]
    footer = stitched_footer([p.meta() for p in pieces])
    stitched = MAGIC + b"".join(bytes(p.body) for p in pieces) + footer + footer_tail(footer)
    assert stitched == _one_writer(chunks, dtype, 12)
    meta = pq.ParquetFile(pa.BufferReader(stitched)).metadata
    assert meta.num_rows == 3101 and meta.num_row_groups == 3
    assert meta.row_group(1).column(0).statistics.min == 500


def test_a_file_that_is_not_parquet_is_refused_by_name():
    with pytest.raises(StitchError, match="no PAR1 magic"):
        Piece.parse(pa.py_buffer(b"PAR1 not really a parquet file"))


def test_a_parallel_shard_keeps_chunk_order_and_verifies_when_early_chunks_are_slow(tmp_path):
    root = ArtifactRoot(str(tmp_path))
    pool = EncodePool(4)
    w = ParallelShardWriter(
        root, ShardPlace("r", 1, 2, "m.t", 0), DType.FLOAT16, 16, pool, fsync=True
    )
    rng = np.random.default_rng(1)
    want_keys, released, kept = [], [], []
    later_encoded = threading.Event()  # set once chunk 5 (behind the slow ones) is encoded
    for i in range(12):
        n = 50 + i
        keys = rng.permutation(100_000)[:n].astype(np.int64)
        values = rng.standard_normal((n, 16), dtype=np.float32)
        want_keys.append(keys)

        def job(keys=keys, values=values, i=i):
            if i < 2:  # finishes after the chunks submitted behind it
                assert later_encoded.wait(30), "chunk 5 was not encoded within 30 s"
            rows = encode_rows(keys, values, None, 5, DType.FLOAT16, 16)
            if i == 5:
                later_encoded.set()
            return rows

        w.write(job, release=lambda i=i: released.append(i), on_rows=kept.append)
    info = w.close()
    pool.close()
    assert sorted(released) == list(range(12))
    assert info.rows == sum(len(k) for k in want_keys) and info.path == "m.t/rank-00000.parquet"
    got = read_shard(root, root.dump_dir("r", 1, 2), info, DType.FLOAT16)  # checks sha256
    assert np.array_equal(got.keys, np.concatenate(want_keys))
    assert np.array_equal(np.concatenate([k.keys for k in kept]), got.keys)
    assert (got.steps == 5).all() and (got.ops == 0).all()
    assert not list(tmp_path.rglob("*.tmp*"))


def test_a_failing_chunk_fails_the_shard_releases_every_chunk_and_leaves_no_file(tmp_path):
    root = ArtifactRoot(str(tmp_path))
    pool = EncodePool(2)
    w = ParallelShardWriter(
        root, ShardPlace("r", 1, 3, "m.t", 0), DType.FLOAT32, 4, pool, fsync=False
    )
    released = []
    lock = threading.Lock()

    def release(i: int) -> None:
        with lock:
            released.append(i)

    for i in range(6):

        def job(i=i):
            if i == 2:
                raise ValueError("bad chunk 2")
            return encode_rows(np.arange(3), np.ones((3, 4), np.float32), None, 1, DType.FLOAT32, 4)

        w.write(job, release=lambda i=i: release(i))
    with pytest.raises(ValueError, match="bad chunk 2"):
        w.close()
    w.abort()  # what the worker does after a failed close: nothing left to do
    pool.close()
    assert sorted(released) == list(range(6))
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


def test_an_empty_parallel_shard_is_a_valid_parquet_file_with_no_rows(tmp_path):
    root = ArtifactRoot(str(tmp_path))
    pool = EncodePool(1)
    info = ParallelShardWriter(
        root, ShardPlace("r", 1, 4, "m.t", 0), DType.INT8_ROWWISE, 8, pool
    ).close()
    pool.close()
    got = read_shard(root, root.dump_dir("r", 1, 4), info, DType.INT8_ROWWISE)
    assert info.rows == 0 and len(got) == 0


def test_the_worker_reserves_host_bytes_without_waiting_for_queued_items():
    q = ByteBoundedQueue(1000)
    q.put("a", 600)
    q.put("b", 400)  # queued, only the worker can take it
    q.reserve(900)  # nothing else held by the worker: admitted at once (over capacity)
    assert q.outstanding_bytes == 1900 and q.peak_bytes == 1900
    _, n = q.get()
    waited = []

    def reserve_more() -> None:
        t0 = time.perf_counter()
        q.reserve(100)
        waited.append(time.perf_counter() - t0)

    t = threading.Thread(target=reserve_more)
    t.start()  # the worker holds 1500 bytes other threads will release: it waits for them
    deadline = time.monotonic() + 30
    while q.blocked_reserves == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert q.blocked_reserves == 1, "reserve did not wait within 30 s"
    assert not waited and t.is_alive()  # still waiting in reserve
    assert q.outstanding_bytes == 1900
    q.release(900)
    q.release(n)
    t.join(30)
    assert waited and q.outstanding_bytes == 400 + 100  # "b" still queued, and the reservation


def test_default_budgets_follow_the_machine_and_the_ranks_on_it(monkeypatch):
    monkeypatch.setattr("deltarec.dump.budget.usable_cores", lambda: 16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert default_encode_workers() == 15
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert default_encode_workers() == 7
    monkeypatch.setattr("deltarec.dump.budget.usable_cores", lambda: 2)
    assert default_encode_workers() == 1
    monkeypatch.setattr("deltarec.dump.budget.available_memory", lambda: 16 << 30)
    assert default_host_budget() == 1 << 30  # 16 GiB / 8 / 2 ranks
    monkeypatch.setattr("deltarec.dump.budget.available_memory", lambda: 0)
    assert default_host_budget() == MIN_HOST_BUDGET


def test_a_shard_that_cannot_be_opened_fails_the_dump_and_gives_its_bytes_back(
    tmp_path, monkeypatch
):
    from tests._helpers.dump import HandTables

    from deltarec.dump import Dumper, DumperConfig
    from deltarec.errors import DumpError

    real_init = ParallelShardWriter.__init__

    def init(self, root, place, *args, **kw):
        if place.table == "sparse.b":
            raise PermissionError("read-only artifact root")
        real_init(self, root, place, *args, **kw)

    monkeypatch.setattr(ParallelShardWriter, "__init__", init)
    tables = HandTables(seed=9)
    cfg = DumperConfig(artifacts=str(tmp_path), run="o", snapshot=False, fsync=False)
    d = Dumper(cfg, tables.sources())
    d.start(step=0)
    tables.step(1)
    d.dump_now(1)
    with pytest.raises(DumpError, match=r"sparse\.b.*read-only artifact root"):
        d.wait_idle(timeout=30)
    assert d.queue.outstanding_bytes == 0
    d.close()


@pytest.mark.parametrize("dtype", list(DType))
@pytest.mark.parametrize(("rows", "dim"), [(65536, 128), (65536, 16), (4096, 1024), (100, 32)])
def test_a_chunks_encoding_allocates_no_more_than_its_budget_bytes_and_its_scratch(
    dtype, rows, dim
):
    """What the host budget charges a chunk (rows + piece) plus the encoding's scratch bounds
    what encoding it allocates: numpy (traced) and pyarrow's pool, at their peaks."""
    import tracemalloc

    import torch

    from deltarec.dump.encode import PieceArena, encode_scratch_bytes
    from deltarec.tracking.gather import HostRows

    rng = np.random.default_rng(0)
    values = rng.standard_normal((rows, dim), dtype=np.float32)
    keys = np.arange(rows, dtype=np.int64)
    host = HostRows(
        torch.from_numpy(keys), torch.from_numpy(values), torch.zeros(rows, dtype=torch.int8)
    )
    charged = host.nbytes - values.nbytes - keys.nbytes  # beyond the rows already in memory
    pool = pa.proxy_memory_pool(pa.system_memory_pool())
    previous = pa.default_memory_pool()
    pa.set_memory_pool(pool)
    tracemalloc.start()
    try:
        piece, _ = encode_rows(keys, values, None, 1, dtype, dim, PieceArena(0))
        numpy_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        pa.set_memory_pool(previous)
    used = numpy_peak + pool.max_memory()
    assert piece.rows == rows and pool.max_memory() > 0
    assert used <= charged + encode_scratch_bytes(dtype, dim, rows), (used, charged)


def test_the_host_budget_is_shared_out_between_queue_scratch_and_arena():
    from deltarec.dump.budget import ARENA_MAX, plan_host_budget

    big = plan_host_budget(2 << 30, 15, 25 << 20)
    assert (big.encode_threads, big.arena_bytes, big.scratch_bytes) == (15, ARENA_MAX, 375 << 20)
    assert big.queue_bytes + big.scratch_bytes + big.arena_bytes == 2 << 30
    small = plan_host_budget(64 << 20, 15, 5 << 20)  # 1/4 of 64 MiB affords 3 encodings
    assert (small.encode_threads, small.arena_bytes, small.scratch_bytes) == (3, 8 << 20, 15 << 20)
    assert small.queue_bytes == (64 - 8 - 15) << 20
    tiny = plan_host_budget(1 << 20, 4, 5 << 20)  # one thread always runs
    assert tiny.encode_threads == 1 and tiny.queue_bytes >= 1


def test_a_publishing_trainer_keeps_rows_for_its_publisher_out_of_the_same_budget():
    from deltarec.dump.budget import plan_host_budget

    alone = plan_host_budget(1 << 30, 4, 10 << 20)
    publishing = plan_host_budget(1 << 30, 4, 10 << 20, hand_off=True)
    assert (alone.keep_rows_bytes, alone.publish_queue_bytes) == (0, 0)
    hand = (1 << 30) // 8  # kept rows (twice while joined) and the publisher's queue
    assert publishing.keep_rows_bytes == hand // 4 and publishing.publish_queue_bytes == hand // 2
    assert publishing.queue_bytes == alone.queue_bytes - hand


def test_a_shard_of_many_pieces_is_byte_identical_and_its_metas_hold_no_python_trees():
    import gc

    dtype, dim = DType.FLOAT32, 8
    rng = np.random.default_rng(3)
    chunks = [_rows(rng, 40 + 7 * i, 1000 * i, dim, dtype) for i in range(20)]
    pieces = [encode_piece(c, dtype, dim) for c in chunks]
    metas = [p.meta() for p in pieces]
    # bytes and arrays only: nothing per row group or column the collector has to walk
    assert not any(gc.is_tracked(v) for m in metas for v in vars(m).values())
    footer = stitched_footer(metas)
    stitched = MAGIC + b"".join(bytes(p.body) for p in pieces) + footer + footer_tail(footer)
    assert stitched == _one_writer(chunks, dtype, dim)  # 20 row groups: the long list header
    meta = pq.ParquetFile(pa.BufferReader(stitched)).metadata
    assert meta.num_row_groups == 20 and meta.row_group(19).column(0).statistics.min == 19000
