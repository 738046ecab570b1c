"""Two view prefixes on one database: separate stores on Redis, refused in one SQL registry.

A SQL store's registry (which run serves each table, generations, progress marks) is one per
PostgreSQL schema or SQLite file and keys serving names by table; views of a second prefix
beside the first's would share it and take over the first's serving. Opening a second prefix
there is refused with a message naming both prefixes, and the first store is left exactly as
it was. A Redis key prefix covers the registry's keys too: two prefixes are two stores.
"""

from __future__ import annotations

import numpy as np
import pytest

from deltarec.artifacts import ArtifactRoot
from deltarec.artifacts.lineage import expected_state
from deltarec.artifacts.types import DumpKind, TableSpec
from deltarec.errors import BadInputError
from deltarec.publish import DumpPublisher
from deltarec.stores import open_store
from deltarec.testing.dumps import new_generation, random_rows, write_dump

T = "sparse.ebc.user_id"
TABLES = {T: TableSpec(dim=8, num_embeddings=1000)}
RUN = "prefixes"


def _with_prefix(backend, prefix: str) -> str:
    if backend.kind == "redis":  # the fixture's own key prefix, made two
        return backend.url.replace("?prefix=", f"?prefix={prefix}")
    return f"{backend.url}&prefix={prefix}_"


def _published(backend, tmp_path, prefix: str, seed: int) -> ArtifactRoot:
    root = ArtifactRoot(str(tmp_path / f"art-{prefix}"))
    info = new_generation(root, RUN, TABLES, world_size=1)
    rows = {T: {0: random_rows(range(0, 1000, 3), TABLES[T], seed)}}
    manifest = write_dump(root, info, 0, rows, kind=DumpKind.SNAPSHOT)
    with open_store(_with_prefix(backend, prefix), run=RUN) as store:
        DumpPublisher(store, root, RUN).publish_dump(manifest, 0)
    return root


def _assert_serves(url: str, root: ArtifactRoot) -> None:
    """The serving name of ``url`` (the first run to provision serves) holds the run's
    generation 1, key by key."""
    state = expected_state(root, RUN, 1)
    et = state.tables[T]
    keys = et.present_keys()
    with open_store(url) as store:
        got = store.read(T, np.concatenate([keys, np.array([1, 2], np.int64)]))
    assert got.found[: len(keys)].all() and not got.found[len(keys) :].any()
    np.testing.assert_array_equal(got.embedding[: len(keys)], et.load(keys))
    np.testing.assert_array_equal(got.versions[: len(keys)], et.versions[et.index_of(keys)])


def test_a_second_prefix_is_refused_by_a_sql_registry_or_is_a_store_of_its_own(backend, tmp_path):
    first = _published(backend, tmp_path, "a", seed=1)
    if backend.kind == "redis":
        second = _published(backend, tmp_path, "b", seed=2)
        _assert_serves(_with_prefix(backend, "a"), first)
        _assert_serves(_with_prefix(backend, "b"), second)
        return
    with pytest.raises(BadInputError) as e:
        _published(backend, tmp_path, "b", seed=2)
    message = str(e.value)
    assert "of prefix 'a_', not of prefix 'b_'" in message, message
    assert ("schema 't" if backend.kind == "postgres" else "file '") in message, message
    _assert_serves(_with_prefix(backend, "a"), first)  # nothing of it changed


def test_a_registry_from_before_the_prefix_was_recorded_is_claimed_by_its_own_prefix_only(
    backend, tmp_path
):
    if backend.kind == "redis":
        pytest.skip("a Redis key prefix covers its registry's keys")
    first = _published(backend, tmp_path, "a", seed=1)
    with open_store(_with_prefix(backend, "a")) as store, store._tx() as cur:  # type: ignore[attr-defined]
        store._exec(cur, "DROP TABLE deltarec_prefix")  # type: ignore[attr-defined]
    with pytest.raises(BadInputError, match="serving name 'a_sparse_ebc_user_id' of table"):
        open_store(_with_prefix(backend, "b")).close()
    _assert_serves(_with_prefix(backend, "a"), first)  # it claims the registry again
    with pytest.raises(BadInputError, match="of prefix 'a_', not of prefix 'b_'"):
        open_store(_with_prefix(backend, "b")).close()
