"""The outbox on a real S3-compatible object store (SeaweedFS, started by the fixtures).

What decides who writes never depends on what a store lists: exclusive creates are conditional
writes the server enforces (``If-None-Match: *``), and a folder counts by the files it holds,
whatever the store lists for it once emptied (SeaweedFS keeps it; AWS S3 drops it).
"""

from __future__ import annotations

import json
import threading

import pytest

from deltarec.artifacts import ArtifactRoot
from deltarec.artifacts.lease import LeaseHeldError, RunLease, epochs
from deltarec.artifacts.types import GenerationInfo, TableSpec

pytestmark = pytest.mark.integration


@pytest.fixture
def root(s3_server) -> ArtifactRoot:
    uri, opts = s3_server.fresh_uri()
    return ArtifactRoot(uri, opts)


def _race(n: int, fn):
    """Run ``fn(i)`` in ``n`` threads released together; their results in order."""
    barrier = threading.Barrier(n)
    out: list[object] = [None] * n

    def one(i: int) -> None:
        barrier.wait()
        try:
            out[i] = fn(i)
        except Exception as e:  # the test inspects what each writer got
            out[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def _fresh(root: ArtifactRoot) -> ArtifactRoot:
    """Another writer: its own filesystem object, no shared listing cache."""
    return ArtifactRoot(root.uri, root.fs.storage_options)


def test_of_writers_racing_to_create_one_object_exactly_one_wins_and_its_bytes_stay(root):
    roots = [_fresh(root) for _ in range(6)]
    for round_ in range(5):
        path = f"{root.path}/race/obj-{round_}.json"
        got = _race(6, lambda i, p=path: roots[i].create_exclusive(p, f"writer {i}".encode()))
        assert all(isinstance(g, bool) for g in got), got
        assert got.count(True) == 1, got
        winner = got.index(True)
        assert root.fs.cat_file(path) == f"writer {winner}".encode()


def test_creating_an_existing_object_is_refused_by_the_server_and_leaves_it_unchanged(root):
    path = f"{root.path}/once.json"
    assert root.create_exclusive(path, b"first")
    # s3fs is told nothing about the object (a fresh client): the server alone refuses
    assert _fresh(root).create_exclusive(path, b"second") is False
    assert root.fs.cat_file(path) == b"first"


def test_of_trainers_racing_for_one_run_exactly_one_takes_the_lease(root):
    roots = [_fresh(root) for _ in range(5)]
    got = _race(5, lambda i: RunLease.acquire(roots[i], "ctr", ttl_s=30))
    leases = [g for g in got if isinstance(g, RunLease)]
    refused = [g for g in got if isinstance(g, LeaseHeldError)]
    assert len(leases) == 1 and len(refused) == 4, got
    assert epochs(root, "ctr") == [leases[0].record.epoch]
    leases[0].check()
    leases[0].release()


def _info(run: str) -> GenerationInfo:
    return GenerationInfo(run=run, generation=1, world_size=1, tables={"m.t": TableSpec(dim=4)})


def test_trainers_racing_for_a_generation_each_get_their_own(root):
    roots = [_fresh(root) for _ in range(4)]
    got = _race(4, lambda i: roots[i].allocate_generation(_info("gen")).generation)
    assert sorted(got) == [1, 2, 3, 4], got  # type: ignore[type-var]
    assert root.list_generations("gen") == [1, 2, 3, 4]


def test_an_emptied_dump_folder_is_not_an_incomplete_dump_though_the_store_lists_it(root):
    root.replace_bytes(root.generation_file("r", 1), json.dumps(_info("r").to_json()).encode())
    shard = root.shard_path("r", 1, 1, "m.t", 0)
    root.replace_bytes(shard, b"rows")
    assert root.list_incomplete_dumps("r", 1) == [1]
    assert root.clean_incomplete("r") == [root.dump_dir("r", 1, 1)]
    root.fs.invalidate_cache()
    listed = [e.rstrip("/").rsplit("/", 1)[-1] for e in root.fs.ls(root.gen_dir("r", 1))]
    assert "dump-000001" in listed  # SeaweedFS keeps the emptied folder listed
    assert root.list_incomplete_dumps("r", 1) == []
    assert root.clean_incomplete("r") == []


def test_a_directory_object_alone_does_not_make_a_dump_incomplete(root):
    root.replace_bytes(root.generation_file("r", 1), json.dumps(_info("r").to_json()).encode())
    marker = root.dump_dir("r", 1, 2) + "/"  # what consoles and some tools create for a folder
    root.fs.pipe_file(marker, b"")
    assert root.list_incomplete_dumps("r", 1) == []
    root.replace_bytes(root.shard_path("r", 1, 2, "m.t", 0), b"rows")
    assert root.list_incomplete_dumps("r", 1) == [2]
