"""Many small shards read on two processes: the same tables, verdicts and errors as one by one.

:func:`shardpool.read_groups` hands chunks of shards to a forked child and this process in
turn. Whatever the child does (reads its share, meets a bad shard, dies), the tables come back
in order and the error raised is the serial read's, for the first bad shard; the replay, verify
and publish give the same results and refuse the same corrupted or missing shard.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pyarrow as pa
import pytest

from deltarec.artifacts import ArtifactRoot, DumpKind, ShardRows, TableSpec, shardpool, wholeshard
from deltarec.artifacts.lineage import expected_state
from deltarec.artifacts.types import ShardInfo
from deltarec.artifacts.wholeshard import CheckedShards
from deltarec.errors import ArtifactError, ChecksumError
from deltarec.publish import DumpPublisher, heldparts
from deltarec.stores import open_store
from deltarec.testing.dumps import new_generation, random_rows, write_dump
from deltarec.verify.engine import verify
from deltarec.verify.options import VerifyOptions

RANKS = 6
TABLES = {
    f"sparse.ebc.t{t}": TableSpec(dim=4, num_embeddings=300, sharding="row_wise") for t in range(3)
}


@pytest.fixture
def pooled(monkeypatch) -> None:
    """The pool from the first shard on, a chunk a shard, whatever this machine's CPUs."""
    monkeypatch.setattr(shardpool, "POOL_SHARDS", 1)
    monkeypatch.setattr(shardpool, "CHUNK_SHARDS", 1)
    monkeypatch.setattr(shardpool, "_cpus", lambda: 2)


def _shards(groups: int, per_group: int) -> list[list[ShardInfo]]:
    return [
        [ShardInfo(f"g{g}/s{i}", f"t{g}", i, 1, 0, "") for i in range(per_group)]
        for g in range(groups)
    ]


def _slow_read(bad: set[str] = frozenset(), die: str = "", parent: int = 0):  # type: ignore[assignment]
    """A read that takes a while (so that both processes take chunks) and says who read it."""

    def read(shard: ShardInfo) -> pa.Table:
        time.sleep(0.01)
        if shard.path in bad:
            raise ChecksumError(shard.path, "content does not match the manifest's sha256")
        if shard.path == die and os.getpid() != parent:
            os._exit(3)  # the child dies at this shard
        return pa.table({"path": [shard.path], "pid": [os.getpid()]})

    return read


def _flat(out: list[list[pa.Table]]) -> list[list[str]]:
    return [pa.concat_tables(ts).column("path").to_pylist() if ts else [] for ts in out]


def test_both_processes_read_and_the_tables_come_back_in_order(pooled):
    groups = _shards(3, 7)
    out = shardpool.read_groups(groups, _slow_read(), local=True)
    assert _flat(out) == [[s.path for s in g] for g in groups]
    pids = {p for ts in out for t in ts for p in t.column("pid").to_pylist()}
    assert os.getpid() in pids and len(pids) == 2


def test_the_first_bad_shard_is_the_one_raised_wherever_it_was_read(pooled):
    groups = _shards(2, 10)
    bad = {"g1/s8", "g0/s9", "g1/s2"}
    with pytest.raises(ChecksumError) as serial:
        shardpool.read_groups(groups, _slow_read(bad), local=False)  # not local: serially
    with pytest.raises(ChecksumError) as both:
        shardpool.read_groups(groups, _slow_read(bad), local=True)
    assert str(both.value) == str(serial.value) and "g0/s9" in str(both.value)


def test_a_child_that_dies_leaves_its_shards_to_this_process(pooled):
    groups = _shards(2, 8)
    out = shardpool.read_groups(groups, _slow_read(die="g0/s3", parent=os.getpid()), local=True)
    assert _flat(out) == [[s.path for s in g] for g in groups]


def test_few_shards_or_a_remote_root_are_read_here_one_by_one():
    assert not shardpool.can_pool(shardpool.POOL_SHARDS - 1, local=True)
    assert not shardpool.can_pool(shardpool.POOL_SHARDS, local=False)
    out = shardpool.read_groups(_shards(2, 3), _slow_read(), local=True)
    assert [len(ts) for ts in out] == [3, 3]
    assert {t.column("pid")[0].as_py() for ts in out for t in ts} == {os.getpid()}


