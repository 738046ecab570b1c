"""Publishing is fenced: a store refuses a dump of a generation older than the newest it has
seen for the run (SPEC §5 "One writer per run"), on every backend, on real servers."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from deltarec.artifacts import ArtifactRoot, codec
from deltarec.artifacts.types import DumpKind, TableSpec
from deltarec.errors import StaleGenerationError
from deltarec.ids import make_version
from deltarec.publish import DumpPublisher
from deltarec.stores import ProgressMark, open_store
from deltarec.testing.dumps import new_generation, random_rows, write_dump

T = "sparse.ebc.user_id"
SPEC = {T: TableSpec(dim=4)}
_N = itertools.count()


@pytest.fixture(params=["sqlite", "postgres", "redis"])
def store_url(request, tmp_path) -> str:
    n = next(_N)
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/store.db"
    if request.param == "postgres":
        return f"{request.getfixturevalue('postgres_server').url}?schema=fence{n}"
    return f"{request.getfixturevalue('redis_server').url}?prefix=fence{n}:"


def _write(store, keys, value: float, generation: int, seq: int = 1):
    k = np.asarray(keys, np.int64)
    emb = codec.encode(np.full((len(k), 4), value, np.float32), SPEC[T].dtype)
    mark = ProgressMark("ctr", generation, seq, T, 0, len(k), True)
    versions = np.full(len(k), make_version(generation, seq), np.int64)
    return store.write(T, k, emb, np.zeros(len(k), np.int8), versions, mark=mark)


@pytest.mark.integration
def test_a_store_refuses_rows_and_marks_of_a_superseded_generation(store_url):
    store = open_store(store_url, run="ctr")
    try:
        store.provision(SPEC)
        reg = store.registry
        reg.register_generation("ctr", 1)
        _write(store, [1, 2], 1.0, generation=1)
        reg.register_generation("ctr", 2)
        with pytest.raises(StaleGenerationError, match=r"generation 1.*seen generation 2"):
            _write(store, [2, 3], 9.0, generation=1, seq=2)
        with pytest.raises(StaleGenerationError):
            reg.check_writer("ctr", 1)
        got = store.read(T, np.array([1, 2, 3], np.int64))
        assert got.found.tolist() == [True, True, False]  # nothing of the refused write
        assert np.all(codec.decode(got.embedding[:2], SPEC[T].dtype, 4) == 1.0)
        assert [(m.generation, m.seq) for m in reg.progress("ctr", 1)] == [(1, 1)]
        reg.register_generation("ctr", 1)  # registering an old one again changes nothing
        reg.check_writer("ctr", 2)
        _write(store, [3], 2.0, generation=2)
        assert store.read(T, np.array([3], np.int64)).found.all()
        reg.check_writer("other-run", 1)  # runs are fenced separately
    finally:
        store.close()


@pytest.mark.integration
def test_the_publisher_refuses_a_superseded_generation_before_writing(store_url, tmp_path):
    root = ArtifactRoot(str(tmp_path / "art"))
    old = new_generation(root, "ctr", SPEC, world_size=1)
    new = new_generation(root, "ctr", SPEC, world_size=1)
    late = write_dump(root, old, 1, {T: {0: random_rows(range(10), SPEC[T])}})
    first = write_dump(root, new, 0, {T: {0: random_rows(range(5), SPEC[T], seed=1)}},
                       kind=DumpKind.SNAPSHOT)  # fmt: skip
    store = open_store(store_url, run="ctr")
    try:
        publisher = DumpPublisher(store, root, "ctr")
        publisher.publish_dump(first, 0)
        with pytest.raises(StaleGenerationError, match="generation 1"):
            publisher.publish_dump(late, 0)
        got = store.read(T, np.arange(10, dtype=np.int64))
        assert got.found.tolist() == [True] * 5 + [False] * 5
        assert store.registry.progress("ctr", old.generation) == []
    finally:
        store.close()
