"""Rollback on PAI FeatureStore (the strict test SDK), as far as a store that cannot delete can
hold a point: every key of the target gets its row back, and every key a newer generation wrote
that the target does not hold gets its fallback row (key -1's row of a ZCH table; zeros)."""

from __future__ import annotations

import numpy as np
import pytest
from tests._helpers import featurestore as fs_state

from deltarec.artifacts import ArtifactRoot
from deltarec.artifacts.types import DType, DumpKind, TableKind, TableSpec
from deltarec.cli import main
from deltarec.stores import open_store
from deltarec.testing.dumps import new_generation, random_rows, write_dump

T = "sparse.ebc.user_id"
Z = "sparse.zch.ad_id"
EBC = "EmbeddingBagCollection"
TABLES = {
    T: TableSpec(dim=4, module_type=EBC),
    Z: TableSpec(dim=4, dtype=DType.INT8_ROWWISE, kind=TableKind.ZCH, module_type=EBC),
}
STORE = "featurestore://proj/emb?region=cn-hangzhou"


@pytest.fixture(params=fs_state.SURFACES)
def state(request, tmp_path, monkeypatch) -> str:
    path = str(tmp_path / "featurestore.db")
    fs_state.use_test_sdk(monkeypatch, path, surface=request.param)
    return path


def _fresh_generation(root, rows, loc):
    """A generation with no parent: one snapshot of ``rows``, published, verified, promoted."""
    info = new_generation(root, "r", TABLES, world_size=1)
    write_dump(root, info, 1, {t: {0: r} for t, r in rows.items()}, kind=DumpKind.SNAPSHOT)
    assert main(["publish", *loc]) == 0
    assert main(["verify", *loc, "--all"]) == 0
    assert main(["promote", *loc, "--generation", str(info.generation)]) == 0


def test_rollback_after_a_fresh_retrain_restores_every_row_and_gives_newer_ids_the_fallback(
    tmp_path, state, capsys
):
    root = ArtifactRoot(str(tmp_path / "art"))
    loc = ["--artifacts", root.uri, "--run", "r", "--store", STORE]
    one = {T: random_rows(range(50), TABLES[T], 1), Z: random_rows([-1, 5, 9, 12], TABLES[Z], 2)}
    _fresh_generation(root, one, loc)
    two = {T: random_rows(range(30, 80), TABLES[T], 3), Z: random_rows([-1, 9, 40], TABLES[Z], 4)}
    _fresh_generation(root, two, loc)
    capsys.readouterr()

    assert main(["rollback", *loc, "--to-generation", "1"]) == 0
    out = capsys.readouterr().out
    assert "against generation 1 dump 1: equal" in out

    with open_store(STORE, root.uri, run="r") as s:
        back = s.read(T, np.arange(50))
        np.testing.assert_array_equal(back.embedding, one[T].embedding)
        ids = s.read(Z, np.array([-1, 5, 9, 12]))
        np.testing.assert_array_equal(ids.embedding, one[Z].embedding)
        newer = s.read(T, np.arange(50, 80))  # two's keys: a plain table's fallback is zeros
        assert not newer.embedding.any()
        admitted = s.read(Z, np.array([40]))  # an id only two admitted: the point's fallback
        np.testing.assert_array_equal(admitted.embedding[0], one[Z].embedding[0])
    assert main(["verify", *loc, "--all", "--generation", "1", "--through-seq", "1"]) == 0