@pytest.fixture
def dump(tmp_path) -> tuple[ArtifactRoot, dict[str, dict[int, ShardRows]]]:
    """A snapshot of three tables over six ranks, then a delta over them."""
    root = ArtifactRoot(str(tmp_path / "art"))
    info = new_generation(root, "r", TABLES, world_size=RANKS)
    keys = np.arange(300, dtype=np.int64)
    rows = {
        table: {
            r: random_rows(part, spec, t * 10 + r)
            for r, part in enumerate(np.array_split(keys, RANKS))
        }
        for t, (table, spec) in enumerate(TABLES.items())
    }
    write_dump(root, info, 0, rows, kind=DumpKind.SNAPSHOT)
    delta = {
        table: {
            r: random_rows(part[::3], spec, 99 + r, step=5)
            for r, part in enumerate(np.array_split(keys, RANKS))
        }
        for table, spec in TABLES.items()
    }
    write_dump(root, info, 1, delta, first_step=5, last_step=5)
    return root, rows


def _replay(root: ArtifactRoot) -> dict[str, tuple[np.ndarray, ...]]:
    state = expected_state(root, "r", 1, checked=CheckedShards(root))
    return {
        t: (e.keys, e.versions, e.ops, e.steps, e.load(e.keys)) for t, e in state.tables.items()
    }


@pytest.fixture
def two_processes(monkeypatch) -> list[int]:
    """The pool for any dump, a chunk a shard, each shard's read slowed so that the child takes
    chunks too; the list receives the number of chunks the child handed back, call by call."""
    monkeypatch.setattr(shardpool, "POOL_SHARDS", 1)
    monkeypatch.setattr(shardpool, "CHUNK_SHARDS", 1)
    monkeypatch.setattr(shardpool, "_cpus", lambda: 2)
    real_read, real_mapped = wholeshard.read_whole_table, shardpool._mapped
    handed: list[int] = []

    def slow(*args):
        time.sleep(0.005)
        return real_read(*args)

    def mapped(memfd):
        got = real_mapped(memfd)
        handed.append(len(got))
        return got

    monkeypatch.setattr(wholeshard, "read_whole_table", slow)
    monkeypatch.setattr(heldparts, "read_whole_table", slow)
    monkeypatch.setattr(shardpool, "_mapped", mapped)
    return handed


def test_a_replay_read_on_two_processes_equals_the_serial_replay(dump, request):
    root, _ = dump
    serial = _replay(root)
    handed = request.getfixturevalue("two_processes")
    both = _replay(root)
    assert handed and all(n > 0 for n in handed)  # the child read some of each dump
    for table in TABLES:
        for got, want in zip(both[table], serial[table], strict=True):
            np.testing.assert_array_equal(got, want)


def _corrupt(root: ArtifactRoot, table: str, rank: int, seq: int = 1) -> str:
    path = os.path.join(root.dump_dir("r", 1, seq), table, f"rank-{rank:05d}.parquet")
    with open(path, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    return path


def _verify(root: ArtifactRoot, store_url: str, all_keys: bool):
    with open_store(store_url, run="r") as store:
        result = verify(root, "r", store, options=VerifyOptions(sample=None if all_keys else 50))
    return result.passed, result.errors, result.shard_failures


@pytest.mark.parametrize("damage", ["corrupted", "missing"])
def test_verify_and_publish_refuse_a_bad_shard_alike_on_two_processes(
    dump, tmp_path, request, damage
):
    root, _ = dump
    url = f"sqlite:///{tmp_path / 'store.db'}"
    with open_store(url, run="r") as store:
        DumpPublisher(store, root, "r").publish_generation(1)
    good = {all_keys: _verify(root, url, all_keys) for all_keys in (True, False)}
    assert all(passed for passed, _, _ in good.values())
    path = _corrupt(root, "sparse.ebc.t2", 4)
    if damage == "missing":
        os.unlink(path)
    serial = {all_keys: _verify(root, url, all_keys) for all_keys in (True, False)}
    with (
        pytest.raises(ArtifactError) as serial_publish,
        open_store(f"sqlite:///{tmp_path / 'serial.db'}", run="r") as store,
    ):
        DumpPublisher(store, root, "r").publish_generation(1)
    handed = request.getfixturevalue("two_processes")
    both = {all_keys: _verify(root, url, all_keys) for all_keys in (True, False)}
    assert both == serial
    for passed, errors, failures in both.values():
        assert not passed and "rank-00004" in errors[0]
        (failure,) = failures
        assert (failure.table, failure.rank, failure.generation, failure.seq) == (
            "sparse.ebc.t2",
            4,
            1,
            1,
        )
        assert failure.path.endswith("gen-000001/dump-000001/sparse.ebc.t2/rank-00004.parquet")
        assert ("missing" in failure.problem) == (damage == "missing")
    with (
        pytest.raises(ArtifactError) as pooled_publish,
        open_store(f"sqlite:///{tmp_path / 'pooled.db'}", run="r") as store,
    ):
        DumpPublisher(store, root, "r").publish_generation(1)
    assert handed and any(handed)  # the child read shards, the bad one among them or not
    assert type(pooled_publish.value) is type(serial_publish.value)
    assert str(pooled_publish.value) == str(serial_publish.value)
